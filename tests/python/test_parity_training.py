"""Training and checkpoint parity with transformers: AdamW steps, state dicts,
save_pretrained round trips, from_config initialisation, train()/eval()."""

import json
import os

import numpy as np
import pytest
import torch
import transformers

import hf_models as hf

STEPS = 20
LR = 2e-3
BETAS = (0.9, 0.95)
EPS = 1e-6
WEIGHT_DECAY = 0.01

# At least one model per architecture; the LM heads exercise tied weights.
TRAINED = [
    hf.Case("BertForSequenceClassification", "small", "single"),
    hf.Case("BertForMaskedLM", "odd"),
    hf.Case("RobertaForMaskedLM", "small"),
    hf.Case("DistilBertForSequenceClassification", "small", "multi"),
    hf.Case("GPT2LMHeadModel", "small"),
    hf.Case("GPT2ForSequenceClassification", "odd", "regression"),
]

MODEL_TYPES = ("bert", "roberta", "distilbert", "gpt2")
# Every head once, for the checkpoint round trips.
ONE_PER_HEAD = [case for model_type in MODEL_TYPES
                for case in hf.cases(model_type, sizes=("small",), problems=("multi",))]
# LM heads with their own decoder: saved, the decoder must stay separate.
UNTIED = [case for model_type in MODEL_TYPES for case in hf.variant_cases(model_type)
          if case.variant == "untied"]


def ids(case):
    return case.id


def vanishing_gradients(model) -> set[str]:
    """Parameters whose gradient is numerically zero (see hf_models.grad_errors)."""
    norms = {name: float(p.grad.norm()) if p.grad is not None else 0.0 for name, p in model.named_parameters()}
    scale = max(norms.values())
    return {name for name, norm in norms.items() if norm <= 1e-6 * scale}


