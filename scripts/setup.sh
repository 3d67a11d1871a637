#!/usr/bin/env bash
# Installs everything fusetrain needs to build, test and benchmark, from
# Debian's packages and PyPI. Safe to run again: it installs only what is missing.
set -euo pipefail

APT_PACKAGES=(
  g++ cmake ninja-build ccache pkg-config
  libdnnl-dev            # oneDNN: the benchmark baseline for matmul
  nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
PY_PACKAGES=(numpy pytest)
py_missing=()
for pkg in "${PY_PACKAGES[@]}"; do
  "$PYTHON" -c "import $pkg" 2>/dev/null || py_missing+=("$pkg")
done
if ((${#py_missing[@]})); then
  echo "setup: pip installing ${py_missing[*]}"
  "$PYTHON" -m pip install -q "${py_missing[@]}"
fi
