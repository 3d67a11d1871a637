// Measuring the machine: what fusetrain's own GEMM reaches here, the peak that benchmarks divide model FLOPs by.
#pragma once

#include <cstdint>

namespace fusetrain::kernels {

/// Best throughput in GFLOP/s of fusetrain's GEMM computing C (M, N) = A (M, K) · B (K, N), in float32 or in
/// bfloat16 with float32 accumulation (whichever code path this CPU gets), on `num_threads` threads (0: all cores):
/// the best of `repeats` timings of three calls each, after one warm-up call. Allocates its operands.
double measure_matmul_gflops(int64_t M, int64_t N, int64_t K, bool bf16, int num_threads, int repeats = 5);

/// The same for C (M, N) = A (M, K) · op(B) with A in bfloat16 and B a weight W in bfloat16 or, with `nf4`, NF4
/// (blocks of 64) dequantised as the GEMM packs it (gemm_quant4_bf16): `trans_b` stores W (N, K) (a Linear's
/// forward, x·Wᵀ), else (K, N) (its input gradient, dy·W).
double measure_weight_matmul_gflops(int64_t M, int64_t N, int64_t K, bool trans_b, bool nf4, int num_threads,
                                    int repeats = 5);

}  // namespace fusetrain::kernels
