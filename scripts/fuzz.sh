#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) into build-fuzz/ with clang++-14 (ASan + UBSan) and runs each over a scratch
# copy of its seed corpus (fuzz/corpus/<target>/), one after another. Prints, per target, the executions, libFuzzer's
# coverage figures (cov: edges, ft: features), the corpus it ended with, the time and whether it crashed; exits 1 when
# any target crashed. Reproducers go to build-fuzz/crashes/<target>/ (ignored by git), libFuzzer's output to
# build-fuzz/logs/<target>.log. Inputs slower than 10 s are saved there too (slow-unit-*) but are not failures.
#
# usage: scripts/fuzz.sh [SECONDS_PER_TARGET | --runs N] [TARGET ...]    (default: 60 seconds each, every target)
# Replay a reproducer:  build-fuzz/fuzz/fuzz_<target> build-fuzz/crashes/<target>/crash-...
# Environment: FUZZ_BUILD_DIR (build-fuzz), JOBS (build jobs, default: nproc), FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail
cd "$(dirname "$0")/.."

limit=(-max_total_time=60)
targets=()
while (($#)); do
  case "$1" in
    --runs) limit=(-runs="$2"); shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    [0-9]*) limit=(-max_total_time="$1"); shift ;;
    *) targets+=("$1"); shift ;;
  esac
done
((${#targets[@]})) || targets=(safetensors hf_dir config tokenizer tokenizer_dir dataset checkpoint onnx_import features)

CXX_FUZZ=${CXX_FUZZ:-clang++-14}
command -v "$CXX_FUZZ" >/dev/null ||
  { echo "fuzz: $CXX_FUZZ not found; run scripts/setup.sh (clang-14, libclang-rt-14-dev, libomp-14-dev)" >&2; exit 2; }
# Sanitizer reports name source lines through llvm-symbolizer (package llvm-14, which installs it under this name).
[[ -z "${ASAN_SYMBOLIZER_PATH:-}" && -x /usr/lib/llvm-14/bin/llvm-symbolizer ]] &&
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$CXX_FUZZ" -DFUSETRAIN_BUILD_FUZZ=ON \
  -DFUSETRAIN_BUILD_TESTS=OFF -DFUSETRAIN_BUILD_EXAMPLES=OFF -DFUSETRAIN_BUILD_PYTHON=OFF >/dev/null
mkdir -p "$BUILD/logs"
if ! ninja -C "$BUILD" -j "${JOBS:-$(nproc)}" "${targets[@]/#/fuzz_}" >"$BUILD/logs/build.log" 2>&1; then
  tail -40 "$BUILD/logs/build.log" >&2
  exit 2
fi
printf '%-14s %10s %8s %7s %8s %14s %7s  %s\n' target executions seconds cov ft corpus crashes reproducer
status=0
scratch_root=$BUILD/scratch
[[ -d /dev/shm && -w /dev/shm ]] && scratch_root=/dev/shm
for target in "${targets[@]}"; do
  # Targets write the files they parse into a scratch directory: on tmpfs, since rewriting a file on ext4 flushes it.
  corpus="$BUILD/corpus/$target" crashes="$BUILD/crashes/$target" scratch="$scratch_root/fusetrain-fuzz-$target-$$"
  rm -rf "$corpus" "$scratch"
  mkdir -p "$corpus" "$crashes" "$scratch"
  cp fuzz/corpus/"$target"/* "$corpus"/
  log="$BUILD/logs/$target.log"
  start=$(date +%s)
  rc=0
  # -timeout: one input taking longer than this is a finding (a hang); -rss_limit_mb: so is using more memory.
  FUSETRAIN_FUZZ_SCRATCH="$scratch" "$BUILD/fuzz/fuzz_$target" "${limit[@]}" -timeout=60 -rss_limit_mb=2560 \
    -print_final_stats=1 -artifact_prefix="$crashes/" ${FUZZ_ARGS:-} "$corpus" >"$log" 2>&1 || rc=$?
  seconds=$(($(date +%s) - start))
  rm -rf "$scratch"
  # The last status line ("#N DONE cov: C ft: F corp: E/Bb ...", or the last progress line before a crash).
  status_line=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  field() { sed -nE "s/.* $1: ([^ ]+).*/\1/p" <<<"$status_line"; }
  executions=$(sed -nE 's/^stat::number_of_executed_units: ([0-9]+)/\1/p' "$log" | tail -1)
  reproducer=$(sed -nE 's/.*Test unit written to (.*)$/\1/p' "$log" | grep -v '/slow-unit-' | tail -1 || true)
  crashed=0
  if ((rc != 0)) || [[ -n "$reproducer" ]]; then
    crashed=1
    status=1
  fi
  printf '%-14s %10s %8s %7s %8s %14s %7s  %s\n' "$target" "${executions:-?}" "$seconds" "$(field cov)" "$(field ft)" \
    "$(field corp)" "$crashed" "${reproducer:-}"
  slow=$(grep -c 'Test unit written to .*/slow-unit-' "$log" || true)
  ((slow)) && echo "    $slow input(s) took over 10 s (not a failure): $crashes/slow-unit-*" >&2
  if ((crashed)); then
    grep -E '^(fuzz: |==[0-9]+==ERROR|SUMMARY|.*runtime error)' "$log" | head -5 | sed 's/^/    /' >&2 || true
  fi
done
exit $status
