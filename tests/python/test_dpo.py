"""fusetrain.trl's DPOTrainer against TRL's own DPOTrainer on PyTorch: the same data and order, one import apart.

Tolerances. The loss, the gradients and the sequence log-probabilities are f32 sums taken in another order (the
engine's chunked LM head against PyTorch's): within 1e-4 relative (their observed error is ~1e-6, compounding through
the AdamW updates over the steps). The rewards are β·(log p − log p_ref), the difference of two f32 sums of hundreds
of token log-probabilities each: their error is that of the sums (~1e-7·|log p|), so they are compared within 1e-4 of
β·|log p| (a relative comparison of a near-zero difference would measure only the cancellation). A reward accuracy
counts chosen > rejected: it is compared where the margin exceeds that error.

A small Llama (odd sizes, grouped-query attention) with a byte-level BPE tokenizer trained on Tiny Shakespeare,
prompts of 1-5 lines, completions of 1-9."""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("trl")
import datasets  # noqa: E402
import trl  # noqa: E402

import hf_models as hf  # noqa: E402
import test_trl  # noqa: E402

fusetrain = hf.fusetrain_module()
from fusetrain import trl as ft_trl  # noqa: E402
from fusetrain.trainer import engine_model, hf_parameter  # noqa: E402

STEPS = 6


from test_trl import model_dir  # noqa: E402,F401  (the same small Llama and tokenizer as the SFT tests)


