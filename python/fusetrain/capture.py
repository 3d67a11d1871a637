"""Capture: a transformers model that fusetrain does not build natively, as an engine model.

The model's training forward (dropout included) is exported by torch.onnx's dynamo exporter, with the batch and
sequence axes dynamic and every parameter under its transformers name (no constant folding, no value
deduplication), and the graph is imported (`Model.from_onnx`) with the task's loss appended to its logits. The
engine never imports PyTorch; capture does, since the user already holds a PyTorch model.

A capture is written once per model class, config, task and torch version into the capture cache
($FUSETRAIN_CACHE, else ~/.cache/fusetrain) as model.onnx and config.json; a later run reads it from there. The
cached graph's weights are replaced by the model's own on every load.

The command line captures through `python -m fusetrain.capture --model DIR --task TASK`, which the `fusetrain`
command (and `python -m fusetrain`) runs for a model directory whose architecture fusetrain does not build: it
prints the path of a graph holding DIR's weights (model.onnx, with DIR's config.json and tokenizer files beside
it), which the engine's command line trains as any ONNX graph. The training process never imports PyTorch.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import pathlib
import sys
import tempfile
import warnings
from typing import Any

from fusetrain import _core

# The task each transformers head class trains, by the suffix of its class name.
_TASK_OF_SUFFIX = (
    ("ForSequenceClassification", "seq-cls"),
    ("ForTokenClassification", "token-cls"),
    ("ForQuestionAnswering", "qa"),
    ("ForMaskedLM", "mlm"),
    ("ForCausalLM", "clm"),
    ("ForImageClassification", "image-cls"),
    ("ForCTC", "ctc"),  # speech recognition (Wav2Vec2): per-frame logits, the engine's CTC loss
    ("ForConditionalGeneration", "seq2seq"),  # an encoder-decoder (T5, BART); other such classes are refused
    ("MTModel", "seq2seq"),  # Marian
)
# The inputs fusetrain feeds a graph, in the order the exported forward takes them: token sequences, or images.
_FED_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Float inputs in place of tokens: images, a speech model's log-mel features (Whisper), raw audio (Wav2Vec2).
_FEATURE_INPUTS = ("pixel_values", "input_features", "input_values")
# An encoder-decoder's decoder inputs: the labels shifted right (the collator's, else the model's own
# prepare_decoder_input_ids_from_labels), and their mask.
_DECODER_INPUTS = ("decoder_input_ids", "decoder_attention_mask")
# SpecAugment's masks (Wav2Vec2 and the speech encoders built like it), as float inputs: which frames take the learned
# masked_spec_embed, (batch, frames), and which hidden features are zeroed, (batch, hidden). The Trainer draws them
# for each training batch with the model's own _compute_mask_indices; a batch without them masks nothing.
_MASK_INPUTS = ("mask_time_indices", "mask_feature_indices")
_FORMAT = 6  # bumped when what a cached capture holds changes


class CaptureError(ValueError):
    """A model could not be captured; the message names the model and why."""


def task_of_class(architecture: str) -> str | None:
    """The task ("seq-cls", "mlm", ...) a transformers head class trains, from its name; None for other classes."""
    return next((task for suffix, task in _TASK_OF_SUFFIX if architecture.endswith(suffix)), None)


def cache_root() -> pathlib.Path:
    """Where captures are kept: $FUSETRAIN_CACHE/capture, else ~/.cache/fusetrain/capture."""
    base = os.environ.get("FUSETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fusetrain")
    return pathlib.Path(base) / "capture"


def engine_task(task: str) -> str:
    """The engine's task for a captured task: an image or audio classifier's head is the engine's classification of
    a whole input ("seq-cls"), with the same problem_type rules."""
    return "seq-cls" if task in ("image-cls", "audio-cls") else task


def _fed_inputs(model: Any) -> list[str]:
    """The inputs of `model`'s forward that the engine feeds: input_ids, attention_mask, and token_type_ids where
    the forward takes them and the model has more than one token type; pixel_values for an image model,
    input_features for a speech model (Whisper's log-mel features); an encoder-decoder's decoder inputs after
    them."""
    parameters = inspect.signature(model.forward).parameters
    features = next((name for name in _FEATURE_INPUTS if name in parameters), None)
    if "input_ids" not in parameters and features is not None:
        names = [features]
    else:
        names = [name for name in _FED_INPUTS if name in parameters]
        if "input_ids" not in names:
            raise CaptureError(f"{type(model).__name__}.forward takes neither input_ids nor one of "
                               f"{', '.join(_FEATURE_INPUTS)}; fusetrain captures models whose inputs are token "
                               "sequences, images or speech features")
        if "token_type_ids" in names and int(getattr(model.config, "type_vocab_size", 0) or 0) < 2:
            names.remove("token_type_ids")
    if is_encoder_decoder(model):
        names += [name for name in _DECODER_INPUTS if name in parameters]
    return names + spec_augment_inputs(model)


def _speech_encoder(model: Any) -> Any | None:
    """The module holding SpecAugment (_mask_hidden_states and masked_spec_embed): the model's base, else None."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    return base if hasattr(base, "_mask_hidden_states") else None


def spec_augment_inputs(model: Any) -> list[str]:
    """The SpecAugment masks the model draws in training (mask_time_indices where config.mask_time_prob > 0,
    mask_feature_indices where config.mask_feature_prob > 0, neither when config.apply_spec_augment is off)."""
    config = model.config
    if _speech_encoder(model) is None or not getattr(config, "apply_spec_augment", True):
        return []
    probabilities = (getattr(config, "mask_time_prob", 0.0), getattr(config, "mask_feature_prob", 0.0))
    return [name for name, p in zip(_MASK_INPUTS, probabilities) if p and p > 0]


def draw_spec_augment(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with the SpecAugment masks of one training step, drawn as the model's forward draws them in training
    (its module's _compute_mask_indices on NumPy's global generator: the time mask over (batch, frames), then the
    feature mask over (batch, hidden)), as float32 arrays. A model without SpecAugment gets the batch back."""
    import numpy as np
    import torch

    names = spec_augment_inputs(model)
    if not names:
        return batch
    config, encoder = model.config, _speech_encoder(model)
    compute = sys.modules[type(encoder).__module__]._compute_mask_indices
    audio = batch["input_values"]
    rows, samples = int(audio.shape[0]), int(audio.shape[1])
    frames = int(encoder._get_feat_extract_output_lengths(torch.tensor(samples)))
    out = dict(batch)
    if "mask_time_indices" in names:
        out["mask_time_indices"] = compute((rows, frames), mask_prob=config.mask_time_prob,
                                           mask_length=config.mask_time_length, attention_mask=None,
                                           min_masks=config.mask_time_min_masks).astype(np.float32)
    if "mask_feature_indices" in names:
        out["mask_feature_indices"] = compute((rows, config.hidden_size), mask_prob=config.mask_feature_prob,
                                              mask_length=config.mask_feature_length,
                                              min_masks=config.mask_feature_min_masks).astype(np.float32)
    return out


def feature_input(model: Any) -> str | None:
    """The float input a model reads in place of input_ids (pixel_values, input_features, input_values), else None."""
    inputs = _fed_inputs(model)
    return inputs[0] if inputs[0] in _FEATURE_INPUTS else None


def is_encoder_decoder(model: Any) -> bool:
    """Whether a transformers model is an encoder-decoder that takes token sequences (T5, BART, Marian, ...)."""
    parameters = inspect.signature(model.forward).parameters
    return bool(getattr(model.config, "is_encoder_decoder", False)) and "decoder_input_ids" in parameters


def _output_names(task: str) -> list[str]:
    return ["start_logits", "end_logits"] if task == "qa" else ["logits"]


def cache_key(model: Any, task: str) -> str:
    """What a capture depends on: the class, its config, the task, the inputs, torch's and fusetrain's versions."""
    import torch

    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    parameter_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    text = json.dumps({"class": f"{type(model).__module__}.{type(model).__qualname__}", "config": config,
                       "task": task, "inputs": _fed_inputs(model), "dtypes": parameter_dtypes,
                       "torch": torch.__version__, "fusetrain": _core.__version__, "format": _FORMAT},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class _Forward:
    """Builds the module torch.onnx.export traces: the model called with the fed inputs by keyword, returning its
    outputs by name, with the model's own submodules so that parameter names stay transformers'."""

    @staticmethod
    def make(model: Any, inputs: list[str], outputs: list[str]) -> Any:
        import torch

        class Forward(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                object.__setattr__(self, "inner", model)  # not a submodule: its names would gain an "inner." prefix
                # the model's own submodules, parameters and buffers (BART's final_logits_bias), under their names
                self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers

            def forward(self, input_ids: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
                        pixel_values: Any = None, input_features: Any = None, input_values: Any = None,
                        decoder_input_ids: Any = None, decoder_attention_mask: Any = None,
                        mask_time_indices: Any = None, mask_feature_indices: Any = None) -> tuple:
                given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                         "pixel_values": pixel_values, "input_features": input_features, "input_values": input_values,
                         "decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_attention_mask}
                encoder = _speech_encoder(model)
                if encoder is not None:  # SpecAugment from the graph's mask inputs, not from NumPy at trace time
                    masks = _SpecAugment(encoder, mask_time_indices, mask_feature_indices)
                    object.__setattr__(encoder, "_mask_hidden_states", masks)
                try:
                    out = self.inner(**{name: given[name] for name in inputs if name not in _MASK_INPUTS},
                                     return_dict=True)
                finally:
                    if encoder is not None:
                        object.__delattr__(encoder, "_mask_hidden_states")
                return tuple(getattr(out, name) for name in outputs)

        return Forward()


class _SpecAugment:
    """A speech encoder's _mask_hidden_states while it is exported: the masks are the graph's float inputs (1 where
    masked). Masked frames become masked_spec_embed and masked features 0, as the model's own masking assigns them;
    the time mask is sliced to the frames the audio gives (its own axis is dynamic apart from theirs)."""

    def __init__(self, encoder: Any, time: Any, feature: Any) -> None:
        self.encoder, self.time, self.feature = encoder, time, feature

    def __call__(self, hidden_states: Any, mask_time_indices: Any = None, attention_mask: Any = None) -> Any:
        if self.time is not None:
            mask = self.time[:, : hidden_states.shape[1], None]
            hidden_states = hidden_states * (1 - mask) + mask * self.encoder.masked_spec_embed
        if self.feature is not None:
            hidden_states = hidden_states * (1 - self.feature[:, None, :])
        return hidden_states


def _export(model: Any, task: str, path: pathlib.Path) -> None:
    import torch

    inputs, outputs = _fed_inputs(model), _output_names(task)
    generator = torch.Generator().manual_seed(0)
    batch = torch.export.Dim("batch_size", min=1)
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    target = torch.export.Dim("decoder_sequence_length", min=2, max=max(max_positions, 8))
    example = {"input_ids": torch.randint(min(3, vocab - 1), vocab, (2, 8), generator=generator),
               "attention_mask": torch.ones(2, 8, dtype=torch.long),
               "token_type_ids": torch.zeros(2, 8, dtype=torch.long),
               # another length than the source's, so that the two sequence axes stay apart
               "decoder_input_ids": torch.randint(min(3, vocab - 1), vocab, (2, 5), generator=generator),
               "decoder_attention_mask": torch.ones(2, 5, dtype=torch.long)}
    dims = {name: {0: batch, 1: target} for name in _DECODER_INPUTS}
    config = model.config
    if inputs[0] == "pixel_values":
        # Images of the size the config names: the batch is the one dynamic axis (a position table fits one size).
        size = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
        channels = int(getattr(config, "num_channels", 3))
        example["pixel_values"] = torch.randn(2, channels, *size, generator=generator)
        dims["pixel_values"] = {0: batch}
    elif inputs[0] == "input_features":
        # Whisper's log-mel features: num_mel_bins rows of the one length its encoder takes (two frames per position,
        # the second convolution's stride); the batch is the one dynamic axis.
        frames = 2 * int(getattr(config, "max_source_positions", 0) or 0)
        if not frames or not getattr(config, "num_mel_bins", 0):
            raise CaptureError(f"{type(model).__name__} takes input_features but its config names no num_mel_bins "
                               "and max_source_positions; fusetrain captures Whisper's (batch, mel bins, frames)")
        example["input_features"] = torch.randn(2, int(config.num_mel_bins), frames, generator=generator)
        dims["input_features"] = {0: batch}
    elif inputs[0] == "input_values":
        # Raw audio (Wav2Vec2): (batch, samples), both axes dynamic; the example is long enough for the feature
        # encoder's receptive field to fit several frames.
        samples = _audio_example_length(config)
        example["input_values"] = torch.randn(2, samples, generator=generator)
        audio = torch.export.Dim("audio_length", min=_receptive_field(config), max=max(samples * 64, 1 << 22))
        dims["input_values"] = {0: batch, 1: audio}
        # SpecAugment's masks: the time mask's frames another size than the audio's 13, so that the exporter keeps
        # its axis apart from theirs (the graph slices it to the frames the audio gives)
        example["mask_time_indices"] = torch.zeros(2, 17)
        dims["mask_time_indices"] = {0: batch, 1: torch.export.Dim("mask_frames", min=1, max=1 << 20)}
        example["mask_feature_indices"] = torch.zeros(2, int(getattr(config, "hidden_size", 1)))
        dims["mask_feature_indices"] = {0: batch}
    else:
        sequence = torch.export.Dim("sequence_length", min=2, max=max(max_positions, 8))
        dims.update({name: {0: batch, 1: sequence} for name in _FED_INPUTS})
    dims = {name: dims[name] for name in inputs}
    was_training = model.training
    model.train()  # dropout in the graph, as transformers' Trainer trains
    try:
        with _quiet_logging(), torch.no_grad():
            torch.onnx.export(_Forward.make(model, inputs, outputs), (), str(path),
                              kwargs={name: example[name] for name in inputs}, input_names=inputs,
                              output_names=outputs, dynamo=True, optimize=False, opset_version=18,
                              dynamic_shapes=dims, verbose=False)
    except Exception as error:  # noqa: BLE001 (the exporter raises many kinds; each is named in the message)
        raise CaptureError(f"torch.onnx.export could not capture {type(model).__name__}: "
                           f"{type(error).__name__}: {_first_line(error)}") from error
    finally:
        model.train(was_training)
    _simplify(path)
    dynamic = {name: list(example[name].shape) for name in inputs if name in ("input_values", "mask_time_indices")}
    if dynamic:
        _note_example_shapes(path, dynamic)


def _note_example_shapes(path: pathlib.Path, shapes: dict[str, list[int]]) -> None:
    """Records the examples' shapes of float inputs with a dynamic axis besides the batch in the graph's metadata
    ("fusetrain.example_shape.<name>": sizes separated by commas): the sizes the importer lays out the parameters
    at."""
    import onnx

    graph = onnx.load(str(path))
    for name, shape in shapes.items():
        entry = graph.metadata_props.add()
        entry.key, entry.value = f"fusetrain.example_shape.{name}", ",".join(str(int(size)) for size in shape)
    onnx.save(graph, str(path))


def _receptive_field(config: Any) -> int:
    """The fewest samples a Wav2Vec2-style feature encoder (config.conv_kernel, conv_stride) turns into one frame."""
    field = 1
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        field = (field - 1) * int(stride) + int(kernel)
    return field


def _audio_example_length(config: Any) -> int:
    """An example audio length for the export: 13 frames of the feature encoder (more than any positional
    convolution's padding), so that no frame count is specialised to a constant."""
    hop = 1
    for stride in config.conv_stride:
        hop *= int(stride)
    return _receptive_field(config) + 12 * hop


def _simplify(path: pathlib.Path) -> None:
    """onnxscript's graph optimizer on the exported graph, without what would break the name binding: constants
    are folded except through a float initializer of rank >= 1 (a parameter, or a buffer such as rotary
    frequencies: a folded transpose of a weight would be a new initializer under a new name), then its rewrite
    rules, dead-node removal and common-subexpression elimination; no deduplication of equal initializers (a fresh
    model's norm weights are all equal and must stay apart) and no lifting of constants into initializers. The
    export's Transpose, Split and Sequence chains around attention and rotary embeddings then fold into the
    program the native build compiles to. These passes are onnxscript's internals: with a version that lacks them
    the graph is left as exported (it trains the same, more slowly)."""
    try:
        from onnxscript import ir, rewriter
        from onnxscript.ir.passes import common
        from onnxscript.optimizer import _constant_folding
    except ImportError:
        return
    model = ir.load(str(path))
    weights = {v.name for v in model.graph.initializers.values()
               if v.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
               and v.shape is not None and len(v.shape) >= 1}

    def should_fold(node: Any) -> bool | None:
        return False if any(v is not None and v.name in weights for v in node.inputs) else None

    passes = ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([
            _constant_folding.FoldConstantsPass(shape_inference=True, input_size_limit=8192,
                                                output_size_limit=262144, should_fold=should_fold),
            rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES),
            common.RemoveUnusedNodesPass(),
            common.RemoveUnusedFunctionsPass(),
            common.RemoveUnusedOpsetsPass(),
        ], steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(),
        common.CommonSubexpressionEliminationPass(),
    )
    # The rewrite rules read constants' values: a weight that happens to be zero (a fresh model's biases) would be
    # a removable "Add 0" or a Conv bias of zeros, and the parameter would vanish from the graph. The weights'
    # values are hidden from every pass and put back after.
    held = {}
    for value in model.graph.initializers.values():
        if value.name in weights:
            held[value.name] = value.const_value
            value.const_value = None
    passes(model)
    kept = set()
    for value in model.graph.initializers.values():
        if value.name in held:
            value.const_value = held[value.name]
            kept.add(value.name)
    if kept != set(held):
        raise CaptureError(f"simplifying the captured graph lost its weights {', '.join(sorted(set(held) - kept))}")
    ir.save(model, str(path))
    _constants_as_nodes(path, weights)


def _constants_as_nodes(path: pathlib.Path, weights: set[str]) -> None:
    """Float initializers the folding created (BLOOM's ALiBi slopes, ...) become Constant nodes: the importer
    trains every float initializer of more than one element as a parameter, and these are not the model's."""
    import onnx

    graph = onnx.load(str(path))
    folded = [t for t in graph.graph.initializer
              if t.name not in weights and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                           onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)]
    if not folded:
        return
    nodes = [onnx.helper.make_node("Constant", [], [t.name], name=f"folded_{t.name}", value=t) for t in folded]
    kept = [t for t in graph.graph.initializer if t not in folded]
    del graph.graph.initializer[:]
    graph.graph.initializer.extend(kept)
    rest = list(graph.graph.node)
    del graph.graph.node[:]
    graph.graph.node.extend(nodes + rest)
    onnx.save(graph, str(path))


@contextlib.contextmanager
def _quiet_logging():
    """Warnings of the exporter and transformers' loading progress bars off (a capture prints one line)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


def _write_folder(folder: pathlib.Path, fill: Any) -> pathlib.Path:
    """`folder`/model.onnx, the folder filled by fill(scratch) in a scratch folder beside it and renamed into place:
    a write stopped half-way is never read as complete. Another process that wrote the same folder meanwhile wins.
    A cache that cannot be written is a CaptureError naming it."""
    import shutil

    scratch = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        fill(scratch)
        try:
            os.replace(scratch, folder)
        except OSError:
            if not (folder / "model.onnx").exists():
                raise
    except OSError as error:
        raise CaptureError(f"cannot write the capture cache {folder.parent} ({error.strerror or error}); set "
                           "FUSETRAIN_CACHE to a writable folder") from error
    finally:
        if scratch is not None and scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return folder / "model.onnx"


def captured_path(model: Any, task: str) -> pathlib.Path:
    """The captured graph of `model` for `task` (captured now unless the cache holds it)."""
    folder = cache_root() / cache_key(model, task)
    if (folder / "model.onnx").exists() and (folder / "config.json").exists():
        return folder / "model.onnx"

    def fill(scratch: pathlib.Path) -> None:
        config = model.config.to_dict()
        config["architectures"] = [type(model).__name__]  # what the engine model names itself
        (scratch / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        _export(model, task, scratch / "model.onnx")

    return _write_folder(folder, fill)


def capture(model: Any, task: str | None = None) -> Any:
    """An engine model (fusetrain.Model) for a transformers model object: its graph captured (or read from the
    cache) and imported for `task` (default: the task of the model's class), holding the model's current weights
    under their transformers names. Raises CaptureError naming the model and the construct that stopped it."""
    architecture = type(model).__name__
    task = task or task_of_class(architecture)
    if task is None:
        raise CaptureError(f"{architecture} is not a head fusetrain trains (a class ending in "
                           + ", ".join(suffix for suffix, _ in _TASK_OF_SUFFIX) + ")")
    dropped = {key: getattr(model.config, key, 0.0) for key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")}
    dropped = {key: value for key, value in dropped.items() if isinstance(value, (int, float)) and value > 0}
    if dropped:
        key, value = next(iter(dropped.items()))
        raise CaptureError(f"{architecture}'s config.{key} is {value}: LayerDrop skips whole layers at random in each "
                           "training step, which one captured graph cannot do; set model.config." + key + " = 0.0 "
                           "(the default of transformers' speech recognition scripts) to train it on the engine")
    if task == "seq2seq" and not is_encoder_decoder(model):
        raise CaptureError(f"{architecture} is not an encoder-decoder of token sequences (config.is_encoder_decoder "
                           "and a forward taking decoder_input_ids); fusetrain captures those as seq2seq")
    graph = captured_path(model, task)
    fixed = _fixed_values(model, graph)
    try:
        engine = _core.Model.from_onnx(graph, engine_task(task), frozen=sorted(fixed), values=fixed,
                                       padding_rows=_padding_rows(model), tie_identical=False)
    except ValueError as error:
        raise CaptureError(f"fusetrain cannot import the captured graph of {architecture}: {error}") from error
    state = model.state_dict()
    names = engine.state_dict_names()
    missing = [name for name in names if name not in state]
    if missing:
        raise CaptureError(f"the captured graph of {architecture} holds weights under names that are not the model's "
                           f"parameters ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    engine.load_state_dict({name: state[name].detach() for name in names}, strict=True)
    return engine


def _padding_rows(model: Any) -> dict[str, int]:
    """Every embedding table's padding_idx (-1: none) under each name its weight has (a table tied to an LM head may
    appear in the graph under the head's name): the row its lookups give no gradient, as nn.Embedding does."""
    import torch

    rows = {id(m.weight): -1 if m.padding_idx is None else int(m.padding_idx)
            for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: rows[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in rows}


def _fixed_values(model: Any, graph: pathlib.Path) -> dict[str, Any]:
    """The graph's initializers that do not train, with the model's values: its parameters without requires_grad
    (Marian's sinusoidal positions, or what the user froze) and its float buffers (BART's final_logits_bias, rotary
    frequencies). The engine keeps them fixed, as transformers' optimizer does, at this model's values (the cached
    graph holds those of the model it was first captured from)."""
    import onnx

    fixed = {name: p for name, p in model.named_parameters() if not p.requires_grad}
    fixed.update((name, b) for name, b in model.named_buffers() if b.is_floating_point())
    if not fixed:
        return {}
    held = {t.name for t in onnx.load(str(graph), load_external_data=False).graph.initializer}
    return {name: value.detach().float().numpy() for name, value in fixed.items() if name in held}


def from_directory(path: str | os.PathLike, architecture: str | None = None, **config_overrides: Any) -> Any:
    """Model.from_pretrained for a directory whose architecture fusetrain does not build: the transformers class
    (`architecture`, else config.json's "architectures"[0]) loaded with transformers, overrides applied, and
    captured. Raises CaptureError naming the directory and why."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    name = architecture or (config.get("architectures") or [None])[0]
    named = (config.get("architectures") or [None])[0]
    task = task_of_class(name) if isinstance(name, str) else None
    if task is not None and name == named and not config_overrides:
        # The directory's own class: its prepared graph (from the cache when the directory has not changed) holds
        # its weights, so neither transformers nor torch need load the model again.
        try:
            return _core.Model.from_onnx(prepare_directory(path, task), engine_task(task), tie_identical=False)
        except ValueError as error:
            raise CaptureError(f"fusetrain cannot import the captured graph of {name}: {error}") from error
    import transformers

    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or task is None:
        raise CaptureError(f"{os.fspath(path)}: fusetrain does not build {name or config.get('model_type')!r} and "
                           "captures transformers head classes (...ForSequenceClassification, "
                           "...ForTokenClassification, ...ForQuestionAnswering, ...ForMaskedLM, ...ForCausalLM, "
                           "...ForImageClassification); pass architecture= to name one")
    with _quiet_logging():
        model = cls.from_pretrained(os.fspath(path), **config_overrides)
    return capture(model.float())


# ---------------------------------------------------------------- the command line's capture

_AUTO_CLASSES = {"seq-cls": "AutoModelForSequenceClassification", "token-cls": "AutoModelForTokenClassification",
                 "qa": "AutoModelForQuestionAnswering", "mlm": "AutoModelForMaskedLM", "clm": "AutoModelForCausalLM",
                 "image-cls": "AutoModelForImageClassification", "seq2seq": "AutoModelForSeq2SeqLM",
                 "ctc": "AutoModelForCTC", "audio-cls": "AutoModelForAudioClassification"}
_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                    "merges.txt", "added_tokens.json", "tokenizer.model", "generation_config.json",
                    "preprocessor_config.json")


def is_native(config: dict) -> bool:
    """Whether fusetrain builds the model a config.json describes (its architecture, else its model_type)."""
    rows = _core.architectures()
    named = (config.get("architectures") or [None])[0]
    if named is not None:
        return any(row["architecture"] == named for row in rows)
    return any(row["model_type"] == config.get("model_type") for row in rows)


def _prepared_key(directory: pathlib.Path, task: str, seed: int, labels: list[str] | None = None) -> str:
    """What a directory's prepared graph depends on, read without loading anything: the directory's path, the names,
    sizes and modification times of its weight and JSON files (config.json among them), the task, the seed of a
    missing head, the class names the head is made for, and the versions of torch, transformers and fusetrain."""
    from importlib import metadata

    entries = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()
                     if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    versions = [metadata.version(name) for name in ("torch", "transformers")] + [_core.__version__, _FORMAT]
    text = json.dumps([str(directory.resolve()), entries, task, seed, versions] + ([labels] if labels else []))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _label_overrides(directory: pathlib.Path, labels: list[str] | None) -> dict[str, Any]:
    """from_pretrained's arguments that make a classification head for `labels` (names, position = id) where the
    directory's config.json names other classes, as transformers' example scripts pass them; {} where it agrees."""
    if not labels:
        return {}
    config = json.loads((directory / "config.json").read_text())
    id2label = config.get("id2label") or {}
    if [str(id2label.get(str(k))) for k in range(len(id2label))] == list(labels):
        return {}
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {name: k for k, name in enumerate(labels)}, "ignore_mismatched_sizes": True}


def prepare_directory(model_dir: str | os.PathLike, task: str, seed: int = 42,
                      labels: list[str] | None = None) -> pathlib.Path:
    """The graph the command line trains for a model directory fusetrain does not build: the capture of its
    transformers class for `task` (from the cache when present) with the directory's weights as initializers,
    config.json and the tokenizer files beside it. Weights of a head the directory lacks are drawn as transformers
    draws them, from `seed`; `labels` (class names) remake a classification head for them where config.json names
    others."""
    directory = pathlib.Path(model_dir)
    if not (directory / "config.json").is_file():
        raise CaptureError(f"{directory}: expected a model directory with config.json, found none")
    if task not in _AUTO_CLASSES:
        raise CaptureError(f"task {task!r} is not one fusetrain captures ({', '.join(_AUTO_CLASSES)})")
    # Prepared before: nothing to load (neither the model nor the capture).
    overrides = _label_overrides(directory, labels)
    target = cache_root() / "directories" / _prepared_key(directory, task, seed, labels if overrides else None)
    if (target / "model.onnx").exists():
        return target / "model.onnx"
    import numpy as np
    import onnx
    import onnx.numpy_helper
    import torch
    import transformers

    torch.manual_seed(seed)
    with _quiet_logging():
        try:
            model = getattr(transformers, _AUTO_CLASSES[task]).from_pretrained(str(directory), **overrides)
        except (ValueError, OSError, KeyError) as error:
            raise CaptureError(f"{directory}: transformers cannot build a model for --task {task}: "
                               f"{_first_line(error)}") from error
    model = model.float()
    graph_path = captured_path(model, task)

    def fill(scratch: pathlib.Path) -> None:
        graph = onnx.load(str(graph_path))
        state = {name: value.detach().numpy() for name, value in model.state_dict().items()}
        for initializer in graph.graph.initializer:
            if initializer.name in state and initializer.data_type == onnx.TensorProto.FLOAT:
                value = np.ascontiguousarray(state[initializer.name], dtype=np.float32)
                initializer.CopyFrom(onnx.numpy_helper.from_array(value, initializer.name))
        onnx.save(graph, str(scratch / "model.onnx"), save_as_external_data=graph.ByteSize() > 1_500_000_000)
        config = model.config.to_dict()
        config["architectures"] = [type(model).__name__]
        (scratch / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        # what does not train and the embeddings' padding rows, which the importer reads beside the graph (the
        # graph's initializers already hold the directory's values)
        sidecar = {"frozen": sorted(_fixed_values(model, graph_path)), "padding_rows": _padding_rows(model)}
        (scratch / "fusetrain_capture.json").write_text(json.dumps(sidecar, indent=2) + "\n")
        for name in _PROCESSOR_FILES:
            if (directory / name).exists():
                (scratch / name).write_bytes((directory / name).read_bytes())

    return _write_folder(target, fill)


def main(argv: list[str] | None = None) -> int:
    """`python -m fusetrain.capture --model DIR --task TASK [--seed N]`: prints the prepared graph's path."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fusetrain.capture", description=main.__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--labels", type=json.loads, default=None, help="class names, a JSON list")
    args = parser.parse_args(argv)
    try:
        print(prepare_directory(args.model, args.task, args.seed, args.labels))
    except CaptureError as error:
        print(f"fusetrain: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
