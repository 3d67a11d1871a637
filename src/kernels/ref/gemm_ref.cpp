#include "kernels/ref/gemm_ref.h"

#include <cstring>

namespace fusetrain::kernels {

namespace {

float bf16_to_f32(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T, typename Load>
void gemm_ref(const GemmShape& s, float alpha, const T* A, const T* B, float beta, float* C, Load load) {
  for (int64_t i = 0; i < s.M; i++) {
    for (int64_t j = 0; j < s.N; j++) {
      double sum = 0.0;
      for (int64_t k = 0; k < s.K; k++) {
        double a = load(s.trans_a ? A[k * s.lda + i] : A[i * s.lda + k]);
        double b = load(s.trans_b ? B[j * s.ldb + k] : B[k * s.ldb + j]);
        sum += a * b;
      }
      float* c = &C[i * s.ldc + j];
      *c = float(alpha * sum + (beta == 0.0f ? 0.0 : double(beta) * *c));
    }
  }
}

}  // namespace

void gemm_f32_ref(const GemmShape& shape, float alpha, const float* A, const float* B, float beta, float* C) {
  gemm_ref(shape, alpha, A, B, beta, C, [](float x) { return x; });
}

void gemm_bf16_ref(const GemmShape& shape, float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C) {
  gemm_ref(shape, alpha, A, B, beta, C, bf16_to_f32);
}

}  // namespace fusetrain::kernels
