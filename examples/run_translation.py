"""Fine-tunes an encoder-decoder (T5, BART, Marian, ...) for translation, in the form of transformers'
examples/pytorch/translation/run_translation.py: HfArgumentParser over model, data and Seq2SeqTrainingArguments,
DataCollatorForSeq2Seq, Seq2SeqTrainer with predict_with_generate, and BLEU by sacreBLEU.

    python examples/run_translation.py --model_name_or_path DIR --train_file train.jsonl \\
        --validation_file dev.jsonl --source_lang en --target_lang fr --output_dir runs/mt \\
        --do_train --do_eval --predict_with_generate --per_device_train_batch_size 8 --num_train_epochs 3

Data: JSON Lines, one {"translation": {"en": "...", "fr": "..."}} per line. The script is transformers' own way
of training but for one line after the transformers import, which makes the training steps fusetrain's:

    from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments

(without it the script runs on transformers' Seq2SeqTrainer, as tests/python/test_translation_script.py does).

The BLEU is sacreBLEU's corpus_bleu on the decoded generations (the metric transformers' script loads through
`evaluate`, which needs the Hub; the package computes the same score offline).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import sacrebleu
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments  # the one line that trains on fusetrain's engine

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A model directory (config.json, weights, tokenizer files)."})


@dataclass
class DataTrainingArguments:
    source_lang: str = field(metadata={"help": "The key of the source text in each translation."})
    target_lang: str = field(metadata={"help": "The key of the target text in each translation."})
    train_file: str | None = field(default=None, metadata={"help": "Training pairs, JSON Lines."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation pairs, JSON Lines."})
    test_file: str | None = field(default=None, metadata={"help": "Pairs to predict, JSON Lines."})
    source_prefix: str = field(default="", metadata={"help": "Text put before every source (T5: 'translate ...: ')."})
    max_source_length: int = field(default=128, metadata={"help": "Sources are truncated to this many tokens."})
    max_target_length: int = field(default=128, metadata={"help": "Targets are truncated to this many tokens."})
    val_max_target_length: int | None = field(
        default=None, metadata={"help": "The generation length of evaluation (default: max_target_length)."})
    num_beams: int | None = field(default=None, metadata={"help": "Beams of evaluation's generation."})
    ignore_pad_token_for_loss: bool = field(
        default=True, metadata={"help": "Padded label positions are -100 (left out of the loss)."})


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(training_args.get_process_log_level())
    set_seed(training_args.seed)

    files = {split: path for split, path in (("train", data_args.train_file), ("validation", data_args.validation_file),
                                             ("test", data_args.test_file)) if path}
    raw = datasets.load_dataset("json", data_files=files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    if model.config.decoder_start_token_id is None:
        raise ValueError("the model's config has no decoder_start_token_id")

    source, target, prefix = data_args.source_lang, data_args.target_lang, data_args.source_prefix

    def preprocess(examples: dict) -> dict:
        inputs = [prefix + pair[source] for pair in examples["translation"]]
        targets = [pair[target] for pair in examples["translation"]]
        encoded = tokenizer(inputs, max_length=data_args.max_source_length, truncation=True)
        labels = tokenizer(text_target=targets, max_length=data_args.max_target_length, truncation=True)
        encoded["labels"] = labels["input_ids"]
        return encoded

    tokenized = {split: raw[split].map(preprocess, batched=True, remove_columns=raw[split].column_names,
                                       desc=f"tokenizing the {split} pairs") for split in raw}
    label_pad = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=label_pad,
                                      pad_to_multiple_of=8 if training_args.fp16 or training_args.bf16 else None)

    def compute_metrics(eval_preds) -> dict:
        predictions, labels = eval_preds
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        predictions = np.where(predictions != -100, predictions, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded = [text.strip() for text in tokenizer.batch_decode(predictions, skip_special_tokens=True)]
        references = [text.strip() for text in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        bleu = sacrebleu.corpus_bleu(decoded, [references])
        lengths = [np.count_nonzero(p != tokenizer.pad_token_id) for p in predictions]
        return {"bleu": round(bleu.score, 4), "gen_len": round(float(np.mean(lengths)), 4)}

    trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=tokenized.get("train"),
                             eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
                             data_collator=collator,
                             compute_metrics=compute_metrics if training_args.predict_with_generate else None)
    max_length = data_args.val_max_target_length or data_args.max_target_length
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = dict(result.metrics, train_samples=len(tokenized["train"]))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate(max_length=max_length, num_beams=data_args.num_beams, metric_key_prefix="eval")
        metrics["eval_samples"] = len(tokenized["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.do_predict:
        out = trainer.predict(tokenized["test"], max_length=max_length, num_beams=data_args.num_beams,
                              metric_key_prefix="predict")
        metrics = dict(out.metrics, predict_samples=len(tokenized["test"]))
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            predictions = np.where(out.predictions != -100, out.predictions, tokenizer.pad_token_id)
            texts = [text.strip() for text in tokenizer.batch_decode(predictions, skip_special_tokens=True)]
            with open(os.path.join(training_args.output_dir, "generated_predictions.txt"), "w") as f:
                f.write("\n".join(texts) + "\n")


if __name__ == "__main__":
    main()
