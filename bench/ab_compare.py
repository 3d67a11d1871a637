"""Before/after: fusetrain's step time on the bench workloads, this checkout against another one, side by side.

    git worktree add /tmp/base <commit> && (cd /tmp/base && cmake -S . -B build -G Ninja \
        -DFUSETRAIN_BUILD_TESTS=OFF -DFUSETRAIN_BUILD_EXAMPLES=OFF && ninja -C build _core)
    python bench/ab_compare.py --baseline /tmp/base                       # W1-W3, fp32 and bf16
    python bench/ab_compare.py --baseline /tmp/base --workloads w3 --rounds 3

Each (workload, framework) runs compare.py's worker (the same model directory, batches, warmup and timed steps: a
full training step with clipping and AdamW) once per round from each checkout, alternating which goes first, so
both see the same machine load. Reported: the median step time of each side over all its timed steps, the ratio
after/before, the fastest step of each side and its ratio (other work on the machine only ever adds time, so on a
shared machine the fastest steps compare the code, the medians the load), each side's peak resident memory, and
whether the two sides' losses are bit-identical (every round runs the same steps on the same batches).
Timings only inform; nothing here fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compare  # noqa: E402  (the workloads and the worker)


def worker(checkout: pathlib.Path, framework: str, directory: pathlib.Path, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    result = subprocess.run([sys.executable, str(checkout / "bench" / "compare.py"), "--worker", framework, "--dir",
                             str(directory), "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads",
                             str(args.threads)], capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        sys.exit(f"{checkout}: {framework} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout, with its build/python built")
    parser.add_argument("--workloads", default="w1,w2,w3")
    parser.add_argument("--frameworks", default="fusetrain_fp32,fusetrain_bf16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--output", default=str(compare.RESULTS / "ab_compare.json"))
    args = parser.parse_args()
    sides = {"before": pathlib.Path(args.baseline).resolve(), "after": compare.ROOT}
    results = {"cpu": compare.cpu_name(), "baseline": str(sides["before"]), "rounds": args.rounds,
               "steps": args.steps, "workloads": {}}
    lines = ["| workload | framework | median before / after (ms) | ratio | fastest before / after (ms) | ratio | "
             "RSS before / after (MB) | losses bit-identical |", "|---|---|---|---|---|---|---|---|"]
    for workload in args.workloads.split(","):
        directory = compare.prepare(workload, args.warmup + args.steps)
        for framework in args.frameworks.split(","):
            times = {"before": [], "after": []}
            rss = {"before": [], "after": []}
            losses = {"before": [], "after": []}  # every round's, per side: the same steps on the same batches
            for round_index in range(args.rounds):
                order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
                for side in order:
                    print(f"[{workload}] {framework} {side} (round {round_index + 1})", file=sys.stderr, flush=True)
                    run = worker(sides[side], framework, directory, args)
                    times[side] += run["step_times"]
                    rss[side].append(run["peak_rss_mb"])
                    losses[side].append(run["losses"])
            median = {side: statistics.median(values) for side, values in times.items()}
            fastest = {side: min(values) for side, values in times.items()}
            results["workloads"].setdefault(workload, {})[framework] = {
                "step_times": times, "median_step_s": median, "fastest_step_s": fastest, "peak_rss_mb": rss,
                "losses": losses, "losses_identical": losses["before"] == losses["after"]}
            lines.append(f"| {workload} | {framework} | {1e3 * median['before']:.1f} / {1e3 * median['after']:.1f} | "
                         f"{median['after'] / median['before']:.3f} | {1e3 * fastest['before']:.1f} / "
                         f"{1e3 * fastest['after']:.1f} | {fastest['after'] / fastest['before']:.3f} | "
                         f"{max(rss['before']):.0f} / {max(rss['after']):.0f} | "
                         f"{'yes' if losses['before'] == losses['after'] else 'no'} |")
            pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['cpu']}, {args.threads} threads, {args.rounds} rounds x {args.steps} timed steps per side\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
