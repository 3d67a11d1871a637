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
- `fusetrain_rendezvous_timeout`: seconds a process that a launcher's variables (`WORLD_SIZE` > 1,
  `RANK`, `MASTER_ADDR`, `MASTER_PORT`) make one of several waits for the others to connect before
  raising an error naming them (default $FUSETRAIN_RENDEZVOUS_TIMEOUT, else 60). transformers waits
  `ddp_timeout` (30 minutes) on a GPU and without limit on the CPU; fusetrain joins the CPU
  process group itself, within this timeout, before transformers would;
- `early_stopping_patience` / `early_stopping_threshold`: early stopping without a callback.

Values transformers would divide by, crash on deep inside, or silently read as something else are
refused when the arguments are made, each with a ValueError naming the argument, what was expected
and what was found (`check_arguments`; `fusetrain.Trainer` applies it to transformers' own
TrainingArguments too): `gradient_accumulation_steps` < 1 or not an integer, `num_train_epochs`,
`learning_rate` or `weight_decay` negative or not finite, `max_steps` other than -1 or an integer
>= 1, `warmup_steps` not finite or a non-integer >= 1, `max_grad_norm` negative or not finite, and
`logging_steps`, `eval_steps` or `save_steps` negative or not finite under the "steps" strategy
(`save_steps` 0 too).

`engine_refusals()` lists the settings the engine does not run; with any, `fusetrain.Trainer`
trains with transformers' loop (one warning) unless `fusetrain_require_engine` is set.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

import transformers

from fusetrain import _core
from fusetrain._versions import check_transformers
from fusetrain.distributed import RENDEZVOUS_TIMEOUT_VARIABLE, join_process_group

# fusetrain.Trainer and fusetrain.trl import this module: with a transformers older than the engine loop needs,
# they are one clear ImportError.
check_transformers()

_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


