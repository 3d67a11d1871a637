"""`fusetrain.Trainer`: transformers' `Trainer`, with fusetrain's engine running the training steps.

    from fusetrain import Trainer, TrainingArguments      # the only line that changes

It is a subclass of `transformers.Trainer`. The engine replaces what it runs faster: the step loop
(forward, backward, gradient accumulation, clipping and the fused AdamW update, with batches collated
in C++ when the collator is a standard one), the forward of evaluation and prediction
(`prediction_step`), and the optimizer and scheduler state inside checkpoints. Everything else is
transformers' own and inherited: the arguments, callbacks and `report_to` integrations, logging
(`log`, `log_metrics`, `save_metrics`), the evaluation and prediction loops, `compute_metrics` and
`preprocess_logits_for_metrics`, checkpoint files and rotation, `load_best_model_at_end`,
`create_model_card`, `hyperparameter_search`, and subclasses such as examples' `QuestionAnsweringTrainer`.

Checkpoints hold what transformers writes (`model.safetensors`, `optimizer.pt`, `scheduler.pt`,
`rng_state.pth`, `trainer_state.json`, `training_args.bin`) plus `fusetrain_state.json` (the engine's
dropout stream and fp16 loss scale), so either Trainer resumes the other's checkpoints.

A transformers head class fusetrain does not build itself is captured (`fusetrain.capture`: its training
forward exported by torch.onnx's dynamo exporter and imported, parameters under their transformers names).
A model or setting the engine cannot run (a graph it cannot capture or import, another optimizer, a
custom `compute_loss`, ...) trains with transformers' own loop after one warning naming it and why;
`TrainingArguments(fusetrain_require_engine=True)` makes that an error instead. Arguments transformers would
crash on or misread (`check_arguments`, applied to transformers' own TrainingArguments too) and a model whose
config no longer describes it (`check_config_matches_model`) are refused with a ValueError before training.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import transformers
from transformers.trainer import logger
from transformers.trainer_callback import EarlyStoppingCallback
from transformers.trainer_pt_utils import get_model_param_count
from transformers.trainer_utils import TrainOutput

from fusetrain import _core, capture, data
from fusetrain._versions import counts_unshifted_labels
from fusetrain.distributed import engine_communicator
from fusetrain._core import Model
from fusetrain.training_args import TrainingArguments, _value, check_arguments, engine_dict, engine_refusals

# transformers collators whose batches equal the engine's own up to padding.
_PADDING_COLLATORS = ("PaddingCollator", "DataCollatorWithPadding", "DataCollatorForTokenClassification", "default_data_collator",
                      "DefaultDataCollator")
_ENGINE_STATE_FILE = "fusetrain_state.json"
# The Trainer methods whose override by a subclass changes a training step or the order of the examples: the engine
# cannot run those.
_STEP_METHODS = ("training_step", "compute_loss", "create_optimizer", "create_scheduler", "get_train_dataloader",
                 "_get_train_sampler")


def _trainable(row: dict) -> bool:
    return bool(row["task"])


def supported_trainer_classes() -> list[str]:
    """The transformers model classes whose training fusetrain.Trainer runs on the engine."""
    return [row["architecture"] for row in _core.architectures() if _trainable(row)]


def _registry_row(architecture: str) -> dict | None:
    return next((row for row in _core.architectures() if row["architecture"] == architecture), None)


def _native(architecture: str) -> bool:
    """Whether fusetrain builds the architecture itself (else the engine trains its captured graph)."""
    row = _registry_row(architecture)
    return row is not None and _trainable(row)


def _task_of(architecture: str) -> str:
    row = _registry_row(architecture)
    if row is not None and _trainable(row):
        return row["task"]
    task = capture.task_of_class(architecture)
    if task is not None:
        return task
    raise TypeError(
        f"fusetrain cannot train a {architecture}: it builds " + ", ".join(supported_trainer_classes())
        + " and captures other transformers head classes (...ForSequenceClassification, ...ForTokenClassification, "
        "...ForQuestionAnswering, ...ForMaskedLM, ...ForCausalLM, ...ForImageClassification, encoder-decoders' "
        "...ForConditionalGeneration)"
    )


def _is_peft(model: Any) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "get_base_model")


def _base_model(model: Any) -> Any:
    """The transformers model: itself, or the one a PEFT model wraps (its Linear layers carrying the adapters)."""
    return model.get_base_model() if _is_peft(model) else model


def architecture_of(model: Any) -> str:
    """The transformers class a model object is (for a PEFT model: the class it wraps)."""
    return type(_base_model(model)).__name__


def _lora_refusal(model: Any) -> str | None:
    """Why the engine cannot train this PEFT model's adapters (None when it can)."""
    configs = model.peft_config
    if len(configs) != 1:
        return f"the PEFT model holds {len(configs)} adapters ({', '.join(configs)}); the engine trains one"
    (name, config), = configs.items()
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return f"the PEFT adapter is {config.peft_type}; the engine trains LORA adapters"
    unsupported = [(getattr(config, "use_dora", False), "DoRA"), (getattr(config, "rank_pattern", None), "rank_pattern"),
                   (getattr(config, "alpha_pattern", None), "alpha_pattern"),
                   (getattr(config, "layers_to_transform", None) is not None, "layers_to_transform"),
                   (getattr(config, "bias", "none") != "none", f"bias={getattr(config, 'bias', None)!r}"),
                   (getattr(config, "target_parameters", None), "target_parameters"),
                   (getattr(config, "trainable_token_indices", None), "trainable_token_indices"),
                   (getattr(config, "exclude_modules", None), "exclude_modules"),
                   (not isinstance(getattr(config, "target_modules", None), (list, set, tuple, str)),
                    "target_modules that are not names")]
    layers = [m for m in _base_model(model).modules() if _is_bnb(m, "Linear4bit") or _is_bnb(m, "Linear8bitLt")]
    unsupported += [(any(_is_bnb(m, "Linear8bitLt") and m.state.has_fp16_weights for m in layers),
                     "an 8-bit layer holding float16 weights (has_fp16_weights=True)"),
                    (any(_is_bnb(m, "Linear4bit") and m.compute_dtype == torch.float16 for m in layers),
                     "a 4-bit base computing in float16")]
    named = [what for flag, what in unsupported if flag]
    if isinstance(config.target_modules, str) and config.target_modules != "all-linear":
        named.append("a target_modules regular expression")
    if named:
        return f"the LoRA adapter {name!r} uses {', '.join(named)}, which the engine does not implement"
    return None


