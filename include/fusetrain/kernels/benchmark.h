// Measuring the machine: what fusetrain's own GEMM reaches here, the peak that benchmarks divide model FLOPs by.
#pragma once

#include <cstdint>

namespace fusetrain::kernels {

/// Best throughput in GFLOP/s of fusetrain's GEMM computing C (M, N) = A (M, K) · B (K, N), in float32 or in
/// bfloat16 with float32 accumulation (whichever code path this CPU gets), on `num_threads` threads (0: all cores):
/// the best of `repeats` timings of three calls each, after one warm-up call. Allocates its operands.
double measure_matmul_gflops(int64_t M, int64_t N, int64_t K, bool bf16, int num_threads, int repeats = 5);

}  // namespace fusetrain::kernels