@pytest.mark.parametrize("case", TRAINED, ids=ids)
def test_adamw_steps_match_torch(case):
    """20 AdamW steps on 4 batches (cycled), dropout off: the same loss at every step."""
    fusetrain = hf.fusetrain_module()
    batches = [hf.make_batch(case, seed=seed) for seed in range(4)]

    hf_model = hf.fresh_reference_model(case)
    torch_opt = torch.optim.AdamW(hf_model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    ft_model = hf.ft_from_reference(case)
    ft_opt = fusetrain.AdamW(ft_model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    hf_losses, ft_losses = [], []
    for step in range(STEPS):
        batch = batches[step % len(batches)]
        torch_opt.zero_grad()
        loss = hf_model(**hf.to_torch(batch)).loss
        loss.backward()
        if step == 0:
            irrelevant = vanishing_gradients(hf_model)
        torch_opt.step()
        hf_losses.append(loss.item())

        ft_loss, _ = ft_model.loss_and_grads(**batch)
        ft_opt.step()
        ft_losses.append(float(ft_loss))

    hf_losses, ft_losses = np.array(hf_losses), np.array(ft_losses)
    rel = np.abs(ft_losses - hf_losses) / np.abs(hf_losses)
    assert rel.max() < 1e-4, (
        f"{case.id}: loss diverges from torch; first bad step {int(np.argmax(rel >= 1e-4))}, "
        f"worst relative error {rel.max():.3g} at step {int(rel.argmax())}\n"
        f"  transformers {np.array2string(hf_losses, precision=6)}\n"
        f"  fusetrain    {np.array2string(ft_losses, precision=6)}")
    # The optimizer did something: the loss on batch 0 went down over the run.
    assert hf_losses[16] < hf_losses[0]

    # The parameters agree too; the loss alone barely sees weight decay (2e-5 of each
    # weight per step) or eps. Parameters whose gradient vanishes mathematically
    # (attention key biases, the key third of GPT-2's c_attn.bias) move by Adam-normalised
    # rounding noise and cannot affect any output, so they are left out.
    ft_state = ft_model.state_dict()
    errors = []
    for name, want in hf.hf_state_dict(hf_model).items():
        if name in irrelevant:
            continue
        got = np.asarray(ft_state[name], dtype=np.float64)
        if name.endswith("attn.c_attn.bias"):  # GPT-2's fused (query, key, value) bias
            query, _, value = np.split(got, 3)
            got = np.concatenate([query, value])
            query, _, value = np.split(want, 3)
            want = np.concatenate([query, value])
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        if rel > 1e-4:
            errors.append(f"{name}: relative error {rel:.3g}")
    assert not errors, f"{case.id}: parameters after {STEPS} steps differ:\n  " + "\n  ".join(errors)

    # Afterwards the models still agree on a fresh batch.
    batch = hf.without_labels(hf.make_batch(case, seed=99))
    hf.assert_logits_match(case, ft_model.forward(**batch), hf.hf_outputs(hf_model, batch),
                           rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("case", ONE_PER_HEAD, ids=ids)
def test_state_dict_matches_transformers(case):
    """state_dict() holds every name of transformers' state_dict() (tied names
    included) with the checkpoint's values."""
    want = hf.hf_state_dict(hf.reference_model(case))
    got = hf.ft_from_reference(case).state_dict()
    assert set(got) == set(want), (f"missing {sorted(set(want) - set(got))}, "
                                   f"unexpected {sorted(set(got) - set(want))}")
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)


@pytest.mark.parametrize("case", ONE_PER_HEAD + UNTIED, ids=ids)
def test_save_pretrained_loads_in_transformers(case, tmp_path):
    """Weights set through load_state_dict, saved by fusetrain, load in transformers'
    Auto class with nothing missing or unexpected, and give fusetrain's logits."""
    fusetrain = hf.fusetrain_module()
    other = hf.build_hf_model(case, seed=7)  # different weights than the checkpoint
    try:
        ft_model = fusetrain.Model.from_pretrained(hf.reference_dir(case))
    except ValueError:
        if case.variant and hf.VARIANTS[case.variant].may_refuse:
            pytest.skip(f"fusetrain refuses {case.variant} (checked by test_config_variants)")
        raise
    ft_model.load_state_dict(hf.hf_state_dict(other))

    out = tmp_path / "saved"
    ft_model.save_pretrained(str(out))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    auto = getattr(transformers, hf.AUTO_CLASSES[case.task])
    loaded, info = auto.from_pretrained(str(out), output_loading_info=True, attn_implementation="eager")
    loaded.eval()
    assert type(loaded).__name__ == case.architecture
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], f"{case.id}: transformers reports {kind} {info[kind]}"
    assert loaded.config.num_labels == other.config.num_labels
    assert loaded.config.problem_type == other.config.problem_type

    loaded_state = hf.hf_state_dict(loaded)
    for name, value in hf.hf_state_dict(other).items():
        np.testing.assert_array_equal(loaded_state[name], value, err_msg=name)
    batch = hf.without_labels(hf.make_batch(case))
    hf.assert_logits_match(case, ft_model.forward(**batch), hf.hf_outputs(loaded, batch))


@pytest.mark.parametrize("case", [hf.Case("BertForSequenceClassification", "odd", "single"),
                                  hf.Case("GPT2LMHeadModel", "odd")], ids=ids)
def test_load_state_dict_then_forward(case):
    """load_state_dict with another model's weights gives that model's outputs."""
    other = hf.build_hf_model(case, seed=3)
    ft_model = hf.ft_from_reference(case)
    ft_model.load_state_dict(hf.hf_state_dict(other))
    batch = hf.without_labels(hf.make_batch(case))
    hf.assert_logits_match(case, ft_model.forward(**batch), hf.hf_outputs(other, batch))


def test_bf16_checkpoint_loads_as_float32(tmp_path):
    case = hf.Case("BertForTokenClassification", "small")
    model = hf.build_hf_model(case).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ft_model = hf.fusetrain_module().Model.from_pretrained(str(tmp_path))
    state = ft_model.state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(state[name]), value.float().numpy(), err_msg=name)
    batch = hf.without_labels(hf.make_batch(case))
    hf.assert_logits_match(case, ft_model.forward(**batch), hf.hf_outputs(model.float(), batch))


def test_pretrained_body_with_a_new_head():
    """A BertModel checkpoint loads as BertForSequenceClassification (config override
    num_labels=3): the body keeps its weights, the head is freshly initialised."""
    base = hf.Case("BertModel", "small")
    ft_model = hf.fusetrain_module().Model.from_pretrained(
        hf.reference_dir(base), architecture="BertForSequenceClassification", num_labels=3)
    assert sorted(ft_model.missing_keys) == ["classifier.bias", "classifier.weight"]
    state = ft_model.state_dict()
    assert np.asarray(state["classifier.weight"]).shape == (3, hf.SIZES["small"].hidden)
    np.testing.assert_array_equal(np.asarray(state["classifier.bias"]), 0)
    for name, value in hf.hf_state_dict(hf.reference_model(base)).items():
        np.testing.assert_array_equal(np.asarray(state["bert." + name]), value, err_msg=name)
    batch = hf.make_batch(hf.Case("BertForSequenceClassification", "small", "single"))
    batch["labels"] = batch["labels"] % 3
    assert np.asarray(ft_model.forward(**batch)["logits"]).shape == (hf.BATCH, 3)
    assert np.isfinite(ft_model.loss_and_grads(**batch)[0])