def _is_bnb(module: Any, layer: str) -> bool:
    """Whether `module` is bitsandbytes' own `layer` class (PEFT's LoRA wrappers around it share the name)."""
    return type(module).__name__ == layer and type(module).__module__.startswith("bitsandbytes")


def _quantized_modules(model: Any) -> dict[str, Any]:
    """bitsandbytes' quantised layers (4-bit, LLM.int8) of a (PEFT) model's base: engine weight name -> the layer."""
    adapter = _adapter_of(model)
    return {_plain_name(name, adapter) + ".weight": module for name, module in _base_model(model).named_modules()
            if _is_bnb(module, "Linear4bit") or _is_bnb(module, "Linear8bitLt")}


def _int8_scales(module: Any) -> Any:
    """An LLM.int8 layer's absmax of each weight row (SCB): on the weight until the first forward moves it to the
    layer's state."""
    scb = getattr(module.weight, "SCB", None)
    return scb if scb is not None else module.state.SCB


def _quantized_values(model: Any) -> dict[str, Any]:
    """The engine's values of each quantised weight, as bitsandbytes holds them. 4-bit: the packed codes (uint8,
    flat), the absmax of each block (float32; with double quantisation its 8-bit codes dequantised as bitsandbytes'
    own dequantize_4bit does), and the format's 16 values. LLM.int8: the int8 codes (as uint8, flat) and the absmax
    of each row."""
    import bitsandbytes.functional as bnb_functional

    out = {}
    for name, module in _quantized_modules(model).items():
        if _is_bnb(module, "Linear8bitLt"):
            out[name] = module.weight.data.detach().reshape(-1).view(torch.uint8)
            out[name + ".absmax"] = _int8_scales(module).float()
            continue
        state = module.weight.quant_state
        absmax = state.absmax
        if state.nested:
            absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        out[name] = module.weight.data.detach().reshape(-1)
        out[name + ".absmax"] = absmax.float()
        out[name + ".quant_map"] = state.code.float()
    return out


def _lora_settings(model: Any) -> dict:
    (config,) = model.peft_config.values()
    targets = config.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    # A base whose frozen weights are all bf16 (loaded with dtype=torch.bfloat16 to save memory) stays bf16 in the
    # engine: its frozen projections are kept as they are rather than widened to twice the memory.
    frozen = [p for p in _base_model(model).parameters() if not p.requires_grad and p.is_floating_point()]
    bf16_base = bool(frozen) and all(p.dtype == torch.bfloat16 for p in frozen)
    settings = dict(r=int(config.r), lora_alpha=float(config.lora_alpha),
                    lora_dropout=float(config.lora_dropout or 0.0), target_modules=targets,
                    modules_to_save=sorted(config.modules_to_save or []),
                    use_rslora=bool(getattr(config, "use_rslora", False)),
                    base_dtype="bfloat16" if bf16_base else "float32")
    quantized = _quantized_modules(model)
    if quantized:  # QLoRA: bitsandbytes' quantised base, read as it is
        states = {("int8", 64, torch.float32) if _is_bnb(m, "Linear8bitLt") else
                  (m.weight.quant_state.quant_type, m.weight.quant_state.blocksize, m.compute_dtype)
                  for m in quantized.values()}
        if len(states) != 1:
            raise TypeError(f"the quantised layers of the model differ in format, block size or compute dtype: {states}")
        ((quant_type, blocksize, compute),) = states
        settings.update(quant_type=quant_type, quant_blocksize=int(blocksize), quant_bf16=compute == torch.bfloat16,
                        quantized=sorted(quantized))
    return settings


def _adapter_of(model: Any) -> str | None:
    return next(iter(model.peft_config)) if _is_peft(model) else None


def _plain_name(name: str, adapter: str | None) -> str | None:
    """A module or parameter name of a PEFT model's base as the engine (and the transformers model without PEFT)
    names it: "<m>.base_layer.weight" is "<m>.weight", "<m>.lora_A.<adapter>.weight" "<m>.lora_A.weight",
    "<m>.modules_to_save.<adapter>.<p>" "<m>.<p>"; None for PEFT's frozen original_module copy of a module trained in
    full. Without an adapter, the name itself."""
    if adapter is None:
        return name
    if ".original_module." in name + ".":
        return None
    for part, plain in ((".base_layer", ""), (f".lora_A.{adapter}", ".lora_A"), (f".lora_B.{adapter}", ".lora_B"),
                        (f".modules_to_save.{adapter}", "")):
        name = name.replace(part, plain)
    return name


def _engine_names(hf_model: Any) -> dict[str, str]:
    """Engine parameter name -> the name in hf_model's state_dict (for a PEFT model, PEFT's module names folded away
    as _plain_name does)."""
    adapter = _adapter_of(hf_model)
    names = {}
    for key in _base_model(hf_model).state_dict():
        name = _plain_name(key, adapter)
        if name is not None:
            names[name] = key
    return names


# ------------------------------------------------------------ does the config still describe the model?
#
# The engine builds the model it trains from model.config. A config changed after the model was built
# (model.config.num_attention_heads = 2, hidden_act = "relu", num_hidden_layers one less, ...) would thus train
# another model than the one held, silently where no weight's shape shows it. The rule: the model transformers
# builds from the config now must be the model held, module by module (same classes, parameter and buffer shapes,
# tied weights, and the settings transformers copies from the config into the modules when it builds them: head
# counts, epsilons, dropout probabilities, activation classes, padding ids). It is built on the meta device: no
# memory, and no random numbers drawn.

# Module attributes that change after a model is built without a change of its config.
_RUNTIME_ATTRIBUTES = frozenset({"training", "gradient_checkpointing", "kernel_config", "name_or_path",
                                 "max_seq_len_cached"})
_MAX_CONFIG_TRIALS = 48


def _built_from_config(model: Any, config: Any) -> Any:
    with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(model)(config)


def _peft_only(name: str) -> bool:
    """A module PEFT adds (an adapter, the dict holding it, a wrapper's copies): none of the base model's."""
    return any(part.startswith("lora_") or part in ("modules_to_save", "original_module") for part in name.split("."))


def _settings(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in _RUNTIME_ATTRIBUTES
            and (v is None or isinstance(v, (bool, int, float, str)))}


def _shapes(module: Any) -> dict[str, tuple]:
    tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    return {k: tuple(v.shape) for k, v in tensors.items() if v is not None}


def _class_of(name: str) -> type | None:
    """The class transformers' activation `name` (a hidden_act value) builds."""
    from transformers.activations import ACT2CLS

    entry = ACT2CLS.get(name) if isinstance(name, str) else None
    return entry[0] if isinstance(entry, tuple) else entry


