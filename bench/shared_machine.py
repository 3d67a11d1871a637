"""Training on a shared machine: each framework's step time idle and with one other busy process on the machine.

    python bench/shared_machine.py --workloads w3,w4 --frameworks fusetrain_fp32,torch_fp32 --rounds 2

Every (workload, framework) runs as in bench/compare.py (its worker process, model, batches and step, --threads
threads), once on the idle machine and once while a competing process spins on one core (a Python busy loop, the
load a second user's job puts on a 2-core machine). The order alternates every round (idle first, then loaded first)
and the timed steps of all rounds pool. Reported per framework: the idle and loaded median step, the slowdown
(loaded / idle), and for fusetrain its slowdown over PyTorch eager's (the first torch framework given), the figure
the shared-machine target is written in. Writes bench/results/shared_machine.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import subprocess
import sys
import time

import compare

LOADS = ("idle", "loaded")


@contextlib.contextmanager
def competing_process(load: str):
    """One process spinning on a core for the duration, when `load` is "loaded"."""
    if load == "idle":
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)  # running before the worker starts
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="w3,w4")
    parser.add_argument("--frameworks", default="fusetrain_fp32,torch_fp32")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--output", default=str(compare.RESULTS / "shared_machine.json"))
    args = parser.parse_args()
    frameworks = args.frameworks.split(",")
    unknown = [f for f in frameworks if f not in compare.FRAMEWORKS] + \
        [w for w in args.workloads.split(",") if w not in compare.WORKLOADS]
    if unknown or args.rounds < 1:
        sys.exit(f"unknown framework or workload: {', '.join(unknown)}" if unknown else
                 f"--rounds must be at least 1, found {args.rounds}")
    results = {"cpu": compare.cpu_name(), "threads": args.threads, "warmup": args.warmup, "steps": args.steps,
               "rounds": args.rounds, "workloads": {}}
    for workload in args.workloads.split(","):
        directory = compare.prepare(workload, args.warmup + args.steps)
        times = {f: {load: [] for load in LOADS} for f in frameworks}
        errors = {}
        for round_index in range(args.rounds):
            loads = LOADS if round_index % 2 == 0 else LOADS[::-1]
            for framework in frameworks:
                for load in loads:
                    if framework in errors:
                        continue
                    print(f"[{workload}] {framework} {load} (round {round_index + 1}) ...", file=sys.stderr,
                          flush=True)
                    with competing_process(load):
                        run = compare.run_worker(sys.executable, framework, directory, args)
                    if "error" in run:
                        errors[framework] = run["error"]
                    else:
                        times[framework][load] += run["step_times"]
        runs = {}
        for framework in frameworks:
            if framework in errors:
                runs[framework] = {"error": errors[framework]}
                continue
            medians = {load: statistics.median(times[framework][load]) for load in LOADS}
            runs[framework] = {"idle_median_s": medians["idle"], "loaded_median_s": medians["loaded"],
                               "slowdown": medians["loaded"] / medians["idle"], "step_times": times[framework]}
        results["workloads"][workload] = runs
        pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"wrote {args.output}")


def table(results: dict) -> str:
    lines = [f"{results['cpu']}, {results['threads']} threads, one competing busy process when loaded", "",
             "| workload | framework | idle median (ms) | loaded median (ms) | slowdown | slowdown / eager's |",
             "|---|---|---|---|---|---|"]
    for workload, runs in results["workloads"].items():
        eager = next((r for f, r in runs.items() if f.startswith("torch") and "slowdown" in r), None)
        for framework, r in runs.items():
            if "error" in r:
                lines.append(f"| {workload} | {framework} | not run: {r['error']} | | | |")
                continue
            relative = f"{r['slowdown'] / eager['slowdown']:.2f}" if eager and framework.startswith(
                ("fusetrain", "captured")) else "-"
            lines.append(f"| {workload} | {framework} | {1000 * r['idle_median_s']:.0f} | "
                         f"{1000 * r['loaded_median_s']:.0f} | {r['slowdown']:.2f}x | {relative} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
