"""The library versions fusetrain's Python layer supports, and its refusal of an older transformers.

fusetrain.Trainer runs transformers' own training-loop helpers around the engine's steps: `_init_training_state`,
`_finalize_training` and the two-argument `set_initial_training_values`, which transformers 5.3 introduced (4.57's
loop computed the same inline). With an older transformers, `fusetrain.Trainer` (and fusetrain.trl, built on it) is
one ImportError naming the version found and the one needed, not a failure halfway through `train()`.
pyproject.toml declares the same minimum; scripts/version_matrix.sh tests it.
"""

from __future__ import annotations

import re
from importlib import metadata

TRANSFORMERS_MIN = (5, 3)


def release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "5.25.0" -> (5, 25, 0), "6.0.0.dev0" -> (6, 0, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_transformers(version: str | None = None) -> None:
    """Raises ImportError unless `version` (default: the installed transformers) is at least TRANSFORMERS_MIN."""
    if version is None:
        try:
            version = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return  # the import that follows names the missing package
    if release(version) < TRANSFORMERS_MIN:
        needed = ".".join(map(str, TRANSFORMERS_MIN))
        raise ImportError(
            f"fusetrain.Trainer needs transformers >= {needed} (the engine's loop runs its Trainer's training-loop "
            f"helpers, which transformers {needed} introduced), found transformers {version}: "
            f"pip install -U 'transformers>={needed}'")


def counts_unshifted_labels(trainer) -> bool:
    """Whether transformers' Trainer counts a causal LM's `num_items_in_batch` over every label, the first of each
    row too, rather than over the shifted labels the loss reads. transformers 5.3-5.10 always counted every label;
    5.11 added `Trainer._loss_shifts_labels` and counts shifted labels when it is true. The engine divides its
    summed token losses by the same count, so that the logged loss is the one transformers logs."""
    return not getattr(trainer, "_loss_shifts_labels", False)
