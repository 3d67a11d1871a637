#!/usr/bin/env bash
# Configures and builds into build/ (ccache keeps rebuilds cheap). With --main-job first, only what the main job
# needs (no tests, examples or Python module: scripts/run.sh); other arguments are passed to ninja (targets).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
PARTS="-DFUSETRAIN_BUILD_TESTS=ON -DFUSETRAIN_BUILD_EXAMPLES=ON -DFUSETRAIN_BUILD_PYTHON=ON"
if [[ ${1:-} == --main-job ]]; then
  PARTS="-DFUSETRAIN_BUILD_TESTS=OFF -DFUSETRAIN_BUILD_EXAMPLES=OFF -DFUSETRAIN_BUILD_PYTHON=OFF"
  shift
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release $PARTS ${CMAKE_ARGS:-} >/dev/null
ninja -C "$BUILD_DIR" -j "${JOBS:-$(nproc)}" "$@"
