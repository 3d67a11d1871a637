"""Feature files: the command line's image and audio data, decoded and preprocessed in Python for the engine.

    python -m fusetrain.features --task image-cls --model DIR --train-file FOLDER [--eval-file F] [--test-file F]
                                 [--input-column image] [--label-column label]

The `fusetrain` command runs this (in a child process, as it runs capture) for `--task image-cls`, `audio-cls` and
`ctc`, then hands the engine's command line the files it prints: one JSON line, {"train": PATH, "eval": PATH,
"test": PATH, "labels": [class names]} (each file named only when given). The training process never decodes an
image or a sound and never imports PyTorch.

Data, as transformers' example scripts read it:
- a folder with one subfolder per class (datasets' imagefolder / audiofolder layout; the class names are the
  subfolders' names, sorted), or a folder whose metadata.jsonl / metadata.csv names each file (`file_name`) and its
  label or transcription;
- a JSON Lines, CSV or TSV table whose input column (default "image" or "audio") holds file paths, relative to the
  table, and whose label column ("label"; for ctc, the transcription column "text") holds the class or text.

Images are decoded with Pillow and converted to RGB; sounds with soundfile (libsndfile: WAV, FLAC, OGG, MP3, ...),
averaged to mono and resampled to the feature extractor's rate with SciPy's polyphase filter where it differs. Each
example then goes through the model directory's own preprocessor (preprocessor_config.json: AutoImageProcessor or
AutoFeatureExtractor), and a CTC transcription through its tokenizer, so the engine trains on what transformers'
pipeline would give the model.

A feature file is a safetensors file: `features` (float32, every example's values one after another),
`feature_offsets` (int64, N + 1), `labels` and `label_offsets` (int64; a class per example, or a token sequence per
example for ctc; absent for unlabelled data), and under the metadata key "fusetrain.features" a JSON object naming
the model input, the per-example shape (-1 on a free axis: raw audio's length), the padding value and the class
names (for ctc, the tokenizer's vocabulary, blank and word delimiter instead, which the engine decodes greedy
transcriptions with for its WER and CER). Files are cached ($FUSETRAIN_CACHE/features, else ~/.cache/fusetrain/features), keyed by the data files'
names, sizes and modification times, the model directory's preprocessor and tokenizer files, the task and columns.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from importlib import metadata
from typing import Any

_FORMAT = 1
TASKS = ("image-cls", "audio-cls", "ctc")
_INPUT_COLUMNS = {"image-cls": "image", "audio-cls": "audio", "ctc": "audio"}
_LABEL_COLUMNS = {"image-cls": "label", "audio-cls": "label", "ctc": "text"}
_MODEL_FILES = ("preprocessor_config.json", "config.json", "tokenizer_config.json", "vocab.json", "tokenizer.json",
                "special_tokens_map.json", "added_tokens.json")
_CHUNK = 64  # images through the processor at a time


class FeatureError(ValueError):
    """Data that cannot be turned into a feature file; the message names the file and what was expected."""


def cache_root() -> pathlib.Path:
    """Where feature files are kept: $FUSETRAIN_CACHE/features, else ~/.cache/fusetrain/features."""
    base = os.environ.get("FUSETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fusetrain")
    return pathlib.Path(base) / "features"


def _extensions(task: str) -> set[str]:
    if task == "image-cls":
        from PIL import Image

        return {ext.lower() for ext in Image.registered_extensions()}
    import soundfile

    return {"." + name.lower() for name in soundfile.available_formats()} | {".oga", ".aif"}


def _table(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a JSON Lines, CSV or TSV file."""
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as error:
                    raise FeatureError(f"{path}:{number}: expected one JSON object per line, found {line[:60]!r} "
                                       f"({error})") from error
                if not isinstance(row, dict):
                    raise FeatureError(f"{path}:{number}: expected a JSON object, found {type(row).__name__}")
                rows.append(row)
        return rows
    if path.suffix in (".csv", ".tsv"):
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ","))
    raise FeatureError(f"{path}: expected a folder, or a .jsonl, .csv or .tsv table, found {path.suffix or 'no'} "
                       "suffix")


