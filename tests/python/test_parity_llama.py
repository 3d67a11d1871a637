"""Llama, Mistral and Qwen2 against transformers (eager attention): logits, loss and every gradient, from configs
with odd sizes (grouped-query attention with 2 key/value heads for 6 query heads, head size 12, a vocabulary of
101), each rope scaling type, tied and untied embeddings, Qwen2's q/k/v biases, Llama's attention and MLP biases,
and Llama's sequence classification; then 20 AdamW steps.

Tolerances as for the other architectures (hf_models): logits 1e-4, loss 1e-5, every gradient 1e-4 norm-wise; the
measured differences are ~1e-7 on the logits (f32 sums in a different order)."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch
import transformers

import hf_models as hf

fusetrain = hf.fusetrain_module()

BASE = dict(vocab_size=101, hidden_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=100, max_position_embeddings=64, pad_token_id=0)
CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
CASES = {
    "llama": ("llama", "LlamaForCausalLM", {}),
    "llama-tied-linear": ("llama", "LlamaForCausalLM",
                          {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3": ("llama", "LlamaForCausalLM",
                     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    # Positions past max_position_embeddings: the dynamic NTK base grows with the batch's longest position.
    "llama-dynamic": ("llama", "LlamaForCausalLM",
                      {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 8}),
    "llama-biases-mha": ("llama", "LlamaForCausalLM",
                         {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 6, "rope_theta": 500.0}),
    "llama-seq-cls": ("llama", "LlamaForSequenceClassification", {"num_labels": 3}),
    "mistral": ("mistral", "MistralForCausalLM", {"sliding_window": 32}),
    # Windows shorter than the sequence: every Mistral layer; Qwen2's from max_window_layers on (layer 1 of 2).
    "mistral-window": ("mistral", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2-window": ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4,
                                                   "max_window_layers": 1}),
    "qwen2-tied": ("qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}
B, T = 3, 12


def reference_dir(case: str) -> tuple[str, str]:
    kind, architecture, extra = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(CONFIGS[kind](**{**BASE, **extra}))
    hf.perturb_(model, 0, scale=0.02)
    path = tempfile.mkdtemp(prefix=f"fusetrain-{case}-")
    model.float().save_pretrained(path)
    return path, architecture


def batch(architecture: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 101, size=(B, T)).astype(np.int64)
    mask = np.ones((B, T), dtype=np.int64)
    ids[1, 9:] = 0  # padding (pad_token_id 0) at the end of one row
    mask[1, 9:] = 0
    if "SequenceClassification" in architecture:
        labels = rng.integers(0, 3, size=B).astype(np.int64)
    else:
        labels = np.where(mask == 1, ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_every_gradient(case):
    path, architecture = reference_dir(case)
    reference = getattr(transformers, architecture).from_pretrained(path, attn_implementation="eager").eval()
    data = batch(architecture)
    out = reference(**{k: torch.from_numpy(v) for k, v in data.items()})
    out.loss.backward()
    model = fusetrain.Model.from_pretrained(path)
    assert model.architecture == architecture
    loss, grads = model.loss_and_grads(**data)
    hf.assert_loss_matches(loss, out.loss.item(), case)
    logits = model.forward(input_ids=data["input_ids"], attention_mask=data["attention_mask"])["logits"]
    want = out.logits.detach().numpy()
    keep = data["attention_mask"].astype(bool) if logits.ndim == 3 else slice(None)  # padded rows attend to nothing
    np.testing.assert_allclose(logits[keep], want[keep], rtol=1e-4, atol=1e-5)
    errors = hf.grad_errors(grads, {n: p.grad.numpy() if p.grad is not None else None
                                    for n, p in reference.named_parameters()})
    assert not errors, f"{case}: " + "\n  ".join(errors)


@pytest.mark.parametrize("case", ["llama", "qwen2-tied", "llama-seq-cls", "mistral-window"])
def test_adamw_steps_track_torch(case):
    path, architecture = reference_dir(case)
    reference = getattr(transformers, architecture).from_pretrained(path, attn_implementation="eager").eval()
    model = fusetrain.Model.from_pretrained(path)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    ft_opt = fusetrain.AdamW(model, lr=1e-3, weight_decay=0.0)
    batches = [batch(architecture, seed) for seed in range(4)]
    torch_losses, ft_losses = [], []
    for step in range(20):
        data = batches[step % 4]
        torch_opt.zero_grad()
        loss = reference(**{k: torch.from_numpy(v) for k, v in data.items()}).loss
        loss.backward()
        torch_opt.step()
        torch_losses.append(loss.item())
        ft_loss, _ = model.loss_and_grads(**data)
        ft_opt.step()
        ft_losses.append(ft_loss)
    rel = np.abs(np.array(ft_losses) - torch_losses) / np.abs(torch_losses)
    assert rel.max() < 1e-4, f"{case}: worst relative loss error {rel.max():.3g} at step {int(rel.argmax())}"
    assert torch_losses[16] < torch_losses[0]


def test_save_pretrained_round_trips(tmp_path):
    path, architecture = reference_dir("qwen2-tied")
    model = fusetrain.Model.from_pretrained(path)
    model.save_pretrained(tmp_path)
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    data = batch(architecture)
    with torch.no_grad():
        want = loaded(input_ids=torch.from_numpy(data["input_ids"])).logits.numpy()
    got = model.forward(input_ids=data["input_ids"])["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _edit_config(path: str, **changes) -> None:
    config_path = f"{path}/config.json"
    config = json.load(open(config_path))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    json.dump(config, open(config_path, "w"))


def test_qwen2_windows_without_layer_types_follow_max_window_layers():
    # Older Qwen2 configs have no "layer_types": the windowed layers are those from max_window_layers on. The
    # window must change the logits here (else the test could not tell), and be the same as with the list.
    path, _ = reference_dir("qwen2-window")
    ids = batch("Qwen2ForCausalLM")["input_ids"]

    def logits() -> np.ndarray:
        return fusetrain.Model.from_pretrained(path).forward(input_ids=ids)["logits"]

    with_list = logits()
    _edit_config(path, layer_types=None)
    np.testing.assert_array_equal(logits(), with_list)
    _edit_config(path, use_sliding_window=False)
    full = logits()
    assert np.abs(full - with_list).max() > 1e-3
    _edit_config(path, use_sliding_window=True, max_window_layers=2)  # no layer from 2 on: full attention again
    np.testing.assert_array_equal(logits(), full)


def test_bad_layer_types_are_refused():
    path, _ = reference_dir("qwen2-window")
    _edit_config(path, layer_types=["full_attention", "windowed"])
    with pytest.raises(ValueError, match=r'"layer_types"\[1\] should be "full_attention" or "sliding_attention", '
                                         r'found "windowed"'):
        fusetrain.Model.from_pretrained(path)


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("case", ["llama", "qwen2-tied", "llama-seq-cls"])
def test_bf16_is_as_close_to_f32_as_autocast(case):
    """bf16 mixed precision (SwiGLU on bf16 projections, bf16 q, k, v and context, grouped-query attention) against
    transformers' f32 result, next to transformers under torch.autocast(bf16): the two round different values in a
    different order, so they are not compared with each other; fusetrain's distance from f32 must be of the size of
    autocast's (at most three times it, and at least 1e-3 for the loss and 2e-2 for the gradients, bf16's 8-bit
    mantissa over a few roundings)."""
    path, architecture = reference_dir(case)
    reference = getattr(transformers, architecture).from_pretrained(path, attn_implementation="eager").eval()
    data = batch(architecture)
    inputs = {k: torch.from_numpy(v) for k, v in data.items()}

    def torch_run(bf16: bool):
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = reference(**inputs).loss
        loss.backward()
        grads = np.concatenate([p.grad.numpy().ravel() for _, p in reference.named_parameters()])
        return loss.item(), grads

    loss_f32, grads_f32 = torch_run(False)
    loss_autocast, grads_autocast = torch_run(True)
    model = fusetrain.Model.from_pretrained(path)
    model.bf16 = True
    loss, grads = model.loss_and_grads(**data)
    ours = np.concatenate([np.asarray(grads[n], dtype=np.float32).ravel() for n, _ in reference.named_parameters()])

    loss_autocast_error = abs(loss_autocast - loss_f32) / abs(loss_f32)
    loss_error = abs(loss - loss_f32) / abs(loss_f32)
    assert loss_error <= max(3 * loss_autocast_error, 1e-3), (case, loss_error, loss_autocast_error)
    grad_autocast_error = _relative(grads_autocast, grads_f32)
    grad_error = _relative(ours, grads_f32)
    assert grad_error <= max(3 * grad_autocast_error, 2e-2), (case, grad_error, grad_autocast_error)
