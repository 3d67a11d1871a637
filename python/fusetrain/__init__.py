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

`fusetrain.Trainer` and `fusetrain.TrainingArguments` subclass transformers' classes of the
same names: change the import line of a transformers training script and its training steps
run on the engine.
"""

from typing import Any

from fusetrain._core import (
    SGD,
    AdamW,
    Model,
    __version__,
    architectures,
    cpu_features,
    measure_matmul_gflops,
    supported_architectures,
)

__all__ = [
    "Trainer",
    "TrainingArguments",
    "Model",
    "AdamW",
    "SGD",
    "__version__",
    "architectures",
    "cpu_features",
    "measure_matmul_gflops",
    "supported_architectures",
]


def __getattr__(name: str) -> Any:
    # Trainer and TrainingArguments subclass transformers' classes: imported on first use, so that
    # `import fusetrain` (Model, AdamW) needs neither transformers nor torch.
    if name == "Trainer":
        from fusetrain.trainer import Trainer

        return Trainer
    if name == "TrainingArguments":
        from fusetrain.training_args import TrainingArguments

        return TrainingArguments
    raise AttributeError(f"module 'fusetrain' has no attribute {name!r}")
