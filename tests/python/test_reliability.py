"""Reliability at the command line: a diverging run never saves a poisoned checkpoint, inputs are checked at the
boundary with one clear line, saves killed at any moment leave only complete checkpoints that resume bit for bit,
and a full disk fails the save without touching earlier checkpoints."""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import safetensors.numpy

from cli_support import CLI, data, error_line, run, tiny_model, train_args  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is not built (bash scripts/build.sh)")


def checkpoints(output: pathlib.Path) -> list[pathlib.Path]:
    if not output.exists():  # a run killed before it made its output directory
        return []
    found = [p for p in output.iterdir() if p.name.startswith("checkpoint-") and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def weights(directory: pathlib.Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(directory / "model.safetensors"))


def leftovers(output: pathlib.Path) -> list[str]:
    """What an interrupted save can leave: staging directories, temporary files, replaced checkpoints."""
    return sorted(p.name for p in output.iterdir() if ".tmp-" in p.name or p.name.endswith(".old"))


# ---- 1. a diverging run ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16"]], ids=["fp32", "bf16", "fp16"])
def test_diverging_run_skips_steps_stops_and_saves_no_poisoned_checkpoint(tiny_model, data, tmp_path, precision):
    """A learning rate of 1e8 sends the loss to NaN after the first update. Those steps are
    skipped and logged, the third in a row stops the run naming the last checkpoint saved before them, and every
    checkpoint on disk holds finite weights, unchanged by the skipped steps."""
    output = tmp_path / "out"
    result = run(*train_args(tiny_model, data, output, "--max-steps", "10", "--save-steps", "1", "--learning-rate",
                             "1e8", *precision))
    line = error_line(result)
    log = [json.loads(entry) for entry in (output / "log.jsonl").read_text().splitlines()]
    skipped = [entry["step"] for entry in log if "skipped_step" in entry]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3)), log
    first_bad = skipped[0]
    assert f"3 steps in a row ({first_bad} to {first_bad + 2})" in line, line
    assert f"last good checkpoint is {output / f'checkpoint-{first_bad - 1}'}" in line, line
    assert not (output / "model.safetensors").exists(), "a stopped run writes no final model"
    saved = checkpoints(output)
    assert [int(p.name.split("-")[1]) for p in saved] == list(range(1, first_bad + 2))
    good = weights(output / f"checkpoint-{first_bad - 1}")
    for checkpoint in saved:
        for name, value in weights(checkpoint).items():
            assert np.isfinite(value).all(), f"{checkpoint.name}: {name} is not finite"
            if int(checkpoint.name.split("-")[1]) >= first_bad:  # skipped steps left the weights alone
                np.testing.assert_array_equal(value, good[name], err_msg=f"{checkpoint.name}: {name}")
    assert leftovers(output) == []


def test_nonfinite_step_limit_is_a_flag(tiny_model, data, tmp_path):
    output = tmp_path / "out"
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "10", "--save-strategy", "no",
                                      "--learning-rate", "1e8", "--fusetrain-max-nonfinite-steps", "1")))
    assert "1 steps in a row (2 to 2)" in line and "no checkpoint was saved before them" in line, line


def test_an_update_that_overflows_the_weights_is_never_saved(tiny_model, data, tmp_path):
    """A learning rate past f32's range makes the first update itself infinite; the save that follows refuses the
    weights as it writes them and leaves nothing behind."""
    output = tmp_path / "out"
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "3", "--save-steps", "1",
                                      "--learning-rate", "1e39")))
    assert "checkpoint-1 was not saved" in line and "holds a non-finite value" in line, line
    assert checkpoints(output) == [] and leftovers(output) == []


@pytest.fixture(scope="module")
def poisoned(tiny_model, tmp_path_factory) -> pathlib.Path:
    """tiny_model with one NaN in a query weight."""
    out = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(tiny_model, out)
    tensors = weights(out)
    name = "bert.encoder.layer.1.attention.self.query.weight"
    tensors[name][3, 5] = np.nan
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


NAMED = 'tensor "bert.encoder.layer.1.attention.self.query.weight" holds a non-finite value at element 101'


@pytest.mark.parametrize("command", ["evaluate", "predict", "train"])
def test_non_finite_weights_are_refused_naming_the_tensor(poisoned, data, tmp_path, command):
    args = {"evaluate": ["evaluate", "--model", str(poisoned), "--eval-file", str(data["dev"])],
            "predict": ["predict", "--model", str(poisoned), "--test-file", str(data["dev"]), "--output",
                        str(tmp_path / "p.tsv")],
            "train": train_args(poisoned, data, tmp_path / "out", "--max-steps", "1")}[command]
    line = error_line(run(*args, *([] if command == "train" else ["--max-seq-length", "32"])))
    assert NAMED in line and "model.safetensors" in line, line
    assert not (tmp_path / "p.tsv").exists()


