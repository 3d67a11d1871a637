"""The `fusetrain` command line: bad input gives one clear line and a non-zero
exit without leaving a partial checkpoint; resuming continues bit for bit; a run
killed while saving leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy

from cli_support import CLI, ROOT, SHAKESPEARE, data, error_line, run, tiny_llama, tiny_model, train_args  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is not built (bash scripts/build.sh)")


@pytest.mark.parametrize("case", ["missing_train_file", "empty_file", "missing_column", "label_not_integer",
                                  "label_out_of_range", "non_utf8", "batch_size_zero", "negative_lr",
                                  "output_dir_is_a_file", "missing_model"])
def test_bad_input_gives_one_clear_line(case, tiny_model, data, tmp_path):
    output = tmp_path / "out"
    train = data["train"]
    extra: list[str] = []
    model = tiny_model
    expect = ""
    if case == "missing_train_file":
        train, expect = tmp_path / "nope.tsv", "does not exist"
    elif case == "empty_file":
        train = tmp_path / "empty.tsv"
        train.write_text("")
        expect = "empty"
    elif case == "missing_column":
        extra, expect = ["--text-column", "review"], 'no column "review"'
    elif case == "label_not_integer":
        train = tmp_path / "bad_label.tsv"
        train.write_text("label\tsentence\npos\ta fine film\n")
        expect = 'label "pos" is not an integer'
    elif case == "label_out_of_range":
        train = tmp_path / "range.tsv"
        train.write_text("label\tsentence\n0\tgood\n5\tbad\n")
        extra, expect = ["--num-labels", "2"], "out of range"
    elif case == "non_utf8":
        train = tmp_path / "latin1.tsv"
        train.write_bytes(b"label\tsentence\n1\tna\xefve film\n")
        expect = "invalid UTF-8"
    elif case == "batch_size_zero":
        extra, expect = ["--per-device-train-batch-size", "0"], "per_device_train_batch_size must be > 0"
    elif case == "negative_lr":
        extra, expect = ["--learning-rate", "-0.1"], "learning_rate must be >= 0"
    elif case == "output_dir_is_a_file":
        output = tmp_path / "a_file"
        output.write_text("x")
        expect = "is not a directory"
    elif case == "missing_model":
        model, expect = tmp_path / "no_model", "is not a directory"
    args = train_args(model, {"train": train}, output, "--max-steps", "2", *extra)
    line = error_line(run(*args))
    assert expect in line, line
    if output.is_dir():
        assert not any(p.name.startswith("checkpoint-") for p in output.iterdir())


def test_long_lines_are_truncated_not_rejected(tiny_model, tmp_path):
    train = tmp_path / "long.tsv"
    train.write_text("label\tsentence\n1\t" + " ".join(["great"] * 500) + "\n0\tbad\n")
    result = run(*train_args(tiny_model, {"train": train}, tmp_path / "out", "--max-steps", "1"))
    assert result.returncode == 0, result.stderr


def final_loss(output: pathlib.Path) -> float:
    logs = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return [entry for entry in logs if "loss" in entry][-1]["loss"]


@pytest.mark.parametrize("precision", [[], ["--fp16"], ["--optim", "sgd", "--optim-args", "momentum=0.9,nesterov=true"],
                                       ["--optim", "rmsprop", "--optim-args", "centered=true,momentum=0.5"],
                                       ["--optim", "adagrad"], ["--optim", "lion_32bit"], ["--optim", "adafactor"]],
                         ids=["fp32", "fp16", "sgd-nesterov", "rmsprop-centered", "adagrad", "lion", "adafactor"])
def test_resume_continues_bit_for_bit(tiny_model, data, tmp_path, precision):
    """8 steps straight vs 4 steps, then resume from checkpoint-4 for 4 more (dropout on); in fp16 the
    checkpoint carries the loss scale, with another optimizer its states (optimizer.safetensors)."""
    common = ["--lr-scheduler-type", "cosine", "--warmup-steps", "2", "--save-steps", "4", *precision]
    straight = tmp_path / "straight"
    assert run(*train_args(tiny_model, data, straight, "--max-steps", "8", *common)).returncode == 0
    half = tmp_path / "half"
    killed = run(*train_args(tiny_model, data, half, "--max-steps", "8", *common),
                 env={"FUSETRAIN_FAULT_DURING_SAVE": "8"})
    assert killed.returncode == 86, killed.stderr
    resumed = run(*train_args(tiny_model, data, half, "--max-steps", "8", *common,
                              "--resume-from-checkpoint", str(half / "checkpoint-4")))
    assert resumed.returncode == 0, resumed.stderr
    assert final_loss(resumed_dir := half) == final_loss(straight)
    a = (straight / "model.safetensors").read_bytes()
    b = (resumed_dir / "model.safetensors").read_bytes()
    assert a == b, "final weights differ"
    assert (half / "checkpoint-4" / "scaler.json").exists() == ("--fp16" in precision)


def test_8bit_adamw_resumes_bit_for_bit(tiny_llama, tmp_path):
    """The 64-wide Llama's projections (4096+ elements) take 8-bit states: 6 steps straight vs a run killed while saving step 6,
    resumed from checkpoint-3, end with the same weights; the checkpoint holds the codes as u8 tensors."""
    text = tmp_path / "train.txt"
    text.write_text("\n".join(SHAKESPEARE.read_text().splitlines()[:400]) + "\n")
    common = ["--task", "clm", "--max-seq-length", "64", "--save-steps", "3", "--optim", "adamw_8bit",
              "--weight-decay", "0.1"]
    straight, half = tmp_path / "straight", tmp_path / "half"
    assert run(*train_args(tiny_llama, {"train": text}, straight, "--max-steps", "6", *common)).returncode == 0
    killed = run(*train_args(tiny_llama, {"train": text}, half, "--max-steps", "6", *common),
                 env={"FUSETRAIN_FAULT_DURING_SAVE": "6"})
    assert killed.returncode == 86, killed.stderr
    resumed = run(*train_args(tiny_llama, {"train": text}, half, "--max-steps", "6", *common,
                              "--resume-from-checkpoint", str(half / "checkpoint-3")))
    assert resumed.returncode == 0, resumed.stderr
    assert (straight / "model.safetensors").read_bytes() == (half / "model.safetensors").read_bytes()
    states = safetensors.numpy.load_file(str(half / "checkpoint-3" / "optimizer.safetensors"))
    assert states["state1"].dtype == np.uint8 and states["state1"].size >= 8 * 4096
    assert states["qmap1"].shape == (256,) and states["state1_32bit"].dtype == np.float32


def test_resume_with_another_optimizer_is_one_clear_error(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    assert run(*train_args(tiny_model, data, out, "--max-steps", "2", "--save-steps", "2", "--optim", "sgd",
                           "--optim-args", "momentum=0.9")).returncode == 0
    result = run(*train_args(tiny_model, data, tmp_path / "again", "--max-steps", "4", "--resume-from-checkpoint",
                             str(out / "checkpoint-2")))
    assert result.returncode != 0
    assert "the optimizer state is sgd's but this run's optimizer is adamw_torch" in error_line(result)


@pytest.mark.parametrize("flags, expected", [
    (["--optim", "adafactorx"], "optim: the engine runs adamw_torch"),
    (["--optim", "sgd", "--optim-args", "momentum=fast"], "optim_args: momentum=fast is not a finite number"),
    (["--optim", "sgd", "--optim-args", "betas=0.9"], "optim_args: optim sgd takes momentum, dampening, nesterov"),
    (["--optim", "sgd", "--optim-args", "momentum"], "optim_args: \"momentum\" is not key=value"),
])
def test_bad_optimizer_flags_are_one_clear_error(tiny_model, data, tmp_path, flags, expected):
    result = run(*train_args(tiny_model, data, tmp_path / "out", "--max-steps", "1", *flags))
    assert result.returncode != 0
    assert expected in error_line(result)


def test_kill_during_save_leaves_previous_checkpoint_intact(tiny_model, data, tmp_path):
    output = tmp_path / "out"
    result = run(*train_args(tiny_model, data, output, "--max-steps", "4", "--save-steps", "2"),
                 env={"FUSETRAIN_FAULT_DURING_SAVE": "4"})
    assert result.returncode == 86, result.stderr
    assert (output / "checkpoint-2" / "model.safetensors").exists()
    assert not (output / "checkpoint-4").exists()
    state = json.loads((output / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    evaluated = run("evaluate", "--model", str(output / "checkpoint-2"), "--eval-file", str(data["dev"]),
                    "--max-seq-length", "32")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "eval_accuracy" in evaluated.stdout


def test_train_evaluate_predict_round_trip(tiny_model, data, tmp_path):
    output = tmp_path / "out"
    trained = run(*train_args(tiny_model, data, output, "--num-train-epochs", "1", "--eval-file", str(data["dev"]),
                              "--eval-strategy", "epoch", "--save-strategy", "epoch", "--save-total-limit", "1"))
    assert trained.returncode == 0, trained.stderr
    assert "dev accuracy:" in trained.stdout
    state = json.loads(next(output.glob("checkpoint-*")).joinpath("trainer_state.json").read_text())
    assert any("eval_accuracy" in entry for entry in state["log_history"])
    predictions = tmp_path / "pred.tsv"
    predicted = run("predict", "--model", str(output), "--test-file", str(data["dev"]), "--output", str(predictions),
                    "--max-seq-length", "32")
    assert predicted.returncode == 0, predicted.stderr
    rows = predictions.read_text().splitlines()
    assert rows[0] == "index\tprediction" and len(rows) == 65
    # The saved model loads in transformers.
    import transformers
    transformers.AutoModelForSequenceClassification.from_pretrained(output)


def test_inspect_prints_memory_plan(tiny_model):
    result = run("inspect", "--model", str(tiny_model), "--max-seq-length", "32", "--profile")
    assert result.returncode == 0, result.stderr
    assert "activation peak" in result.stdout and "profile" in result.stdout
    assert "nodes (schedule order" not in result.stdout


def test_inspect_profile_nodes_lists_every_scheduled_node(tiny_model):
    result = run("inspect", "--model", str(tiny_model), "--max-seq-length", "32", "--profile", "--profile-nodes")
    assert result.returncode == 0, result.stderr
    scheduled = int(re.search(r"(\d+) nodes scheduled", result.stdout).group(1))
    listing = result.stdout.split("nodes (schedule order, mean ms):\n")[1].splitlines()
    rows = [line.split() for line in listing[:scheduled]]
    assert [int(r[0]) for r in rows] == list(range(scheduled))
    assert all(float(r[1]) >= 0.0 and "->" in r for r in rows)
    assert "Embedding" in [r[2] for r in rows]
    alone = run("inspect", "--model", str(tiny_model), "--max-seq-length", "32", "--profile-nodes")
    assert alone.returncode != 0 and "--profile" in alone.stderr


def test_fp16_tracks_fp32(tiny_model, data, tmp_path):
    """--fp16 (f16 operands, dynamic loss scaling) logs losses and gradient norms within 1% of fp32's."""
    logs = []
    for flags in ([], ["--fp16"]):
        out = tmp_path / f"run{len(logs)}"
        result = run(*train_args(tiny_model, data, out, "--max-steps", "6", "--logging-steps", "1",
                                 "--save-strategy", "no", *flags))
        assert result.returncode == 0, result.stderr
        logs.append([json.loads(l) for l in (out / "log.jsonl").read_text().splitlines() if '"loss"' in l])
    assert len(logs[0]) == len(logs[1]) == 6
    for fp32, fp16 in zip(*logs):
        assert fp16["loss"] == pytest.approx(fp32["loss"], rel=1e-2)
        assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-2)
    assert any(a["loss"] != b["loss"] for a, b in zip(*logs)), "fp16 must actually round"


