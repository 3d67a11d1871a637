// Plain-loop reference GEMM; the tests compare kernels/cpu/gemm against it.
// Same contract as kernels/cpu/gemm.h: C (M, N) = alpha * op(A) * op(B) + beta * C, row-major,
// trans_a: A stored (K, M), trans_b: B stored (N, K); beta == 0 overwrites C.
#pragma once

#include <cstdint>

#include "kernels/cpu/gemm.h"

namespace fusetrain::kernels {

void gemm_f32_ref(const GemmShape& shape, float alpha, const float* A, const float* B, float beta, float* C);
// A, B: bf16 bit patterns, products accumulated in double.
void gemm_bf16_ref(const GemmShape& shape, float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C);

}  // namespace fusetrain::kernels