@pytest.mark.parametrize("case", ONE_PER_HEAD, ids=ids)
def test_from_config_initialises_like_transformers(case, tmp_path):
    """from_config initialises as transformers does: the tensors transformers sets to
    constants (biases, LayerNorms) hold the same constants, padding rows are zero, and
    random tensors have transformers' scale (GPT-2 scales c_proj by 1/sqrt(2 n_layer));
    deterministic per seed; saved, it loads in transformers with the same logits."""
    fusetrain = hf.fusetrain_module()
    config = hf.hf_config(case).to_dict()
    ft_model = fusetrain.Model.from_config(config, seed=0, architecture=case.architecture)
    state = {name: np.asarray(v) for name, v in ft_model.state_dict().items()}
    reference = hf.hf_state_dict(hf.build_hf_model(case, perturb=False))
    assert set(state) == set(reference), (f"missing {sorted(set(reference) - set(state))}, "
                                          f"unexpected {sorted(set(state) - set(reference))}")
    for name, want in reference.items():
        got = state[name]
        assert got.shape == want.shape, f"{name}: shape {got.shape}, transformers {want.shape}"
        if np.all(want == want.flat[0]):
            np.testing.assert_array_equal(got, want.flat[0], err_msg=f"{name} is constant in transformers")
            continue
        if want.ndim == 2:
            zero_rows = np.flatnonzero(~want.any(axis=1))
            np.testing.assert_array_equal(got[zero_rows], 0, err_msg=f"{name}: padding rows {zero_rows}")
        if want.size >= 1000:
            standard_error = want.std() / np.sqrt(want.size)
            assert abs(got.mean()) < 5 * standard_error, f"{name}: mean {got.mean():.3g}, std {got.std():.3g}"
            assert 0.85 < got.std() / want.std() < 1.15, (
                f"{name}: std {got.std():.4g}, transformers {want.std():.4g}")

    again = fusetrain.Model.from_config(config, seed=0, architecture=case.architecture).state_dict()
    other = fusetrain.Model.from_config(config, seed=1, architecture=case.architecture).state_dict()
    weight = next(n for n in state if state[n].size >= 1000)
    np.testing.assert_array_equal(np.asarray(again[weight]), state[weight])
    assert not np.array_equal(np.asarray(other[weight]), state[weight])

    ft_model.save_pretrained(str(tmp_path))
    loaded = hf.load_hf(case, str(tmp_path))
    batch = hf.without_labels(hf.make_batch(case))
    hf.assert_logits_match(case, ft_model.forward(**batch), hf.hf_outputs(loaded, batch))


def test_from_config_accepts_a_path():
    case = hf.Case("GPT2LMHeadModel", "small")
    path = os.path.join(hf.reference_dir(case), "config.json")
    ft_model = hf.fusetrain_module().Model.from_config(path, seed=0)
    assert ft_model.config["n_embd"] == hf.SIZES["small"].hidden
    names = set(ft_model.state_dict())
    assert "transformer.wte.weight" in names and "lm_head.weight" in names


def test_config_round_trips(tmp_path):
    case = hf.Case("RobertaForSequenceClassification", "odd", "multi")
    ft_model = hf.ft_from_reference(case)
    assert ft_model.config["problem_type"] == "multi_label_classification"
    ft_model.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    original = json.loads(open(os.path.join(hf.reference_dir(case), "config.json")).read())
    for key in ("model_type", "architectures", "hidden_size", "num_attention_heads", "vocab_size",
                "id2label", "problem_type", "pad_token_id", "layer_norm_eps", "max_position_embeddings"):
        assert saved.get(key) == original.get(key), key


def test_train_mode_enables_dropout():
    """train() turns dropout on (outputs change from call to call), eval() turns it
    off again and restores parity."""
    case = hf.Case("BertForSequenceClassification", "small", "single")
    batch = hf.without_labels(hf.make_batch(case))
    ft_model = hf.ft_from_reference(case)
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    ft_model.train()
    first = np.asarray(ft_model.forward(**batch)["logits"]).copy()
    second = np.asarray(ft_model.forward(**batch)["logits"]).copy()
    assert not np.allclose(first, hf_out["logits"], atol=1e-3)
    assert not np.allclose(first, second, atol=1e-4)
    ft_model.eval()
    hf.assert_logits_match(case, ft_model.forward(**batch), hf_out)
