"""Fine-tunes an image classifier (ViT, ConvNeXt, Swin, ...) on a folder of images, in the form of transformers'
examples/pytorch/image-classification/run_image_classification.py: HfArgumentParser over model, data and
TrainingArguments, datasets' `imagefolder` builder, torchvision transforms (a random resized crop and flip for
training, a resize and centre crop for evaluation, both normalised by the image processor's mean and std; where
torchvision has no build for the installed torch, examples/image_transforms.py's copies of them), and accuracy.

    python examples/run_image_classification.py --model_name_or_path DIR --train_dir images/train \\
        --validation_dir images/validation --output_dir runs/images --do_train --do_eval \\
        --per_device_train_batch_size 32 --num_train_epochs 3 --remove_unused_columns False

Data: one subfolder per class, its images inside (imagefolder's layout). The script is transformers' own way of
training but for one line after the transformers import, which makes the training steps fusetrain's:

    from fusetrain import Trainer, TrainingArguments

(without it the script runs on transformers' Trainer, as tests/python/test_image_classification_script.py does).
Accuracy is computed with numpy (the metric transformers' script loads through `evaluate`, which needs the Hub).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from datasets import load_dataset

try:
    from torchvision.transforms import (
        CenterCrop,
        Compose,
        Normalize,
        RandomHorizontalFlip,
        RandomResizedCrop,
        Resize,
        ToTensor,
    )
except (ImportError, RuntimeError):  # no torchvision built for this torch (PyPI's needs CUDA's): the same transforms
    from image_transforms import (  # examples/image_transforms.py: torch and PIL, torchvision's sampling
        CenterCrop,
        Compose,
        Normalize,
        RandomHorizontalFlip,
        RandomResizedCrop,
        Resize,
        ToTensor,
    )
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)

from fusetrain import Trainer, TrainingArguments  # the one line that trains on fusetrain's engine

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A model directory (config.json, weights, image processor)."})
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Load a checkpoint whose classifier has another number of labels."})


@dataclass
class DataTrainingArguments:
    train_dir: str | None = field(default=None, metadata={"help": "Training images, a folder per class."})
    validation_dir: str | None = field(default=None, metadata={"help": "Evaluation images, a folder per class."})
    train_val_split: float | None = field(
        default=0.15, metadata={"help": "Without validation_dir: this fraction of the training images evaluates."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first this many images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first this many images."})
    image_column_name: str = field(default="image", metadata={"help": "The column holding the images."})
    label_column_name: str = field(default="label", metadata={"help": "The column holding the labels."})


def collate_fn(examples: list[dict]) -> dict:
    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([e["label"] for e in examples])}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(training_args.get_process_log_level())
    set_seed(training_args.seed)

    files = {split: directory for split, directory in (("train", data_args.train_dir),
                                                        ("validation", data_args.validation_dir)) if directory}
    dataset = load_dataset("imagefolder", data_dir=None, data_files={
        split: f"{directory}/**" for split, directory in files.items()})
    if "validation" not in dataset and data_args.train_val_split and training_args.do_eval:
        split = dataset["train"].train_test_split(data_args.train_val_split, seed=training_args.seed)
        dataset["train"], dataset["validation"] = split["train"], split["test"]
    if data_args.label_column_name != "label":
        dataset = dataset.rename_column(data_args.label_column_name, "label")
    labels = dataset["train"].features["label"].names
    label2id = {label: str(i) for i, label in enumerate(labels)}
    id2label = {str(i): label for i, label in enumerate(labels)}

    def compute_metrics(p) -> dict:
        return {"accuracy": float(np.mean(np.argmax(p.predictions, axis=1) == p.label_ids))}

    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=len(labels), label2id=label2id,
                                        id2label=id2label, finetuning_task="image-classification")
    model = AutoModelForImageClassification.from_pretrained(
        model_args.model_name_or_path, config=config, ignore_mismatched_sizes=model_args.ignore_mismatched_sizes)
    image_processor = AutoImageProcessor.from_pretrained(model_args.model_name_or_path)

    if "shortest_edge" in image_processor.size:
        size = image_processor.size["shortest_edge"]
    else:
        size = (image_processor.size["height"], image_processor.size["width"])
    normalize = (Normalize(mean=image_processor.image_mean, std=image_processor.image_std)
                 if hasattr(image_processor, "image_mean") and hasattr(image_processor, "image_std")
                 else lambda x: x)
    train_transforms = Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), normalize])
    val_transforms = Compose([Resize(size), CenterCrop(size), ToTensor(), normalize])
    column = data_args.image_column_name

    def preprocess_train(batch: dict) -> dict:
        batch["pixel_values"] = [train_transforms(image.convert("RGB")) for image in batch[column]]
        return batch

    def preprocess_val(batch: dict) -> dict:
        batch["pixel_values"] = [val_transforms(image.convert("RGB")) for image in batch[column]]
        return batch

    if training_args.do_train:
        if data_args.max_train_samples is not None:
            dataset["train"] = dataset["train"].shuffle(seed=training_args.seed).select(
                range(data_args.max_train_samples))
        dataset["train"].set_transform(preprocess_train)
    if training_args.do_eval:
        if data_args.max_eval_samples is not None:
            dataset["validation"] = dataset["validation"].shuffle(seed=training_args.seed).select(
                range(data_args.max_eval_samples))
        dataset["validation"].set_transform(preprocess_val)

    trainer = Trainer(model=model, args=training_args,
                      train_dataset=dataset["train"] if training_args.do_train else None,
                      eval_dataset=dataset["validation"] if training_args.do_eval else None,
                      compute_metrics=compute_metrics, processing_class=image_processor, data_collator=collate_fn)
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