def _examples(path: pathlib.Path, task: str, input_column: str, label_column: str,
              labelled: bool) -> list[tuple[pathlib.Path, Any]]:
    """(media file, label or transcription; None when unlabelled) per example, in a stable order."""
    if not path.exists():
        raise FeatureError(f"data \"{path}\" does not exist")
    if path.is_dir():
        table = next((path / name for name in ("metadata.jsonl", "metadata.csv") if (path / name).is_file()), None)
        if table is not None:
            return _examples_of_table(table, _table(table), "file_name", label_column, labelled)
        if task == "ctc":
            raise FeatureError(f"{path}: a ctc folder needs metadata.jsonl or metadata.csv naming each file "
                               f"(file_name) and its transcription ({label_column}); found neither")
        extensions = _extensions(task)
        classes = sorted(p for p in path.iterdir() if p.is_dir())
        if classes:
            out = [(f, c.name) for c in classes for f in sorted(c.iterdir()) if f.suffix.lower() in extensions]
        elif not labelled:
            out = [(f, None) for f in sorted(path.iterdir()) if f.suffix.lower() in extensions]
        else:
            raise FeatureError(f"{path}: expected one subfolder per class (the imagefolder layout), found none")
        if not out:
            raise FeatureError(f"{path}: found no {'image' if task == 'image-cls' else 'audio'} files "
                               f"({', '.join(sorted(extensions)[:8])}, ...)")
        return out
    return _examples_of_table(path, _table(path), input_column, label_column, labelled)


def _examples_of_table(path: pathlib.Path, rows: list[dict[str, Any]], input_column: str, label_column: str,
                       labelled: bool) -> list[tuple[pathlib.Path, Any]]:
    if not rows:
        raise FeatureError(f"{path}: has no examples")
    out = []
    for number, row in enumerate(rows, 1):
        for column in (input_column, label_column) if labelled else (input_column,):
            if row.get(column) is None:
                raise FeatureError(f"{path}: example {number} has no {column!r} (columns: {', '.join(row)})")
        name = row[input_column]
        if not isinstance(name, str):
            raise FeatureError(f"{path}: example {number}: {input_column} must be a file path, found {name!r}")
        file = pathlib.Path(name) if os.path.isabs(name) else path.parent / name
        if not file.is_file():
            raise FeatureError(f"{path}: example {number}: {file} does not exist")
        out.append((file, row[label_column] if labelled else None))
    return out


def _class_ids(values: list[Any], names: list[str], where: str) -> list[int]:
    ids = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise FeatureError(f"{where}: a class label must be a name or an integer, found {value!r}")
        if isinstance(value, str) and value not in names and value.isdigit():
            value = int(value)
        if isinstance(value, int):
            if not 0 <= value < len(names):
                raise FeatureError(f"{where}: class {value} is outside the {len(names)} classes ({', '.join(names)})")
            ids.append(value)
        elif value in names:
            ids.append(names.index(value))
        else:
            raise FeatureError(f"{where}: class {value!r} is not one of the training data's ({', '.join(names)})")
    return ids


def class_names(train: list[Any] | None, config: dict[str, Any]) -> list[str]:
    """The class names, position = id: the training labels' distinct names, sorted (as datasets' imagefolder and
    transformers' scripts list them), or for integer labels range(max + 1) named by the model's id2label; without
    training data, the model's id2label."""
    id2label = config.get("id2label") or {}
    configured = [str(id2label.get(str(k), id2label.get(k, k))) for k in range(len(id2label))]
    if train is None:
        return configured or [str(k) for k in range(int(config.get("num_labels", 2)))]
    if all(isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and v.isdigit() for v in train):
        count = max(int(v) for v in train) + 1
        return configured if len(configured) >= count else [str(k) for k in range(count)]
    return sorted({str(v) for v in train})


