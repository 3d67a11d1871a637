"""Smoke tests of the Python binding fusetrain._core on a tiny BERT.

Run after `bash scripts/build.sh` (conftest.py finds build/python) or `pip install .`:
    python -m pytest -q tests/python
"""

import json

import numpy as np
import pytest

import fusetrain

B, T = 2, 8
NUM_LABELS = 3
CONFIG = {
    "model_type": "bert",
    "architectures": ["BertForSequenceClassification"],
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 32,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "num_labels": NUM_LABELS,
}


@pytest.fixture
def model():
    return fusetrain.Model.from_config(CONFIG, seed=0)


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    input_ids = rng.integers(1, CONFIG["vocab_size"], size=(B, T), dtype=np.int64)
    attention_mask = np.ones((B, T), dtype=np.int64)
    attention_mask[1, 5:] = 0
    labels = np.array([0, 2], dtype=np.int64)
    return input_ids, attention_mask, labels


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_version_and_cpu_features():
    assert fusetrain.__version__ == "0.1.0"
    assert isinstance(fusetrain.cpu_features(), str)
    assert "BertForSequenceClassification" in fusetrain.supported_architectures()


def test_properties(model):
    assert model.architecture == "BertForSequenceClassification"
    assert model.model_type == "bert"
    assert model.config["hidden_size"] == 32 and model.config["num_labels"] == NUM_LABELS
    assert model.missing_keys == []
    assert not model.training  # eval by default, like transformers after from_pretrained
    state = model.state_dict()
    assert model.num_parameters == sum(v.size for v in state.values())  # no tied weights in this head


def test_forward_int64_and_int32_ids_agree(model, batch):
    input_ids, attention_mask, _ = batch
    out64 = model.forward(input_ids, attention_mask=attention_mask)
    assert set(out64) == {"logits"}
    logits = out64["logits"]
    assert logits.dtype == np.float32 and logits.shape == (B, NUM_LABELS)
    assert np.isfinite(logits).all()
    out32 = model.forward(input_ids.astype(np.int32), attention_mask=attention_mask.astype(np.int32))
    np.testing.assert_array_equal(out32["logits"], logits)
    # A non-contiguous view (every other column of a wider array) is converted, not misread.
    wide = np.zeros((B, 2 * T), dtype=np.int64)
    wide[:, ::2] = input_ids
    np.testing.assert_array_equal(model(wide[:, ::2], attention_mask=attention_mask)["logits"], logits)
    # The returned logits are a copy: a later run does not change them.
    before = logits.copy()
    model.forward(input_ids[:, ::-1].copy())
    np.testing.assert_array_equal(logits, before)


def test_int64_ids_are_read_in_place():
    ids = np.arange(16, dtype=np.int64).reshape(2, 8)
    assert fusetrain._core._input_address(ids) == ids.ctypes.data
    ids32 = ids.astype(np.int32)
    assert fusetrain._core._input_address(ids32) != ids32.ctypes.data
    strided = np.arange(32, dtype=np.int64).reshape(2, 16)[:, ::2]
    assert fusetrain._core._input_address(strided) != strided.ctypes.data


def test_forward_loss_is_cross_entropy_of_logits(model, batch):
    input_ids, attention_mask, labels = batch
    out = model.forward(input_ids, attention_mask=attention_mask, labels=labels)
    assert isinstance(out["loss"], float)
    expected = -log_softmax(out["logits"].astype(np.float64))[np.arange(B), labels].mean()
    assert out["loss"] == pytest.approx(expected, rel=1e-5)


def test_loss_and_grads_cover_every_parameter(model, batch):
    input_ids, attention_mask, labels = batch
    loss, grads = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    state = model.state_dict()
    assert list(grads) == list(state)
    for name, value in state.items():
        assert grads[name].shape == value.shape, name
        assert grads[name].dtype == np.float32 and np.isfinite(grads[name]).all(), name
    assert np.abs(grads["classifier.weight"]).sum() > 0
    forward_loss = model.forward(input_ids, attention_mask=attention_mask, labels=labels)["loss"]
    assert loss == pytest.approx(forward_loss, rel=1e-6)
    # The gradients are zeroed before each call, not accumulated.
    _, again = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    np.testing.assert_allclose(again["classifier.bias"], grads["classifier.bias"], rtol=1e-5, atol=1e-8)


