"""fusetrain: a training engine for transformer models, written in C++.

A model is compiled once into a static training plan (forward, backward and the
optimizer step) whose activations live in one planned arena, so a step does no
allocation and no dispatch work. This package is the thin Python layer over it.

    import numpy as np
    import fusetrain

    model = fusetrain.Model.from_pretrained("path/to/bert", num_labels=2)
    optimizer = fusetrain.AdamW(model, lr=2e-5)
    model.train()
    loss, grads = model.loss_and_grads(input_ids, attention_mask=mask, labels=labels)
    optimizer.step()
    logits = model.eval().forward(input_ids, attention_mask=mask)["logits"]

Parameters keep their Hugging Face names, so `model.state_dict()` and
`model.load_state_dict(...)` exchange weights with transformers (numpy arrays, or
torch tensors), and `save_pretrained` writes a directory transformers can load.
Engine errors (bad config, wrong shapes, unknown architecture) raise ValueError.

`fusetrain.Trainer` and `fusetrain.TrainingArguments` (and `Seq2SeqTrainer`,
`Seq2SeqTrainingArguments`) subclass transformers' classes of the same names: change the import
line of a transformers training script and its training steps run on the engine.
"""

from typing import Any

from fusetrain._core import (
    SGD,
    AdamW,
    Model,
    Optimizer,
    __version__,
    architectures,
    cpu_features,
    measure_matmul_gflops,
    supported_architectures,
)

__all__ = [
    "Trainer",
    "TrainingArguments",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Model",
    "AdamW",
    "SGD",
    "Optimizer",
    "__version__",
    "architectures",
    "cpu_features",
    "measure_matmul_gflops",
    "supported_architectures",
]


_native_from_pretrained = Model.from_pretrained


def _from_pretrained(path: Any, architecture: str | None = None, **config_overrides: Any) -> Model:
    """Loads config.json and *.safetensors from a local model directory.

    architecture: the transformers class to build (e.g. "BertForSequenceClassification");
        defaults to config["architectures"][0].
    **config_overrides: merged into the config first, e.g. num_labels=2.
    Head weights missing from the checkpoint are freshly initialised and listed in missing_keys.
    An architecture fusetrain does not build is loaded with transformers and captured (fusetrain.capture; needs
    PyTorch and transformers), its parameters under their transformers names.
    """
    import json
    import os

    config_path = os.path.join(os.fspath(path), "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = None  # the engine names what is wrong with it
    if isinstance(config, dict):
        from fusetrain import capture

        named = dict(config, architectures=[architecture]) if architecture else config
        if not capture.is_native(named):
            return capture.from_directory(path, architecture, **config_overrides)
    return _native_from_pretrained(path, architecture, **config_overrides)


Model.from_pretrained = staticmethod(_from_pretrained)


def __getattr__(name: str) -> Any:
    # Trainer and TrainingArguments subclass transformers' classes: imported on first use, so that
    # `import fusetrain` (Model, AdamW) needs neither transformers nor torch.
    if name == "Trainer":
        from fusetrain.trainer import Trainer

        return Trainer
    if name == "TrainingArguments":
        from fusetrain.training_args import TrainingArguments

        return TrainingArguments
    if name in ("Seq2SeqTrainer", "Seq2SeqTrainingArguments"):
        from fusetrain import seq2seq

        return getattr(seq2seq, name)
    raise AttributeError(f"module 'fusetrain' has no attribute {name!r}")