def _where(module: str, key: str) -> str:
    return f"{module}.{key}" if module else f"the model's {key}"


def _shape_text(shape: tuple | None) -> str:
    return "none" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def _module_class(module: Any) -> type:
    """A module's class; for a parametrized module (weight_norm's ParametrizedConv1d, which torch makes anew for each
    module) the class it parametrizes."""
    if torch.nn.utils.parametrize.is_parametrized(module):
        return type(module).__bases__[0]
    return type(module)


def _mismatch(held: dict[str, Any], built: dict[str, Any]) -> dict | None:
    """The first difference, module by module, between the modules of the model built from the config (`built`) and
    those of the model held: first of structure (a module missing or extra, another class or number of layers) or of
    a parameter's or buffer's shape, then of a setting. A dict: "text", and "pairs", the differing (the config's,
    the model's) values there."""
    for name, module in built.items():
        other = held.get(name)
        if other is None:
            return dict(pairs=[], text=f"the config gives a module {name} ({type(module).__name__}) the model does not "
                                       "have")
        if (_is_bnb(other, "Linear4bit") or _is_bnb(other, "Linear8bitLt")) and type(module) is torch.nn.Linear:
            # bitsandbytes' quantised layer (a 4- or 8-bit load) stands for the config's Linear: its weight is codes.
            if (other.in_features, other.out_features) != (module.in_features, module.out_features):
                return dict(pairs=[((module.in_features, module.out_features), (other.in_features, other.out_features))],
                            text=f"{name} maps {other.in_features} to {other.out_features} features where the config "
                                 f"gives {module.in_features} to {module.out_features}")
            continue
        if _module_class(other) is not _module_class(module):
            return dict(pairs=[(type(module), type(other))],
                        text=f"{name or 'the model'} is a {type(other).__name__} where the config gives a "
                             f"{type(module).__name__}")
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) != len(other):
            return dict(pairs=[(len(module), len(other))],
                        text=f"{name} holds {len(other)} modules where the config gives {len(module)}")
        given, found = _shapes(module), _shapes(other)
        for key in [*given, *(k for k in found if k not in given)]:
            if given.get(key) != found.get(key):
                return dict(pairs=[(g, f) for g, f in zip(given.get(key) or (), found.get(key) or ()) if g != f],
                            text=f"{_where(name, key)} has shape {_shape_text(found.get(key))} where the config gives "
                                 f"{_shape_text(given.get(key))}")
    extra = next((name for name in held if name not in built and not _peft_only(name)), None)
    if extra is not None:
        return dict(pairs=[], text=f"the model holds {extra} ({type(held[extra]).__name__}), which the config does "
                                   "not give")
    for name, module in built.items():
        # Only what transformers set when it built the module: resize_token_embeddings adds vocab_size, ...
        given, found = _settings(module), _settings(held[name])
        differing = [k for k in given if given[k] != found.get(k)]
        if differing:
            key = differing[0]
            return dict(pairs=[(given.get(k), found.get(k)) for k in differing],
                        text=f"{_where(name, key)} is {found.get(key)!r} where the config gives {given.get(key)!r}")
    return None


def _ties(model: Any) -> set[frozenset[str]]:
    """The groups of parameter names that are one tensor (tied weights)."""
    groups: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), set()).add(name)
    return {frozenset(group) for group in groups.values() if len(group) > 1}


def _model_mismatch(held: dict[str, Any], held_model: Any, built_model: Any, peft: bool) -> dict | None:
    """_mismatch, then (but for a PEFT model, whose copies of a module trained in full untie it) tied weights."""
    mismatch = _mismatch(held, dict(built_model.named_modules()))
    if mismatch is not None or peft:
        return mismatch
    held_ties, built_ties = _ties(held_model), _ties(built_model)
    group = min(held_ties ^ built_ties, key=sorted, default=None)
    if group is None:
        return None
    first, *rest = sorted(group)
    tied = group in held_ties
    return dict(pairs=[(not tied, tied)],
                text=f"{first} is {'tied to' if tied else 'a separate weight from'} {', '.join(rest)} where the "
                     f"config {'unties' if tied else 'ties'} them")