def preference_dataset(n: int = 32, seed: int = 2) -> datasets.Dataset:
    """Prompts continued by their own next lines (chosen) or by lines from elsewhere (rejected)."""
    lines = test_trl.SHAKESPEARE.read_text().splitlines()
    rng = np.random.default_rng(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        start, other = int(rng.integers(0, 20000)), int(rng.integers(0, 20000))
        rows["prompt"].append("\n".join(lines[start:start + int(rng.integers(1, 6))]))
        rows["chosen"].append("\n".join(lines[start + 6:start + 6 + int(rng.integers(1, 10))]))
        rows["rejected"].append("\n".join(lines[other:other + int(rng.integers(1, 10))]))
    return datasets.Dataset.from_dict(rows)


def lora_config():
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def make_trainer(trainer_class, config_class, model_dir, tmp_path, lora: bool, **settings):
    args = config_class(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                        logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                        train_sampling_strategy="sequential", max_length=256, **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ref = None  # LoRA: the base is the reference; precomputed: TRL computes them with the model before training
    if not lora and not settings.get("precompute_ref_log_probs"):
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    return trainer_class(model=model, ref_model=ref, args=args, train_dataset=preference_dataset(),
                         processing_class=tokenizer, peft_config=lora_config() if lora else None)


def close(ours, theirs, tolerance, scale=None):
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    scale = np.abs(theirs) if scale is None else scale
    return bool(np.all(np.abs(ours - theirs) <= tolerance * scale)), np.max(np.abs(ours - theirs) / scale)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_loss_rewards_and_every_gradient_match_trl(lora, model_dir, tmp_path):
    """One batch of 4 pairs: TRL's compute_loss and backward on PyTorch against the engine's preference program (the
    reference: the base without the adapters, or TRL's frozen ref_model), every trainable gradient."""
    theirs = make_trainer(trl.DPOTrainer, trl.DPOConfig, model_dir, tmp_path / "trl", lora)
    ours = make_trainer(ft_trl.DPOTrainer, ft_trl.DPOConfig, model_dir, tmp_path / "ours", lora)
    batch = next(iter(theirs.get_train_dataloader()))
    theirs.model.train()
    loss = theirs.compute_loss(theirs.model, batch)
    loss.backward()
    engine = ours._engine_ready_model()
    engine.train()
    our_loss, grads = engine.loss_and_grads(**ours._preference_batch(batch))
    assert abs(our_loss - loss.item()) <= 1e-4 * abs(loss.item()), (our_loss, loss.item())
    trainable = engine.trainable_names()
    assert len(grads) == len(trainable) and (not lora or all("lora_" in name for name in trainable))
    for name in trainable:
        want = hf_parameter(theirs.model, name).grad.numpy()
        err = np.linalg.norm(grads[name] - want) / max(np.linalg.norm(want), 1e-30)
        assert err < 1e-4, (name, err)
    # The sequence log-probabilities and the rewards TRL logged for this batch.
    stats = engine.last_preference_stats()
    beta, pairs = theirs.beta, len(stats["logps"]) // 2
    logps, ref = np.array(stats["logps"]), np.array(stats["ref_logps"])
    metrics = {k: v[-1] for k, v in theirs._metrics["train"].items()}
    rewards = beta * (logps - ref)
    assert close(logps[:pairs].mean(), metrics["logps/chosen"], 1e-4)[0]
    assert close(logps[pairs:].mean(), metrics["logps/rejected"], 1e-4)[0]
    scale = beta * np.abs(logps).max()
    assert close(rewards[:pairs].mean(), metrics["rewards/chosen"], 1e-4, scale)[0]
    assert close(rewards[pairs:].mean(), metrics["rewards/rejected"], 1e-4, scale)[0]


def test_the_loss_reads_which_half_is_chosen(model_dir, tmp_path):
    """The checks above can fail: with the chosen and rejected halves of the batch swapped, the loss differs (a
    reference of 0 makes the margins those of the policy's own log-probabilities)."""
    ours = make_trainer(ft_trl.DPOTrainer, ft_trl.DPOConfig, model_dir, tmp_path, lora=False)
    batch = ours._preference_batch(next(iter(ours.get_train_dataloader())))
    engine = ours._engine_ready_model()
    batch["ref_logps"] = np.zeros(8, np.float32)
    loss = engine.forward(**batch)["loss"]
    order = [4, 5, 6, 7, 0, 1, 2, 3]
    swapped = {k: v[order] for k, v in batch.items()}
    assert abs(engine.forward(**swapped)["loss"] - loss) > 1e-2 * loss


@pytest.mark.parametrize("case", [
    pytest.param({"lora": True}, id="lora-sigmoid"),
    pytest.param({"lora": False}, id="full-ref-model"),
    pytest.param({"lora": False, "precompute_ref_log_probs": True}, id="full-precomputed"),
    pytest.param({"lora": True, "loss_type": ["ipo"]}, id="lora-ipo"),
])
def test_training_matches_trl_over_steps(case, model_dir, tmp_path):
    """TRL's DPOTrainer and fusetrain's over 6 steps: every logged metric, with TRL's keys."""
    settings = dict(case)
    lora = settings.pop("lora")
    theirs = make_trainer(trl.DPOTrainer, trl.DPOConfig, model_dir, tmp_path / "trl", lora, **settings)
    theirs.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusetrain: training runs with")  # a fallback fails the test
        ours = make_trainer(ft_trl.DPOTrainer, ft_trl.DPOConfig, model_dir, tmp_path / "ours", lora, **settings)
        ours.train()
    logs = [[e for e in t.state.log_history if "loss" in e] for t in (ours, theirs)]
    assert len(logs[0]) == len(logs[1]) == STEPS
    assert [set(e) for e in logs[0]] == [set(e) for e in logs[1]]  # the same metric keys
    series = {k: np.array([[e[k] for e in log] for log in logs]) for k in logs[1][0]}
    for key in ("loss", "grad_norm", "entropy", "logps/chosen", "logps/rejected"):
        ok, err = close(series[key][0], series[key][1], 1e-4)
        assert ok, (key, err, series[key])
    for key in ("logits/chosen", "logits/rejected"):  # means of logits near 0: relative to their spread
        ok, err = close(series[key][0], series[key][1], 1e-4, np.abs(series[key][1]).max())
        assert ok, (key, err, series[key])
    scale = theirs.beta * np.abs(series["logps/chosen"][1]).max()
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        ok, err = close(series[key][0], series[key][1], 1e-4, scale)
        assert ok, (key, err, series[key])
    decided = np.abs(series["rewards/margins"][1]) > 1e-3 * scale
    assert np.array_equal(series["rewards/accuracies"][0][decided], series["rewards/accuracies"][1][decided])
    assert np.abs(series["mean_token_accuracy"][0] - series["mean_token_accuracy"][1]).max() <= 1e-6
    assert np.array_equal(series["num_tokens"][0], series["num_tokens"][1])


def test_unsupported_settings_fall_back_to_trl_naming_the_cause(model_dir, tmp_path):
    trainer = make_trainer(ft_trl.DPOTrainer, ft_trl.DPOConfig, model_dir, tmp_path, lora=True,
                           loss_type=["robust"])
    assert "loss_type ['robust']" in trainer.engine_refusal()
    trainer.args.max_steps = 1
    with pytest.warns(UserWarning, match=r"fusetrain: training runs with transformers' own loop.*robust"):
        trainer.train()


def test_engine_refuses_bad_preference_input(model_dir, tmp_path):
    ours = make_trainer(ft_trl.DPOTrainer, ft_trl.DPOConfig, model_dir, tmp_path, lora=True)
    engine = ours._engine_ready_model()
    batch = ours._preference_batch(next(iter(ours.get_train_dataloader())))
    with pytest.raises(ValueError, match=r"ref_logps must be float32 of shape \(8,\)"):
        engine.forward(**batch, ref_logps=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="ref_logps: value nan at sequence 0 is not finite"):
        engine.forward(**batch, ref_logps=np.full(8, np.nan, np.float32))
    with pytest.raises(ValueError, match=r"logps should be \(2P\)"):
        engine.forward(**{k: v[:3] for k, v in batch.items()})
    plain = engine_model(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    plain.set_preference("sigmoid", 0.1)
    with pytest.raises(ValueError, match="a preference loss compares against reference log-probabilities"):
        plain.forward(**batch)
    with pytest.raises(ValueError, match='loss_type "robust"'):
        plain.set_preference("robust", 0.1)


# ---------------------------------------------------------------- TRL's own script, the command line

def preference_data_dir(root: pathlib.Path) -> pathlib.Path:
    """train.jsonl of conversational preference pairs (a dataset directory load_dataset reads as it is)."""
    out = root / "pref-data"
    out.mkdir()
    lines = test_trl.SHAKESPEARE.read_text().splitlines()
    rng = np.random.default_rng(0)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(32):
            start, other = int(rng.integers(0, 20000)), int(rng.integers(0, 20000))
            turn = lambda role, at, n: [{"role": role, "content": "\n".join(lines[at:at + n])}]  # noqa: E731
            f.write(json.dumps({"prompt": turn("user", start, int(rng.integers(1, 4))),
                                "chosen": turn("assistant", start + 4, int(rng.integers(2, 12))),
                                "rejected": turn("assistant", other, int(rng.integers(2, 12)))}) + "\n")
    return out


def test_trl_dpo_script_runs_with_one_import_line_changed(tmp_path):
    """TRL's own trl/scripts/dpo.py (read from the installed package), once as it is and once with its
    `from trl import ...` line naming fusetrain.trl: both train a small chat model with LoRA on local JSON Lines
    preference pairs, and write the same files and metric keys."""
    source = pathlib.Path(trl.__file__).parent / "scripts" / "dpo.py"
    text = source.read_text()
    line = "from trl import DPOTrainer, get_dataset, get_peft_config, get_quantization_config"
    assert text.count(line) == 1
    ours = tmp_path / "dpo_fusetrain.py"
    ours.write_text(text.replace(line, line.replace("from trl import", "from fusetrain.trl import")))
    model, data = test_trl.chat_model_dir(tmp_path), preference_data_dir(tmp_path)
    outputs = {}
    for name, script in (("trl", str(source)), ("fusetrain", str(ours))):
        out = tmp_path / f"out-{name}"
        result = test_trl.run_trl_script(script, [
            "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            "--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "4", "--learning_rate", "1e-3",
            "--logging_steps", "2", "--save_steps", "4", "--use_cpu", "--bf16", "False", "--report_to", "none",
            "--seed", "0", "--use_peft", "--lora_r", "8", "--lora_alpha", "16"], tmp_path)
        if name == "fusetrain":
            assert "runs with transformers' own loop" not in result.stderr  # no fallback
        state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
        outputs[name] = (sorted(p.name for p in out.iterdir()), sorted(p.name for p in (out / "checkpoint-4").iterdir()),
                         [sorted(e) for e in state["log_history"]], state["log_history"])
    ours_files, theirs_files = outputs["fusetrain"], outputs["trl"]
    assert ours_files[0] == theirs_files[0]
    assert ours_files[1] == sorted(theirs_files[1] + ["fusetrain_state.json"])
    assert ours_files[2] == theirs_files[2]  # the metric keys of every log entry
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected"} <= set(ours_files[3][0])
    # The engine's sampler draws another order than torch's RandomSampler: the losses are compared over the same
    # order in test_training_matches_trl_over_steps, here only checked to be there.
    losses = [e["loss"] for e in ours_files[3] if "loss" in e]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_command_line_dpo_trains_from_json_lines(tmp_path):
    """`python -m fusetrain train --task dpo`: a chat model's directory and JSON Lines preference pairs, with LoRA;
    TRL's files come out. Data without the pairs' fields is one error."""
    import os
    import subprocess
    import sys

    model, data = test_trl.chat_model_dir(tmp_path), preference_data_dir(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "fusetrain", "train", "--task", "dpo", "--model", str(model), "--train-file",
               str(data / "train.jsonl"), "--output-dir", str(out), "--max-seq-length", "256", "--max-steps", "3",
               "--logging-steps", "1", "--per-device-train-batch-size", "2", "--lora-r", "8", "--beta", "0.2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == 3 and np.isfinite(summary["train_loss"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert "runs with transformers' own loop" not in result.stderr
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    bad = [sys.executable, "-m", "fusetrain", "train", "--task", "dpo", "--model", str(model), "--train-file",
           str(tmp_path / "bad.jsonl")]
    result = subprocess.run(bad, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2 and '"prompt", "chosen" and "rejected"' in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
