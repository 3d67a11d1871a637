#!/usr/bin/env bash
# Configures and builds into build/ (ccache keeps rebuilds cheap). Extra
# arguments are passed to ninja (targets).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSETRAIN_BUILD_TESTS=ON \
  -DFUSETRAIN_BUILD_EXAMPLES=ON ${CMAKE_ARGS:-} >/dev/null
ninja -C "$BUILD_DIR" -j "${JOBS:-$(nproc)}" "$@"