def test_resume_refuses_non_finite_weights_and_optimizer_state(tiny_model, poisoned, data, tmp_path):
    output = tmp_path / "out"
    assert run(*train_args(tiny_model, data, output, "--max-steps", "2", "--save-steps", "1")).returncode == 0
    checkpoint = output / "checkpoint-1"
    shutil.copy(poisoned / "model.safetensors", checkpoint / "model.safetensors")
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "3",
                                      "--resume-from-checkpoint", str(checkpoint))))
    assert NAMED in line, line

    checkpoint = output / "checkpoint-2"
    moments = safetensors.numpy.load_file(str(checkpoint / "optimizer.safetensors"))
    with open(checkpoint / "optimizer.safetensors", "rb") as f:
        metadata = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    moments["exp_avg_sq"][7] = np.inf
    safetensors.numpy.save_file(moments, str(checkpoint / "optimizer.safetensors"), metadata=metadata)
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "3",
                                      "--resume-from-checkpoint", str(checkpoint))))
    assert '"exp_avg_sq" holds a non-finite value at element 7' in line, line


def test_python_from_pretrained_refuses_non_finite_weights(poisoned):
    import fusetrain

    with pytest.raises(ValueError, match=NAMED):
        fusetrain.Model.from_pretrained(str(poisoned))


# ---- 2. attention masks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [7, 2, -1])
def test_attention_mask_values_other_than_0_and_1_are_refused(tiny_model, value):
    import fusetrain

    model = fusetrain.Model.from_pretrained(str(tiny_model))
    ids = np.array([[101, 2023, 2003, 102]])
    mask = np.array([[1, 1, value, 1]])
    with pytest.raises(ValueError, match=rf"attention_mask: value {value} at \(0, 2\); expected 1 .* and 0"):
        model.forward(input_ids=ids, attention_mask=mask)
    assert np.isfinite(model.forward(input_ids=ids, attention_mask=np.array([[1, 1, 0, 1]]))["logits"]).all()


# ---- 3. resume fields -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tiny_model, data, tmp_path_factory) -> pathlib.Path:
    output = tmp_path_factory.mktemp("finished") / "out"
    assert run(*train_args(tiny_model, data, output, "--max-steps", "2", "--save-steps", "1")).returncode == 0
    return output


@pytest.mark.parametrize("edit,expect", [
    ({"global_step": -7}, '"global_step" is -7, expected at least 0'),
    ({"global_step": 50}, '"global_step" is 50 but this run ends at step 3, so the checkpoint is from a longer run'),
    ({"global_step": "three"}, '"global_step" should be an integer, found "three"'),
    ({"epoch": 9.0}, '"epoch" is 9, more than its "global_step" 1 allows'),
    ({"log_history": {}}, '"log_history" should be an array'),
], ids=["negative_step", "past_max_steps", "step_not_a_number", "epoch_too_large", "log_history_not_a_list"])
def test_resume_fields_are_range_checked(tiny_model, data, finished_run, tmp_path, edit, expect):
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(finished_run / "checkpoint-1", checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, **edit}))
    output = tmp_path / "out"
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "3",
                                      "--resume-from-checkpoint", str(checkpoint))))
    assert f"{checkpoint / 'trainer_state.json'}: {expect}" in line, line
    assert not (output / "log.jsonl").exists(), "nothing ran"


def test_resume_refuses_an_optimizer_step_count_past_the_global_step(tiny_model, data, finished_run, tmp_path):
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(finished_run / "checkpoint-1", checkpoint)
    moments = safetensors.numpy.load_file(str(checkpoint / "optimizer.safetensors"))
    safetensors.numpy.save_file(moments, str(checkpoint / "optimizer.safetensors"),
                                metadata={"step": "40", "optimizer": "AdamW"})
    line = error_line(run(*train_args(tiny_model, data, tmp_path / "out", "--max-steps", "3",
                                      "--resume-from-checkpoint", str(checkpoint))))
    assert 'the metadata "step" (the optimizer\'s update count) should be an integer in [0, 1]' in line, line


# ---- 4. labels --------------------------------------------------------------------------------------------------


def test_a_stray_class_id_is_refused_unless_num_labels_is_given(tiny_model, data, tmp_path):
    headless = tmp_path / "headless"  # tiny_model without its 2-class classifier, which 1001 classes replace
    shutil.copytree(tiny_model, headless)
    tensors = {k: v for k, v in weights(headless).items() if not k.startswith("classifier.")}
    safetensors.numpy.save_file(tensors, str(headless / "model.safetensors"), metadata={"format": "pt"})
    rows = data["train"].read_text().splitlines()
    train = tmp_path / "train.tsv"
    train.write_text("\n".join(rows[:40] + ["1000\tone row from another label set"]) + "\n")
    line = error_line(run(*train_args(headless, {"train": train}, tmp_path / "out", "--max-steps", "1")))
    assert "the labels are not the contiguous class ids 0 .. 1000 (seen: 0, 1, 1000)" in line, line
    assert "--num-labels 1001" in line
    given = run(*train_args(headless, {"train": train}, tmp_path / "out", "--max-steps", "1", "--num-labels", "1001"))
    assert given.returncode == 0, given.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_labels"] == 1001


