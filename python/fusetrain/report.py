"""`fusetrain report RUN_DIR`: the curves of a run, drawn from its log.jsonl, and TensorBoard event files for
`fusetrain train --report-to tensorboard`.

    fusetrain report runs/sst2            # writes runs/sst2/report.png and runs/sst2/report.html

The PNG has four panels: training loss (with the evaluation loss), learning rate, gradient norm, and the other
evaluation metrics (accuracy, F1, perplexity, ...), all against the optimizer step. The HTML page holds the
same figure as inline SVG and a table of the last evaluation, with nothing to fetch.
"""

from __future__ import annotations

import datetime
import html
import io
import json
import os
import socket
from typing import Any

_SKIP_EVAL = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_loss")


def read_log(run_dir: str) -> list[dict[str, Any]]:
    """The entries of RUN_DIR/log.jsonl; ValueError naming the file and line when one is not a JSON object."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir} has no log.jsonl (expected the output_dir of a fusetrain train run)")
    entries = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
                raise ValueError(f"{path}:{number}: expected an object with an integer \"step\"")
            entries.append(entry)
    if not any("loss" in e or "eval_loss" in e for e in entries):
        raise ValueError(f"{path} holds no training or evaluation loss to draw")
    return entries


def _series(entries: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(e["step"], float(e[key])) for e in entries if isinstance(e.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def figure(entries: list[dict]) -> Any:
    """The four-panel matplotlib figure of a run's log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    (loss_ax, lr_ax), (norm_ax, metric_ax) = axes
    steps, values = _series(entries, "loss")
    loss_ax.plot(steps, values, label="training loss", color="tab:blue")
    steps, values = _series(entries, "eval_loss")
    if steps:
        loss_ax.plot(steps, values, "o-", label="evaluation loss", color="tab:orange")
    loss_ax.set_title("loss")
    loss_ax.legend()
    lr_ax.plot(*_series(entries, "learning_rate"), color="tab:green")
    lr_ax.set_title("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    norm_ax.plot(*_series(entries, "grad_norm"), color="tab:red")
    norm_ax.set_title("gradient norm (before clipping)")
    metrics = sorted({k for e in entries for k in e if k.startswith("eval_") and k not in _SKIP_EVAL})
    for key in metrics:
        metric_ax.plot(*_series(entries, key), "o-", label=key[len("eval_"):])
    metric_ax.set_title("evaluation metrics" if metrics else "evaluation metrics (none logged)")
    if metrics:
        metric_ax.legend()
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return fig


def write_report(run_dir: str) -> tuple[str, str]:
    """Writes RUN_DIR/report.png and RUN_DIR/report.html; returns their paths."""
    entries = read_log(run_dir)
    fig = figure(entries)
    png = os.path.join(run_dir, "report.png")
    fig.savefig(png, dpi=110)
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    import matplotlib.pyplot as plt

    plt.close(fig)
    last_eval = next((e for e in reversed(entries) if "eval_loss" in e), None)
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in sorted(last_eval.items())
                   if isinstance(v, (int, float))) if last_eval else ""
    final = next((e for e in reversed(entries) if "train_runtime" in e), None)
    final_rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in sorted(final.items())
                         if isinstance(v, (int, float))) if final else ""
    svg_text = svg.getvalue()
    svg_text = svg_text[svg_text.index("<svg"):]  # inline: without the XML prolog and doctype
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>fusetrain run: {html.escape(os.path.abspath(run_dir))}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td{{border:1px solid #ccc;padding:2px 8px}} svg{{max-width:100%;height:auto}}</style></head>
<body><h1>{html.escape(os.path.abspath(run_dir))}</h1>
<p>{len(entries)} log entries, steps {entries[0]["step"]} to {entries[-1]["step"]}.</p>
{svg_text}
<h2>Last evaluation</h2><table>{rows or "<tr><td>no evaluation logged</td></tr>"}</table>
<h2>Training</h2><table>{final_rows or "<tr><td>the run has not finished</td></tr>"}</table>
</body></html>
"""
    page_path = os.path.join(run_dir, "report.html")
    with open(page_path, "w") as f:
        f.write(page)
    return png, page_path


class TensorBoardSink:
    """Writes log entries as TensorBoard scalars under OUTPUT_DIR/runs/<time>_<host>, with transformers'
    TensorBoardCallback tags (train/loss, train/learning_rate, eval/accuracy, ...), using TensorBoard's writer as
    torch ships it."""

    def __init__(self) -> None:
        self._writer = None

    def __call__(self, entry: dict, output_dir: str) -> None:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(f"--report-to tensorboard needs the tensorboard package ({error})") from None
            stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
            self._writer = SummaryWriter(log_dir=os.path.join(output_dir, "runs", f"{stamp}_{socket.gethostname()}"))
        step = entry.get("step", 0)
        for key, value in entry.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