def _signature(examples: list[tuple[pathlib.Path, Any]], data: pathlib.Path) -> list[Any]:
    files = {data} | {f for f, _ in examples}
    if data.is_dir():
        files |= {p for p in data.iterdir() if p.is_file()}
    return sorted((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def _model_signature(model: pathlib.Path) -> list[Any]:
    return [(name, hashlib.sha256((model / name).read_bytes()).hexdigest()) for name in _MODEL_FILES
            if (model / name).is_file()]


def _versions() -> list[str]:
    out = []
    for name in ("transformers", "pillow", "soundfile", "scipy", "numpy"):
        try:
            out.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name}=none")
    return out


def _images(files: list[pathlib.Path], model: pathlib.Path) -> tuple[list[Any], dict[str, Any]]:
    import numpy as np
    from PIL import Image, UnidentifiedImageError
    from transformers import AutoImageProcessor

    try:  # the NumPy/Pillow processor: the torchvision one needs a package a CPU install may lack
        processor = AutoImageProcessor.from_pretrained(str(model), backend="pil")
    except (TypeError, ValueError):
        processor = AutoImageProcessor.from_pretrained(str(model))
    values = []
    for start in range(0, len(files), _CHUNK):
        images = []
        for file in files[start:start + _CHUNK]:
            try:
                with Image.open(file) as image:
                    images.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError) as error:
                raise FeatureError(f"{file}: Pillow cannot read it as an image ({error})") from error
        pixels = processor(images=images, return_tensors="np")["pixel_values"]
        values.extend(np.asarray(pixels, dtype=np.float32))
    return values, {"input": "pixel_values", "shape": list(values[0].shape), "padding_value": 0.0}


