#!/usr/bin/env bash
# The C++ test suite under sanitizers. Each build uses the compiler whose instrumentation sees more of the AVX-512
# kernels:
#   build-asan/  clang++-14, AddressSanitizer + UBSan (LeakSanitizer at exit, libstdc++ assertions): clang checks
#                masked AVX-512 loads and stores lane by lane (the kernels' row tails); g++'s ASan skips them.
#   build-tsan/  g++, ThreadSanitizer, with LLVM's libomp as the OpenMP runtime and its Archer tool: g++'s TSan sees
#                full-width vector loads and stores (clang's skips them), and Archer tells TSan about libomp's
#                barriers and reductions (libgomp's are invisible to TSan and read as races).
# ASan runs fusetrain_tests (every case) and the MLP example; TSan runs fusetrain_tests with 4 OpenMP threads (the
# data loader's producer thread, the tokenizer's threads and every OpenMP kernel and optimizer loop).
# fusetrain_no_allocation_test is left out: it replaces malloc and free with glibc's, taking the heap from ASan.
# Prints, per run, the tests run and failed and the sanitizer findings; exits 1 on any finding or failure.
# Logs: build-asan/sanitize-*.log, build-tsan/sanitize-*.log.
#
# usage: scripts/sanitize.sh [asan] [tsan]      (default: both)
# Environment: JOBS (build jobs, default: nproc), TSAN_THREADS (OpenMP threads under TSan, default 4),
#              GTEST_FILTER (narrow fusetrain_tests, e.g. 'DataLoader.*').
set -euo pipefail
cd "$(dirname "$0")/.."

runs=("$@")
((${#runs[@]})) || runs=(asan tsan)
LLVM=/usr/lib/llvm-14
JOBS=${JOBS:-$(nproc)}
for tool in clang++-14 "$LLVM/lib/libarcher.so" "$LLVM/lib/libomp.so"; do
  [[ -e "$tool" ]] || command -v "$tool" >/dev/null ||
    { echo "sanitize: $tool not found; run scripts/setup.sh (clang-14, libclang-rt-14-dev, libomp-14-dev, llvm-14)" >&2; exit 2; }
done
export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-$LLVM/bin/llvm-symbolizer}
export ASAN_OPTIONS=detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# configure_and_build DIR SANITIZE [cmake args...] -- TARGET...
configure_and_build() {
  local dir=$1 sanitize=$2
  shift 2
  local cmake_args=()
  while [[ $1 != -- ]]; do cmake_args+=("$1"); shift; done
  shift
  mkdir -p "$dir"
  local start=$SECONDS
  if ! { cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSETRAIN_SANITIZE="$sanitize" \
           -DFUSETRAIN_BUILD_TESTS=ON -DFUSETRAIN_BUILD_EXAMPLES=ON -DFUSETRAIN_BUILD_PYTHON=OFF "${cmake_args[@]}" &&
         ninja -C "$dir" -j "$JOBS" "$@"; } >"$dir/sanitize-build.log" 2>&1; then
    tail -40 "$dir/sanitize-build.log" >&2
    echo "sanitize: the $sanitize build failed (log: $dir/sanitize-build.log)" >&2
    exit 2
  fi
  echo "$dir: built in $((SECONDS - start)) s"
}

status=0
summary=()
# check NAME LOG EXIT_CODE: one summary line from a run's log.
check() {
  local name=$1 log=$2 code=$3
  local ran failed findings
  ran=$(sed -n 's/^\[==========\] \([0-9]*\) tests\? from .* ran\..*/\1/p' "$log" | tail -1)
  failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\?, listed below:/\1/p' "$log" | tail -1)
  findings=$(grep -c -E 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|WARNING: ThreadSanitizer' "$log" || true)
  failed=${failed:-0}
  summary+=("$(printf '%-34s %6s %7s %9s %5s  %s' "$name" "${ran:--}" "$failed" "$findings" "$code" "$log")")
  ((code == 0 && findings == 0 && failed == 0)) || status=1
}

# run NAME LOG COMMAND...: runs a test binary, its output to LOG, and records it.
run() {
  local name=$1 log=$2
  shift 2
  local start=$SECONDS code=0
  timeout 1500 "$@" >"$log" 2>&1 || code=$?
  echo "$name: $((SECONDS - start)) s"
  check "$name" "$log" "$code"
}

gtest_args=()
[[ -n "${GTEST_FILTER:-}" ]] && gtest_args=(--gtest_filter="$GTEST_FILTER")

for which in "${runs[@]}"; do
  case "$which" in
    asan)
      configure_and_build build-asan address,undefined -DCMAKE_CXX_COMPILER=clang++-14 -- fusetrain_tests mlp_train
      run "asan+ubsan fusetrain_tests" build-asan/sanitize-tests.log build-asan/fusetrain_tests "${gtest_args[@]}"
      run "asan+ubsan mlp_train" build-asan/sanitize-mlp.log build-asan/mlp_train --min-accuracy 0.95
      ;;
    tsan)
      # g++ links its OpenMP library by the name libgomp; LLVM's directory holds libomp under that name (GNU ABI).
      configure_and_build build-tsan thread -DCMAKE_CXX_COMPILER=g++ \
        "-DCMAKE_EXE_LINKER_FLAGS=-L$LLVM/lib -Wl,-rpath,$LLVM/lib" -- fusetrain_tests
      if [[ $(ldd build-tsan/fusetrain_tests) != *libomp.so* ]]; then
        echo "sanitize: build-tsan/fusetrain_tests does not link LLVM's libomp" >&2
        exit 2
      fi
      OMP_NUM_THREADS=${TSAN_THREADS:-4} OMP_TOOL_LIBRARIES=$LLVM/lib/libarcher.so ARCHER_OPTIONS=verbose=1 \
        TSAN_OPTIONS=ignore_noninstrumented_modules=1:history_size=4 \
        run "tsan fusetrain_tests" build-tsan/sanitize-tests.log build-tsan/fusetrain_tests "${gtest_args[@]}"
      # Without Archer, libomp's barriers would show up as races; a filtered run may use no OpenMP at all.
      if [[ -z "${GTEST_FILTER:-}" ]] && ! grep -q 'Archer detected OpenMP application with TSan' build-tsan/sanitize-tests.log; then
        echo "sanitize: Archer did not start; OpenMP synchronisation was invisible to TSan" >&2
        status=1
      fi
      ;;
    *) echo "sanitize: unknown run '$which' (asan, tsan)" >&2; exit 2 ;;
  esac
done

printf '%-34s %6s %7s %9s %5s  %s\n' run tests failed findings exit log
printf '%s\n' "${summary[@]}"
exit "$status"
