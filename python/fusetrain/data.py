"""Datasets into the engine: `datasets.Dataset`, lists of dicts and map-style datasets
become one `_core._Dataset` (flat int64 token and label arrays, copied once), and a
transformers collator becomes a per-batch hook the engine calls.

Column conventions are transformers': `input_ids` (required), optional `attention_mask`
and `token_type_ids`, and labels under `labels`, `label` or `label_ids`. Examples padded
on the right (tokenized with `padding="max_length"`) are unpadded by their attention
mask; the engine pads each batch itself. Numpy does every per-token step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fusetrain import _core

LABEL_COLUMNS = ("labels", "label", "label_ids")
# The dataset label kinds to_engine converts (the engine's names; a task's kinds come from fusetrain.architectures()).
LABEL_KINDS = ("class", "regression", "token_classes", "tokens")
# Columns a batch may carry into the model; others (text, ids of rows) are dropped
# before a collator sees them, as transformers' remove_unused_columns does.
MODEL_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "special_tokens_mask", "start_positions",
                 "end_positions", "pixel_values", "input_features", "input_values", "decoder_input_ids",
                 "decoder_attention_mask") + LABEL_COLUMNS
# An encoder-decoder's target-side columns, padded to the target length (labels with -100).
TARGET_COLUMNS = ("decoder_input_ids", "decoder_attention_mask")
TEXT_COLUMNS = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question", "context"), ("text",),
                ("sentence",), ("content",))


# Float inputs a speech encoder-decoder reads in place of input_ids (Whisper's log-mel features, raw audio).
FEATURE_COLUMNS = ("input_features", "input_values")


def column_names(dataset: Any) -> list[str]:
    """The columns of a datasets.Dataset, or the keys of a list / map-style dataset's first example."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"a dataset must be a datasets.Dataset, a list of dicts or a map-style dataset (with __len__ and "
            f"__getitem__); got a {type(dataset).__name__}"
        )
    if len(dataset) == 0:
        return []
    first = dataset[0]
    if not isinstance(first, Mapping):
        raise TypeError(
            "a dataset must be a datasets.Dataset, a list of dicts or a map-style dataset whose items are dicts; "
            f"its first item is a {type(first).__name__}"
        )
    return list(first.keys())