# ---- 5. unfinished saves ----------------------------------------------------------------------------------------


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_unfinished_saves_of_gone_processes_are_removed(tiny_model, data, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    gone = dead_pid()
    (output / f".checkpoint-3.tmp-{gone}").mkdir()
    (output / f".checkpoint-3.tmp-{gone}" / "model.safetensors").write_bytes(b"\0" * 1000)
    (output / f"model.safetensors.tmp-{gone}").write_bytes(b"\0" * 100)
    live = output / f".checkpoint-9.tmp-{os.getpid()}"  # a save still in progress in another process
    live.mkdir()
    result = run(*train_args(tiny_model, data, output, "--max-steps", "1", "--save-strategy", "no"))
    assert result.returncode == 0, result.stderr
    assert f"cleaned up after an interrupted save" in result.stderr
    assert leftovers(output) == [live.name]


def test_a_save_stopped_between_its_renames_is_put_back(tiny_model, data, tmp_path):
    output = tmp_path / "out"
    assert run(*train_args(tiny_model, data, output, "--max-steps", "2", "--save-steps", "1")).returncode == 0
    (output / "checkpoint-2").rename(output / "checkpoint-2.old")  # the first rename of a re-save, then a kill
    result = run(*train_args(tiny_model, data, output, "--max-steps", "1", "--save-strategy", "no"))
    assert result.returncode == 0, result.stderr
    assert (output / "checkpoint-2" / "model.safetensors").exists() and leftovers(output) == []


# ---- 6. messages ------------------------------------------------------------------------------------------------


def edited_model(tiny_model: pathlib.Path, tmp_path: pathlib.Path, **config) -> pathlib.Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), **config}))
    return out


@pytest.mark.parametrize("config,expect", [
    ({"layer_norm_eps": -1}, 'config.json: "layer_norm_eps" is -1, expected a positive number'),
    ({"hidden_dropout_prob": 2}, 'config.json: "hidden_dropout_prob" is 2, expected a dropout probability in [0, 1)'),
    ({"attention_probs_dropout_prob": -0.5}, '"attention_probs_dropout_prob" is -0.5, expected a dropout'),
    ({"hidden_size": "wide"}, 'config.json: "hidden_size" should be an integer, found "wide"'),
], ids=["eps", "hidden_dropout", "attention_dropout", "hidden_size_type"])
def test_config_errors_name_the_field(tiny_model, data, tmp_path, config, expect):
    model = edited_model(tiny_model, tmp_path, **config)
    line = error_line(run("evaluate", "--model", str(model), "--eval-file", str(data["dev"]), "--max-seq-length", "32"))
    assert expect in line, line
    assert "LayerNorm" not in line.split(expect)[0] and "json.exception" not in line


def test_a_config_that_is_not_an_object_names_the_file(tiny_model, data, tmp_path):
    model = edited_model(tiny_model, tmp_path)
    (model / "config.json").write_text("[1, 2]")
    line = error_line(run("evaluate", "--model", str(model), "--eval-file", str(data["dev"])))
    assert line.endswith(f"{model / 'config.json'}: expected a JSON object, found a JSON array"), line


def test_max_seq_length_beyond_the_positions_is_refused_before_training(tiny_model, data, tmp_path):
    output = tmp_path / "out"
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "1", "--max-seq-length", "200")))
    assert "--max-seq-length 200 is more than the model takes" in line and "gives it 128 positions" in line, line
    assert not output.exists()


