"""Fine-tunes a speech encoder-decoder (Whisper) for recognition, in the form of transformers'
examples/pytorch/speech-recognition/run_speech_recognition_seq2seq.py: HfArgumentParser over model, data and
Seq2SeqTrainingArguments, the feature extractor making log-mel features of each clip, the tokenizer the labels,
DataCollatorSpeechSeq2SeqWithPadding, Seq2SeqTrainer with predict_with_generate, and the word error rate.

    python examples/run_speech_recognition_seq2seq.py --model_name_or_path DIR --train_file train.jsonl \\
        --validation_file dev.jsonl --output_dir runs/asr --do_train --do_eval --predict_with_generate \\
        --per_device_train_batch_size 16 --num_train_epochs 3 --remove_unused_columns False

Data: JSON Lines, one {"audio": {"array": [samples ...], "sampling_rate": 16000}, "text": "..."} per line (the
decoded form of a datasets Audio column). The script is transformers' own way of training but for one line after
the transformers import, which makes the training steps fusetrain's:

    from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments

(without it the script runs on transformers' Seq2SeqTrainer, as tests/python/test_speech_script.py does). The word
error rate is the word-level edit distance over the reference words (the metric transformers' script loads through
`evaluate`, which needs the Hub).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
from transformers import (
    AutoFeatureExtractor,
    AutoModelForSpeechSeq2Seq,
    AutoTokenizer,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments  # the one line that trains on fusetrain's engine

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A model directory (config, weights, feature extractor, "
                                                      "tokenizer files)."})
    freeze_encoder: bool = field(default=False, metadata={"help": "Train the decoder only."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "Training clips, JSON Lines."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation clips, JSON Lines."})
    audio_column_name: str = field(default="audio", metadata={"help": "The column holding each clip."})
    text_column_name: str = field(default="text", metadata={"help": "The column holding each transcription."})
    max_duration_in_seconds: float = field(default=30.0, metadata={"help": "Longer clips are left out."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first this many clips."})


@dataclass
class DataCollatorSpeechSeq2SeqWithPadding:
    """Pads the features with the feature extractor and the labels with the tokenizer (padding as -100), and drops a
    decoder start token the tokenizer put at the start of every label row (the model prepends it again)."""

    feature_extractor: Any
    tokenizer: Any
    decoder_start_token_id: int
    forward_attention_mask: bool = False

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.feature_extractor.pad([{"input_features": f["input_features"]} for f in features],
                                           return_tensors="pt")
        labels_batch = self.tokenizer.pad([{"input_ids": f["labels"]} for f in features], return_tensors="pt")
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


def word_error_rate(predictions: list[str], references: list[str]) -> float:
    """Σ word-level edit distances / Σ reference words."""
    errors = words = 0
    for prediction, reference in zip(predictions, references):
        hyp, ref = prediction.split(), reference.split()
        row = list(range(len(hyp) + 1))
        for i, r in enumerate(ref, 1):
            previous, row[0] = row[0], i
            for j, h in enumerate(hyp, 1):
                previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
        errors += row[len(hyp)]
        words += len(ref)
    return errors / max(words, 1)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(training_args.get_process_log_level())
    set_seed(training_args.seed)

    files = {split: path for split, path in (("train", data_args.train_file), ("eval", data_args.validation_file))
             if path}
    raw = datasets.load_dataset("json", data_files=files)
    feature_extractor = AutoFeatureExtractor.from_pretrained(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSpeechSeq2Seq.from_pretrained(model_args.model_name_or_path)
    if model.config.decoder_start_token_id is None:
        raise ValueError("the model's config has no decoder_start_token_id")
    if model_args.freeze_encoder:
        model.freeze_encoder()
        model.model.encoder.gradient_checkpointing = False

    audio, text = data_args.audio_column_name, data_args.text_column_name
    rate = feature_extractor.sampling_rate

    def prepare(example: dict) -> dict:
        clip = example[audio]
        if clip["sampling_rate"] != rate:
            raise ValueError(f"a clip sampled at {clip['sampling_rate']} Hz; the feature extractor takes {rate} Hz")
        features = feature_extractor(np.asarray(clip["array"], dtype=np.float32), sampling_rate=rate)
        return {"input_features": features.input_features[0], "input_length": len(clip["array"]),
                "labels": tokenizer(example[text]).input_ids}

    vectorized = {split: raw[split].map(prepare, remove_columns=raw[split].column_names,
                                        desc=f"computing the {split} features") for split in raw}
    longest = data_args.max_duration_in_seconds * rate
    vectorized = {split: ds.filter(lambda n: n < longest, input_columns=["input_length"]).remove_columns(
        "input_length") for split, ds in vectorized.items()}
    if data_args.max_eval_samples is not None and "eval" in vectorized:
        vectorized["eval"] = vectorized["eval"].select(range(data_args.max_eval_samples))

    def compute_metrics(pred) -> dict:
        predictions, labels = pred.predictions, pred.label_ids
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded = tokenizer.batch_decode(predictions, skip_special_tokens=True)
        references = tokenizer.batch_decode(labels, skip_special_tokens=True)
        return {"wer": round(word_error_rate(decoded, references), 4)}

    collator = DataCollatorSpeechSeq2SeqWithPadding(feature_extractor, tokenizer,
                                                    model.config.decoder_start_token_id)
    trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=vectorized.get("train"),
                             eval_dataset=vectorized.get("eval"), processing_class=feature_extractor,
                             data_collator=collator,
                             compute_metrics=compute_metrics if training_args.predict_with_generate else None)
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        tokenizer.save_pretrained(training_args.output_dir)
        metrics = dict(result.metrics, train_samples=len(vectorized["train"]))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate(metric_key_prefix="eval", max_length=training_args.generation_max_length)
        metrics["eval_samples"] = len(vectorized["eval"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
