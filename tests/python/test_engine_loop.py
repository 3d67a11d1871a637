"""The engine loop's delegated mode, which fusetrain.Trainer drives: per-step reports, no files of its own,
steps over a partial last accumulation, resume at a step, and its optimizer state in and out."""

from __future__ import annotations

import numpy as np
import pytest

import fusetrain
from fusetrain import _core, data

CONFIG = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 64,
          "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
          "max_position_embeddings": 32, "num_labels": 2, "hidden_dropout_prob": 0.0,
          "attention_probs_dropout_prob": 0.0}


def model():
    return fusetrain.Model.from_config(CONFIG, seed=3)


def dataset(n=10):
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(1, 64, size=rng.integers(3, 9)).tolist(), "label": int(i % 2)}
            for i in range(n)]
    return data.to_engine(rows, task="seq-cls", num_labels=2, vocab_size=64)


def engine_args(tmp_path, **overrides):
    args = dict(_core._training_args_defaults())
    args.update(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                num_train_epochs=2, learning_rate=1e-2, lr_scheduler_type="linear", save_strategy="no",
                disable_tqdm=True, seed=1)
    args.update(overrides)
    return args


def run(engine, stop_after=None):
    reports = []

    def on_event(event, state, control, payload):
        if event == "on_step_end":
            reports.append(dict(state["last_step"], global_step=state["global_step"], epoch=state["epoch"]))
            if state["global_step"] == stop_after:
                return {"should_training_stop": True}
        return None

    engine.set_callbacks(on_event)
    engine.train()
    return reports


def test_delegated_loop_reports_each_step_and_writes_nothing(tmp_path):
    engine = _core._Trainer(model(), engine_args(tmp_path), "seq-cls", dataset(10), None)
    engine.set_delegated(True)
    reports = run(engine)
    # 5 batches of 2 with accumulation 2: steps of 2, 2 and 1 micro-batches per epoch, as transformers counts them.
    assert [r["micro_batches"] for r in reports] == [2, 2, 1, 2, 2, 1]
    assert [r["samples"] for r in reports] == [4, 4, 2, 4, 4, 2]
    assert [r["epoch"] for r in reports][2] == pytest.approx(1.0)
    # Linear decay over 6 steps, each step logged with the rate it applied (step k: lr * (1 - (k - 1) / 6)).
    assert [r["learning_rate"] for r in reports] == pytest.approx([1e-2 * (1 - k / 6) for k in range(6)])
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 and not r["skipped"] for r in reports)
    # A classifier's loss is a mean over examples: the counts transformers' num_items_in_batch would give.
    assert all(r["predicted"] == r["labelled"] == r["samples"] for r in reports)
    assert [r["loss_sum"] / r["predicted"] for r in reports] == pytest.approx([r["loss"] for r in reports])
    assert not (tmp_path / "out").exists()  # logging, evaluation and checkpoints are the caller's


def test_start_at_with_the_optimizer_state_continues_a_run_exactly(tmp_path):
    full = _core._Trainer(model(), engine_args(tmp_path), "seq-cls", dataset(10), None)
    full.set_delegated(True)
    reference = run(full)

    first = model()
    half = _core._Trainer(first, engine_args(tmp_path), "seq-cls", dataset(10), None)
    half.set_delegated(True)
    run(half, stop_after=3)  # a run stopped after its checkpoint at step 3
    state, weights = half.optimizer_state(), first.state_dict()
    assert state["optim"] == "adamw_torch" and state["step"] == 3
    assert set(state["states"]) == {"exp_avg", "exp_avg_sq"} and set(state["states"]["exp_avg"]) == set(weights)

    second = model()
    second.load_state_dict(weights)
    rest = _core._Trainer(second, engine_args(tmp_path), "seq-cls", dataset(10), None)
    rest.set_delegated(True)
    rest.set_optimizer_state(state["step"], state["states"])
    rest.start_at(3, half.dropout_step, 0)
    continued = run(rest)
    assert [r["loss"] for r in continued] == [r["loss"] for r in reference[3:]]
    assert [r["learning_rate"] for r in continued] == [r["learning_rate"] for r in reference[3:]]


def test_bad_optimizer_state_and_resume_points_are_refused(tmp_path):
    engine = _core._Trainer(model(), engine_args(tmp_path), "seq-cls", dataset(10), None)
    states = engine.optimizer_state()["states"]
    exp_avg = states["exp_avg"]
    name = next(iter(exp_avg))
    broken = dict(exp_avg, **{name: np.full_like(exp_avg[name], np.nan)})
    with pytest.raises(ValueError, match=f'exp_avg of "{name}" holds a non-finite value at element 0'):
        engine.set_optimizer_state(1, dict(states, exp_avg=broken))
    short = dict(exp_avg, **{name: exp_avg[name][:1]})
    with pytest.raises(ValueError, match=f'exp_avg of "{name}" needs .* values, found 1'):
        engine.set_optimizer_state(1, dict(states, exp_avg=short))
    missing = {k: v for k, v in exp_avg.items() if k != name}
    with pytest.raises(ValueError, match=f'no exp_avg for "{name}"'):
        engine.set_optimizer_state(1, dict(states, exp_avg=missing))
    with pytest.raises(ValueError, match='no "exp_avg_sq"'):
        engine.set_optimizer_state(1, {"exp_avg": exp_avg})
    with pytest.raises(ValueError, match="nonfinite_skipped_steps .5. <= global_step .2."):
        engine.start_at(2, 0, 5)
    engine.start_at(99)
    with pytest.raises(ValueError, match="resumes at step 99 but ends at step 6"):
        engine.train()