def test_fp16_overflowed_steps_hold_the_learning_rate_schedule(tiny_model, data, tmp_path):
    """A step skipped for overflow neither changes the weights nor advances the schedule (transformers steps
    its scheduler only after an optimizer step that ran). A checkpoint's loss scale of 2^40 overflows
    every step after resuming."""
    out = tmp_path / "run"
    steps = ["--max-steps", "6", "--save-strategy", "steps", "--save-steps", "2", "--lr-scheduler-type", "linear"]
    result = run(*train_args(tiny_model, data, out, *steps, "--fp16"))
    assert result.returncode == 0, result.stderr
    plain = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines() if '"loss"' in l]
    assert len({round(e["learning_rate"], 12) for e in plain}) == 6  # the schedule moves every step

    checkpoint = out / "checkpoint-2"
    scaler = json.loads((checkpoint / "scaler.json").read_text())
    assert scaler["skipped_steps"] == 0
    (checkpoint / "scaler.json").write_text(json.dumps({**scaler, "scale": 2.0 ** 40}))
    resumed = tmp_path / "resumed"
    result = run(*train_args(tiny_model, data, resumed, *steps, "--fp16", "--resume-from-checkpoint", str(checkpoint)))
    assert result.returncode == 0, result.stderr
    logged = [json.loads(l) for l in (resumed / "log.jsonl").read_text().splitlines() if '"loss"' in l]
    assert [e["step"] for e in logged] == [3, 4, 5, 6]
    assert all(e["learning_rate"] == plain[2]["learning_rate"] for e in logged)  # held at the rate step 3 applied
    final = json.loads((resumed / "checkpoint-6" / "scaler.json").read_text())
    assert final["skipped_steps"] == 4 and final["scale"] == 2.0 ** 36
    weights = safetensors.numpy.load_file(str(checkpoint / "model.safetensors"))
    after = safetensors.numpy.load_file(str(resumed / "checkpoint-6" / "model.safetensors"))
    for name, value in weights.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def activation_peak_mib(inspect_output: str) -> float:
    line = next(l for l in inspect_output.splitlines() if l.startswith("activation peak"))
    return float(line.split()[2])


