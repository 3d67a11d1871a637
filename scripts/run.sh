#!/usr/bin/env bash
# Sets up, builds, and runs the main job: `fusetrain train` with no arguments
# fine-tunes all-MiniLM-L6-v2 on a bundled SST-2 slice and prints dev accuracy.
# Arguments are passed to `fusetrain train` (any of them replaces the default job).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh fusetrain
./build/fusetrain info
./build/fusetrain train "$@"