def test_gradient_matches_finite_difference(model, batch):
    input_ids, attention_mask, labels = batch
    _, grads = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    state = model.state_dict()
    eps = 1e-2
    for index in range(NUM_LABELS):
        losses = []
        for sign in (1, -1):
            shifted = dict(state)
            shifted["classifier.bias"] = state["classifier.bias"].copy()
            shifted["classifier.bias"][index] += sign * eps
            model.load_state_dict(shifted)
            losses.append(model.forward(input_ids, attention_mask=attention_mask, labels=labels)["loss"])
        numeric = (losses[0] - losses[1]) / (2 * eps)
        assert grads["classifier.bias"][index] == pytest.approx(numeric, rel=1e-2, abs=1e-4)


def test_state_dict_round_trip_and_strictness(model, batch):
    input_ids, attention_mask, _ = batch
    state = model.state_dict()
    assert all(v.dtype == np.float32 for v in state.values())
    state["classifier.weight"] = np.full_like(state["classifier.weight"], 0.5)
    state["classifier.bias"] = np.arange(NUM_LABELS, dtype=np.float64)  # converted to float32
    model.load_state_dict(state)
    reloaded = model.state_dict()
    np.testing.assert_array_equal(reloaded["classifier.weight"], 0.5)
    np.testing.assert_array_equal(reloaded["classifier.bias"], [0, 1, 2])
    # state_dict returns copies: writing into them leaves the model alone.
    reloaded["classifier.bias"][:] = 7
    np.testing.assert_array_equal(model.state_dict()["classifier.bias"], [0, 1, 2])

    missing = dict(state)
    del missing["classifier.bias"]
    with pytest.raises(ValueError, match="classifier.bias"):
        model.load_state_dict(missing)
    model.load_state_dict(missing, strict=False)
    with pytest.raises(ValueError, match="not_a_parameter"):
        model.load_state_dict({**state, "not_a_parameter": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="classifier.weight"):
        model.load_state_dict({**state, "classifier.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match="floating-point"):
        model.load_state_dict({**state, "classifier.bias": np.zeros(NUM_LABELS, np.int64)})


def test_save_pretrained_round_trip(model, batch, tmp_path):
    input_ids, attention_mask, _ = batch
    logits = model.forward(input_ids, attention_mask=attention_mask)["logits"]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hidden_size"] == 32 and saved["num_labels"] == NUM_LABELS
    loaded = fusetrain.Model.from_pretrained(str(tmp_path))
    assert loaded.architecture == model.architecture
    assert loaded.missing_keys == []
    np.testing.assert_array_equal(loaded.forward(input_ids, attention_mask=attention_mask)["logits"], logits)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name], value, err_msg=name)


def test_from_config_accepts_a_path_and_a_seed(tmp_path, batch):
    input_ids, _, _ = batch
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    a = fusetrain.Model.from_config(str(path), seed=3)
    b = fusetrain.Model.from_config(CONFIG, seed=3)
    c = fusetrain.Model.from_config(CONFIG, seed=4)
    np.testing.assert_array_equal(a.forward(input_ids)["logits"], b.forward(input_ids)["logits"])
    assert not np.array_equal(b.state_dict()["classifier.weight"], c.state_dict()["classifier.weight"])


def test_train_mode_enables_dropout(model, batch):
    input_ids, attention_mask, _ = batch
    eval_logits = model.forward(input_ids, attention_mask=attention_mask)["logits"]
    np.testing.assert_array_equal(model.forward(input_ids, attention_mask=attention_mask)["logits"], eval_logits)
    assert model.train() is model and model.training
    train_logits = model.forward(input_ids, attention_mask=attention_mask)["logits"]
    assert not np.array_equal(train_logits, eval_logits)
    assert model.eval() is model and not model.training
    np.testing.assert_array_equal(model.forward(input_ids, attention_mask=attention_mask)["logits"], eval_logits)


def test_question_answering_outputs_spans(batch):
    input_ids, attention_mask, _ = batch
    qa = fusetrain.Model.from_config(CONFIG, architecture="BertForQuestionAnswering")
    assert qa.architecture == "BertForQuestionAnswering"
    out = qa.forward(input_ids, attention_mask=attention_mask)
    assert set(out) == {"start_logits", "end_logits"}
    assert out["start_logits"].shape == (B, T) and out["end_logits"].shape == (B, T)
    start, end = np.array([1, 2]), np.array([3, 4])
    with_loss = qa.forward(input_ids, attention_mask=attention_mask, start_positions=start, end_positions=end)
    assert np.isfinite(with_loss["loss"])
    with pytest.raises(ValueError, match="end_positions"):
        qa.forward(input_ids, start_positions=start)


def test_sgd_step_applies_minus_lr_times_gradient(model, batch):
    input_ids, attention_mask, labels = batch
    optimizer = fusetrain.SGD(model, lr=0.5)
    before = model.state_dict()
    _, grads = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    optimizer.step()
    after = model.state_dict()
    for name in ("classifier.weight", "classifier.bias"):
        np.testing.assert_allclose(after[name], before[name] - 0.5 * grads[name], rtol=1e-6, atol=1e-7)
    optimizer.lr = 0.0
    assert optimizer.lr == 0.0
    model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    optimizer.step()
    np.testing.assert_array_equal(model.state_dict()["classifier.bias"], after["classifier.bias"])


def test_adamw_first_step_and_training_lowers_the_loss(model, batch):
    input_ids, attention_mask, labels = batch
    optimizer = fusetrain.AdamW(model, lr=1e-3, weight_decay=0.0)
    assert optimizer.lr == pytest.approx(1e-3)
    before = model.state_dict()
    first_loss, grads = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    optimizer.step()
    # The first AdamW step moves each parameter by lr * sign(gradient) (for |g| >> eps).
    delta = model.state_dict()["classifier.bias"] - before["classifier.bias"]
    np.testing.assert_allclose(delta, -1e-3 * np.sign(grads["classifier.bias"]), rtol=1e-3, atol=1e-6)
    optimizer.lr = 1e-2
    for _ in range(20):
        loss, _ = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
        optimizer.step()
    assert loss < 0.5 * first_loss
    assert optimizer.step_count == 21


def test_fp16_loss_scale_unscaled_and_overflow_skipped(model, batch):
    """fp16: gradients carry loss_scale; clip_and_step divides it out, and skips a step that overflowed."""
    input_ids, attention_mask, labels = batch
    model.fp16 = True
    assert model.fp16 and not model.bf16
    model.loss_scale = 1.0
    _, plain = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    model.loss_scale = 256.0
    _, scaled = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    np.testing.assert_allclose(scaled["classifier.weight"] / 256.0, plain["classifier.weight"], rtol=1e-2, atol=1e-7)
    optimizer = fusetrain.AdamW(model, lr=1e-3)
    norm = optimizer.clip_and_step(0.0)
    assert np.isfinite(norm) and optimizer.step_count == 1
    assert norm == pytest.approx(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in plain.values())), rel=2e-2)
    model.loss_scale = 2.0 ** 60  # f16 overflows: the step is skipped, the weights stay
    before = model.state_dict()
    model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    assert not np.isfinite(optimizer.clip_and_step(1.0))
    assert optimizer.step_count == 1
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="loss_scale"):
        model.loss_scale = 0.0


