"""Bad checkpoints and bad inputs raise ValueError with a message naming the file
and/or the tensor; nothing crashes the process."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hf_models as hf

CASE = hf.Case("BertForSequenceClassification", "small", "single")
WEIGHTS = "model.safetensors"
BODY_TENSOR = "bert.encoder.layer.1.attention.self.query.weight"


@pytest.fixture
def checkpoint(tmp_path):
    """A copy of a valid checkpoint, free to break."""
    path = tmp_path / "checkpoint"
    shutil.copytree(hf.reference_dir(CASE), path)
    return path


def load(path, **kwargs):
    return hf.fusetrain_module().Model.from_pretrained(str(path), **kwargs)


def error_of(path, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        load(path, **kwargs)
    return str(info.value)


def edit_tensors(path, edit):
    tensors = load_file(str(path / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def test_valid_checkpoint_loads(checkpoint):
    """The fixture is sound: every failure below comes from the edit."""
    assert load(checkpoint).config["model_type"] == "bert"


def test_missing_directory(tmp_path):
    assert "does-not-exist" in error_of(tmp_path / "does-not-exist")


def test_missing_config(checkpoint):
    os.remove(checkpoint / "config.json")
    assert "config.json" in error_of(checkpoint)


def test_malformed_config(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "bert", "hidden_size": 32,')
    assert "config.json" in error_of(checkpoint)


def test_unknown_model_type(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "not-a-model"
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert "not-a-model" in error_of(checkpoint)


def test_unknown_architecture(checkpoint):
    assert "BertForTelepathy" in error_of(checkpoint, architecture="BertForTelepathy")


def test_heads_not_dividing_hidden_size(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_attention_heads"] = 5  # hidden 32
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert "num_attention_heads" in error_of(checkpoint)


def test_truncated_safetensors(checkpoint):
    data = (checkpoint / WEIGHTS).read_bytes()
    (checkpoint / WEIGHTS).write_bytes(data[: len(data) // 2])
    assert WEIGHTS in error_of(checkpoint)


def test_truncated_safetensors_header(checkpoint):
    (checkpoint / WEIGHTS).write_bytes((checkpoint / WEIGHTS).read_bytes()[:20])
    assert WEIGHTS in error_of(checkpoint)


def test_absurd_header_length(checkpoint):
    """A header length of 2^60 must be rejected, not allocated."""
    data = bytearray((checkpoint / WEIGHTS).read_bytes())
    data[:8] = (1 << 60).to_bytes(8, "little")
    (checkpoint / WEIGHTS).write_bytes(bytes(data))
    assert WEIGHTS in error_of(checkpoint)


def test_tensor_shape_disagrees_with_config(checkpoint):
    name = "bert.embeddings.word_embeddings.weight"
    edit_tensors(checkpoint, lambda t: t.__setitem__(name, t[name][:-1].copy()))
    message = error_of(checkpoint)
    assert name in message
    assert re.search(r"\b98\b", message) and re.search(r"\b99\b", message), \
        f"expected and found shapes should both be named: {message}"


def test_tensor_with_wrong_dtype(checkpoint):
    edit_tensors(checkpoint, lambda t: t.__setitem__(BODY_TENSOR, t[BODY_TENSOR].astype(np.int32)))
    assert BODY_TENSOR in error_of(checkpoint)


def test_missing_tensor(checkpoint):
    edit_tensors(checkpoint, lambda t: t.pop(BODY_TENSOR))
    message = error_of(checkpoint)
    assert BODY_TENSOR in message and "missing" in message.lower()


def test_unexpected_tensor(checkpoint):
    extra = "bert.encoder.layer.0.attention.self.extra.weight"
    edit_tensors(checkpoint, lambda t: t.__setitem__(extra, np.zeros((4, 4), np.float32)))
    message = error_of(checkpoint)
    assert extra in message and "unexpected" in message.lower()


def test_pytorch_bin_only_asks_for_conversion(checkpoint):
    tensors = load_file(str(checkpoint / WEIGHTS))
    os.remove(checkpoint / WEIGHTS)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, checkpoint / "pytorch_model.bin")
    message = error_of(checkpoint)
    assert "pytorch_model.bin" in message or "safetensors" in message
    assert "conver" in message.lower(), f"the message should say how to convert: {message}"


# ---------------------------------------------------------------------------
# Bad inputs to forward / loss_and_grads
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load(hf.reference_dir(CASE))


@pytest.fixture
def batch():
    return hf.make_batch(CASE)


def forward_error(model, **batch) -> str:
    with pytest.raises(ValueError) as info:
        model.forward(**batch)
    return str(info.value)


def test_token_id_out_of_vocabulary(model, batch):
    batch["input_ids"][1, 2] = hf.SIZES["small"].vocab
    forward_error(model, **batch)


def test_negative_token_id(model, batch):
    batch["input_ids"][0, 0] = -1
    forward_error(model, **batch)


def test_sequence_longer_than_position_table(model):
    too_long = hf.make_batch(CASE, seq=hf.SIZES["small"].positions + 1, padding=False)
    forward_error(model, **too_long)


def test_mask_shape_disagrees_with_ids(model, batch):
    batch["attention_mask"] = batch["attention_mask"][:, :-1].copy()
    assert "attention_mask" in forward_error(model, **batch)


def test_float_ids(model, batch):
    batch["input_ids"] = batch["input_ids"].astype(np.float32)
    assert "input_ids" in forward_error(model, **batch)


def test_class_label_out_of_range(model, batch):
    batch["labels"][0] = 7
    assert "labels" in forward_error(model, **batch)


def test_loss_and_grads_needs_labels(model, batch):
    with pytest.raises(ValueError):
        model.loss_and_grads(**hf.without_labels(batch))


def test_initializer_range_zero_and_negative():
    """initializer_range 0 draws zeros, as torch's normal_(std=0) does; a negative one is refused by name."""
    config = {"model_type": "bert", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 16,
              "initializer_range": 0.0}
    fusetrain = hf.fusetrain_module()
    model = fusetrain.Model.from_config(config)
    assert not np.any(model.state_dict()["encoder.layer.0.attention.self.query.weight"])
    config["initializer_range"] = -0.02
    with pytest.raises(ValueError, match='"initializer_range" is -0.02, expected a standard deviation >= 0'):
        fusetrain.Model.from_config(config)
