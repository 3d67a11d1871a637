// Tuned softmax over the last axis, f32, and its backward; portable, AVX2 and AVX-512 paths.
//
// Shape legend: R rows (product of the leading axes), C channels (last axis).
//   forward:  x (R, C) -> y (R, C); y may alias x
//   backward: dy (R, C), y (R, C) -> dx (R, C) = y * (dy - sum(dy * y)); dx may alias dy
// Rows are split across threads; each row is one L1-resident pass set:
// max, then exp(x - max) with the running sum, then the 1/sum scale.
#include <cmath>
#include <limits>

#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// ---- one row ----------------------------------------------------------------------

// y: (C), x: (C)
void softmax_row_portable(float* y, const float* x, int64_t C) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < C; ++c) max = std::max(max, x[c]);
  float sum = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    y[c] = std::exp(x[c] - max);
    sum += y[c];
  }
  const float inv = 1.0f / sum;
  for (int64_t c = 0; c < C; ++c) y[c] *= inv;
}

FT_AVX512 void softmax_row_avx512(float* y, const float* x, int64_t C) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax0 = neg_inf, vmax1 = neg_inf;
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    vmax0 = _mm512_max_ps(vmax0, _mm512_loadu_ps(x + c));
    vmax1 = _mm512_max_ps(vmax1, _mm512_loadu_ps(x + c + 16));
  }
  for (; c < C; c += 16) vmax0 = _mm512_max_ps(vmax0, _mm512_mask_loadu_ps(neg_inf, tail_mask(C - c), x + c));
  const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(vmax0, vmax1)));

  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (c = 0; c + 32 <= C; c += 32) {
    __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + c), vm));
    __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + c + 16), vm));
    _mm512_storeu_ps(y + c, e0);
    _mm512_storeu_ps(y + c + 16, e1);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  for (; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + c), vm));
    _mm512_mask_storeu_ps(y + c, m, e);
    sum0 = _mm512_mask_add_ps(sum0, m, sum0, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1)));
  for (c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    _mm512_mask_storeu_ps(y + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + c), inv));
  }
}

FT_AVX2 void softmax_row_avx2(float* y, const float* x, int64_t C) {
  const __m256 vm = _mm256_set1_ps(row_max8(x, C));
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + c), vm));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + c + 8), vm));
    _mm256_storeu_ps(y + c, e0);
    _mm256_storeu_ps(y + c + 8, e1);
    sum0 = _mm256_add_ps(sum0, e0);
    sum1 = _mm256_add_ps(sum1, e1);
  }
  for (; c < C; c += 8) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(load8(x + c, C - c), vm)), _mm256_castsi256_ps(lanes8(C - c)));
    store8(y + c, C - c, e);
    sum0 = _mm256_add_ps(sum0, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / reduce_add8(_mm256_add_ps(sum0, sum1)));
  for (c = 0; c < C; c += 8) store8(y + c, C - c, _mm256_mul_ps(load8(y + c, C - c), inv));
}

// dx: (C), dy: (C), y: (C)
void softmax_backward_row_portable(float* dx, const float* dy, const float* y, int64_t C) {
  float dot = 0.0f;
  for (int64_t c = 0; c < C; ++c) dot += dy[c] * y[c];
  for (int64_t c = 0; c < C; ++c) dx[c] = y[c] * (dy[c] - dot);
}

FT_AVX512 void softmax_backward_row_avx512(float* dx, const float* dy, const float* y, int64_t C) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(dy + c), _mm512_loadu_ps(y + c), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(dy + c + 16), _mm512_loadu_ps(y + c + 16), acc1);
  }
  for (; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, dy + c), _mm512_maskz_loadu_ps(m, y + c), acc0);
  }
  const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)));
  for (c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    __m512 g = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dy + c), dot);
    _mm512_mask_storeu_ps(dx + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + c), g));
  }
}

FT_AVX2 void softmax_backward_row_avx2(float* dx, const float* dy, const float* y, int64_t C) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(dy + c), _mm256_loadu_ps(y + c), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(dy + c + 8), _mm256_loadu_ps(y + c + 8), acc1);
  }
  for (; c < C; c += 8) acc0 = _mm256_fmadd_ps(load8(dy + c, C - c), load8(y + c, C - c), acc0);
  const __m256 dot = _mm256_set1_ps(reduce_add8(_mm256_add_ps(acc0, acc1)));
  for (c = 0; c < C; c += 8)
    store8(dx + c, C - c, _mm256_mul_ps(load8(y + c, C - c), _mm256_sub_ps(load8(dy + c, C - c), dot)));
}

using SoftmaxRowFn = void (*)(float*, const float*, int64_t);
using SoftmaxBackwardRowFn = void (*)(float*, const float*, const float*, int64_t);

// ---- kernels ------------------------------------------------------------------------

// y (R, C) = softmax(x (R, C)) along C.
class SoftmaxKernel final : public Kernel {
 public:
  SoftmaxKernel(int64_t rows, int64_t C)
      : rows_(rows), C_(C), row_fn_(pick_path<SoftmaxRowFn>(softmax_row_portable, softmax_row_avx2, softmax_row_avx512)) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());
    float* y = static_cast<float*>(args.outputs[0].data());
    const int64_t C = C_;
    parallel_for(rows_, threads_for(rows_ * C, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) row_fn_(y + r * C, x + r * C, C);
    });
  }

 private:
  int64_t rows_, C_;
  SoftmaxRowFn row_fn_;
};

// dx (R, C) = y * (dy - sum_c(dy * y)).
class SoftmaxBackwardKernel final : public Kernel {
 public:
  SoftmaxBackwardKernel(int64_t rows, int64_t C)
      : rows_(rows),
        C_(C),
        row_fn_(pick_path<SoftmaxBackwardRowFn>(softmax_backward_row_portable, softmax_backward_row_avx2,
                                                softmax_backward_row_avx512)) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* dy = static_cast<const float*>(args.inputs[0].data());
    const float* y = static_cast<const float*>(args.inputs[1].data());
    float* dx = static_cast<float*>(args.outputs[0].data());
    const int64_t C = C_;
    parallel_for(rows_, threads_for(rows_ * C, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) row_fn_(dx + r * C, dy + r * C, y + r * C, C);
    });
  }

 private:
  int64_t rows_, C_;
  SoftmaxBackwardRowFn row_fn_;
};

}  // namespace

std::unique_ptr<Kernel> make_softmax_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  if (input_dtype(call, 0) != DType::f32 || x.rank() < 1 || x[-1] == 0) return nullptr;
  return std::make_unique<SoftmaxKernel>(x.numel() / x[-1], x[-1]);
}

std::unique_ptr<Kernel> make_softmax_backward_kernel(const KernelCall& call) {
  const Shape& y = input_shape(call, 1);
  if (input_dtype(call, 0) != DType::f32 || y.rank() < 1 || y[-1] == 0) return nullptr;
  return std::make_unique<SoftmaxBackwardKernel>(y.numel() / y[-1], y[-1]);
}

}  // namespace fusetrain::kernels::cpu_basic
