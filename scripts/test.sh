#!/usr/bin/env bash
# Sets up the machine, builds, and runs the whole test suite, then every fuzz target for a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
(cd build && ctest --output-on-failure --timeout 1500)
# libFuzzer under ASan + UBSan, FUZZ_SECONDS per target over its seed corpus (clang build in build-fuzz/).
bash scripts/fuzz.sh "${FUZZ_SECONDS:-5}"
