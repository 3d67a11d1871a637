"""Graphs exported to ONNX by torch.onnx.export from transformers models, for the import tests: both of torch
2.13's exporters (TorchScript and dynamo), five architectures fusetrain builds and four it does not, with
perturbed weights (so that no two initializers are equal and a mix-up cannot pass), and the mapping from the
graph's initializers back to the torch parameters they came from (an exporter may fold a transpose into a new
initializer, or share one initializer between equal tensors)."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import warnings

import numpy as np
import torch
import transformers

import hf_models as hf

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
              max_position_embeddings=64)

CONFIGS = {
    "bert": lambda: transformers.BertConfig(**_SMALL),
    "roberta": lambda: transformers.RobertaConfig(**_SMALL, pad_token_id=1),
    "distilbert": lambda: transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=100,
                                                        max_position_embeddings=64),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=1, use_cache=False),
    # Grouped-query attention (2 key/value heads for 6), rotary tables from an inv_freq buffer, SwiGLU.
    "llama": lambda: transformers.LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                              num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                              max_position_embeddings=64, rope_theta=500.0, pad_token_id=0,
                                              use_cache=False),
    # Architectures fusetrain does not build natively.
    "electra": lambda: transformers.ElectraConfig(embedding_size=16, **_SMALL),
    "albert": lambda: transformers.AlbertConfig(embedding_size=16, **_SMALL),
    "mpnet": lambda: transformers.MPNetConfig(**_SMALL),
    "deberta-v2": lambda: transformers.DebertaV2Config(**_SMALL, relative_attention=True, position_buckets=8,
                                                       pos_att_type=["p2c", "c2p"], max_relative_positions=16),
}
NATIVE = ["bert", "roberta", "distilbert", "gpt2", "llama"]
NOT_NATIVE = ["electra", "albert", "mpnet", "deberta-v2"]
EXPORTERS = ["torchscript", "dynamo"]

AUTO = {
    "seq-cls": transformers.AutoModelForSequenceClassification,
    "token-cls": transformers.AutoModelForTokenClassification,
    "qa": transformers.AutoModelForQuestionAnswering,
    "mlm": transformers.AutoModelForMaskedLM,
    "clm": transformers.AutoModelForCausalLM,
}

BATCH, SEQ = 3, 8
_dir = tempfile.mkdtemp(prefix="fusetrain-onnx-import-")


def torch_model(arch: str, task: str = "seq-cls", seed: int = 0) -> torch.nn.Module:
    """A transformers model with perturbed random weights, in eval mode (dropout off, as the graph exports)."""
    torch.manual_seed(seed)
    model = AUTO[task].from_config(CONFIGS[arch]())  # the default attention, as a user exports it
    hf.perturb_(model, seed, scale=0.02)
    return model.float().eval()


def output_names(task: str) -> list[str]:
    return ["start_logits", "end_logits"] if task == "qa" else ["logits"]


class _Inputs(torch.nn.Module):
    """The model called with input_ids and attention_mask only, returning its outputs by name: what a user wraps a
    model in so that no other forward argument (GPT-2's logits_to_keep) becomes a graph input."""

    def __init__(self, model: torch.nn.Module, task: str):
        super().__init__()
        self.names = output_names(task)
        object.__setattr__(self, "inner", model)  # not a submodule: that would prefix every name with "inner."
        self._modules = model._modules  # the model's submodules as this one's, so the names stay transformers'

    def forward(self, input_ids, attention_mask):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask)
        return tuple(getattr(out, name) for name in self.names)


