"""Packed rows: several examples in one row, position_ids restarting at each, no attention_mask (transformers' rule
for packed sequences, and what TRL's padding-free collator gives). Attention stays within each example, the rotary
positions follow the restarted ids and the causal-LM loss skips each boundary, so a packed batch is the same
computation as its examples run one per row.

Small Llama (odd sizes, grouped-query attention), Qwen2 (q/k/v biases) and GPT-2 from configs. Tolerances: the
summed losses and every summed gradient 1e-5 relative (norm-wise), what f32 sums in another order leave (measured
~1e-7); against transformers' own packed forward, logits 1e-4 and gradients 1e-4 as in test_parity_llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import hf_models as hf

fusetrain = hf.fusetrain_module()

BASE = dict(vocab_size=101, hidden_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=100, max_position_embeddings=256, pad_token_id=0)
MODELS = {
    "llama": (transformers.LlamaConfig, "LlamaForCausalLM", {}),
    "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM", {}),
    "mistral-window": (transformers.MistralConfig, "MistralForCausalLM", {"sliding_window": 6}),
    "gpt2": (transformers.GPT2Config, "GPT2LMHeadModel",
             dict(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=256)),
}
# Examples shorter and longer than the attention kernel's 64-token tiles, so boundaries fall inside tiles.
LENGTHS = [[7, 70, 1, 13], [90, 5, 29]]


def model_dir(name: str, tmp_path) -> str:
    config_class, architecture, extra = MODELS[name]
    torch.manual_seed(0)
    config = config_class(**extra) if name == "gpt2" else config_class(**{**BASE, **extra})
    model = getattr(transformers, architecture)(config)
    hf.perturb_(model, 0, scale=0.02)
    model.float().save_pretrained(tmp_path)
    return str(tmp_path)


def examples(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 101, size=n).astype(np.int64) for row in LENGTHS for n in row]


def packed_batch(seqs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The examples packed as LENGTHS lays them out, rows right-padded (position 0, label -100), as TRL's
    padding-free collator does for one row (its labels keep each example's first token: the engine skips the
    boundary itself)."""
    rows, positions = [], []
    it = iter(seqs)
    for row in LENGTHS:
        parts = [next(it) for _ in row]
        rows.append(np.concatenate(parts))
        positions.append(np.concatenate([np.arange(len(p)) for p in parts]))
    T = max(len(r) for r in rows)
    ids = np.zeros((len(rows), T), np.int64)
    pos = np.zeros((len(rows), T), np.int64)
    labels = np.full((len(rows), T), -100, np.int64)
    for b, (r, p) in enumerate(zip(rows, positions)):
        ids[b, :len(r)], pos[b, :len(r)], labels[b, :len(r)] = r, p, r
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def unpacked_sums(model, seqs: list[np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    total, grads = 0.0, {}
    for s in seqs:
        if len(s) < 2:
            continue  # a one-token example predicts nothing
        loss, g = model.loss_and_grads(input_ids=s[None], labels=s[None])
        total += loss * (len(s) - 1)
        for n, v in g.items():
            grads[n] = grads.get(n, 0) + v * (len(s) - 1)
    return total, grads


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_rows_equal_their_examples_run_one_per_row(name, tmp_path):
    model = fusetrain.Model.from_pretrained(model_dir(name, tmp_path))
    seqs = examples()
    batch = packed_batch(seqs)
    loss, grads = model.loss_and_grads(**batch)
    predicted = sum(len(s) - 1 for s in seqs)  # every example's own predictions, none across a boundary
    want_loss, want_grads = unpacked_sums(model, seqs)
    assert abs(loss * predicted - want_loss) <= 1e-5 * abs(want_loss), (loss * predicted, want_loss)
    errors = {n: relative(grads[n] * predicted, want_grads[n]) for n in want_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{name}: {worst} off by {errors[worst]:.3g}"

    # The same rows with the boundaries ignored (an all-ones attention_mask: one sequence per row, by transformers'
    # rule) are another computation: the check above can fail.
    mixed_loss, mixed_grads = model.loss_and_grads(**batch, attention_mask=np.ones_like(batch["input_ids"]))
    mixed_predicted = int((batch["labels"][:, 1:] != -100).sum())
    assert abs(mixed_loss * mixed_predicted - want_loss) > 1e-3 * abs(want_loss)
    mixed_errors = [relative(mixed_grads[n] * mixed_predicted, want_grads[n]) for n in want_grads]
    assert max(mixed_errors) > 1e-3, max(mixed_errors)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_packed_rows_match_transformers_packed_forward(name, tmp_path):
    # transformers builds a block-diagonal mask from the restarting position_ids when it keeps no cache (as in
    # training; TRL passes use_cache=False); with TRL's collator labels (-100 at each example's first token) its
    # loss skips the same boundaries.
    path = model_dir(name, tmp_path)
    architecture = MODELS[name][1]
    reference = getattr(transformers, architecture).from_pretrained(path, attn_implementation="eager").eval()
    batch = packed_batch(examples(1))
    batch["labels"][batch["position_ids"] == 0] = -100
    valid = batch["labels"] != -100
    out = reference(**{k: torch.from_numpy(v) for k, v in batch.items()}, use_cache=False)
    out.loss.backward()
    model = fusetrain.Model.from_pretrained(path)
    loss, grads = model.loss_and_grads(**batch)
    hf.assert_loss_matches(loss, out.loss.item(), name)
    logits = model.forward(input_ids=batch["input_ids"], position_ids=batch["position_ids"])["logits"]
    real = batch["input_ids"] != 0
    np.testing.assert_allclose(logits[real], out.logits.detach().numpy()[real], rtol=1e-4, atol=1e-5)
    errors = hf.grad_errors(grads, {n: p.grad.numpy() if p.grad is not None else None
                                    for n, p in reference.named_parameters()})
    assert not errors, f"{name}: " + "\n  ".join(errors)
    assert valid.sum() > 0


def test_models_that_cannot_keep_packed_examples_apart_refuse_them(tmp_path):
    # An imported causal LM's graph builds its own mask from attention_mask: packed rows are refused, not mixed.
    model = fusetrain.Model.from_pretrained(model_dir("llama", tmp_path / "hf"))
    onnx_path = model.export_onnx(str(tmp_path / "model.onnx"))
    imported = fusetrain.Model.from_onnx(onnx_path, task="clm")
    batch = packed_batch(examples())
    with pytest.raises(ValueError, match="position_ids restart inside a row"):
        imported.loss_and_grads(**batch)
