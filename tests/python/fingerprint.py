"""Bit-level fingerprints of what fusetrain computes: losses, logits and gradients, hashed exactly.

A refactor of the compiler, the kernels or the runtime that claims to change no arithmetic must leave
every fingerprint as it was. test_fingerprints.py compares against tests/python/fingerprints.json,
written by a build before the change:

    python tests/python/fingerprint.py --write          # parity cases (every architecture and head)
    python tests/python/fingerprint.py --workloads bench/.compare-work --out /tmp/w.json   # W1-W3
    python tests/python/fingerprint.py --workloads bench/.compare-work --build /tmp/base/build --out /tmp/b.json

Each parity case runs in train mode (dropout on, so the counter-based masks are covered) with two threads,
in fp32 and bf16 (all cases) and in fp16 and bf16 with recompute (the small size): the loss and the sha256
of every gradient after one step, then the losses of two AdamW steps; eval-mode logits for every case.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
STORED = HERE / "fingerprints.json"
# The bits depend on the kernels: the AVX-512 ones (fingerprints.json) or, on a CPU without AVX-512, the AVX2 ones
# (fingerprints-avx2.json: the AVX2 kernels round and sum in other orders); a CPU without AVX2 either runs the
# portable ones, which have none stored. The bf16 fingerprints of fingerprints.json are those of bf16 dot products
# (AVX512-BF16); an AVX-512 CPU without them widens bf16 to f32, as the AVX2 kernels of fingerprints-avx2.json do.
STORED_AVX2 = HERE / "fingerprints-avx2.json"


def cpu_has(feature: str) -> bool:
    import hf_models as hf

    return feature in hf.fusetrain_module().cpu_features().split()


def stored_path() -> pathlib.Path | None:
    """The fingerprints of the kernels this run takes: this CPU's widest, or those FUSETRAIN_KERNELS caps it to
    (None: none are stored for them, as for the portable kernels)."""
    cap = os.environ.get("FUSETRAIN_KERNELS", "")
    if cap == "portable":
        return None
    if cpu_has("avx512f") and cap != "avx2":
        return STORED
    return STORED_AVX2 if cpu_has("avx2") and cpu_has("fma") else None


def modes() -> list[str]:
    """The precision modes whose fingerprints are stored for this CPU's kernels (all but bf16 on an AVX-512 CPU
    without AVX512-BF16, whose widened bf16 GEMM rounds differently from the stored bf16 dot products)."""
    native_or_widened = stored_path() != STORED or cpu_has("avx512_bf16")
    return [m for m in MODES if native_or_widened or not m.startswith("bf16")]
THREADS = 2  # results depend on how work is split: fixed, so the fingerprints do not depend on the machine
MODES = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp16": {"fp16": True},
    "bf16_recompute": {"bf16": True, "recompute": True},
}


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:24]


def configure(model, mode: str):
    model.set_num_threads(THREADS)
    for key, value in MODES[mode].items():
        setattr(model, key, value)
    if mode == "fp16":
        model.loss_scale = 1024.0


def train_fingerprint(fusetrain, model, batches) -> dict:
    """Loss and gradient digest of one step on batches[0], then the losses of AdamW steps on every batch."""
    model.train()
    loss, grads = model.loss_and_grads(**batches[0])
    out = {"loss": float(loss).hex(), "grads": digest(grads[k] for k in sorted(grads))}
    optimizer = fusetrain.AdamW(model, lr=1e-3, weight_decay=0.01)
    losses = []
    for batch in batches:
        model.zero_grad()
        losses.append(float(model.accumulate_grads(**batch)).hex())
        optimizer.clip_and_step(1.0)
    out["steps"] = losses
    return out


def case_fingerprints() -> dict:
    import hf_models as hf
    import test_parity_models as parity

    fusetrain = hf.fusetrain_module()
    result = {}
    for case in parity.CASES + parity.VARIANTS:
        directory = hf.reference_dir(case)
        try:
            probe = fusetrain.Model.from_pretrained(directory)
        except ValueError as refusal:  # a variant fusetrain refuses (hf_models.Variant.may_refuse)
            result[f"{case.id}/refused"] = {"error": str(refusal)}
            continue
        probe.set_num_threads(THREADS)
        probe.eval()
        outputs = probe.forward(**hf.make_batch(case, labels=False))
        result[f"{case.id}/eval"] = {"logits": digest(np.asarray(outputs[k]) for k in sorted(outputs))}
        if case.task == "base":
            continue
        batches = [hf.make_batch(case, seed=s) for s in range(2)]
        for mode in modes():
            if mode in ("fp16", "bf16_recompute") and case.size != "small":
                continue
            model = fusetrain.Model.from_pretrained(directory)
            configure(model, mode)
            result[f"{case.id}/{mode}"] = train_fingerprint(fusetrain, model, batches)
    return result


def workload_fingerprints(work: pathlib.Path, steps: int, build: pathlib.Path) -> dict:
    """W1-W3 as bench/compare.py prepares them: `steps` full steps in fp32 and bf16, with the module of `build`."""
    sys.path.insert(0, str(build / "python"))
    import fusetrain

    result = {}
    for directory in sorted(p for p in work.iterdir() if (p / "batches.npz").exists()):
        data = np.load(directory / "batches.npz")
        batches = [{k: data[k][i] for k in data.files} for i in range(steps)]
        for mode in [m for m in ("fp32", "bf16") if m in modes()]:
            model = fusetrain.Model.from_pretrained(str(directory))
            configure(model, mode)
            result[f"{directory.name}/{mode}"] = train_fingerprint(fusetrain, model, batches)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help=f"write the parity fingerprints to {STORED.name} ({STORED_AVX2.name} on a CPU "
                             "without AVX-512)")
    parser.add_argument("--workloads", type=pathlib.Path, help="bench/compare.py's work directory (W1-W3)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--build", type=pathlib.Path, default=HERE.parents[1] / "build",
                        help="the build whose Python module --workloads runs (another checkout's, to compare)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.workloads:
        prints = workload_fingerprints(args.workloads, args.steps, args.build)
    else:
        import conftest  # noqa: F401  (puts the development build on sys.path)

        prints = case_fingerprints()
    text = json.dumps(prints, indent=1, sort_keys=True) + "\n"
    target = stored_path() if args.write else args.out
    if args.write and target is None:
        sys.exit("fingerprint.py --write: this CPU runs the portable kernels (no AVX2 + FMA), which have no stored "
                 "fingerprints")
    if target:
        target.write_text(text)
        print(f"{len(prints)} fingerprints written to {target}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
