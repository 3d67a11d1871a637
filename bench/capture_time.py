"""How long capture takes: W6 (bench/compare.py's Qwen3-shaped 134M model) captured, imported and compiled into its
first training step, from an empty capture cache and then from the cache, each in a fresh process.

    python bench/capture_time.py            # prepares W6 with compare.py when it is not there yet

Reported per run: the seconds of fusetrain.Model.from_pretrained (transformers' load, the export when the cache is
empty, the import), of the first forward + backward (which compiles the plan) and of the second, the compile time as
their difference, and load + compile. Timings only inform.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compare  # noqa: E402  (the workloads)

WORKER = """
import json, sys, time
import numpy as np
sys.path.insert(0, {build!r})
import fusetrain
directory = {directory!r}
start = time.perf_counter()
model = fusetrain.Model.from_pretrained(directory)
loaded = time.perf_counter()
model.set_num_threads({threads})
model.train()
batch = {{k: v[0] for k, v in np.load(directory + "/batches.npz").items()}}
model.loss_and_grads(**batch)
stepped = time.perf_counter()
model.loss_and_grads(**batch)
again = time.perf_counter()
print(json.dumps({{"load_s": loaded - start, "first_step_s": stepped - loaded, "step_s": again - stepped}}))
"""


def run(directory: pathlib.Path, cache: pathlib.Path, threads: int) -> dict:
    env = dict(os.environ, FUSETRAIN_CACHE=str(cache), OMP_NUM_THREADS=str(threads))
    code = WORKER.format(build=str(compare.ROOT / "build" / "python"), directory=str(directory), threads=threads)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    directory = compare.prepare("w6", 1)
    cache = pathlib.Path(tempfile.mkdtemp(prefix="fusetrain-capture-time-"))
    print(f"cpu: {compare.cpu_name()}")
    print("| run | from_pretrained (s) | first forward+backward (s) | second (s) | compile (s) | load + compile (s) |\n"
          "|---|---|---|---|---|---|")
    for name in ("empty cache", "from the cache", "from the cache"):
        r = run(directory, cache, 2)
        compile_s = r["first_step_s"] - r["step_s"]
        print(f"| {name} | {r['load_s']:.1f} | {r['first_step_s']:.1f} | {r['step_s']:.1f} | {compile_s:.1f} | "
              f"{r['load_s'] + compile_s:.1f} |")


if __name__ == "__main__":
    main()