def _config_trials(config: Any, pairs: list[tuple[Any, Any]]) -> list[tuple[str, Any]]:
    """(field, value) changes of the config that could undo a change behind the differing (the config's, the
    model's) values: a field equal to the config's value set to the model's (for an activation class, a name that
    builds the model's class) first, then an integer field scaled as the values are, or inversely."""
    from transformers.activations import ACT2CLS

    fields = {k: v for k, v in config.to_dict().items() if v is None or isinstance(v, (bool, int, float, str))}
    if hasattr(config, "num_labels"):
        fields["num_labels"] = config.num_labels
    exact, scaled = [], []
    for given, found in pairs:
        for field, value in fields.items():
            if isinstance(given, type):
                if _class_of(value) is given:
                    exact += [(field, name) for name in ACT2CLS if _class_of(name) is found]
            elif type(value) is type(given) and value == given and found != value:
                exact.append((field, found))
            elif type(value) is int and type(given) is int and type(found) is int and given > 0 and found > 0:
                for numerator, denominator in ((found, given), (given, found)):  # e.g. heads behind a head size
                    if value * numerator % denominator == 0 and value * numerator // denominator not in (0, value):
                        scaled.append((field, value * numerator // denominator))
    return list(dict.fromkeys(exact + scaled))[:_MAX_CONFIG_TRIALS]


def check_config_matches_model(model: Any) -> None:
    """Raises ValueError when model.config no longer describes the transformers (or PEFT) model `model`: where they
    differ (a parameter and both shapes, a module's setting, ...), and the config field that changed and the value the
    model was built with when setting that one field back rebuilds exactly the model held."""
    import copy

    base = _base_model(model)
    adapter = _adapter_of(model)
    held: dict[str, Any] = {}
    for name, module in base.named_modules():
        plain = _plain_name(name, adapter)
        if plain is not None:
            held[plain] = module  # a PEFT layer's base_layer comes after the layer, and wins
    advice = "fusetrain builds the model it trains from the config, so it would train a different model than this one"
    try:
        built_model = _built_from_config(base, copy.deepcopy(base.config))
    except Exception as error:  # noqa: BLE001 (transformers refuses the config, whatever its exception)
        raise ValueError(f"fusetrain: model.config no longer builds a {type(base).__name__} ({type(error).__name__}: "
                         f"{error}); was it changed after the model was built? {advice}") from error
    mismatch = _model_mismatch(held, base, built_model, adapter is not None)
    if mismatch is None:
        return
    for field, value in _config_trials(base.config, mismatch["pairs"]):
        config = copy.deepcopy(base.config)
        try:
            setattr(config, field, value)
            agrees = _model_mismatch(held, base, _built_from_config(base, config), adapter is not None) is None
        except Exception:  # noqa: BLE001 (a value transformers refuses is not the one the model was built with)
            continue
        if agrees:
            raise ValueError(f"fusetrain: model.config.{field} is {getattr(base.config, field)!r} but the model was "
                             f"built with {value!r} ({mismatch['text']}); {advice}: set model.config.{field} back to "
                             f"{value!r}, or build the model from the changed config")
    raise ValueError(f"fusetrain: model.config does not describe the model it belongs to ({mismatch['text']}); was it "
                     f"changed after the model was built? {advice}")


def engine_model(model: Any) -> Model:
    """A fusetrain.Model with the config and weights of a transformers model object; a PEFT LoRA model becomes an
    engine LoRA model with the same adapters (frozen base, adapters and modules_to_save trainable; a base held
    in bf16 keeps its frozen projections in bf16). A config that no longer describes the model (changed after the
    model was built) is refused with a ValueError (check_config_matches_model)."""
    base = _base_model(model)
    architecture = type(base).__name__
    task = _task_of(architecture)
    refusal = _lora_refusal(model) if _is_peft(model) else None
    if refusal:
        raise TypeError(refusal)
    check_config_matches_model(model)
    if not _native(architecture):
        if _is_peft(model):
            raise TypeError(f"the engine trains LoRA adapters on the architectures it builds "
                            f"({', '.join(supported_trainer_classes())}), not on a captured {architecture}")
        return capture.capture(base, task)
    config_dict = base.config.to_dict()
    config_dict["architectures"] = [architecture]
    out = Model.from_config(config_dict, architecture=architecture)
    if _is_peft(model):
        out.enable_lora(**_lora_settings(model))
    load_weights(out, model)
    return out


def load_weights(engine: Model, hf_model: Any) -> None:
    """Copies a transformers (or PEFT) model's parameters into the engine model (buffers such as position_ids left
    out)."""
    wanted = set(engine.state_dict_names())
    names = _engine_names(hf_model)
    state = _base_model(hf_model).state_dict()
    values = {name: state[key].detach() for name, key in names.items() if name in wanted}
    if _is_peft(hf_model):
        values.update(_quantized_values(hf_model))
    engine.load_state_dict(values, strict=True)


def write_back(model: Model, hf_model: Any) -> None:
    """Copies the engine model's weights into the transformers model object, in place (a LoRA model: its adapters
    and modules_to_save; the frozen base is unchanged)."""
    names = _engine_names(hf_model)
    weights = model.state_dict()
    trained = set(model.trainable_names()) if model.lora is not None else set(weights)
    with torch.no_grad():
        params = _base_model(hf_model).state_dict(keep_vars=True)
        for name, value in weights.items():
            if name not in trained:
                continue
            target = params.get(names.get(name, name))
            if target is None:
                raise ValueError(f"the transformers model has no parameter {name!r} to write back")
            target.copy_(torch.from_numpy(value).to(target.dtype))


def hf_parameter(hf_model: Any, engine_name: str) -> Any:
    """The torch parameter of hf_model that the engine parameter `engine_name` is (tied names resolved)."""
    return _base_model(hf_model).get_parameter(_engine_names(hf_model).get(engine_name, engine_name))


# The optim values whose optimizer counts steps in an int "step" (bitsandbytes', transformers' Adafactor).
_INT_STEP_OPTIMIZERS = ("lion_32bit", "paged_lion_32bit", "rmsprop_bnb", "rmsprop_32bit", "paged_rmsprop_32bit",
                        "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adafactor")


def _torch_state(optimizer_state: dict, name: str, param: Any) -> dict:
    """Parameter `name`'s entry of the torch optimizer's state dict for the engine's optimizer_state(): its states
    under the optimizer's own names, with the "step" entry in that optimizer's form (torch's a float tensor, SGD's
    none, an int for bitsandbytes' and Adafactor, which also keeps the parameter's RMS); empty when the optimizer keeps
    no state."""
    states = {key: torch.from_numpy(arrays[name]) for key, arrays in optimizer_state["states"].items()
              if name in arrays}
    if not states:
        return {}
    optim, step = optimizer_state["optim"], optimizer_state["step"]
    if optim == "sgd":
        return states
    if optim == "adafactor":
        states["RMS"] = (param.detach().float().norm(2) / param.numel() ** 0.5).item()
    return {"step": step if optim in _INT_STEP_OPTIMIZERS else torch.tensor(float(step)), **states}


def _transformers_model(model: Any) -> Any:
    """A transformers model object for `model`: itself, or one loaded from a directory or a fusetrain.Model."""
    if isinstance(model, (str, os.PathLike)):
        config = transformers.AutoConfig.from_pretrained(os.fspath(model))
        cls = getattr(transformers, (config.architectures or [""])[0], None)
        if cls is None:
            raise TypeError(f"{os.fspath(model)}: config.json names no transformers model class in \"architectures\"")
        return cls.from_pretrained(os.fspath(model))
    if isinstance(model, Model):
        config_dict = dict(model.config)
        cls = getattr(transformers, model.architecture, None)
        if cls is None:
            raise TypeError(f"transformers has no model class {model.architecture}")
        config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        hf_model = cls(config)
        write_back(model, hf_model)
        return hf_model
    return model


def decoder_inputs(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder's batch with decoder_input_ids: the collator's (DataCollatorForSeq2Seq given the model),
    else the labels shifted right as the model's forward shifts them: its prepare_decoder_input_ids_from_labels, or
    (Whisper, which has none) its modeling module's shift_tokens_right with the config's pad and start tokens."""
    if "decoder_input_ids" in batch or batch.get("labels") is None:
        return batch
    labels = batch["labels"]
    labels = labels if torch.is_tensor(labels) else torch.as_tensor(np.asarray(labels))
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        return {**batch, "decoder_input_ids": prepare(labels=labels)}
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    if shift is None:
        raise ValueError(f"{type(model).__name__} has no prepare_decoder_input_ids_from_labels and its module no "
                         "shift_tokens_right: give the batch decoder_input_ids (DataCollatorForSeq2Seq(model=...))")
    config = model.config
    return {**batch, "decoder_input_ids": shift(labels, config.pad_token_id, config.decoder_start_token_id)}


def _loss_divides_by_item_count(model: Any) -> bool:
    """Whether the model's loss is transformers' loss_function, which divides by the num_items_in_batch the Trainer
    passes (a token-weighted mean over all micro-batches of a step), rather than a mean per micro-batch."""
    try:
        return "self.loss_function" in inspect.getsource(type(_base_model(model)).forward)
    except (OSError, TypeError):
        return True


def _engine_state(path: str, step: int) -> dict:
    """A checkpoint's fusetrain_state.json ({} when absent: a transformers checkpoint), checked field by field."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            state = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(state).__name__}")
    dropout = state.get("dropout_step", 0)
    if isinstance(dropout, bool) or not isinstance(dropout, int) or dropout < 0:
        raise ValueError(f'{path}: "dropout_step" is {dropout!r}, expected an integer >= 0')
    scaler = state.get("loss_scaler", {})
    if not isinstance(scaler, dict):
        raise ValueError(f'{path}: "loss_scaler" is {scaler!r}, expected an object (scale, growth_tracker, '
                         "skipped_steps)")
    skipped = scaler.get("skipped_steps", 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or not 0 <= skipped <= step:
        raise ValueError(f'{path}: "loss_scaler.skipped_steps" is {skipped!r}, expected an integer in [0, {step}]')
    return state


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


class Trainer(transformers.Trainer):
    """transformers.Trainer whose training steps, evaluation forward and optimizer run on fusetrain's engine.

    Takes transformers' arguments. `model` may also be a model directory or a fusetrain.Model (a transformers
    model object is built from it). `args` may be a fusetrain.TrainingArguments or transformers' own.
    """

    # A subclass whose parent trainer prepares its own datasets and collator (TRL's) sets this: text columns are then
    # left to it, not tokenized here.
    _prepares_own_datasets = False

    def __init__(self, model: Any = None, args: transformers.TrainingArguments | None = None,
                 data_collator: Callable | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, *rest: Any, **kwargs: Any) -> None:
        if processing_class is None:  # "tokenizer" is the name transformers 4 used
            processing_class = kwargs.pop("tokenizer", None)
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        check_arguments(args)  # transformers' own TrainingArguments do not check them
        if not self._prepares_own_datasets:
            # Text columns are tokenized when a tokenizer is given (transformers expects tokenized datasets).
            train_dataset = data.tokenize_if_needed(train_dataset, processing_class, "train_dataset")
            if isinstance(eval_dataset, dict):
                eval_dataset = {k: data.tokenize_if_needed(v, processing_class, "eval_dataset")
                                for k, v in eval_dataset.items()}
            else:
                eval_dataset = data.tokenize_if_needed(eval_dataset, processing_class, "eval_dataset")
        if model is not None and not (self._prepares_own_datasets and isinstance(model, str)):
            model = _transformers_model(model)  # TRL loads a model named by a string itself (model_init_kwargs)
        if rest:
            super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, *rest, **kwargs)
        else:  # by keyword: TRL's DPOTrainer takes ref_model second
            super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        if data_collator is None and processing_class is None and not self._prepares_own_datasets:
            # transformers' default (default_data_collator) cannot batch examples of different lengths; this one
            # pads them with the model's pad id.
            self.data_collator = data.PaddingCollator(int(getattr(self.model.config, "pad_token_id", None) or 0))
        patience = getattr(args, "early_stopping_patience", 0)
        if patience:
            self.add_callback(EarlyStoppingCallback(patience, getattr(args, "early_stopping_threshold", 0.0)))
        self._engine_model: Model | None = None  # built from self.model on first use
        self._engine_source: Any = None  # the transformers model object it was built from
        self._engine_datasets: dict[int, Any] = {}
        self._engine: Any = None  # the engine loop of the train() running now
        self._warned_fallback = False
        self._captured_source: Any = None  # the model object _capture_error describes
        self._capture_error: str | None = None
        self._data_refusal: str | None = None
        self._eval_engine: Model | None = None  # the engine model an evaluation loop is running on
        if train_dataset is not None and self.engine_refusal() is None:
            self._prepare_engine_data()  # bad data is refused now, naming the problem

    def call_model_init(self, trial: Any = None) -> Any:
        """transformers' call_model_init; a model directory or fusetrain.Model returned becomes a transformers model."""
        return _transformers_model(super().call_model_init(trial))

    def _prepare_engine_data(self) -> None:
        task = _task_of(architecture_of(self.model))
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset) or \
                type(self.train_dataset).__name__ == "IterableDataset":
            self._data_refusal = ("the engine cannot read the training data: it is streamed (an IterableDataset); "
                                  "the engine reads map-style datasets")
            return
        self._data_refusal = None
        self._engine_ready_model()
        # bad data raises, naming it; start and end positions, and an encoder-decoder's targets, are the collator's
        self._engine_dataset(self.train_dataset, task, with_labels=task not in ("qa", "seq2seq"))

    # ------------------------------------------------------------ engine or transformers

    def engine_refusal(self) -> str | None:
        """Why the engine cannot run this Trainer's training (None when it can)."""
        architecture = architecture_of(self.model)
        if not _native(architecture):
            if capture.task_of_class(architecture) is None:
                return (f"fusetrain does not build {architecture} (it builds {', '.join(supported_trainer_classes())})"
                        " and captures only head classes (...ForSequenceClassification, ...ForTokenClassification, "
                        "...ForQuestionAnswering, ...ForMaskedLM, ...ForCausalLM, ...ForImageClassification, "
                        "encoder-decoders' ...ForConditionalGeneration)")
            failure = self._capture_failure()
            if failure is not None:
                return failure
        reasons = engine_refusals(self.args)
        if self.compute_loss_func is not None:
            reasons.append("compute_loss_func is given (the engine computes the model's own loss)")
        if self.optimizer is not None or self.lr_scheduler is not None or self.optimizer_cls_and_kwargs is not None:
            reasons.append("an optimizer or scheduler is given (the engine runs AdamW with the arguments' schedule)")
        overridden = [name for name in _STEP_METHODS
                      if getattr(type(self), name) is not getattr(self._engine_step_class(), name)]
        if overridden:
            reasons.append(f"{type(self).__name__} overrides {', '.join(overridden)}")
        if _is_peft(self.model) and _lora_refusal(self.model):
            reasons.append(_lora_refusal(self.model))
        if self._data_refusal:
            reasons.append(self._data_refusal)
        return "; ".join(reasons) or None

    @classmethod
    def _engine_step_class(cls) -> type:
        """The class whose training-step methods the engine stands in for: a subclass overriding them is refused."""
        return Trainer

    def _capture_failure(self) -> str | None:
        """Why the model could not be captured (None when it was, or when it is not captured at all); tried once
        per model object."""
        if self._captured_source is not self.model:
            self._captured_source, self._capture_error = self.model, None
            try:
                self._engine_ready_model()
            except (capture.CaptureError, TypeError) as error:
                self._capture_error = str(error)
        return self._capture_error

    def _fall_back(self, reason: str, what: str = "training") -> None:
        message = (f"fusetrain: {what} runs with transformers' own loop, not fusetrain's engine: {reason}. "
                   "Set fusetrain_require_engine=True in TrainingArguments to make this an error.")
        if getattr(self.args, "fusetrain_require_engine", False):
            raise ValueError(message.split(". Set")[0])
        if not self._warned_fallback:
            warnings.warn(message, stacklevel=3)
            self._warned_fallback = True

    def _engine_ready_model(self) -> Model:
        """The engine model holding self.model's current weights (built once per transformers model object)."""
        if self._engine_model is None or self._engine_source is not self.model:
            self._engine_model = engine_model(self.model)
            self._engine_source = self.model
        elif self._engine is None:
            load_weights(self._engine_model, self.model)  # the transformers model may have changed since
        self._engine_model.bf16 = bool(self.args.bf16)
        self._engine_model.fp16 = bool(self.args.fp16)
        return self._engine_model

    def _engine_dataset(self, dataset: Any, task: str, with_labels: bool = True) -> Any:
        key = id(dataset)
        if key not in self._engine_datasets:
            config = self._engine_model.config
            self._engine_datasets[key] = (dataset, data.to_engine(
                dataset, task=task, vocab_size=int(config.get("vocab_size") or 0),
                num_labels=int(config.get("num_labels") or len(config.get("id2label") or {}) or 2),
                problem_type=config.get("problem_type"), name="train_dataset", with_labels=with_labels))
        return self._engine_datasets[key][1]

    def _length_column(self, args: Any) -> list[int] | None:
        """The training examples' lengths from the dataset's length_column_name column, which
        train_sampling_strategy="group_by_length" groups by as transformers' does: where the column reaches the
        sampler, a datasets.Dataset's with remove_unused_columns off. None when it groups by the token counts (or
        does not group)."""
        if _value(getattr(args, "train_sampling_strategy", "random")) != "group_by_length":
            return None
        # transformers removes the column before its sampler reads it, or reads a datasets.Dataset's columns only
        name = args.length_column_name
        if args.remove_unused_columns or name not in (getattr(self.train_dataset, "column_names", None) or ()):
            return None
        return [int(length) for length in self.train_dataset[name]]

    # ------------------------------------------------------------ collation

    def _pad_id(self) -> int:
        tokenizer_pad = getattr(self.processing_class, "pad_token_id", None)
        if tokenizer_pad is not None:
            return int(tokenizer_pad)
        return int(self._engine_model.config.get("pad_token_id") or 0)

    def _mlm_spec(self, task: str) -> dict | None:
        """How the engine masks tokens for masked-LM training: only in place of a standard
        DataCollatorForLanguageModeling; under any other collator the labels are the dataset's, as in transformers."""
        if task != "mlm" or self._uses_python_collator():
            return None
        tokenizer = self.processing_class
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise ValueError("masked-LM training needs processing_class=<a tokenizer with a mask token>")
        collator = self.data_collator
        probability = float(getattr(collator, "mlm_probability", 0.15) or 0.15)
        return {"mask_id": int(mask_id), "vocab_size": int(self._engine_model.config["vocab_size"]),
                "special_ids": [int(i) for i in tokenizer.all_special_ids], "probability": probability}

    def _uses_python_collator(self) -> bool:
        """Whether training batches come from calling the collator (else the engine collates in C++)."""
        task = _task_of(architecture_of(self.model))
        if task in ("qa", "image-cls", "seq2seq", "ctc"):
            return True  # start and end positions, the images, an encoder-decoder's or CTC's targets: the collator's
        if capture.feature_input(_base_model(self.model)) is not None:
            return True  # audio: the collator pads each batch's input_values
        collator = self.data_collator
        if collator is None:
            return False
        name = getattr(collator, "__name__", None) or type(collator).__name__
        if name in _PADDING_COLLATORS:
            return task == "mlm"  # masked-LM labels the dataset holds (pre-masked): the collator passes them on
        if name == "DataCollatorForLanguageModeling":
            standard = (getattr(collator, "mask_replace_prob", 0.8) == 0.8
                        and getattr(collator, "random_replace_prob", 0.1) == 0.1)
            return not (task == "mlm" and getattr(collator, "mlm", True) and standard)
        return True

    def _collate_hook(self) -> Callable[[np.ndarray, bool], dict]:
        rows, collator, pad_id = data.model_rows(self.train_dataset), self.data_collator, self._pad_id()
        if capture.spec_augment_inputs(_base_model(self.model)):
            model = _base_model(self.model)

            def augmented(indices: np.ndarray, training: bool) -> dict:
                batch = data.pad_batch(collator(rows(indices)), pad_id)
                return capture.draw_spec_augment(model, batch) if training else batch

            return augmented
        if not capture.is_encoder_decoder(_base_model(self.model)):
            return lambda indices, training: data.pad_batch(collator(rows(indices)), pad_id)
        model = _base_model(self.model)
        decoder_pad = int(getattr(model.config, "pad_token_id", None) or 0)

        def collate(indices: np.ndarray, training: bool) -> dict:
            return data.pad_batch(decoder_inputs(model, collator(rows(indices))), pad_id, decoder_pad_id=decoder_pad)

        return collate

    # ------------------------------------------------------------ training

    def _inner_training_loop(self, batch_size: int | None = None, args: Any = None,
                             resume_from_checkpoint: str | None = None, trial: Any = None,
                             ignore_keys_for_eval: list[str] | None = None) -> TrainOutput:
        check_arguments(args if args is not None else self.args)  # changed since __init__ (a search trial, ...)
        refusal = self.engine_refusal()
        if refusal is None:
            self._prepare_engine_data()  # the model or the data may have changed since __init__
            refusal = self.engine_refusal()
        if refusal is not None:
            self._fall_back(refusal)
            return super()._inner_training_loop(batch_size, args, resume_from_checkpoint, trial, ignore_keys_for_eval)
        return self._engine_training_loop(args, _task_of(architecture_of(self.model)), resume_from_checkpoint, trial,
                                          ignore_keys_for_eval)

    def _engine_training_loop(self, args: Any, task: str, resume_from_checkpoint: str | None, trial: Any,
                              ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        self.accelerator.free_memory()
        train_dataloader = self.get_train_dataloader()  # its length sets the step counts, as in transformers
        (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples, total_train_batch_size,
         _steps_in_epoch, max_steps) = self.set_initial_training_values(args, train_dataloader)
        epochs_trained, _ = self._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                      resume_from_checkpoint, trial)
        # transformers' optimizer and scheduler objects: what callbacks see, and the form of the checkpoints'
        # optimizer.pt and scheduler.pt. The engine runs the update; these hold its state when a checkpoint is saved.
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.optimizer = None
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        # Registered with accelerate as transformers' loop does, so evaluation finds the model prepared.
        self.model_wrapped = self.accelerator.prepare(self.model)

        model = self._engine_ready_model()
        model.set_decayed(self._engine_decayed(model))
        engine = _core._Trainer(model, engine_dict(args, max_steps=max_steps), capture.engine_task(task),
                                self._engine_dataset(self.train_dataset, task, with_labels=task != "qa"), None,
                                self._pad_id(), self._mlm_spec(task))
        engine.set_delegated(True)
        # Data parallel under torchrun or mpirun: each process trains its share of every global batch of
        # per_device_train_batch_size x world_size examples, gradients summed as backward finishes each bucket.
        engine.set_communicator(engine_communicator(args.world_size))
        if self._uses_python_collator():
            engine.set_collate(self._collate_hook())
        lengths = self._length_column(args)
        if lengths is not None:
            engine.set_train_lengths(lengths)
        self._scheduler_steps = 0
        if resume_from_checkpoint is not None:
            self._resume_engine(engine, resume_from_checkpoint)

        logger.info("***** Running training *****")
        logger.info(f"  Num examples = {num_examples:,}")
        logger.info(f"  Num Epochs = {num_train_epochs:,}")
        logger.info(f"  Num update steps per epoch = {num_update_steps_per_epoch:,}")
        logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
        logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_train_batch_size:,}")
        logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        logger.info(f"  Total optimization steps = {max_steps:,}")
        logger.info(f"  Number of trainable parameters = {get_model_param_count(self.model, trainable_only=True):,}")
        if resume_from_checkpoint is not None:
            logger.info(f"  Resuming training from checkpoint with epoch {epochs_trained} and global step "
                        f"{self.state.global_step}")

        start_time = time.time()
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        self._initial_global_step = self.state.global_step
        self._tr_loss = torch.tensor(0.0)
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self._flos_per_token = (6 * self.model.num_parameters(exclude_embeddings=True)
                                if hasattr(self.model, "num_parameters") else 0)
        self._last_learning_rate = None
        counted = bool(self.model_accepts_loss_kwargs) and task != "qa"  # transformers counts num_items_in_batch
        self._loss_by_item_count = counted and _loss_divides_by_item_count(self.model)
        self._loss_sums_micro_batches = counted and not self._loss_by_item_count
        self._count_unshifted_labels = task == "clm" and counts_unshifted_labels(self)
        self._last_grad_norm = None
        self._step_context = (trial, ignore_keys_for_eval, start_time)
        engine.set_callbacks(self._engine_event)
        self._engine = engine
        try:
            engine.train()
            write_back(model, self.model)
        finally:
            self._engine = None
        return self._finalize_training(trial, num_train_samples, start_time)

    def _engine_decayed(self, engine: Model) -> set[str]:
        """The engine's trained parameters that transformers' optimizer decays: get_decay_parameter_names' choice
        (a subclass's own rule included), matched by tensor so tied and PEFT names resolve."""
        names = set(self.get_decay_parameter_names(self.model))
        decayed = {id(p) for name, p in self.model.named_parameters() if name in names}
        return {n for n in engine.trainable_names() if id(hf_parameter(self.model, n)) in decayed}

    def _engine_event(self, event: str, state: dict, control: dict, payload: Any) -> dict:
        """The engine loop's callback: transformers' callbacks, logging, evaluation and checkpoints at each point.
        Returns the stop flags the engine honours."""
        args, s = self.args, self.state
        trial, ignore_keys_for_eval, start_time = self._step_context
        s.global_step, s.epoch = state["global_step"], state["epoch"]
        handler = self.callback_handler
        if event == "on_train_begin":
            self.control = handler.on_train_begin(args, s, self.control)
            if args.eval_on_start:
                self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)
        elif event == "on_epoch_begin":
            self.control = handler.on_epoch_begin(args, s, self.control)
            if self._uses_python_collator():
                # transformers' Trainer makes a DataLoader iterator each epoch, which draws its base seed from torch's
                # generator: drawn here too, a dataset's random transforms (image crops) see the same stream
                torch.empty((), dtype=torch.int64).random_()
        elif event == "on_step_begin":
            self.model.train()  # as transformers' training_step does (an evaluation may have left eval mode)
            self.control = handler.on_step_begin(args, s, self.control)
        elif event == "on_step_end":
            step = state["last_step"]
            loss = step["loss"]
            if self._loss_by_item_count and step["predicted"]:
                # transformers divides the step's summed token losses by num_items_in_batch, the labels of all its
                # micro-batches (for a causal LM it counts every position's label unless it knows the loss shifts
                # them: not before transformers 5.11, nor for GPT-2 before its first forward).
                loss = step["loss_sum"] / (step["labelled"] if self._count_unshifted_labels else step["predicted"])
            elif self._loss_sums_micro_batches:
                # transformers does not divide by the accumulation steps a loss to which it passed num_items_in_batch;
                # a model whose loss ignores that count (a mean per micro-batch) thus reports the sum of its
                # micro-batches' losses. The same number is reported here (the update is the mean's, in both).
                loss *= step["micro_batches"]
            if args.logging_nan_inf_filter and not math.isfinite(loss):
                self._tr_loss += self._tr_loss / (1 + s.global_step - 1 - self._globalstep_last_logged)
            else:
                self._tr_loss += loss
            self.current_flos += float(self._flos_per_token * step["tokens"])
            if args.include_num_input_tokens_seen not in (False, "no", None):
                s.num_input_tokens_seen += step["tokens"]
            self._last_learning_rate, self._last_grad_norm = step["learning_rate"], step["grad_norm"]
            self._engine_step_metrics(step)
            self.control = handler.on_step_end(args, s, self.control)
            self._maybe_log_save_evaluate(self._tr_loss, self._last_grad_norm, self.model, trial, int(s.epoch),
                                          ignore_keys_for_eval, start_time, learning_rate=self._last_learning_rate)
        elif event == "on_epoch_end":
            self.control = handler.on_epoch_end(args, s, self.control)
            self._maybe_log_save_evaluate(self._tr_loss, self._last_grad_norm, self.model, trial, int(s.epoch),
                                          ignore_keys_for_eval, start_time, learning_rate=self._last_learning_rate)
        elif event == "on_log":  # a step the non-finite guard skipped
            self.log({k: v for k, v in payload.items() if k != "step"})
        return {"should_training_stop": self.control.should_training_stop,
                "should_epoch_stop": self.control.should_epoch_stop}

    def _engine_step_metrics(self, step: dict) -> None:
        """Records a finished engine step's figures for the metrics a parent trainer logs (none here)."""

    def _engine_eval_metrics(self, engine: Model, inputs: dict[str, Any]) -> None:
        """Records what an evaluation batch's engine forward measured for a parent trainer's metrics (none here)."""

    # ------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, onnx: bool = False) -> None:
        """transformers' save_model, with the engine's current weights (during training) written back first.

        With onnx=True the directory also gets model.onnx, the inference graph (Model.export_onnx, opset 17), so
        that it loads in Optimum's ORTModelFor... classes as well as in transformers.
        """
        if self._engine is not None:
            write_back(self._engine_model, self.model)
        super().save_model(output_dir, _internal_call)
        if onnx and self.args.should_save:
            directory = pathlib.Path(output_dir if output_dir is not None else self.args.output_dir)
            self._engine_ready_model().export_onnx(directory / "model.onnx")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        engine = self._engine
        optimizer_state = engine.optimizer_state()
        for name in optimizer_state["parameters"]:
            # get_parameter resolves a tied name (GPT-2's lm_head.weight) to the one tensor transformers optimizes.
            param = hf_parameter(self.model, name)
            state = _torch_state(optimizer_state, name, param)
            if state:
                self.optimizer.state[param] = state
        applied = self.state.global_step - engine.nonfinite_skipped_steps - (
            int(engine.scaler_state["skipped_steps"]) if self.args.fp16 else 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": the engine stepped
            while self._scheduler_steps < applied:
                self.lr_scheduler.step()
                self._scheduler_steps += 1
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            engine_state = {"dropout_step": engine.dropout_step, "global_step": self.state.global_step}
            if self.args.fp16:
                engine_state["loss_scaler"] = engine.scaler_state
            with open(os.path.join(output_dir, _ENGINE_STATE_FILE), "w") as f:
                json.dump(engine_state, f, indent=2)

    def _resume_engine(self, engine: Any, checkpoint: str) -> None:
        """Loads a checkpoint's optimizer state (transformers' optimizer.pt / scheduler.pt, from either Trainer) into
        the engine and starts it at the checkpoint's step."""
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_rng_state(checkpoint)
        step = self.state.global_step
        current = engine.optimizer_state()  # the engine's parameters (a tied pair is one) and its state names
        names, kept = current["parameters"], current["states"]
        states = {key: {} for key in kept}
        updates, missing, found = 0, [], 0
        for name in names:
            param = hf_parameter(self.model, name)
            held = self.optimizer.state.get(param) or {}
            wanted = [key for key in kept if name in kept[key]]  # Adafactor keeps factored states for matrices only
            if held and all(key in held for key in wanted):
                found += 1
                for key in wanted:
                    states[key][name] = _numpy(held[key])
                if "step" in held:
                    updates = int(_numpy(held["step"]))
                elif wanted:  # SGD's momentum keeps no count: it has run since the start
                    updates = step
            elif wanted:  # the engine's fresh state (zeros; an 8-bit optimizer's code maps) stands
                missing.append(name)
                for key in wanted:
                    states[key][name] = kept[key][name]
        wanted = list(kept)
        if wanted and not found:
            logger.warning(f"{checkpoint} has no optimizer state (optimizer.pt) for {current['optim']}; it starts "
                           "from zero")
        elif missing and wanted:
            raise ValueError(f"{checkpoint}: optimizer.pt has no {current['optim']} state ({', '.join(wanted)}) for "
                             f"{', '.join(missing[:5])}")
        engine.set_optimizer_state(min(updates, step), states)
        extra = _engine_state(os.path.join(checkpoint, _ENGINE_STATE_FILE), step)
        scaler_skipped = 0
        if self.args.fp16 and "loss_scaler" in extra:
            engine.scaler_state = extra["loss_scaler"]
            scaler_skipped = int(extra["loss_scaler"].get("skipped_steps", 0))
        self._scheduler_steps = int(self.lr_scheduler.last_epoch)
        lag = max(step - self._scheduler_steps - scaler_skipped, 0)
        dropout_step = int(extra.get("dropout_step", step * self.args.gradient_accumulation_steps))
        engine.start_at(step, dropout_step, lag)

    # ------------------------------------------------------------ evaluation and prediction

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' evaluation_loop, with the engine model (its weights synchronised once) for the forward."""
        self._eval_engine = None
        if self._engine is not None:
            self._eval_engine = self._engine_model
        elif self.engine_refusal() is None:
            self._eval_engine = self._engine_ready_model()
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self._eval_engine = None

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """transformers' evaluate; during training the engine's weights are first written into the model object, so
        callbacks given `model` see the weights being evaluated."""
        if self._engine is not None:
            write_back(self._engine_model, self.model)
        return super().evaluate(*args, **kwargs)

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """transformers' prediction_step with the forward run by the engine (transformers' when the engine cannot
        build the model)."""
        engine = self._eval_engine or (self._engine_model if self._engine is not None else None)
        if engine is None:
            if self.engine_refusal() is not None:
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            engine = self._engine_ready_model()
        if capture.is_encoder_decoder(_base_model(self.model)):
            inputs = decoder_inputs(_base_model(self.model), inputs)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        batch = {row["name"]: _numpy(inputs[row["name"]]) for row in engine.inputs
                 if inputs.get(row["name"]) is not None}
        if has_labels:
            batch.update({k: _numpy(inputs[k]) for k in self.label_names})
        out = engine.eval().forward(**batch)  # eval(): no dropout (the engine's training loop is unaffected)
        loss = torch.tensor(out["loss"]) if has_labels and "loss" in out else None
        self._engine_eval_metrics(engine, inputs)
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys is None:
            ignore_keys = list(getattr(self.model.config, "keys_to_ignore_at_inference", []))
        logits = tuple(torch.from_numpy(v) for k, v in out.items() if k != "loss" and k not in ignore_keys)
        if len(logits) == 1:
            logits = logits[0]
        labels = None
        if has_labels:
            labels = tuple(inputs.get(name).detach() for name in self.label_names)
            if len(labels) == 1:
                labels = labels[0]
        return loss, logits, labels