def _sounds(files: list[pathlib.Path], model: pathlib.Path) -> tuple[list[Any], dict[str, Any]]:
    import numpy as np
    import soundfile
    from transformers import AutoFeatureExtractor

    extractor = AutoFeatureExtractor.from_pretrained(str(model))
    rate = int(extractor.sampling_rate)
    values = []
    for file in files:
        try:
            wave, found = soundfile.read(str(file), dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
            raise FeatureError(f"{file}: soundfile cannot read it as audio ({error})") from error
        wave = wave.mean(axis=1)
        if found != rate:
            from math import gcd

            from scipy.signal import resample_poly

            step = gcd(found, rate)
            wave = resample_poly(wave, rate // step, found // step).astype(np.float32)
        if wave.size == 0:
            raise FeatureError(f"{file}: holds no samples")
        out = extractor(wave, sampling_rate=rate, return_tensors="np")["input_values"][0]
        values.append(np.asarray(out, dtype=np.float32).reshape(-1))
    return values, {"input": "input_values", "shape": [-1], "padding_value": float(extractor.padding_value),
                    "sampling_rate": rate}


def write(task: str, model: str | os.PathLike, data: str | os.PathLike, names: list[str] | None, *,
          input_column: str | None = None, label_column: str | None = None, labelled: bool = True
          ) -> tuple[pathlib.Path, list[Any]]:
    """The feature file of `data` for `task` with the model directory `model`'s preprocessor (from the cache when
    nothing it depends on changed), and the examples' raw labels (the class names found, or transcriptions).
    `names` are the class names whose positions are the ids (None: this data's own, see class_names). Raises
    FeatureError naming what is wrong."""
    import numpy as np
    from safetensors.numpy import save_file

    if task not in TASKS:
        raise FeatureError(f"task {task!r} reads no feature files (expected one of {', '.join(TASKS)})")
    model, data = pathlib.Path(model), pathlib.Path(data)
    if not (model / "preprocessor_config.json").is_file():
        raise FeatureError(f"{model}: --task {task} preprocesses with the model's preprocessor_config.json (its "
                           "image processor or feature extractor), found none; save one with "
                           "processor.save_pretrained(DIR)")
    input_column = input_column or _INPUT_COLUMNS[task]
    label_column = label_column or _LABEL_COLUMNS[task]
    examples = _examples(data, task, input_column, label_column, labelled)
    raw = [label for _, label in examples]
    config = json.loads((model / "config.json").read_text()) if (model / "config.json").is_file() else {}
    if labelled and task != "ctc" and names is None:
        names = class_names(raw, config)
    key = json.dumps([_FORMAT, task, input_column, label_column, labelled, names, _signature(examples, data),
                      _model_signature(model), _versions()])
    target = cache_root() / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".safetensors")
    if target.is_file():
        return target, raw

    files = [file for file, _ in examples]
    values, meta = _images(files, model) if task == "image-cls" else _sounds(files, model)
    lengths = np.array([v.size for v in values], dtype=np.int64)
    tensors = {"features": np.concatenate([v.reshape(-1) for v in values]).astype(np.float32),
               "feature_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    if labelled:
        if task == "ctc":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model))
            for text in raw:
                if not isinstance(text, str):
                    raise FeatureError(f"{data}: a transcription must be text, found {text!r}")
            sequences = [list(tokenizer(text).input_ids) for text in raw]
            meta["labels"] = "sequences"
            # what the engine decodes greedy transcriptions and references with (eval_wer, eval_cer)
            meta["vocabulary"] = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            meta["blank"] = tokenizer.pad_token_id
            meta["word_delimiter"] = getattr(tokenizer, "word_delimiter_token", None)
        else:
            sequences = [[k] for k in _class_ids(raw, names, str(data))]
            meta["labels"] = "classes"
            meta["label_names"] = names
        counts = np.array([len(s) for s in sequences], dtype=np.int64)
        tensors["labels"] = np.array([t for s in sequences for t in s], dtype=np.int64)
        tensors["label_offsets"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    else:
        meta["labels"] = "none"
    meta.update({"format": _FORMAT, "task": task, "source": str(data.resolve()), "examples": len(values)})
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
        os.close(handle)
        try:
            save_file(tensors, scratch, metadata={"fusetrain.features": json.dumps(meta)})
            os.replace(scratch, target)
        finally:
            if os.path.exists(scratch):
                os.remove(scratch)
    except OSError as error:
        raise FeatureError(f"cannot write the feature cache {target.parent} ({error.strerror or error}); set "
                           "FUSETRAIN_CACHE to a writable folder") from error
    return target, raw


def main(argv: list[str] | None = None) -> int:
    """`python -m fusetrain.features --task T --model DIR [--train-file F] [--eval-file F] [--test-file F]`: prints
    {"train": ..., "eval": ..., "test": ..., "labels": [...]} as one JSON line."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fusetrain.features", description=main.__doc__)
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--model", required=True)
    for split in ("train", "eval", "test"):
        parser.add_argument(f"--{split}-file")
    parser.add_argument("--input-column")
    parser.add_argument("--label-column")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    try:
        model = pathlib.Path(args.model)
        config = json.loads((model / "config.json").read_text()) if (model / "config.json").is_file() else {}
        names = None
        if args.train_file:
            out["train"], raw = write(args.task, model, args.train_file, None, input_column=args.input_column,
                                      label_column=args.label_column)
            if args.task != "ctc":
                names = class_names(raw, config)
        elif args.task != "ctc":
            names = class_names(None, config)
        for split in ("eval", "test"):
            path = getattr(args, f"{split}_file")
            if path:
                out[split], _ = write(args.task, model, path, names, input_column=args.input_column,
                                      label_column=args.label_column, labelled=split == "eval")
    except FeatureError as error:
        print(f"fusetrain: error: {error}", file=sys.stderr)
        return 1
    out = {k: str(v) for k, v in out.items()}
    if names is not None:
        out["labels"] = names
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
