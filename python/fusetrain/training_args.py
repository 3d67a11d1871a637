"""`fusetrain.TrainingArguments`: transformers' `TrainingArguments`, for the fields the engine runs.

Field names, types and defaults follow transformers 5. Every field here either changes
training the way transformers documents it, or (the "accepted" group) is harmless to
ignore on this engine, such as `report_to` or `dataloader_num_workers`; setting one of
those to a non-default value gives one warning. A transformers field that would change
training but that fusetrain does not run (`label_smoothing_factor`, `group_by_length`,
`deepspeed`, ...) raises ValueError listing every such field, from the constructor and
from `TrainingArguments.from_hf`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

from fusetrain import _core

# transformers' `optim` values that are the update fusetrain's fused AdamW computes.
_ADAMW_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_apex_fused")
_STRATEGIES = ("no", "steps", "epoch")


@dataclass
class TrainingArguments:
    """Training configuration with transformers' field names and defaults.

    The engine-specific fields are `fusetrain_recompute` (activation checkpointing, the
    same as `gradient_checkpointing`), `fusetrain_threads` (kernel threads, 0 = all
    cores), `fusetrain_max_nonfinite_steps` (a step whose loss or gradient norm is inf or
    NaN is skipped; this many in a row stop training with an error) and `early_stopping_patience` / `early_stopping_threshold` (early stopping
    without a callback). `bf16` runs bfloat16 matmuls (AMX / AVX512-BF16) with float32
    master weights; `fp16` runs IEEE half operands with dynamic loss scaling.
    """

    output_dir: str | None = None
    per_device_train_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    optim: str = "adamw_torch_fused"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    bf16: bool = False
    fp16: bool = False
    gradient_checkpointing: bool = False
    logging_strategy: str = "steps"
    logging_steps: float = 500
    disable_tqdm: bool | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    per_device_eval_batch_size: int = 8
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    seed: int = 42
    dataloader_drop_last: bool = False
    resume_from_checkpoint: str | None = None

    # fusetrain's own fields.
    fusetrain_recompute: bool = False
    fusetrain_threads: int = 0
    fusetrain_max_nonfinite_steps: int = 3
    early_stopping_patience: int = 0
    early_stopping_threshold: float = 0.0

    # Accepted for compatibility, no effect on training (a non-default value warns once).
    report_to: Any = "none"
    run_name: str | None = None
    logging_dir: str | None = None
    logging_first_step: bool = False
    log_level: str = "passive"
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    overwrite_output_dir: bool = False
    remove_unused_columns: bool = True
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    save_safetensors: bool = True
    save_only_model: bool = False
    use_cpu: bool = False
    torch_compile: bool = False
    skip_memory_metrics: bool = True
    label_names: list[str] | None = None
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    local_rank: int = -1

    def __post_init__(self) -> None:
        for name in ("lr_scheduler_type", "optim", "logging_strategy", "eval_strategy", "save_strategy"):
            value = getattr(self, name)
            if isinstance(value, enum.Enum):  # transformers' SchedulerType / IntervalStrategy / ...
                setattr(self, name, value.value)
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.fspath(self.output_dir)
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps
        self._check_values()
        ignored = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name in _ACCEPTED and not _is_default(f, getattr(self, f.name))
        ]
        if ignored:
            warnings.warn(
                "fusetrain ignores these TrainingArguments (they do not change training on this engine): "
                + ", ".join(ignored),
                stacklevel=3,
            )

    def _check_values(self) -> None:
        problems = []
        if self.optim not in _ADAMW_OPTIMIZERS:
            problems.append(f"optim={self.optim!r} (fusetrain runs AdamW: one of {', '.join(_ADAMW_OPTIMIZERS)})")
        if self.logging_strategy != "steps":
            problems.append(f"logging_strategy={self.logging_strategy!r} (fusetrain logs every logging_steps: 'steps')")
        for name in ("eval_strategy", "save_strategy"):
            allowed = _STRATEGIES + (("best",) if name == "save_strategy" else ())
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} (expected one of {', '.join(allowed)})")
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value != math.floor(value)):
                problems.append(f"{name}={value!r} (fusetrain takes a whole number of steps >= 1, not a ratio)")
        if self.push_to_hub:
            problems.append("push_to_hub=True (call model.push_to_hub(...) on the transformers model after training)")
        if self.bf16 and self.fp16:
            problems.append("bf16=True with fp16=True (choose one)")
        if problems:
            raise ValueError("TrainingArguments not supported by fusetrain: " + "; ".join(problems))
        _core._check_training_args(self.engine_dict())

    def engine_dict(self) -> dict[str, Any]:
        """The fields the engine's Trainer reads, as the JSON it takes (training_args.json)."""
        out: dict[str, Any] = {}
        for name in _ENGINE_FIELDS:
            value = getattr(self, name)
            if name in ("logging_steps", "save_steps", "eval_steps") and value is not None:
                value = int(value)
            out[name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain dict (transformers' TrainingArguments.to_dict)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_hf(cls, hf_args: Any) -> TrainingArguments:
        """Converts a `transformers.TrainingArguments`.

        Supported fields are copied. A field fusetrain does not run raises ValueError
        listing every such field set to something other than transformers' default;
        fields that are harmless to ignore (logging integrations, dataloader workers,
        ...) are accepted with a warning.
        """
        if not dataclasses.is_dataclass(hf_args):
            raise TypeError(f"from_hf expects a transformers.TrainingArguments; got {type(hf_args).__name__}")
        reference = type(hf_args)(output_dir=hf_args.output_dir)  # transformers' defaults, after its __post_init__
        ours = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unsupported = []
        for f in dataclasses.fields(hf_args):
            if not f.init or f.name in ("do_train", "do_eval", "do_predict"):  # transformers' Trainer ignores them
                continue
            value = getattr(hf_args, f.name)
            if f.name in ours:
                kwargs[f.name] = value.value if isinstance(value, enum.Enum) else value
            elif _plain(value) != _plain(getattr(reference, f.name, None)):
                unsupported.append(f"{f.name}={_plain(value)!r}")
        if unsupported:
            raise ValueError(
                "TrainingArguments fields fusetrain does not support (they would change training): "
                + ", ".join(unsupported)
            )
        for name in _ACCEPTED:  # transformers' spellings of "off" for the ignored fields
            if name in kwargs and _plain(kwargs[name]) == _plain(getattr(reference, name, None)):
                del kwargs[name]
        return cls(**kwargs)


_ENGINE_FIELDS = tuple(_core._training_args_defaults().keys())
_ACCEPTED = (
    "report_to run_name logging_dir logging_first_step log_level do_train do_eval do_predict overwrite_output_dir "
    "remove_unused_columns dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers "
    "save_safetensors save_only_model use_cpu torch_compile skip_memory_metrics label_names push_to_hub "
    "hub_model_id hub_token local_rank"
).split()
_OFF_VALUES = (None, "none", [], ["none"], ("none",))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    if f.name == "report_to" and value in _OFF_VALUES:
        return True
    return value == f.default


def _reject_unknown_fields(init):
    known = {f.name for f in dataclasses.fields(TrainingArguments)}

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                "TrainingArguments fields fusetrain does not support: "
                + ", ".join(unknown)
                + " (supported: see fusetrain.TrainingArguments; harmless transformers fields are accepted)"
            )
        init(self, *args, **kwargs)

    return checked_init


TrainingArguments.__init__ = _reject_unknown_fields(TrainingArguments.__init__)  # type: ignore[method-assign]
