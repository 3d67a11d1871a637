"""TRL's trainers with their training steps on fusetrain's engine.

    from fusetrain.trl import SFTTrainer, SFTConfig      # the only line that changes
    from fusetrain.trl import DPOTrainer, DPOConfig

`SFTTrainer` is a subclass of `trl.SFTTrainer` (through `fusetrain.Trainer`): TRL's own code prepares the
datasets (chat templates, formatting functions, tokenization, packing, completion-only and assistant-only labels),
builds its collator, wraps a PEFT model, logs and saves; the engine runs the steps, with the batches TRL's collator
makes. TRL's other names are re-exported: `from fusetrain.trl import SFTTrainer, get_peft_config` works. Packed rows (`packing=True`, `padding_free=True`) arrive as TRL makes them, one row of several examples with
position_ids restarting at each and no attention_mask; the engine keeps the examples apart in attention and in the
loss (models::BatchSpec::packed), with no T x T mask and no work between examples.

`DPOTrainer` is a subclass of `trl.DPOTrainer`: TRL tokenizes the preference data, its collator puts the chosen
sequences then the rejected ones in one batch, and (precompute_ref_log_probs) TRL computes the reference
log-probabilities up front. The engine runs the policy and the loss (sigmoid, hinge, ipo) in one program, the
log-probabilities summed by the LM head in chunks of rows (models::Model::set_preference); the reference comes from the
batch, from TRL's ref_model (an engine copy), or for a LoRA model from the same weights with the adapters left out.
Its metrics are TRL's: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected, logits/chosen, logits/rejected, entropy, mean_token_accuracy and num_tokens.

What the engine does not run falls back to TRL's own loop after one warning naming the cause, as fusetrain.Trainer
does. The logged metrics are TRL's: the loss, `entropy` and `mean_token_accuracy` (summed by the fused LM head from
its chunks of logits, which never exist whole) and `num_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets
import numpy as np
import torch

try:
    import trl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("fusetrain.trl runs TRL's trainers: install TRL (pip install 'fusetrain[trl]' or pip install "
                      f"trl); importing it failed: {error}") from error
from trl import DPOConfig, SFTConfig  # noqa: F401  (re-exported: the import line a script changes names them)

from fusetrain import data
from fusetrain.trainer import Trainer, architecture_of, engine_model

__all__ = ["SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig"]

# The DPO losses the engine runs (models::PreferenceConfig), by TRL's names.
_PREFERENCE_LOSSES = ("sigmoid", "hinge", "ipo")


def __getattr__(name: str) -> Any:
    """Every other TRL name (get_peft_config, ModelConfig, ...), so a script's one `from trl import ...` line can
    name this module instead."""
    return getattr(trl, name)


def _trl_collate_hook(trainer: Any, engine_batch: Callable[[dict], dict]) -> Callable[[np.ndarray, bool], dict]:
    """The engine's collate hook for a TRL trainer: TRL's collator on the dataset's signature columns, its batch made
    the engine's by `engine_batch`, padded, with TRL's num_tokens (the attention mask's tokens, or a padding-free
    row's length, before the engine's rounding of the length)."""
    dataset, collator, pad_id = trainer.train_dataset, trainer.data_collator, trainer._pad_id()
    trainer._set_signature_columns_if_needed()
    keep = [c for c in data.column_names(dataset) if c in trainer._signature_columns]
    selected = dataset.select_columns(keep) if hasattr(dataset, "select_columns") else dataset

    def collate(indices: np.ndarray, training: bool) -> dict:
        rows = selected[indices.tolist()]
        batch = engine_batch(collator([dict(zip(rows.keys(), values)) for values in zip(*rows.values())]))
        counted = (int(batch["attention_mask"].sum()) if "attention_mask" in batch
                   else int(batch["position_ids"].shape[1]))
        out = data.pad_batch(batch, pad_id)
        out["num_tokens"] = counted
        return out

    return collate


class SFTTrainer(Trainer, trl.SFTTrainer):
    """trl.SFTTrainer whose training steps run on fusetrain's engine. Takes TRL's arguments (an SFTConfig)."""

    _prepares_own_datasets = True

    @classmethod
    def _engine_step_class(cls) -> type:
        return SFTTrainer

    def _uses_python_collator(self) -> bool:
        return True  # TRL's collator builds the labels (completion and assistant masks) and the packed rows

    def _collate_hook(self) -> Callable[[np.ndarray, bool], dict]:
        return _trl_collate_hook(self, lambda batch: batch)

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


class DPOTrainer(Trainer, trl.DPOTrainer):
    """trl.DPOTrainer whose training steps run on fusetrain's engine. Takes TRL's arguments (a DPOConfig)."""

    _prepares_own_datasets = True

    def __init__(self, model: Any, ref_model: Any = None, args: DPOConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 **kwargs: Any) -> None:
        self._engine_reference: Any = None  # the engine copy of ref_model (built with the engine model)
        super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, ref_model=ref_model, **kwargs)

    @classmethod
    def _engine_step_class(cls) -> type:
        return DPOTrainer

    def _uses_python_collator(self) -> bool:
        return True  # TRL's collator puts the chosen then the rejected sequences in one batch

    def engine_refusal(self) -> str | None:
        reasons = [super().engine_refusal()]
        if len(self.loss_types) != 1 or self.loss_types[0] not in _PREFERENCE_LOSSES:
            reasons.append(f"loss_type {self.loss_types} (the engine runs one of {', '.join(_PREFERENCE_LOSSES)})")
        settings = [(self.f_divergence_type != "reverse_kl", f"f_divergence_type={self.f_divergence_type!r}"),
                    (self.ld_alpha is not None, "ld_alpha"), (self.use_weighting, "use_weighting"),
                    (self.aux_loss_enabled, "a router auxiliary loss"), (self.args.sync_ref_model, "sync_ref_model"),
                    (self._is_vision_dataset, "a vision dataset")]
        named = [what for flag, what in settings if flag]
        if named:
            reasons.append(f"{', '.join(named)} (the engine's DPO does not implement it)")
        if self.ref_model is not None and not self.precompute_ref_logps:
            reference = self.accelerator.unwrap_model(self.ref_model)
            if architecture_of(reference) != architecture_of(self.model):
                reasons.append(f"the reference model is a {architecture_of(reference)}, the policy a "
                               f"{architecture_of(self.model)}")
        return "; ".join(r for r in reasons if r) or None

    def _engine_dataset(self, dataset: Any, task: str, with_labels: bool = True) -> Any:
        # The engine's loader needs each example's tokens only for its count and order: the prompt and the chosen
        # completion stand for the pair (TRL's collator builds the batch itself).
        key = id(dataset)
        if key not in self._engine_datasets:
            rows = dataset.select_columns(["prompt_ids", "chosen_ids"])
            ids = datasets.Dataset.from_dict(
                {"input_ids": [p + c for p, c in zip(rows["prompt_ids"], rows["chosen_ids"])]})
            config = self._engine_model.config
            self._engine_datasets[key] = (dataset, data.to_engine(
                ids, task=task, vocab_size=int(config.get("vocab_size") or 0), num_labels=2, name="train_dataset",
                with_labels=False))
        return self._engine_datasets[key][1]

    def _preference_batch(self, batch: dict) -> dict:
        """TRL's collated batch (input_ids, attention_mask, completion_mask, perhaps ref_chosen_logps and
        ref_rejected_logps) as the engine's: labels on the completion tokens, reference log-probabilities (2P)."""
        out = {k: _array(v) for k, v in batch.items()}
        completion = out.pop("completion_mask")
        out["labels"] = np.where(completion == 1, out["input_ids"], -100).astype(np.int64)
        if "ref_chosen_logps" in out:
            out["ref_logps"] = np.concatenate([out.pop("ref_chosen_logps"),
                                               out.pop("ref_rejected_logps")]).astype(np.float32)
        return out

    def _collate_hook(self) -> Callable[[np.ndarray, bool], dict]:
        return _trl_collate_hook(self, self._preference_batch)

    def _engine_ready_model(self):
        model = super()._engine_ready_model()
        model.token_stats = True  # entropy, top-1 hits and mean logits per position, from the fused LM head
        model.set_preference(self.loss_types[0], float(self.beta))
        if self.ref_model is not None and not self.precompute_ref_logps:
            if self._engine_reference is None:
                self._engine_reference = engine_model(self.accelerator.unwrap_model(self.ref_model))
            self._engine_reference.bf16 = bool(self.args.bf16)
            model.set_reference(self._engine_reference)
        return model

    def _record(self, mode: str, stats: dict) -> None:
        """One micro-batch's figures as TRL's compute_loss records them."""
        logps, ref, tokens = (np.asarray(stats[k], dtype=np.float64) for k in ("logps", "ref_logps", "tokens"))
        pairs = len(logps) // 2
        chosen, rejected = logps[:pairs], logps[pairs:]
        chosen_rewards = self.beta * (chosen - ref[:pairs])
        rejected_rewards = self.beta * (rejected - ref[pairs:])
        metrics = self._metrics[mode]

        def ratio(numerator: float, denominator: float) -> float:
            return float(numerator / denominator) if denominator > 0 else 0.0

        if stats["entropy_sum"]:
            entropy, top1, mean_logits = (np.asarray(stats[k], dtype=np.float64)
                                          for k in ("entropy_sum", "top1", "mean_logit_sum"))
            metrics["entropy"].append(ratio(entropy.sum(), tokens.sum()))
            metrics["logits/chosen"].append(ratio(mean_logits[:pairs].sum(), tokens[:pairs].sum()))
            metrics["logits/rejected"].append(ratio(mean_logits[pairs:].sum(), tokens[pairs:].sum()))
            metrics["mean_token_accuracy"].append(ratio(top1[:pairs].sum(), tokens[:pairs].sum()))
        metrics["rewards/chosen"].append(float(chosen_rewards.mean()))
        metrics["rewards/rejected"].append(float(rejected_rewards.mean()))
        metrics["rewards/accuracies"].append(float((chosen_rewards > rejected_rewards).mean()))
        metrics["rewards/margins"].append(float((chosen_rewards - rejected_rewards).mean()))
        metrics["logps/chosen"].append(float(chosen.mean()))
        metrics["logps/rejected"].append(float(rejected.mean()))
        metrics["num_tokens"] = [self._total_train_tokens]

    def _engine_step_metrics(self, step: dict) -> None:
        self._total_train_tokens += step["counted_tokens"]
        for stats in step["preference"]:
            self._record("train", stats)

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """TRL's prediction_step (the loss and its metrics) with the forward run by the engine."""
        engine = self._eval_engine or (self._engine_model if self._engine is not None else None)
        if engine is None:
            if self.engine_refusal() is not None:
                return trl.DPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
            engine = self._engine_ready_model()
        batch = self._preference_batch(inputs)
        out = engine.eval().forward(**batch)
        stats = engine.last_preference_stats()
        if stats is not None:
            self._record("eval", stats)
        return torch.tensor(out["loss"]), None, None


def _array(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