def test_gradient_checkpointing_shrinks_the_plan_and_keeps_the_losses(tiny_model, tmp_path):
    """--gradient-checkpointing: inspect shows the recompute pass and a smaller activation peak; training
    logs the same losses (bit for bit) as without it."""
    # A token-classification plan: a sequence classifier runs its last layer on the first token alone,
    # which leaves a 2-layer model with little for checkpointing to save.
    shape = ["--model", str(tiny_model), "--task", "token-cls", "--max-seq-length", "64",
             "--per-device-train-batch-size", "16"]
    plain = run("inspect", *shape)
    recompute = run("inspect", *shape, "--gradient-checkpointing")
    assert plain.returncode == 0 and recompute.returncode == 0, plain.stderr + recompute.stderr
    assert "pass recompute:" in recompute.stdout and "pass recompute:" not in plain.stdout
    assert activation_peak_mib(recompute.stdout) < 0.8 * activation_peak_mib(plain.stdout)

    losses = []
    for flags in ([], ["--gradient-checkpointing"]):
        out = tmp_path / f"run{len(losses)}"
        result = run("train", "--model", str(tiny_model), "--train-file", str(ROOT / "data" / "sst2" / "train.tsv"),
                     "--max-seq-length", "32", "--per-device-train-batch-size", "8", "--max-steps", "4",
                     "--logging-steps", "1", "--save-strategy", "no", "--output-dir", str(out), "--disable-tqdm",
                     *flags)
        assert result.returncode == 0, result.stderr
        losses.append([json.loads(l)["loss"] for l in (out / "log.jsonl").read_text().splitlines() if '"loss"' in l])
    assert len(losses[0]) == 4 and losses[0] == losses[1]


