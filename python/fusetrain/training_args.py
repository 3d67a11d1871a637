"""`fusetrain.TrainingArguments`: transformers' `TrainingArguments` plus the engine's own fields.

It is a subclass of `transformers.TrainingArguments`, so every field, property and method is
transformers' (a script's `HfArgumentParser` parses it, `should_log`, `device`,
`main_process_first()`, ... behave as documented there). The fields added here:

- `fusetrain_recompute`: recompute each layer's activations in backward (also turned on by
  `gradient_checkpointing`);
- `fusetrain_threads`: kernel threads, 0 for every core;
- `fusetrain_max_nonfinite_steps`: a step whose loss or gradient norm is inf or NaN is skipped,
  this many in a row stop training with an error;
- `fusetrain_require_engine`: raise instead of training with transformers' own loop when the
  engine cannot run the model or the arguments;
- `early_stopping_patience` / `early_stopping_threshold`: early stopping without a callback.

`engine_refusals()` lists the settings the engine does not run; with any, `fusetrain.Trainer`
trains with transformers' loop (one warning) unless `fusetrain_require_engine` is set.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field
from typing import Any

import transformers

from fusetrain import _core

# transformers' `optim` values that are the update fusetrain's fused AdamW computes.
_ADAMW_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_apex_fused")
_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


def _value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments with fusetrain's fields (see the module's doc)."""

    fusetrain_recompute: bool = field(
        default=False, metadata={"help": "Recompute each layer's activations in backward (activation checkpointing)."})
    fusetrain_threads: int = field(default=0, metadata={"help": "Kernel threads (0: every core)."})
    fusetrain_max_nonfinite_steps: int = field(
        default=3,
        metadata={"help": "Steps in a row whose loss or gradient norm is inf or NaN (each skipped) before training "
                          "stops with an error."})
    fusetrain_require_engine: bool = field(
        default=False,
        metadata={"help": "Raise instead of training with transformers' own loop when fusetrain's engine cannot run "
                          "the model or these arguments."})
    early_stopping_patience: int = field(
        default=0, metadata={"help": "Evaluations without improvement of metric_for_best_model before stopping "
                                     "(0: off)."})
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "The least change of metric_for_best_model that counts as an improvement."})

    def __post_init__(self) -> None:
        if (self.bf16 or self.bf16_full_eval) and not self.use_cpu:
            # The engine runs bf16 on the CPU; transformers asks for use_cpu there when no bf16 GPU is present.
            from transformers.utils import is_torch_bf16_gpu_available

            self.use_cpu = not is_torch_bf16_gpu_available()
        if not self.use_cpu and _launched_distributed():
            # transformers on a machine without an accelerator treats each process of torchrun or mpirun as a job
            # of its own unless use_cpu is set; the engine runs on the CPU, so its data-parallel ranks set it.
            import torch

            self.use_cpu = not torch.cuda.is_available()
        super().__post_init__()
        if self.fusetrain_threads < 0:
            raise ValueError(f"fusetrain_threads is {self.fusetrain_threads}; expected 0 (every core) or more")
        if self.fusetrain_max_nonfinite_steps < 1:
            raise ValueError(f"fusetrain_max_nonfinite_steps is {self.fusetrain_max_nonfinite_steps}; expected >= 1")
        if self.early_stopping_patience < 0:
            raise ValueError(f"early_stopping_patience is {self.early_stopping_patience}; expected >= 0")

    @classmethod
    def from_hf(cls, hf_args: transformers.TrainingArguments, **overrides: Any) -> TrainingArguments:
        """A fusetrain.TrainingArguments with every field of `hf_args` (and `overrides`)."""
        if not isinstance(hf_args, transformers.TrainingArguments):
            raise TypeError(f"from_hf expects a transformers.TrainingArguments; got {type(hf_args).__name__}")
        values = {f.name: getattr(hf_args, f.name) for f in dataclasses.fields(hf_args) if f.init}
        values.update(overrides)
        return cls(**values)


