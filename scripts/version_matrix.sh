#!/usr/bin/env bash
# The Python layer against the library versions its users have: each cell of the matrix is a virtual environment
# (under build/matrix/) that sees this machine's packages (scripts/setup.sh) with the cell's versions installed over
# them, and runs the drop-in and example-script tests there against build/python. Prints one line per cell and
# writes build/matrix/results.md. Cells: a name and its pip requirements; `bash scripts/version_matrix.sh NAME...`
# runs only those. It takes about ten minutes a cell and PyPI's servers; `FUSETRAIN_VERSION_MATRIX=1 bash
# scripts/test.sh` runs it after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
declare -A CELLS=(
  # transformers before 5.3: fusetrain.Trainer refuses it at import (python/fusetrain/_versions.py); its cell runs
  # tests/python/test_versions.py, which checks that refusal (datasets 5 needs huggingface_hub 1.x, which
  # transformers 4.57 refuses).
  [transformers-4.57]="transformers==4.57.6 datasets<5"
  # The oldest transformers the drop-ins support (pyproject.toml), with the newest torch, PEFT and TRL, and the
  # kernels package in the range transformers 5.3 declares (the newer one beside transformers 5.x fails its import).
  [transformers-5.3]="transformers==5.3.0 kernels>=0.10.2,<0.11"
  # The newest transformers, torch, PEFT and TRL: what scripts/setup.sh installs.
  [newest]=""
  # The newest torch this machine's package index holds (a CUDA build; its CUDA libraries are not used on a CPU).
  [torch-2.14]="torch==2.14.1"
)
ORDER=(transformers-4.57 transformers-5.3 newest torch-2.14)
TESTS=(tests/python/test_versions.py tests/python/test_trainer_api.py tests/python/test_example_scripts.py
       tests/python/test_trl.py tests/python/test_dpo.py)
declare -A CELL_TESTS=([transformers-4.57]="tests/python/test_versions.py")

cells=("$@")
((${#cells[@]})) || cells=("${ORDER[@]}")
[[ -d build/python/fusetrain ]] || { echo "version_matrix: build/python is missing; run scripts/build.sh" >&2; exit 2; }
mkdir -p build/matrix
results=build/matrix/results.md
echo "| cell | transformers | torch | peft | trl | tests run | result |" >"$results"
echo "|---|---|---|---|---|---|---|" >>"$results"
status=0
for cell in "${cells[@]}"; do
  [[ -v CELLS[$cell] ]] || { echo "version_matrix: unknown cell $cell (cells: ${ORDER[*]})" >&2; exit 2; }
  venv=build/matrix/$cell
  if [[ ! -x $venv/bin/python ]]; then
    "$PYTHON" -m venv --system-site-packages "$venv"
  fi
  if [[ -n ${CELLS[$cell]} ]]; then
    # shellcheck disable=SC2086  # the cell's requirements are words
    "$venv/bin/python" -m pip install -q ${CELLS[$cell]} 2>&1 | grep -v "dependency conflicts\|requires\|^$\|WARNING: Location" || true
  fi
  versions=$("$venv/bin/python" -c "
import importlib.metadata as m
print(' | '.join(m.version(p) for p in ('transformers', 'torch', 'peft', 'trl')))")
  log=build/matrix/$cell.log
  start=$SECONDS
  tests=("${TESTS[@]}")
  # shellcheck disable=SC2206  # a cell's own test list is words
  [[ -v CELL_TESTS[$cell] ]] && tests=(${CELL_TESTS[$cell]})
  if PYTHONPATH=build/python "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" >"$log" 2>&1; then
    outcome="passed"
  else
    outcome="FAILED"
    status=1
  fi
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | tr -d '=' | xargs)
  echo "| $cell | $versions | ${tests[*]##*/} | $outcome: $summary ($((SECONDS - start)) s) |" >>"$results"
  echo "version_matrix: $cell ($versions): $outcome: $summary (log: $log)"
done
cat "$results"
exit $status