def test_language_modelling_reports_perplexity(tiny_model, tmp_path):
    """--task mlm on a BERT (fresh MLM head) and --task clm on a fresh GPT-2 with a byte-level BPE."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    sentences = [line.split("\t", 1)[1] for line in (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[1:400]]
    text = tmp_path / "text.txt"
    text.write_text("\n".join(sentences) + "\n")
    mlm = run("train", "--model", str(tiny_model), "--task", "mlm", "--train-file", str(text), "--eval-file", str(text),
              "--max-seq-length", "32", "--per-device-train-batch-size", "8", "--max-steps", "6",
              "--save-strategy", "no", "--output-dir", str(tmp_path / "mlm"), "--disable-tqdm")
    assert mlm.returncode == 0, mlm.stderr
    assert '"eval_perplexity"' in mlm.stdout

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([str(text)], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(vocab_size=bpe.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    bpe.save(str(gpt2 / "tokenizer.json"))
    clm = run("train", "--model", str(gpt2), "--task", "clm", "--train-file", str(text), "--eval-file", str(text),
              "--max-seq-length", "32", "--per-device-train-batch-size", "4", "--max-steps", "20",
              "--learning-rate", "3e-3", "--save-strategy", "no", "--output-dir", str(tmp_path / "clm"),
              "--disable-tqdm")
    assert clm.returncode == 0, clm.stderr
    metrics = json.loads(clm.stdout[clm.stdout.rfind("{"):clm.stdout.rfind("}") + 1])
    # A fresh model over a 400-token vocabulary starts near perplexity 400; 20 steps must cut that by a third.
    assert metrics["eval_perplexity"] < 270


@pytest.fixture(scope="module")
def tiny_base_model(tiny_model, tmp_path_factory) -> pathlib.Path:
    """tiny_model's encoder without its classification head, as a BertModel checkpoint."""
    import transformers

    out = tmp_path_factory.mktemp("tiny_bert_base")
    transformers.BertForSequenceClassification.from_pretrained(tiny_model).bert.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


