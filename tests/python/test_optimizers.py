"""Optimizers and their parameter groups against transformers' Trainer and torch.optim.

Weight decay: which parameters decay is transformers' Trainer.get_decay_parameter_names, for every architecture the
engine builds (here) and every captured one (test_capture.py); the Python Trainer hands transformers' own choice to
the engine, the CLI applies the same rules (Model.decays).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_models as hf  # noqa: E402

fusetrain = hf.fusetrain_module()
T = transformers

_DECODER = dict(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
_ENCODER = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=40)
# Every architecture class the engine builds, from a small config.
NATIVE = {
    **{cls: lambda: T.BertConfig(**_ENCODER) for cls in ("BertForMaskedLM", "BertForSequenceClassification",
                                                         "BertForTokenClassification", "BertForQuestionAnswering")},
    **{cls: lambda: T.RobertaConfig(**_ENCODER, pad_token_id=1)
       for cls in ("RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForTokenClassification",
                   "RobertaForQuestionAnswering")},
    **{cls: lambda: T.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                       max_position_embeddings=40)
       for cls in ("DistilBertForMaskedLM", "DistilBertForSequenceClassification")},
    **{cls: lambda: T.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=40, pad_token_id=0)
       for cls in ("GPT2LMHeadModel", "GPT2ForSequenceClassification")},
    "LlamaForCausalLM": lambda: T.LlamaConfig(**_DECODER, attention_bias=True, mlp_bias=True),
    "LlamaForSequenceClassification": lambda: T.LlamaConfig(**_DECODER),
    "MistralForCausalLM": lambda: T.MistralConfig(**_DECODER),
    "Qwen2ForCausalLM": lambda: T.Qwen2Config(**_DECODER),
}


def transformers_decays(model) -> set[str]:
    """The parameter names transformers' Trainer decays (its method reads nothing of the Trainer itself)."""
    return set(T.Trainer.get_decay_parameter_names(None, model))


def test_every_native_architecture_is_covered():
    from fusetrain import trainer
    assert set(NATIVE) == set(trainer.supported_trainer_classes())


@pytest.mark.parametrize("architecture", sorted(NATIVE))
def test_native_decay_groups_are_transformers(architecture, tmp_path):
    torch.manual_seed(0)
    model = getattr(T, architecture)(NATIVE[architecture]())
    model.save_pretrained(tmp_path)
    engine = fusetrain.Model.from_pretrained(str(tmp_path))
    names = engine.trainable_names()
    assert set(names) <= set(dict(model.named_parameters(remove_duplicate=False)))
    want = transformers_decays(model)
    wrong = sorted(n for n in names if engine.decays(n) != (n in want))
    assert not wrong, f"{architecture}: decay differs from transformers' for {wrong}"
    assert any(engine.decays(n) for n in names) and not all(engine.decays(n) for n in names)


def test_set_decayed_overrides_the_rule_and_refuses_unknown_names(tmp_path):
    torch.manual_seed(0)
    T.LlamaForCausalLM(NATIVE["LlamaForCausalLM"]()).save_pretrained(tmp_path)
    engine = fusetrain.Model.from_pretrained(str(tmp_path))
    engine.set_decayed({"model.norm.weight"})
    assert [n for n in engine.trainable_names() if engine.decays(n)] == ["model.norm.weight"]
    with pytest.raises(ValueError, match='"model.nonexistent.weight", which is not a trained parameter'):
        engine.set_decayed({"model.nonexistent.weight"})


def _llama_rows(rows: int = 4, length: int = 12) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    ids = rng.integers(1, 101, size=(rows, length))
    return [{"input_ids": r, "attention_mask": np.ones_like(r), "labels": r.copy()} for r in ids]


def _train_llama(trainer_cls, args_cls, path, out, **extra):
    model = T.LlamaForCausalLM.from_pretrained(path).float()
    # One batch of all 4 rows per step: the samplers' orders cannot make the steps differ.
    args = args_cls(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-3, max_steps=20,
                    logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                    lr_scheduler_type="constant", weight_decay=0.1, **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=_llama_rows())
    trainer.train()
    return model, [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_trainer_decays_a_llama_as_transformers_trainer_does(tmp_path):
    """20 AdamW steps with weight_decay 0.1 (lr 1e-3): every logged loss and every weight within 1e-5 relative
    (norm-wise per tensor) of transformers' Trainer. Decaying the norm weights
    (as the engine did before it followed transformers' groups) moves them 2e-3 relative over these steps, 200x the
    tolerance."""
    torch.manual_seed(0)
    config = T.LlamaConfig(**_DECODER)
    reference = T.LlamaForCausalLM(config)
    hf.perturb_(reference, 0, scale=0.02)
    reference.save_pretrained(tmp_path / "start")
    ours, ours_losses = _train_llama(fusetrain.Trainer, fusetrain.TrainingArguments, tmp_path / "start",
                                     tmp_path / "ours", fusetrain_require_engine=True)
    theirs, theirs_losses = _train_llama(T.Trainer, T.TrainingArguments, tmp_path / "start", tmp_path / "theirs")
    assert len(ours_losses) == len(theirs_losses) == 20
    np.testing.assert_allclose(ours_losses, theirs_losses, rtol=1e-5)
    theirs_weights = dict(theirs.named_parameters())
    errors = {}
    for name, param in ours.named_parameters():
        want = theirs_weights[name].detach().numpy()
        errors[name] = float(np.linalg.norm(param.detach().numpy() - want) / np.linalg.norm(want))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: {errors[worst]:.2e} relative"