def export(model: torch.nn.Module, path: str, exporter: str, task: str = "seq-cls", fold: bool = True,
           opset: int | None = None) -> str:
    """torch.onnx.export of `model` with dynamic batch and sequence axes, inputs input_ids and attention_mask.
    fold=False keeps every weight under its own name (no constant folding); opset defaults to 17 (TorchScript)
    and 18 (dynamo)."""
    model = _Inputs(model, task)
    ids = torch.randint(2, 100, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if exporter == "torchscript":
                torch.onnx.export(model, (ids,), path, kwargs={"attention_mask": mask}, input_names=names,
                                  output_names=output_names(task), opset_version=opset or 17, dynamo=False,
                                  do_constant_folding=fold,
                                  dynamic_axes={n: {0: "batch_size", 1: "sequence_length"} for n in names})
            else:
                dims = {0: torch.export.Dim("batch_size"), 1: torch.export.Dim("sequence_length", max=64)}
                torch.onnx.export(model, (ids,), path, kwargs={"attention_mask": mask}, input_names=names,
                                  output_names=output_names(task), opset_version=opset or 18, dynamo=True, optimize=fold,
                                  dynamic_shapes={"input_ids": dims, "attention_mask": dims})
        finally:
            logging.disable(logging.NOTSET)
    return path


@functools.lru_cache(maxsize=None)
def exported(arch: str, exporter: str, task: str = "seq-cls", seed: int = 0) -> str:
    """The path of `arch`'s graph as `exporter` writes it (cached per session); config.json beside it."""
    folder = os.path.join(_dir, f"{arch}-{task}-{exporter}-{seed}")
    os.makedirs(folder, exist_ok=True)
    model = torch_model(arch, task, seed)
    model.config.save_pretrained(folder)
    return export(model, os.path.join(folder, "model.onnx"), exporter, task)


def batch(arch: str, task: str = "seq-cls", seed: int = 0, num_labels: int = 2) -> dict[str, np.ndarray]:
    """Padded ids, their mask and labels for `task`."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 100, size=(BATCH, SEQ)).astype(np.int64)
    mask = np.ones((BATCH, SEQ), dtype=np.int64)
    mask[1, SEQ - 3:] = 0
    # Padding holds the pad id: its embedding row gets no gradient (nn.Embedding's padding_idx), and GPT-2's
    # sequence classification pools the last token before it.
    ids[1, SEQ - 3:] = CONFIGS[arch]().pad_token_id
    out = {"input_ids": ids, "attention_mask": mask}
    if task == "seq-cls":
        out["labels"] = rng.integers(0, num_labels, size=BATCH).astype(np.int64)
    elif task in ("token-cls", "mlm", "clm"):
        vocab = 100 if task in ("mlm", "clm") else num_labels
        labels = rng.integers(0, vocab, size=(BATCH, SEQ)).astype(np.int64)
        labels[mask == 0] = -100
        out["labels"] = labels
    elif task == "qa":
        out["start_positions"] = rng.integers(0, SEQ, size=BATCH).astype(np.int64)
        out["end_positions"] = rng.integers(0, SEQ, size=BATCH).astype(np.int64)
    return out


def torch_loss_and_grads(model: torch.nn.Module, data: dict[str, np.ndarray]):
    model.zero_grad()
    out = model(**{k: torch.from_numpy(v) for k, v in data.items()})
    out.loss.backward()
    return out, {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}


def initializer_sources(state: dict[str, np.ndarray], model: torch.nn.Module) -> dict[str, list[tuple[str, bool]]]:
    """For each initializer of the imported graph, the torch parameters it holds (name, transposed): equal values,
    or the transpose an exporter folded. With perturbed weights the match is unique unless the exporter shared
    one initializer between uses of one tensor."""
    params = {name: p.detach().numpy() for name, p in model.named_parameters()}
    sources = {}
    for init_name, value in state.items():
        found = []
        for name, p in params.items():
            if p.shape == value.shape and np.array_equal(p, value):
                found.append((name, False))
            elif p.ndim == 2 and p.T.shape == value.shape and np.array_equal(p.T, value):
                found.append((name, True))
        sources[init_name] = found
    return sources


def expected_grads(sources, torch_grads) -> dict[str, np.ndarray]:
    """The gradient each initializer should have: the sum over the torch parameters it holds."""
    out = {}
    for init_name, found in sources.items():
        if found:
            out[init_name] = sum(torch_grads[name].T if t else torch_grads[name] for name, t in found)
    return out