def sentences_from_bundled_sst2(count: int) -> list[str]:
    rows = (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[1:count + 1]
    return [row.split("\t", 1)[1] for row in rows]


def logged_losses(output: pathlib.Path) -> list[float]:
    return [entry["loss"] for entry in map(json.loads, (output / "log.jsonl").read_text().splitlines())
            if "loss" in entry]


def last_json(text: str) -> dict:
    return json.loads(text[text.rfind("{"):text.rfind("}") + 1])


def test_token_classification_train_evaluate_predict(tiny_base_model, tmp_path):
    """--task token-cls on JSON Lines of words and tag names: the tags become the model's labels, the loss falls,
    the saved model carries id2label, and predict writes one tag per word."""
    def tag(word: str) -> str:
        return "B-PUNCT" if not any(c.isalnum() for c in word) else "B-NUM" if any(c.isdigit() for c in word) else \
            "B-LONG" if len(word) > 6 else "O"
    rows = [{"tokens": s.split(), "ner_tags": [tag(w) for w in s.split()]} for s in sentences_from_bundled_sst2(400)]
    rows = [r for r in rows if r["tokens"]]
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:320]))
    dev.write_text("".join(json.dumps(r) + "\n" for r in rows[320:]))
    output = tmp_path / "ner"
    trained = run("train", "--model", str(tiny_base_model), "--task", "token-cls", "--train-file", str(train),
                  "--eval-file", str(dev), "--max-seq-length", "48", "--per-device-train-batch-size", "8",
                  "--num-train-epochs", "3", "--learning-rate", "3e-3", "--logging-steps", "5",
                  "--save-strategy", "no", "--output-dir", str(output), "--disable-tqdm")
    assert trained.returncode == 0, trained.stderr
    metrics = last_json(trained.stdout)
    losses = logged_losses(output)
    assert losses[0] > 1.0 and metrics["eval_loss"] < 0.5 * losses[0], (losses, metrics)
    assert metrics["eval_accuracy"] > 0.8
    assert 0 < metrics["eval_precision"] <= 1 and 0 < metrics["eval_recall"] <= 1 and metrics["eval_f1"] > 0.5
    config = json.loads((output / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"]
    assert sorted(config["id2label"].values()) == ["B-LONG", "B-NUM", "B-PUNCT", "O"]

    import transformers
    transformers.AutoModelForTokenClassification.from_pretrained(output)
    unlabelled = tmp_path / "test.jsonl"
    unlabelled.write_text("".join(json.dumps({"tokens": r["tokens"]}) + "\n" for r in rows[320:]))
    predictions = tmp_path / "tags.jsonl"
    predicted = run("predict", "--model", str(output), "--task", "token-cls", "--test-file", str(unlabelled),
                    "--output", str(predictions), "--max-seq-length", "128")
    assert predicted.returncode == 0, predicted.stderr
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(lines) == len(rows) - 320
    for line, row in zip(lines, rows[320:]):
        assert len(line["tags"]) == len(row["tokens"])
    correct = sum(p == t for line, row in zip(lines, rows[320:]) for p, t in zip(line["tags"], row["ner_tags"]))
    assert correct / sum(len(r["tokens"]) for r in rows[320:]) > 0.8


def test_question_answering_train_evaluate_predict(tiny_base_model, tmp_path):
    """--task qa on SQuAD-style JSON Lines: windows over long contexts, exact match and F1 on evaluation, and
    predicted answers that are spans of their contexts."""
    import random

    rng = random.Random(3)
    sentences = sentences_from_bundled_sst2(900)
    rows = []
    for i in range(0, 880, 4):
        context = " ".join(sentences[i:i + 4])
        words = context.split(" ")
        first = rng.randrange(len(words))
        # The question is the answer's left neighbour; the answer is the word after it.
        question = "what follows " + (words[first - 1] if first else "the start")
        start = len(" ".join(words[:first])) + (1 if first else 0)
        rows.append({"question": question, "context": context,
                     "answers": {"text": [words[first]], "answer_start": [start]}})
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:180]))
    dev.write_text("".join(json.dumps(r) + "\n" for r in rows[180:]))
    output = tmp_path / "qa"
    trained = run("train", "--model", str(tiny_base_model), "--task", "qa", "--train-file", str(train),
                  "--eval-file", str(dev), "--max-seq-length", "64", "--doc-stride", "16",
                  "--per-device-train-batch-size", "8", "--max-steps", "30", "--learning-rate", "3e-3",
                  "--logging-steps", "5", "--save-strategy", "no", "--output-dir", str(output), "--disable-tqdm")
    assert trained.returncode == 0, trained.stderr
    metrics = last_json(trained.stdout)
    assert {"eval_exact_match", "eval_f1", "eval_loss"} <= metrics.keys()
    assert 0 <= metrics["eval_exact_match"] <= metrics["eval_f1"] <= 100
    losses = logged_losses(output)
    assert losses[-1] < losses[0], losses
    config = json.loads((output / "config.json").read_text())
    assert config["architectures"] == ["BertForQuestionAnswering"]

    unlabelled = tmp_path / "questions.jsonl"
    unlabelled.write_text("".join(json.dumps({"question": r["question"], "context": r["context"]}) + "\n"
                                  for r in rows[180:]))
    predictions = tmp_path / "answers.jsonl"
    predicted = run("predict", "--model", str(output), "--task", "qa", "--test-file", str(unlabelled),
                    "--output", str(predictions), "--max-seq-length", "64", "--doc-stride", "16")
    assert predicted.returncode == 0, predicted.stderr
    answers = [json.loads(line)["answer"] for line in predictions.read_text().splitlines()]
    assert len(answers) == len(rows) - 180
    assert all(answer in row["context"] for answer, row in zip(answers, rows[180:]))