def test_errors_are_value_errors_with_context(model, batch):
    input_ids, attention_mask, labels = batch
    with pytest.raises(ValueError, match="hidden_size"):
        fusetrain.Model.from_config({**CONFIG, "hidden_size": 30})
    with pytest.raises(ValueError, match="NoSuchModelForAnything"):
        fusetrain.Model.from_config(CONFIG, architecture="NoSuchModelForAnything")
    with pytest.raises(ValueError, match=r"input_ids.*\(8,\)"):
        model.forward(input_ids[0])
    with pytest.raises(ValueError, match=r"attention_mask.*\(2, 7\)"):
        model.forward(input_ids, attention_mask=attention_mask[:, :7])
    with pytest.raises(ValueError, match=r"labels.*\(3,\)"):
        model.forward(input_ids, labels=np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="integer"):
        model.forward(input_ids.astype(np.float32))
    with pytest.raises(ValueError, match="labels"):
        model.loss_and_grads(input_ids)
    with pytest.raises(ValueError):
        fusetrain.Model.from_pretrained("/nonexistent/fusetrain-model")
    with pytest.raises(ValueError, match="config"):
        fusetrain.Model.from_config(42)


def test_matches_transformers(model, batch, tmp_path):
    """Weights exchanged both ways with transformers give the same logits, loss and gradients."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    input_ids, attention_mask, labels = batch
    model.save_pretrained(tmp_path)
    reference = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    out = reference(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        labels=torch.from_numpy(labels),
    )
    out.loss.backward()
    ours_loss, ours_grads = model.loss_and_grads(input_ids, attention_mask=attention_mask, labels=labels)
    ours = model.forward(input_ids, attention_mask=attention_mask)["logits"]
    np.testing.assert_allclose(ours, out.logits.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert ours_loss == pytest.approx(out.loss.item(), rel=1e-4)
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(ours_grads[name], parameter.grad.numpy(), rtol=1e-3, atol=1e-6, err_msg=name)
    # transformers -> fusetrain: torch tensors are accepted directly.
    other = fusetrain.Model.from_config(CONFIG, seed=1)
    other.load_state_dict(reference.state_dict())
    np.testing.assert_allclose(other.forward(input_ids, attention_mask=attention_mask)["logits"], ours, rtol=1e-6)


def _tiny_config(model_type):
    if model_type == "gpt2":
        return {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
                "pad_token_id": 0, "num_labels": NUM_LABELS}
    if model_type in ("llama", "mistral", "qwen2"):
        return {"model_type": model_type, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
                "max_position_embeddings": 32, "pad_token_id": 0, "num_labels": NUM_LABELS}
    if model_type == "distilbert":
        return {"model_type": "distilbert", "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4,
                "hidden_dim": 64, "max_position_embeddings": 32, "num_labels": NUM_LABELS}
    config = {k: v for k, v in CONFIG.items() if k != "architectures"}
    config["model_type"] = model_type
    return config


def test_every_registry_row_builds_and_returns_its_outputs(batch):
    input_ids, attention_mask, _ = batch
    rows = fusetrain.architectures()
    assert [row["architecture"] for row in rows] == fusetrain.supported_architectures()
    assert {row["model_type"] for row in rows} == {"bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2"}
    for row in rows:
        model = fusetrain.Model.from_config(_tiny_config(row["model_type"]), architecture=row["architecture"])
        assert (model.architecture, model.model_type) == (row["architecture"], row["model_type"])
        assert list(model.forward(input_ids, attention_mask=attention_mask)) == row["outputs"], row
        assert (row["head"] == "Base") == (row["task"] == "") == (row["label_kinds"] == [])
        assert row["language_model"] == (row["task"] in ("mlm", "clm"))


def test_python_trainer_reads_its_classes_and_tasks_from_the_registry():
    from fusetrain.trainer import _task_of, supported_trainer_classes

    rows = {row["architecture"]: row for row in fusetrain.architectures()}
    trained = supported_trainer_classes()
    assert set(trained) == {name for name, row in rows.items() if row["task"]}  # every head, question answering too
    assert "BertForQuestionAnswering" in trained and "GPT2LMHeadModel" in trained and "BertModel" not in trained
    for name in trained:
        assert _task_of(name) == rows[name]["task"]
    with pytest.raises(TypeError, match="cannot train a GPT2Model"):
        _task_of("GPT2Model")
