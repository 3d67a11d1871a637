"""Losses, logits and gradients are bit-identical to the stored fingerprints (fingerprint.py): a change to the
compiler, passes, kernels or runtime that is meant to keep the arithmetic must not move a single bit. A change that
means to alter results rewrites fingerprints.json with `python tests/python/fingerprint.py --write` and says why.
The AVX-512 kernels and the AVX2 ones (a CPU without AVX-512) have fingerprints of their own."""

import json

import pytest

import fingerprint


def test_every_case_is_bit_identical_to_the_stored_fingerprints():
    path = fingerprint.stored_path()
    if path is None:
        pytest.skip("no fingerprints are stored for the portable kernels (a CPU without AVX2 + FMA)")
    # An AVX-512 CPU without AVX512-BF16 computes no bf16 modes (fingerprint.modes()): its widened bf16 GEMM rounds
    # differently from the stored bf16 dot products, so those stored cases are not compared on it.
    stored = {key: value for key, value in json.loads(path.read_text()).items()
              if key.rsplit("/", 1)[1] in ("eval", "refused", *fingerprint.modes())}
    computed = fingerprint.case_fingerprints()
    assert sorted(computed) == sorted(stored), (
        f"cases differ: new {sorted(set(computed) - set(stored))}, gone {sorted(set(stored) - set(computed))}")
    changed = [f"{key}: stored {stored[key]}, computed {computed[key]}" for key in sorted(stored)
               if stored[key] != computed[key]]
    assert not changed, f"{len(changed)} of {len(stored)} fingerprints changed:\n  " + "\n  ".join(changed)