@pytest.mark.parametrize("task", ["seq-cls", "mlm"])
def test_a_tokenizer_larger_than_the_vocabulary_is_refused_naming_the_vocabulary(tiny_model, data, tmp_path, task):
    """MiniLM's 30522-entry tokenizer on a model with 1000 embedding rows was blamed on "labels" (or reached a
    kernel): it is refused before training, naming the vocabulary."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128, num_labels=2)
    model = tmp_path / "small_vocab"
    builder = transformers.BertForMaskedLM if task == "mlm" else transformers.BertForSequenceClassification
    builder(config).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tiny_model / name, model / name)
    output = tmp_path / "out"
    line = error_line(run(*train_args(model, data, output, "--max-steps", "1", "--task", task,
                                      "--text-column", "sentence")))
    assert "the training data holds token id" in line, line
    assert "but the model's vocabulary has 1000 entries (config.json \"vocab_size\")" in line, line
    assert "labels" not in line, line
    assert not (output / "model.safetensors").exists()


def test_question_answering_missing_key_names_the_line_and_its_keys(tiny_model, tmp_path):
    first = {"question": "q?", "context": "the answer", "answers": {"text": ["answer"], "answer_start": [4]}}
    train = tmp_path / "qa.jsonl"
    train.write_text(json.dumps(first) + "\n" + json.dumps({"question": "q?", "context": "c"}) + "\n")
    line = error_line(run("train", "--task", "qa", "--model", str(tiny_model), "--train-file", str(train),
                          "--output-dir", str(tmp_path / "out"), "--max-steps", "1"))
    assert line.endswith(f'{train}:2: no key "answers", which the first object (line 1) has; every line needs the '
                         "same keys (this line's: question, context)"), line


# ---- crash test: kill -9 at random moments ----------------------------------------------------------------------


def crash_run(tiny_model, data, tmp_path, kills: int, seed: int) -> None:
    """Trains 12 steps saving every step, killed with SIGKILL `kills` times at random moments, each restart resuming
    from the newest checkpoint, as a user would. Then: nothing half-written is left, every checkpoint is complete,
    and training resumed from every one of them ends with the weights of an uninterrupted run, bit for bit."""
    steps = ["--max-steps", "12", "--save-steps", "1", "--lr-scheduler-type", "cosine", "--warmup-steps", "2"]
    reference = tmp_path / "reference"
    started = time.monotonic()
    assert run(*train_args(tiny_model, data, reference, *steps, "--save-strategy", "no")).returncode == 0
    duration = time.monotonic() - started
    output = tmp_path / "out"
    rng = random.Random(seed)
    killed = 0
    while killed < kills:
        resume = checkpoints(output)[-1:]
        args = train_args(tiny_model, data, output, *steps,
                          *(["--resume-from-checkpoint", str(resume[0])] if resume else []))
        process = subprocess.Popen([str(CLI), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            process.wait(timeout=rng.uniform(0.05, duration))
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            killed += 1
            continue
        assert process.returncode == 0, process.stderr.read()
        shutil.rmtree(output)  # finished before the kill: start over, so that every kill interrupts training
    newest = checkpoints(output)[-1:]
    final = run(*train_args(tiny_model, data, output, *steps,
                            *(["--resume-from-checkpoint", str(newest[0])] if newest else [])))
    assert final.returncode == 0, final.stderr
    assert leftovers(output) == []
    expected = (reference / "model.safetensors").read_bytes()
    assert (output / "model.safetensors").read_bytes() == expected
    saved = checkpoints(output)
    assert saved, "no checkpoint survived"
    for checkpoint in saved:
        step = int(checkpoint.name.split("-")[1])
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["global_step"] == step
        for name in ("config.json", "optimizer.safetensors", "rng_state.json", "scheduler.json", "tokenizer.json",
                     "training_args.json"):
            assert (checkpoint / name).stat().st_size > 0, f"{checkpoint.name}/{name}"
        assert all(np.isfinite(v).all() for v in weights(checkpoint).values())
        if step == 12:
            continue
        resumed = tmp_path / f"resumed-{step}"
        result = run(*train_args(tiny_model, data, resumed, *steps, "--save-strategy", "no",
                                 "--resume-from-checkpoint", str(checkpoint)))
        assert result.returncode == 0, result.stderr
        assert (resumed / "model.safetensors").read_bytes() == expected, f"resumed from {checkpoint.name}"


def test_kill_9_during_training_and_saves_leaves_complete_checkpoints(tiny_model, data, tmp_path):
    crash_run(tiny_model, data, tmp_path, kills=4, seed=1)


@pytest.mark.slow
def test_kill_9_twenty_four_times(tiny_model, data, tmp_path):
    crash_run(tiny_model, data, tmp_path, kills=24, seed=2)


# ---- a full disk ------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs (needs root, as CI and the setup script run): room for one checkpoint of tiny_model."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_the_save_and_keeps_earlier_checkpoints(tiny_model, data, small_disk):
    output = small_disk / "out"
    line = error_line(run(*train_args(tiny_model, data, output, "--max-steps", "6", "--save-steps", "1")))
    assert "was not saved (earlier checkpoints are intact)" in line and "No space left on device" in line, line
    saved = checkpoints(output)
    assert saved, "the disk should hold at least one checkpoint"
    assert leftovers(output) == []
    for checkpoint in saved:
        assert all(np.isfinite(v).all() for v in weights(checkpoint).values())
        evaluated = run("evaluate", "--model", str(checkpoint), "--eval-file", str(data["dev"]), "--max-seq-length",
                        "32")
        assert evaluated.returncode == 0, evaluated.stderr
