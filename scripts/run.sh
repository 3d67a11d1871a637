#!/usr/bin/env bash
# Sets up, builds, and runs the main job: `fusetrain train` with no arguments
# fine-tunes all-MiniLM-L6-v2 on a bundled SST-2 slice and prints dev accuracy.
# Arguments are passed to `fusetrain train` (any of them replaces the default job).
# It installs and builds only what the main job needs; scripts/test.sh adds the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_main.sh
bash scripts/build.sh --main-job fusetrain
./build/fusetrain info
./build/fusetrain train "$@"