def _ragged(dataset: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Column `name` of per-example sequences as (values int64/float, offsets of N + 1)."""
    arrow = _arrow_table(dataset)
    if arrow is not None:
        import pyarrow as pa

        column = arrow.column(name).combine_chunks()
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise ValueError(f'column "{name}" must hold one sequence per example; it holds {column.type}')
        offsets = np.asarray(column.offsets, dtype=np.int64)
        values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        return values, offsets - offsets[0]
    rows = [np.asarray(_item(dataset, i)[name]).reshape(-1) for i in range(len(dataset))]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    values = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return values, offsets


def _scalar_column(dataset: Any, name: str) -> np.ndarray:
    arrow = _arrow_table(dataset)
    if arrow is not None:
        return arrow.column(name).to_numpy()
    return np.asarray([np.asarray(_item(dataset, i)[name]) for i in range(len(dataset))])


def _arrow_table(dataset: Any):
    """The rows of a datasets.Dataset as a pyarrow Table (its selection and order applied), else None."""
    if hasattr(dataset, "with_format") and hasattr(dataset, "column_names") and hasattr(dataset, "data"):
        return dataset.with_format("arrow")[:]
    return None


def _first_keys(dataset: Any) -> set[str]:
    """The keys of a dataset's first example, torch's random state left as it was: a transform that draws (random
    crops) runs for the probe, and the training batches must see the draws transformers' Trainer's would."""
    try:
        import torch
    except ImportError:
        return set(_item(dataset, 0))
    state = torch.get_rng_state()
    try:
        return set(_item(dataset, 0))
    finally:
        torch.set_rng_state(state)


def _item(dataset: Any, i: int) -> Mapping[str, Any]:
    item = dataset[i]
    if not isinstance(item, Mapping):
        raise TypeError(f"dataset item {i} is a {type(item).__name__}; expected a dict of columns")
    return item


def _as_int(values: np.ndarray, what: str) -> np.ndarray:
    if values.size and values.dtype.kind not in "iub":
        raise ValueError(f"{what} must be integers; found dtype {values.dtype}")
    return np.ascontiguousarray(values, dtype=np.int64)


def _unpad(values: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    return values[keep] if keep is not None else values


def to_engine(
    dataset: Any,
    *,
    task: str,
    num_labels: int,
    vocab_size: int,
    problem_type: str | None = None,
    name: str = "dataset",
    with_labels: bool = True,
) -> _core._Dataset:
    """Converts a tokenized dataset into the engine's `_Dataset` for `task` (seq-cls, token-cls, mlm, clm: a
    task of fusetrain.architectures() whose labels are among LABEL_KINDS).

    With `with_labels` False the labels stay in the dataset for a collator to read (question answering's start and
    end positions) and the engine's dataset holds the tokens alone.

    Raises ValueError naming the dataset and what is wrong: no input_ids, labels missing or
    of the wrong shape, out-of-range ids or labels, left padding.
    """
    if isinstance(dataset, _core._Dataset):
        return dataset
    columns = column_names(dataset)
    if len(dataset) == 0:
        raise ValueError(f"the {name} is empty")
    if task == "image-cls":
        return _features_to_engine(dataset, columns, "pixel_values", num_labels, problem_type, name, with_labels)
    if task == "ctc":  # the collator pads the audio and the label sequences
        return _features_to_engine(dataset, columns, "input_values", num_labels, problem_type, name, False)
    if task == "seq-cls" and "input_ids" not in columns and "input_values" in columns:  # audio classification
        return _features_to_engine(dataset, columns, "input_values", num_labels, problem_type, name, with_labels)
    if task == "seq2seq" and "input_ids" not in columns:
        feature = next((f for f in FEATURE_COLUMNS if f in columns or f in _first_keys(dataset)), None)
        if feature is not None:  # a speech encoder-decoder: the collator gives the features and the targets
            offsets = np.zeros(len(dataset) + 1, dtype=np.int64)
            return _core._Dataset(offsets, np.zeros(0, dtype=np.int64), None, "none", None, 0, 0,
                                  without_tokens=True)
    if task == "seq2seq":
        with_labels = False  # the targets are the collator's (decoder inputs and labels of their own length)
    if "input_ids" not in columns:
        raise ValueError(
            f"the {name} has no input_ids column (columns: {', '.join(columns) or 'none'}): tokenize it first, e.g. "
            "dataset.map(lambda batch: tokenizer(batch['sentence'], truncation=True), batched=True), "
            "or pass processing_class=tokenizer so the Trainer can"
        )
    ids, offsets = _ragged(dataset, "input_ids")
    ids = _as_int(ids, f"the {name}'s input_ids")
    keep = None
    if "attention_mask" in columns:
        mask, mask_offsets = _ragged(dataset, "attention_mask")
        if mask.shape != ids.shape or not np.array_equal(mask_offsets, offsets):
            raise ValueError(f"the {name}'s attention_mask does not have the shape of its input_ids")
        mask = mask.astype(bool)
        if not mask.all():
            # Right padding only: within an example, no kept token may follow a padding token.
            starts = np.zeros(len(ids), dtype=bool)
            starts[offsets[:-1]] = True
            rises = np.flatnonzero(mask[1:] & ~mask[:-1] & ~starts[1:])
            if rises.size:
                example = int(np.searchsorted(offsets, rises[0] + 1, side="right") - 1)
                raise ValueError(
                    f"example {example} of the {name} is padded on the left; fusetrain needs right padding "
                    "(tokenizer.padding_side = 'right') or no padding"
                )
            keep = mask
    lengths = np.diff(offsets) if keep is None else np.add.reduceat(keep.astype(np.int64), offsets[:-1])
    new_offsets = np.zeros_like(offsets)
    np.cumsum(lengths, out=new_offsets[1:])
    type_ids = None
    if "token_type_ids" in columns:
        type_ids = _unpad(_as_int(_ragged(dataset, "token_type_ids")[0], f"the {name}'s token_type_ids"), keep)
    ids = _unpad(ids, keep)

    if not with_labels:
        return _core._Dataset(new_offsets, ids, type_ids, "none", None, 0, vocab_size)
    label_column = next((c for c in LABEL_COLUMNS if c in columns), None)
    task_kinds = next((row["label_kinds"] for row in _core.architectures() if row["task"] == task), None)
    if task_kinds is None or not set(task_kinds) <= set(LABEL_KINDS):
        raise ValueError(f"to_engine converts datasets for the tasks whose labels are {', '.join(LABEL_KINDS)}; "
                         f"got task {task!r}")
    kind, labels = "none", None
    if "class" in task_kinds and label_column is not None:
        kind, labels = _example_labels(dataset, label_column, num_labels, problem_type, name)
    elif "token_classes" in task_kinds and label_column is not None:
        values, label_offsets = _ragged(dataset, label_column)
        if not np.array_equal(label_offsets, offsets):
            raise ValueError(f'the {name}\'s "{label_column}" must hold one label per token of input_ids')
        kind, labels = "token_classes", _unpad(_as_int(values, f'the {name}\'s "{label_column}"'), keep)
    elif "tokens" in task_kinds:
        kind = "tokens"
    return _core._Dataset(new_offsets, ids, type_ids, kind, labels, num_labels if kind != "regression" else 0,
                          vocab_size)


def _example_labels(dataset: Any, label_column: str, num_labels: int, problem_type: str | None,
                    name: str) -> tuple[str, np.ndarray]:
    """One label per example: ("class", int64 ids) or ("regression", float32 targets)."""
    values = _scalar_column(dataset, label_column)
    if values.ndim != 1:
        raise ValueError(
            f'the {name}\'s "{label_column}" must hold one value per example for sequence classification; '
            f"found shape {values.shape}"
        )
    if problem_type == "regression" or num_labels == 1 or values.dtype.kind == "f":
        if num_labels != 1:
            raise ValueError(
                f'the {name}\'s "{label_column}" holds floats but the model has {num_labels} labels; '
                "regression needs num_labels=1"
            )
        return "regression", np.ascontiguousarray(values, dtype=np.float32)
    return "class", _as_int(values, f'the {name}\'s "{label_column}"')


_PREPROCESS_HINTS = {
    "pixel_values": "preprocess the images first, e.g. dataset.with_transform(lambda batch: "
                    "image_processor(batch['image'], return_tensors='pt'))",
    "input_values": "preprocess the audio first, e.g. dataset.map(lambda example: {'input_values': "
                    "feature_extractor(example['audio']['array'], sampling_rate=16000).input_values[0]})",
}


def _features_to_engine(dataset: Any, columns: list[str], feature: str, num_labels: int, problem_type: str | None,
                        name: str, with_labels: bool) -> _core._Dataset:
    """An image or audio dataset for the engine: its examples' labels (one per example); the collator gives each
    batch's `feature` (pixel_values or input_values: stored, or made on access by a transform, datasets'
    set_transform / with_transform as run_image_classification.py's) and, without `with_labels`, its labels."""
    if feature not in columns and feature not in _first_keys(dataset):
        raise ValueError(f"the {name} has no {feature} column (columns: {', '.join(columns) or 'none'}): "
                         f"{_PREPROCESS_HINTS[feature]}")
    offsets = np.zeros(len(dataset) + 1, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    label_column = next((c for c in LABEL_COLUMNS if c in columns), None)
    if not with_labels or label_column is None:
        return _core._Dataset(offsets, empty, None, "none", None, 0, 0, without_tokens=True)
    kind, labels = _example_labels(dataset, label_column, num_labels, problem_type, name)
    return _core._Dataset(offsets, empty, None, kind, labels, num_labels if kind != "regression" else 0, 0,
                          without_tokens=True)


def tokenize_if_needed(dataset: Any, tokenizer: Any, name: str) -> Any:
    """A dataset without input_ids tokenized with `tokenizer` (truncation on) from its text column(s)."""
    if dataset is None or tokenizer is None:
        return dataset
    columns = column_names(dataset)
    if "input_ids" in columns:
        return dataset
    text = next((group for group in TEXT_COLUMNS if all(c in columns for c in group)), None)
    if text is None:
        return dataset  # to_engine names the missing column
    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return dataset.map(lambda batch: tokenizer(*[batch[c] for c in text], truncation=True), batched=True)
    encoded = tokenizer(*[[_item(dataset, i)[c] for i in range(len(dataset))] for c in text], truncation=True)
    return [{**_item(dataset, i), **{k: v[i] for k, v in encoded.items()}} for i in range(len(dataset))]


def model_rows(dataset: Any) -> Callable[[np.ndarray], list[dict[str, Any]]]:
    """A function from example indices to the examples a collator takes: dicts of the model's columns only."""
    keep = [c for c in column_names(dataset) if c in MODEL_COLUMNS]
    if (getattr(dataset, "format", None) or {}).get("type") == "custom":
        # a transform (set_transform / with_transform: images made into pixel_values on access) reads the columns
        # it was written for, so the rows are fetched whole and the model's columns taken from its output
        def transformed(indices: np.ndarray) -> list[dict[str, Any]]:
            batch = dataset[indices.tolist()]
            columns = [k for k in batch if k in MODEL_COLUMNS]
            return [dict(zip(columns, values)) for values in zip(*(batch[k] for k in columns))]

        return transformed
    if hasattr(dataset, "select_columns"):
        selected = dataset.select_columns(keep)

        def rows(indices: np.ndarray) -> list[dict[str, Any]]:
            batch = selected[indices.tolist()]
            return [dict(zip(batch.keys(), values)) for values in zip(*batch.values())]

        return rows

    def rows(indices: np.ndarray) -> list[dict[str, Any]]:
        return [{k: v for k, v in _item(dataset, int(i)).items() if k in keep} for i in indices]

    return rows


def pad_batch(batch: Mapping[str, Any], pad_id: int, multiple: int = 8,
              decoder_pad_id: int | None = None) -> dict[str, np.ndarray]:
    """A collator's batch as int64 / float32 numpy arrays, right-padded to a multiple of `multiple` tokens so the
    engine compiles few plans (padding changes no result: masked positions and -100 labels are ignored). An
    encoder-decoder's batch (one with decoder_input_ids) pads its source columns to the source length and its
    decoder inputs and labels to the target length, the decoder inputs with `decoder_pad_id` (default `pad_id`):
    a causal decoder's positions never read the positions after them."""
    out = {}
    for key, value in batch.items():
        array = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        out[key] = array
    ids = out.get("input_ids")
    if ids is None:
        # Audio or images: the label sequences (CTC's, or a speech encoder-decoder's with its decoder inputs) to a
        # multiple of `multiple`, which changes no result (-100 is ignored, a causal decoder never reads later
        # positions); the audio stays as the collator made it (without an attention mask, padding it would).
        mask = out.pop("attention_mask", None)
        if mask is not None and not np.all(mask == 1):
            raise ValueError("the data collator's batch has an attention_mask that marks padding in audio or images; "
                             "fusetrain captures such a model from its input_values (or pixel_values) alone, so it "
                             "cannot mask that padding: collate without it (a Wav2Vec2-base feature extractor's "
                             "return_attention_mask=False), padding with zeros as transformers does then")
        keys = [key for key in ("labels", *TARGET_COLUMNS) if key in out and out[key].ndim == 2]
        fill = {"decoder_input_ids": pad_id if decoder_pad_id is None else decoder_pad_id, "decoder_attention_mask": 0}
        for key in keys if out.get("labels", np.zeros(0)).dtype.kind in "iu" else ():
            extra = -out[key].shape[1] % multiple
            if extra:
                out[key] = np.pad(out[key], ((0, 0), (0, extra)), constant_values=fill.get(key, -100))
        return out
    if ids.ndim != 2:
        return out
    fill = {"input_ids": pad_id, "attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1,
            "position_ids": 0, "decoder_input_ids": pad_id if decoder_pad_id is None else decoder_pad_id,
            "decoder_attention_mask": 0}
    target = [key for key in ("labels", *TARGET_COLUMNS) if key in out] if "decoder_input_ids" in out else []
    groups = [([key for key in out if key not in target], ids.shape[1])]
    if target:
        groups.append((target, out["decoder_input_ids"].shape[1]))
    for keys, length in groups:
        extra = -length % multiple
        if not extra:
            continue
        for key in keys:
            array = out[key]
            if array.ndim == 2 and array.shape[1] == length:
                out[key] = np.pad(array, ((0, 0), (0, extra)), constant_values=fill.get(key, -100))
    return out


def _plain_array(value: Any) -> np.ndarray:
    """A value as a numpy array of float32 (floating values) or int64 (integers and booleans)."""
    array = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    if array.dtype.kind == "f":
        return array.astype(np.float32, copy=False)
    return array.astype(np.int64, copy=False) if array.dtype.kind in "iub" else array


class PaddingCollator:
    """Pads a list of examples into a batch of torch tensors: input_ids with `pad_id`, attention_mask and
    token_type_ids with 0, per-token labels with -100 (fusetrain.Trainer's default without a tokenizer). Examples
    without input_ids (images) are stacked as they are."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        if "input_ids" not in features[0]:
            batch = {key: torch.from_numpy(np.stack([_plain_array(f[key]) for f in features])) for key in features[0]}
            if "label" in batch and "labels" not in batch:
                batch["labels"] = batch.pop("label")
            return batch
        longest = max(len(f["input_ids"]) for f in features)
        fill = {"input_ids": self.pad_id, "attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1,
                "decoder_input_ids": self.pad_id, "decoder_attention_mask": 0}
        batch: dict[str, Any] = {}
        for key in features[0]:
            values = [np.asarray(f[key]) for f in features]
            if values[0].dtype.kind == "f":
                values = [v.astype(np.float32) for v in values]
            elif values[0].dtype.kind in "iub":
                values = [v.astype(np.int64) for v in values]
            if values[0].ndim == 1:
                value = fill.get(key, -100)
                # each column to its own longest: an encoder-decoder's labels are as long as its targets
                padded = np.full((len(values), max(len(v) for v in values)), value, dtype=values[0].dtype)
                for i, v in enumerate(values):
                    padded[i, :len(v)] = v
                batch[key] = torch.from_numpy(padded)
            else:
                batch[key] = torch.from_numpy(np.stack(values))
        if "attention_mask" not in batch:
            mask = np.zeros((len(features), longest), dtype=np.int64)
            for i, f in enumerate(features):
                mask[i, :len(f["input_ids"])] = 1
            batch["attention_mask"] = torch.from_numpy(mask)
        if "label" in batch and "labels" not in batch:
            batch["labels"] = batch.pop("label")
        return batch


def scatter_token_rows(rows: np.ndarray, lengths: np.ndarray,
                       token_labels: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Token-classification predictions back to transformers' (N, T, K) layout, padded with -100.

    `rows` holds the logits of the labelled tokens (or every token when unlabelled), example by example;
    `token_labels` are the examples' labels, flat (None when unlabelled).
    """
    n, longest, classes = len(lengths), int(lengths.max()), rows.shape[1]
    predictions = np.full((n, longest, classes), -100.0, dtype=np.float32)
    positions = np.arange(longest)[None, :] < lengths[:, None]
    if token_labels is None:
        predictions[positions] = rows
        return predictions, None
    labels = np.full((n, longest), -100, dtype=np.int64)
    labels[positions] = token_labels
    predictions[labels != -100] = rows
    return predictions, labels
