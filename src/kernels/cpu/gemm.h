// Dense matrix multiply for the CPU backend.
//
// C (M, N) = alpha * op(A) (M, K) * op(B) (K, N) + beta * C, all row-major.
// trans_a: A is stored (K, M); trans_b: B is stored (N, K). Leading dimensions
// are in elements. beta == 0 overwrites C without reading it (NaN in C is
// fine); beta == 1 accumulates. K == 0 or alpha == 0 gives C = beta * C.
//
// The calls never allocate: packing workspace comes from `scratch`, which must
// hold at least the matching *_scratch_bytes() (any alignment). The code path
// is chosen per call by CPU feature (AVX-512 with AVX512_BF16, AVX-512, AVX2,
// portable); FUSETRAIN_GEMM=portable|avx2|avx512 in the environment caps it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusetrain/core/quant.h"

namespace fusetrain::kernels {

struct GemmShape {
  int64_t M, N, K;
  bool trans_a, trans_b;
  int64_t lda, ldb, ldc;
};

// Work on finished blocks of C while they are still in cache (bias, activation): once the
// last K block of a block of C is accumulated, apply(context, &C(row, col), ldc, row, col,
// rows, cols) runs for it on the thread that computed it. The blocks tile C exactly once.
// With row_align > 1 the threads' rows are split at multiples of it (and of the tile height), so each block of
// row_align rows is finished by one thread, its strips in row order for each range of columns.
struct GemmEpilogue {
  void (*apply)(const void* context, float* c, int64_t ldc, int64_t row, int64_t col, int64_t rows, int64_t cols);
  const void* context;
  int64_t row_align = 1;
};

// C may be null when an epilogue is given, beta is 0 and K <= gemm_strip_max_k(): each finished
// strip is then formed in a per-thread buffer inside scratch and handed to the epilogue (with that
// buffer's own row stride), and no (M, N) result is stored: for epilogues that write their own
// outputs (a rounded, activated copy) the f32 product never reaches memory.
int64_t gemm_strip_max_k(bool bf16_operands);

// How a parallel GEMM splits C among its threads. `adaptive` (the default): one equal block per thread while the
// threads run at the same measured rate, and blocks taken in turn from a shared counter (several per thread, so a
// thread slowed by another process on its core takes fewer) while they do not (kernels/cpu/thread_balance.h).
// `equal` and `shared` fix one split, for tests and benchmarks. Every split gives bit-identical results.
enum class GemmSplit { adaptive, equal, shared };
void set_gemm_split(GemmSplit split);

// Bytes of scratch for one call with num_threads threads (covers all of them).
size_t gemm_f32_scratch_bytes(const GemmShape& shape, int num_threads);
void gemm_f32(const GemmShape& shape, float alpha, const float* A, const float* B, float beta, float* C, void* scratch,
              int num_threads, const GemmEpilogue* epilogue = nullptr);

// A and B hold bf16 bit patterns; accumulation and C are fp32.
size_t gemm_bf16_scratch_bytes(const GemmShape& shape, int num_threads);
void gemm_bf16(const GemmShape& shape, float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C,
               void* scratch, int num_threads, const GemmEpilogue* epilogue = nullptr);

// A and B hold IEEE half bit patterns. No CPU this targets multiplies in f16, so
// the operands are converted to f32 in scratch first (exactly: every half is an
// f32) and the f32 GEMM runs: the products and f32 sums an fp16 tensor core forms.
size_t gemm_f16_scratch_bytes(const GemmShape& shape, int num_threads);
void gemm_f16(const GemmShape& shape, float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C,
              void* scratch, int num_threads, const GemmEpilogue* epilogue = nullptr);

// B from a 4-bit quantised weight W (rows, cols), dequantised while its panels are packed (no dequantised copy of W
// exists): trans_b gives C = A·Wᵀ (N = rows, K = cols), else C = A·W (K = rows, N = cols); ldb is unused. C is
// overwritten (alpha 1, beta 0). A in f32, or bf16 bit patterns (with a bf16 W on AVX512-BF16, vdpbf16ps products).
size_t gemm_quant4_scratch_bytes(const GemmShape& shape, int num_threads);
void gemm_quant4_f32(const GemmShape& shape, const float* A, const quant::QuantMatrix& W, float* C, void* scratch,
                     int num_threads, const GemmEpilogue* epilogue = nullptr);
void gemm_quant4_bf16(const GemmShape& shape, const uint16_t* A, const quant::QuantMatrix& W, float* C, void* scratch,
                      int num_threads, const GemmEpilogue* epilogue = nullptr);

// Strided batch: for b in [0, batch), C + b*stride_c = alpha * op(A + b*stride_a) * op(B + b*stride_b)
// + beta * (C + b*stride_c). stride_a or stride_b may be 0 to broadcast that operand.
size_t gemm_f32_batched_scratch_bytes(const GemmShape& shape, int64_t batch, int num_threads);
void gemm_f32_batched(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                      float alpha, const float* A, const float* B, float beta, float* C, void* scratch,
                      int num_threads);

size_t gemm_f16_batched_scratch_bytes(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b,
                                      int num_threads);
void gemm_f16_batched(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                      float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C, void* scratch,
                      int num_threads);

size_t gemm_bf16_batched_scratch_bytes(const GemmShape& shape, int64_t batch, int num_threads);
void gemm_bf16_batched(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                       float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C, void* scratch,
                       int num_threads);

}  // namespace fusetrain::kernels
