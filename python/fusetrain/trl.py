"""TRL's trainers with their training steps on fusetrain's engine.

    from fusetrain.trl import SFTTrainer, SFTConfig      # the only line that changes

`SFTTrainer` is a subclass of `trl.SFTTrainer` (through `fusetrain.Trainer`): TRL's own code prepares the
datasets (chat templates, formatting functions, tokenization, packing, completion-only and assistant-only labels),
builds its collator, wraps a PEFT model, logs and saves; the engine runs the steps, with the batches TRL's collator
makes. TRL's other names are re-exported: `from fusetrain.trl import SFTTrainer, get_peft_config` works. Packed rows (`packing=True`, `padding_free=True`) arrive as TRL makes them, one row of several examples with
position_ids restarting at each and no attention_mask; the engine keeps the examples apart in attention and in the
loss (models::BatchSpec::packed), with no T x T mask and no work between examples.

What the engine does not run falls back to TRL's own loop after one warning naming the cause, as fusetrain.Trainer
does. The logged metrics are TRL's: the loss, `entropy` and `mean_token_accuracy` (summed by the fused LM head from
its chunks of logits, which never exist whole) and `num_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import trl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("fusetrain.trl runs TRL's trainers: install TRL (pip install 'fusetrain[trl]' or pip install "
                      f"trl); importing it failed: {error}") from error
from trl import DPOConfig, SFTConfig  # noqa: F401  (re-exported: the import line a script changes names them)

from fusetrain import data
from fusetrain.trainer import Trainer

__all__ = ["SFTTrainer", "SFTConfig", "DPOConfig"]


def __getattr__(name: str) -> Any:
    """Every other TRL name (get_peft_config, ModelConfig, ...), so a script's one `from trl import ...` line can
    name this module instead."""
    return getattr(trl, name)


class SFTTrainer(Trainer, trl.SFTTrainer):
    """trl.SFTTrainer whose training steps run on fusetrain's engine. Takes TRL's arguments (an SFTConfig)."""

    _prepares_own_datasets = True

    @classmethod
    def _engine_step_class(cls) -> type:
        return SFTTrainer

    def _uses_python_collator(self) -> bool:
        return True  # TRL's collator builds the labels (completion and assistant masks) and the packed rows

    def _collate_hook(self) -> Callable[[np.ndarray, bool], dict]:
        dataset, collator, pad_id = self.train_dataset, self.data_collator, self._pad_id()
        self._set_signature_columns_if_needed()
        keep = [c for c in data.column_names(dataset) if c in self._signature_columns]
        selected = dataset.select_columns(keep) if hasattr(dataset, "select_columns") else dataset

        def collate(indices: np.ndarray, training: bool) -> dict:
            rows = selected[indices.tolist()]
            batch = collator([dict(zip(rows.keys(), values)) for values in zip(*rows.values())])
            # TRL's num_tokens: the attention mask's tokens, or a padding-free row's length (before the engine's
            # rounding of the length).
            counted = (int(batch["attention_mask"].sum()) if "attention_mask" in batch
                       else int(batch["position_ids"].shape[1]))
            out = data.pad_batch(batch, pad_id)
            out["num_tokens"] = counted
            return out

        return collate

    def _engine_ready_model(self):
        model = super()._engine_ready_model()
        model.token_stats = True  # entropy and mean_token_accuracy, from the fused LM head
        return model

    def _engine_eval_metrics(self, engine, inputs: dict[str, Any]) -> None:
        # TRL's compute_loss in evaluation: the batch's mean entropy and accuracy, and the running token count.
        stats = engine.last_token_stats()
        if stats is None:
            return
        counted = stats["counted"]
        self._metrics["eval"]["entropy"].append(stats["entropy_sum"] / counted if counted > 0 else 0.0)
        self._metrics["eval"]["mean_token_accuracy"].append(stats["top1"] / counted if counted > 0 else 0.0)
        self._metrics["eval"]["num_tokens"] = [self._total_train_tokens]

    def _engine_step_metrics(self, step: dict) -> None:
        # As TRL's compute_loss records them: one mean per micro-batch (the step's mean, once per micro-batch, averages
        # the same), and the running token count.
        for _ in range(step["micro_batches"]):
            self._metrics["train"]["entropy"].append(step["token_entropy"])
            self._metrics["train"]["mean_token_accuracy"].append(step["token_accuracy"])
        self._total_train_tokens += step["counted_tokens"]
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