def _value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _default_rendezvous_timeout() -> float:
    text = os.environ.get(RENDEZVOUS_TIMEOUT_VARIABLE, "60")
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"fusetrain: {RENDEZVOUS_TIMEOUT_VARIABLE} is {text!r}; expected a number of seconds > 0") \
            from None


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
    fusetrain_rendezvous_timeout: float = field(
        default_factory=_default_rendezvous_timeout,
        metadata={"help": "Seconds to wait for the other processes of a WORLD_SIZE > 1 launch to connect to "
                          "MASTER_ADDR:MASTER_PORT before raising an error naming them (default: "
                          f"${RENDEZVOUS_TIMEOUT_VARIABLE}, else 60)."})
    early_stopping_patience: int = field(
        default=0, metadata={"help": "Evaluations without improvement of metric_for_best_model before stopping "
                                     "(0: off)."})
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "The least change of metric_for_best_model that counts as an improvement."})

    def __post_init__(self) -> None:
        check_arguments(self)
        timeout = self.fusetrain_rendezvous_timeout
        if not _is_number(timeout) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"fusetrain: fusetrain_rendezvous_timeout is {timeout!r}; expected a number of "
                             "seconds > 0")
        if (self.bf16 or self.bf16_full_eval) and not self.use_cpu:
            # The engine runs bf16 on the CPU; transformers asks for use_cpu there when no bf16 GPU is present.
            from transformers.utils import is_torch_bf16_gpu_available

            self.use_cpu = not is_torch_bf16_gpu_available()
        if not self.use_cpu and _launched_distributed():
            # transformers on a machine without an accelerator treats each process of torchrun or mpirun as a job
            # of its own unless use_cpu is set; the engine runs on the CPU, so its data-parallel ranks set it.
            import torch

            self.use_cpu = not torch.cuda.is_available()
        if self._joins_cpu_process_group():
            # transformers (through accelerate) would join it with no time limit: a missing peer hangs the run.
            join_process_group(backend="gloo", rendezvous_timeout=float(self.fusetrain_rendezvous_timeout),
                               group_timeout=float(self.ddp_timeout))
        super().__post_init__()
        if self.fusetrain_threads < 0:
            raise ValueError(f"fusetrain_threads is {self.fusetrain_threads}; expected 0 (every core) or more")
        if self.fusetrain_max_nonfinite_steps < 1:
            raise ValueError(f"fusetrain_max_nonfinite_steps is {self.fusetrain_max_nonfinite_steps}; expected >= 1")
        if self.early_stopping_patience < 0:
            raise ValueError(f"early_stopping_patience is {self.early_stopping_patience}; expected >= 0")

    def _joins_cpu_process_group(self) -> bool:
        """Whether transformers is about to join a torch.distributed process group over gloo, as accelerate does for
        the CPU processes of a launch with WORLD_SIZE > 1 (not with an MPI backend, on XLA or under DeepSpeed)."""
        from transformers.utils import is_torch_xla_available

        if _environment_world_size() <= 1 or self.deepspeed or is_torch_xla_available():
            return False
        if not (self.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")):
            return False
        import torch.distributed as dist

        if not dist.is_available() or dist.is_initialized():
            return False
        return self.ddp_backend == "gloo" or (self.ddp_backend is None and not dist.is_mpi_available())

    @classmethod
    def from_hf(cls, hf_args: transformers.TrainingArguments, **overrides: Any) -> TrainingArguments:
        """A fusetrain.TrainingArguments with every field of `hf_args` (and `overrides`)."""
        if not isinstance(hf_args, transformers.TrainingArguments):
            raise TypeError(f"from_hf expects a transformers.TrainingArguments; got {type(hf_args).__name__}")
        values = {f.name: getattr(hf_args, f.name) for f in dataclasses.fields(hf_args) if f.init}
        values.update(overrides)
        return cls(**values)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_arguments(args: transformers.TrainingArguments) -> None:
    """Raises ValueError for a value of `args` that transformers' Trainer would divide by, crash on deep inside, or
    silently read as something else (ones transformers refuses itself with a clear message are left to it). Works
    for transformers' own TrainingArguments too."""

    def refuse(name: str, expected: str) -> None:
        raise ValueError(f"fusetrain: {name} is {_value(getattr(args, name))!r}; expected {expected}")

    def finite(name: str) -> bool:
        value = getattr(args, name)
        return _is_number(value) and math.isfinite(value)

    accumulation = args.gradient_accumulation_steps
    if not _is_integer(accumulation) or accumulation < 1:  # transformers divides by it
        refuse("gradient_accumulation_steps", "an integer >= 1")
    if not finite("num_train_epochs") or args.num_train_epochs < 0:  # math.ceil(nan), or silently no steps
        refuse("num_train_epochs", "a finite number >= 0")
    if not _is_integer(args.max_steps) or not (args.max_steps == -1 or args.max_steps >= 1):
        # transformers trains one step for 0, crashes on a float, and reads any negative value as -1
        refuse("max_steps", "an integer >= 1, or -1 to train for num_train_epochs")
    if not finite("learning_rate") or args.learning_rate < 0:
        refuse("learning_rate", "a finite number >= 0")
    if not finite("warmup_steps") or (args.warmup_steps >= 1 and args.warmup_steps != int(args.warmup_steps)):
        # transformers refuses a negative value itself; int() crashes on inf or nan and truncates 2.5 to 2
        refuse("warmup_steps", "an integer, or a fraction in [0, 1) of the training steps")
    if not finite("weight_decay") or args.weight_decay < 0:
        refuse("weight_decay", "a finite number >= 0")
    if args.max_grad_norm is not None and (not finite("max_grad_norm") or args.max_grad_norm < 0):
        # transformers clips only when max_grad_norm > 0: a negative or nan value silently turns clipping off
        refuse("max_grad_norm", "a finite number >= 0 (0: no clipping)")
    # Under the "steps" strategy transformers logs, evaluates or saves when global_step % steps == 0: a negative
    # value means every step, nan never, and save_steps 0 never. (It refuses logging_steps 0, and a fractional
    # value above 1, itself; eval_steps None or 0 is documented as "logging_steps".)
    if _value(args.logging_strategy) == "steps" and (not finite("logging_steps") or args.logging_steps < 0):
        refuse("logging_steps", "a number > 0 (an integer, or a fraction < 1 of the training steps)")
    if _value(args.eval_strategy) == "steps" and args.eval_steps is not None and (
            not finite("eval_steps") or args.eval_steps < 0):
        refuse("eval_steps", "a number > 0 (an integer, or a fraction < 1 of the training steps)")
    if _value(args.save_strategy) == "steps" and (not finite("save_steps") or args.save_steps <= 0):
        refuse("save_steps", "a number > 0 (an integer, or a fraction < 1 of the training steps)")


def _environment_world_size() -> int:
    """WORLD_SIZE as a launcher set it (1 when unset)."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"fusetrain: the environment variable WORLD_SIZE is {text!r}; expected the number of "
                         "processes (an integer >= 1)") from None


def _launched_distributed() -> bool:
    """Whether a launcher (torchrun, mpirun, srun) started this process as one of several."""
    return _environment_world_size() > 1 or _core._launched_by_mpi()


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

    if _value(args.optim) not in _core.optimizer_names():
        refuse("optim", f"the engine runs {', '.join(_core.optimizer_names())}")
    else:
        try:
            _core.check_optimizer(_value(args.optim), args.optim_args or "")
        except ValueError as e:
            refuse("optim_args", str(e))
    if args.optim_target_modules:
        refuse("optim_target_modules", "the engine's optimizers update every trained parameter alike")
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
    if _value(getattr(args, "train_sampling_strategy", "random")) not in ("random", "sequential", "group_by_length"):
        refuse("train_sampling_strategy",
               "the engine reads examples shuffled (random), in order (sequential) or grouped by length")
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
        optim=str(_value(args.optim)),
        optim_args=args.optim_args or "",
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
