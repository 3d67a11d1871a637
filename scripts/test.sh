#!/usr/bin/env bash
# Sets up the machine, builds, and runs the whole test suite, then the C++ suite under ASan + UBSan and every
# fuzz target for a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
(cd build && ctest --output-on-failure --timeout 2700)  # python_tests: ~12 min with AVX-512, ~23 on an AVX2-only Zen 1
# The Python suite's 20 slowest tests (ctest keeps a passing test's output in its log only).
sed -n '/slowest 20 durations/,/^[0-9]* passed/p' build/Testing/Temporary/LastTest.log
# The C++ suite under AddressSanitizer + UBSan (clang build in build-asan/, about 6.5 minutes cold on 2 cores);
# `scripts/sanitize.sh` also runs it under ThreadSanitizer.
bash scripts/sanitize.sh asan
# libFuzzer under ASan + UBSan, FUZZ_SECONDS per target over its seed corpus (clang build in build-fuzz/).
bash scripts/fuzz.sh "${FUZZ_SECONDS:-5}"
# The wheel installed and run in a bare Debian root (scripts/clean_room.sh): minutes, root, Debian's and PyPI's
# servers; on when FUSETRAIN_CLEAN_ROOM=1.
if [[ ${FUSETRAIN_CLEAN_ROOM:-0} == 1 ]]; then
  bash scripts/clean_room.sh
fi
# The drop-in and example-script tests under other transformers / torch versions (scripts/version_matrix.sh): about
# ten minutes a cell and PyPI's servers; on when FUSETRAIN_VERSION_MATRIX=1.
if [[ ${FUSETRAIN_VERSION_MATRIX:-0} == 1 ]]; then
  bash scripts/version_matrix.sh
fi
