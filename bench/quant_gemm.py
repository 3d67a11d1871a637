"""The dequantising GEMM against the plain bfloat16 GEMM, per shape: C = A·Wᵀ (a Linear's forward, W (N, K)) and
C = dy·W (its input gradient), A in bfloat16, W in bfloat16 or NF4 (blocks of 64, dequantised as its panels are
packed). Shapes: W4's projections at 4,096 tokens (4 x 1,024) and an 8B model's attention and MLP projections at
1,024 tokens.

    python bench/quant_gemm.py [--threads 2] [--repeats 5] [--rounds 3]

Rounds alternate the two weights; the best GFLOP/s of each is kept (measure_weight_matmul_gflops: the best of
`repeats` timings of three calls). Figures go to bench/results/quant_gemm.json (or --out)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "build" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from compare import cpu_name  # noqa: E402

import fusetrain  # noqa: E402

SHAPES = [("W4 q/o_proj", 4096, 768, 768), ("W4 gate/up_proj", 4096, 2048, 768), ("W4 down_proj", 4096, 768, 2048),
          ("8B q/o_proj", 1024, 4096, 4096), ("8B gate/up_proj", 1024, 14336, 4096),
          ("8B down_proj", 1024, 4096, 14336)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "quant_gemm.json")
    args = parser.parse_args()
    rows = []
    print(f"{cpu_name()}, {args.threads} threads")
    print("| shape | M x N x K | pass | bf16 GFLOP/s | NF4 GFLOP/s | NF4 / bf16 |")
    print("|---|---|---|---|---|---|")
    for name, m, n, k in SHAPES:
        for forward in (True, False):
            best = {"bfloat16": 0.0, "nf4": 0.0}
            for _ in range(args.rounds):
                for weight in best:
                    best[weight] = max(best[weight], fusetrain._core.measure_weight_matmul_gflops(
                        m, n, k, forward, weight, args.threads, args.repeats))
            ratio = best["nf4"] / best["bfloat16"]
            rows.append({"shape": name, "m": m, "n": n, "k": k, "pass": "x·Wᵀ" if forward else "dy·W",
                         "bf16_gflops": best["bfloat16"], "nf4_gflops": best["nf4"], "ratio": ratio})
            print(f"| {name} | {m} x {n} x {k} | {'x·Wᵀ' if forward else 'dy·W'} | {best['bfloat16']:.1f} | "
                  f"{best['nf4']:.1f} | {ratio:.2f} |", flush=True)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
