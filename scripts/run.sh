#!/usr/bin/env bash
# Sets up, builds, and runs the main job: the MLP training example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh fusetrain mlp_train
./build/fusetrain --version
./build/mlp_train "$@"