def _launched_distributed() -> bool:
    """Whether a launcher (torchrun, mpirun, srun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or _core._launched_by_mpi()


def _data_parallel_ready(args: transformers.TrainingArguments) -> bool:
    """Whether the engine can train data-parallel over this run's processes: transformers set up
    torch.distributed for them (torchrun, or mpirun with MASTER_ADDR/MASTER_PORT)."""
    import torch.distributed as dist

    return (args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED and dist.is_available()
            and dist.is_initialized() and dist.get_world_size() == args.world_size)


def engine_refusals(args: transformers.TrainingArguments) -> list[str]:
    """The settings of `args` fusetrain's engine does not run, each as "field=value (why)"; empty when it runs
    them all. Works for transformers' own TrainingArguments too (the engine fields then take their defaults)."""
    out = []

    def refuse(name: str, why: str) -> None:
        out.append(f"{name}={_value(getattr(args, name))!r} ({why})")

    if _value(args.optim) not in _ADAMW_OPTIMIZERS:
        refuse("optim", "the engine runs AdamW")
    if args.optim_args or args.optim_target_modules:
        refuse("optim_args" if args.optim_args else "optim_target_modules", "the engine's AdamW takes no extra options")
    if _value(args.lr_scheduler_type) not in _SCHEDULES:
        refuse("lr_scheduler_type", f"the engine runs {', '.join(_SCHEDULES)}")
    if args.lr_scheduler_kwargs:
        refuse("lr_scheduler_kwargs", "the engine's schedules take no options")
    if args.label_smoothing_factor:
        refuse("label_smoothing_factor", "the engine's losses are the models' own")
    for name in ("neftune_noise_alpha", "deepspeed", "parallelism_config"):
        if getattr(args, name, None):
            refuse(name, "not run by the engine")
    if args.fsdp:
        refuse("fsdp", "not run by the engine")
    if args.use_liger_kernel:
        refuse("use_liger_kernel", "the engine has its own kernels")
    if args.auto_find_batch_size:
        refuse("auto_find_batch_size", "the engine plans its memory for one batch size")
    if _value(getattr(args, "train_sampling_strategy", "random")) != "random":
        refuse("train_sampling_strategy", "the engine shuffles examples at random")
    if args.world_size > 1 and not _data_parallel_ready(args):
        out.append(f"world_size={args.world_size} in parallel mode {args.parallel_mode.value} (the engine trains "
                   "data-parallel over torch.distributed or an MPI launcher's ranks)")
    return out


def engine_dict(args: transformers.TrainingArguments, *, max_steps: int) -> dict[str, Any]:
    """The engine loop's arguments (its training_args.json form) for a run of `max_steps` optimizer steps.

    The loop only runs the steps: logging, evaluation and checkpoints are transformers' Trainer's, so the engine's
    strategies are off."""
    out = dict(_core._training_args_defaults())
    for name in out:
        if hasattr(args, name):
            out[name] = _value(getattr(args, name))
    warmup = float(args.warmup_steps)
    out.update(
        output_dir=str(args.output_dir),
        max_steps=int(max_steps),
        warmup_steps=warmup if warmup < 1 else float(math.floor(warmup)),
        warmup_ratio=0.0,
        logging_steps=1,
        eval_strategy="no",
        eval_steps=None,
        save_strategy="no",
        save_total_limit=None,
        load_best_model_at_end=False,
        metric_for_best_model=None,
        greater_is_better=None,
        resume_from_checkpoint=None,
        early_stopping_patience=0,
        disable_tqdm=True,
        fusetrain_recompute=bool(getattr(args, "fusetrain_recompute", False)),
        fusetrain_threads=int(getattr(args, "fusetrain_threads", 0)),
        fusetrain_max_nonfinite_steps=int(getattr(args, "fusetrain_max_nonfinite_steps", 3)),
        # transformers' default None means PyTorch DDP's 25 MiB
        ddp_bucket_cap_mb=int(args.ddp_bucket_cap_mb or 25),
    )
    return out
