"""Seq2SeqTrainer and Seq2SeqTrainingArguments: transformers' classes of those names with the training steps on
fusetrain's engine.

    from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments

An encoder-decoder (T5, BART, Marian, ...) is captured into the engine (fusetrain.capture) with its decoder inputs;
each training step, and each evaluation forward that needs only the loss and logits, runs there. With
predict_with_generate, evaluation generates with transformers' `generate` on the model object, which holds the
engine's weights (written back before every evaluation), and the loss of those batches is the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import transformers

from fusetrain.trainer import Trainer, write_back
from fusetrain.training_args import TrainingArguments


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments, transformers.Seq2SeqTrainingArguments):
    """transformers.Seq2SeqTrainingArguments (predict_with_generate, generation_max_length, ...) with fusetrain's
    fields (fusetrain.TrainingArguments)."""


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """transformers.Seq2SeqTrainer whose training steps, evaluation forward and optimizer run on fusetrain's engine;
    generation (predict_with_generate) is transformers' on the trained weights."""

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, **gen_kwargs: Any) -> tuple[Any, Any, Any]:
        """The engine's forward (fusetrain.Trainer.prediction_step), or with predict_with_generate transformers'
        generation on the model object, whose weights are the engine's."""
        if not self.args.predict_with_generate or prediction_loss_only:
            return Trainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        if self._engine is not None:
            write_back(self._engine_model, self.model)
        return transformers.Seq2SeqTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys,
                                                           **gen_kwargs)