def test_question_answering_bad_answer_is_one_clear_line(tiny_model, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "q", "context": "a b c", "answers": {"text": ["b"], "answer_start": [0]}})
                    + "\n")
    result = run("train", "--model", str(tiny_model), "--task", "qa", "--train-file", str(data), "--output-dir",
                 str(tmp_path / "out"), "--disable-tqdm")
    assert error_line(result) == f'fusetrain: error: {data}:1: the answer "b" is not at character 0 of the context'
    assert not (tmp_path / "out").exists()


def test_cli_tasks_and_model_types_are_the_registry_s(tiny_model, data, tmp_path):
    """--task's help lists the tasks the command line trains (seq2seq's models all captured; ctc's from Python), an
    unknown task or model_type the registry's names."""
    import json

    import fusetrain

    rows = fusetrain.architectures()
    tasks = {row["task"] for row in rows if row["task"]}
    help_text = " ".join(run("train", "--help").stdout.split())
    listed = help_text.split("what to train: ", 1)[1].split(" --", 1)[0]
    native, python = listed.split("; ", 1)
    assert {entry.split(" (")[0] for entry in native.split(", ")} == tasks | {"seq2seq", "ctc"}, listed
    assert python.startswith("and with the pip-installed fusetrain command, image-cls and audio-cls"), listed
    line = error_line(run("train", "--model", str(tiny_model), "--task", "summarise", "--train-file", str(data["train"])))
    # every task a head trains: seq2seq's and ctc's models are all captured (no native architecture)
    assert set(line.split("(supported: ", 1)[1].rstrip(")").split(", ")) == tasks | {"seq2seq", "ctc"}, line
    model = tmp_path / "t5"
    model.mkdir()
    for file in tiny_model.iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, model_type="t5")))
    line = error_line(run("train", "--model", str(model), "--train-file", str(data["train"])))
    model_types = ", ".join(dict.fromkeys(row["model_type"] for row in rows))
    assert line.endswith(f'{model}/config.json: model_type "t5" is not supported (supported: {model_types})'), line
    line = error_line(run("train", "--model", str(tiny_model), "--task", "clm", "--train-file", str(data["train"])))
    causal = [row["model_type"] for row in rows if row["task"] == "clm"]
    listed = causal[0] if len(causal) == 1 else ", ".join(causal[:-1]) + " and " + causal[-1]
    assert f'--task clm (causal language modelling) supports {listed} models, found model_type "bert"' in line, line


def test_info_names_the_kernel_path_and_refuses_an_unknown_cap():
    """`fusetrain info` says which instruction set the kernels take (the widest the CPU has, or the FUSETRAIN_KERNELS
    cap), so an installed wheel shows the path it runs; a cap it does not know is one error."""
    plain = run("info", env={"FUSETRAIN_KERNELS": ""})
    assert plain.returncode == 0
    widest = "avx512" if "avx512f" in plain.stdout else "avx2" if "avx2" in plain.stdout else "portable"
    assert f"kernels: {widest} (the widest this CPU has;" in plain.stdout
    for cap in ("avx2", "portable"):
        capped = run("info", env={"FUSETRAIN_KERNELS": cap})
        assert capped.returncode == 0 and f"kernels: {cap} (FUSETRAIN_KERNELS={cap})" in capped.stdout
    line = error_line(run("info", env={"FUSETRAIN_KERNELS": "sse9"}))
    assert line == 'fusetrain: error: FUSETRAIN_KERNELS should be "portable" or "avx2" (or unset), found "sse9"'
