// Tuned LayerNorm over the last axis, f32, its fused backward, and AddLayerNorm (residual add first);
// portable, AVX2 and AVX-512 paths.
//
// Shape legend: R rows (product of the leading axes), C channels.
//   forward:  x (R, C), gamma (C), beta (C) -> y (R, C), mean (R), rstd (R)
//   backward: dy (R, C), x (R, C), gamma (C), mean (R), rstd (R)
//             -> dx (R, C) (may alias dy), dgamma (C), dbeta (C)
// Statistics take one pass per row, shifted by the row's first element so a
// large common offset does not cancel: with d = x - x[0], mean = x[0] + E[d],
// var = E[d^2] - E[d]^2 (biased), rstd = 1/sqrt(var + eps), all fp32.
// Backward: xhat = (x - mean) * rstd, g = dy * gamma,
//   dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),
//   dgamma = sum_r dy * xhat, dbeta = sum_r dy.
// Each thread sums dgamma/dbeta for its rows into its own (2, C) slice of
// scratch; after a barrier the slices are added in thread order, so the result
// is deterministic for a given thread count.
#include <cmath>
#include <cstring>

#include "fusetrain/core/alloc.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/rng.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// ---- forward, one row -----------------------------------------------------------------

// y: (C), mean, rstd: one each; x: (C), gamma, beta: (C)
void layernorm_row_portable(float* y, float* mean_out, float* rstd_out, const float* x, const float* gamma,
                            const float* beta, int64_t C, float eps) {
  const float shift = x[0];
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    float d = x[c] - shift;
    s1 += d;
    s2 += d * d;
  }
  const float inv_c = 1.0f / static_cast<float>(C);
  const float mean_d = s1 * inv_c;
  const float var = std::max(s2 * inv_c - mean_d * mean_d, 0.0f);
  const float mean = shift + mean_d;
  const float rstd = 1.0f / std::sqrt(var + eps);
  for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - mean) * rstd * gamma[c] + beta[c];
  *mean_out = mean;
  *rstd_out = rstd;
}

// Mean and rstd from the shifted sums (d = x - shift), then y = (x - mean) * rstd * gamma + beta.
FT_AVX512_INLINE void finish_row_avx512(float* y, float* mean_out, float* rstd_out, const float* x, const float* gamma,
                                        const float* beta, int64_t C, float eps, float shift, __m512 s1, __m512 s2) {
  const float inv_c = 1.0f / static_cast<float>(C);
  const float mean_d = _mm512_reduce_add_ps(s1) * inv_c;
  const float var = std::max(_mm512_reduce_add_ps(s2) * inv_c - mean_d * mean_d, 0.0f);
  const float mean = shift + mean_d;
  const float rstd = 1.0f / std::sqrt(var + eps);
  const __m512 vmean = _mm512_set1_ps(mean), vrstd = _mm512_set1_ps(rstd);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + c), vmean), vrstd);
    __m512 out = _mm512_fmadd_ps(xhat, _mm512_maskz_loadu_ps(m, gamma + c), _mm512_maskz_loadu_ps(m, beta + c));
    _mm512_mask_storeu_ps(y + c, m, out);
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

FT_AVX512 void layernorm_row_avx512(float* y, float* mean_out, float* rstd_out, const float* x, const float* gamma,
                                    const float* beta, int64_t C, float eps) {
  const __m512 shift = _mm512_set1_ps(x[0]);
  __m512 s1a = _mm512_setzero_ps(), s1b = _mm512_setzero_ps();
  __m512 s2a = _mm512_setzero_ps(), s2b = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + c), shift);
    __m512 d1 = _mm512_sub_ps(_mm512_loadu_ps(x + c + 16), shift);
    s1a = _mm512_add_ps(s1a, d0);
    s1b = _mm512_add_ps(s1b, d1);
    s2a = _mm512_fmadd_ps(d0, d0, s2a);
    s2b = _mm512_fmadd_ps(d1, d1, s2b);
  }
  for (; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, x + c), shift);
    s1a = _mm512_add_ps(s1a, d);
    s2a = _mm512_fmadd_ps(d, d, s2a);
  }
  finish_row_avx512(y, mean_out, rstd_out, x, gamma, beta, C, eps, x[0], _mm512_add_ps(s1a, s1b),
                    _mm512_add_ps(s2a, s2b));
}

// AddLayerNorm without dropout, one row: sum = x + residual is formed, stored and summed in one
// pass, then normalised from L1. The same operations in the same order as layernorm_row_avx512
// on the stored sum, so bit for bit its result.
FT_AVX512 void add_layernorm_row_avx512(float* y, float* mean_out, float* rstd_out, float* sum, const float* x,
                                        const float* residual, const float* gamma, const float* beta, int64_t C,
                                        float eps) {
  const float first = x[0] + residual[0];
  const __m512 shift = _mm512_set1_ps(first);
  __m512 s1a = _mm512_setzero_ps(), s1b = _mm512_setzero_ps();
  __m512 s2a = _mm512_setzero_ps(), s2b = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(x + c), _mm512_loadu_ps(residual + c));
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(residual + c + 16));
    _mm512_storeu_ps(sum + c, v0);
    _mm512_storeu_ps(sum + c + 16, v1);
    __m512 d0 = _mm512_sub_ps(v0, shift);
    __m512 d1 = _mm512_sub_ps(v1, shift);
    s1a = _mm512_add_ps(s1a, d0);
    s1b = _mm512_add_ps(s1b, d1);
    s2a = _mm512_fmadd_ps(d0, d0, s2a);
    s2b = _mm512_fmadd_ps(d1, d1, s2b);
  }
  for (; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    const __m512 v = _mm512_maskz_add_ps(m, _mm512_maskz_loadu_ps(m, x + c), _mm512_maskz_loadu_ps(m, residual + c));
    _mm512_mask_storeu_ps(sum + c, m, v);
    __m512 d = _mm512_maskz_sub_ps(m, v, shift);
    s1a = _mm512_add_ps(s1a, d);
    s2a = _mm512_fmadd_ps(d, d, s2a);
  }
  finish_row_avx512(y, mean_out, rstd_out, sum, gamma, beta, C, eps, first, _mm512_add_ps(s1a, s1b),
                    _mm512_add_ps(s2a, s2b));
}

void add_layernorm_row_portable(float* y, float* mean_out, float* rstd_out, float* sum, const float* x,
                                const float* residual, const float* gamma, const float* beta, int64_t C, float eps) {
  for (int64_t c = 0; c < C; ++c) sum[c] = x[c] + residual[c];
  layernorm_row_portable(y, mean_out, rstd_out, sum, gamma, beta, C, eps);
}

FT_AVX2 void layernorm_row_avx2(float* y, float* mean_out, float* rstd_out, const float* x, const float* gamma,
                                const float* beta, int64_t C, float eps) {
  const __m256 shift = _mm256_set1_ps(x[0]);
  __m256 s1a = _mm256_setzero_ps(), s1b = _mm256_setzero_ps();
  __m256 s2a = _mm256_setzero_ps(), s2b = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + c), shift);
    const __m256 d1 = _mm256_sub_ps(_mm256_loadu_ps(x + c + 8), shift);
    s1a = _mm256_add_ps(s1a, d0);
    s1b = _mm256_add_ps(s1b, d1);
    s2a = _mm256_fmadd_ps(d0, d0, s2a);
    s2b = _mm256_fmadd_ps(d1, d1, s2b);
  }
  for (; c < C; c += 8) {
    const __m256 d = _mm256_and_ps(_mm256_sub_ps(load8(x + c, C - c), shift), _mm256_castsi256_ps(lanes8(C - c)));
    s1a = _mm256_add_ps(s1a, d);
    s2a = _mm256_fmadd_ps(d, d, s2a);
  }
  const float inv_c = 1.0f / static_cast<float>(C);
  const float mean_d = reduce_add8(_mm256_add_ps(s1a, s1b)) * inv_c;
  const float var = std::max(reduce_add8(_mm256_add_ps(s2a, s2b)) * inv_c - mean_d * mean_d, 0.0f);
  const float mean = x[0] + mean_d;
  const float rstd = 1.0f / std::sqrt(var + eps);
  const __m256 vmean = _mm256_set1_ps(mean), vrstd = _mm256_set1_ps(rstd);
  for (c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load8(x + c, n), vmean), vrstd);
    store8(y + c, n, _mm256_fmadd_ps(xhat, load8(gamma + c, n), load8(beta + c, n)));
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

// The sum's pass, then layernorm_row_avx2 on it from L1 (so bit for bit Add and then LayerNorm).
FT_AVX2 void add_layernorm_row_avx2(float* y, float* mean_out, float* rstd_out, float* sum, const float* x,
                                    const float* residual, const float* gamma, const float* beta, int64_t C, float eps) {
  for (int64_t c = 0; c < C; c += 8) store8(sum + c, C - c, _mm256_add_ps(load8(x + c, C - c), load8(residual + c, C - c)));
  layernorm_row_avx2(y, mean_out, rstd_out, sum, gamma, beta, C, eps);
}

// ---- backward, one row ------------------------------------------------------------------

// dx: (C); dgamma_part, dbeta_part: (C) per-thread sums; dy, x: (C); gamma: (C)
template <bool AccDx>
void layernorm_backward_row_portable(float* dx, float* dgamma_part, float* dbeta_part, const float* dy, const float* x,
                                     const float* gamma, float mean, float rstd, int64_t C) {
  float sum_g = 0.0f, sum_gx = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    float xhat = (x[c] - mean) * rstd;
    float g = dy[c] * gamma[c];
    sum_g += g;
    sum_gx += g * xhat;
    dgamma_part[c] += dy[c] * xhat;
    dbeta_part[c] += dy[c];
  }
  const float inv_c = 1.0f / static_cast<float>(C);
  const float a = sum_g * inv_c, b = sum_gx * inv_c;
  for (int64_t c = 0; c < C; ++c) {
    float xhat = (x[c] - mean) * rstd;
    float v = rstd * (dy[c] * gamma[c] - a - xhat * b);
    dx[c] = AccDx ? dx[c] + v : v;
  }
}

template <bool AccDx>
FT_AVX512 void layernorm_backward_row_avx512(float* dx, float* dgamma_part, float* dbeta_part, const float* dy,
                                             const float* x, const float* gamma, float mean, float rstd, int64_t C) {
  const __m512 vmean = _mm512_set1_ps(mean), vrstd = _mm512_set1_ps(rstd);
  __m512 sum_g = _mm512_setzero_ps(), sum_gx = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    __m512 vdy = _mm512_maskz_loadu_ps(m, dy + c);
    __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + c), vmean), vrstd);
    xhat = _mm512_maskz_mov_ps(m, xhat);
    __m512 g = _mm512_mul_ps(vdy, _mm512_maskz_loadu_ps(m, gamma + c));
    sum_g = _mm512_add_ps(sum_g, g);
    sum_gx = _mm512_fmadd_ps(g, xhat, sum_gx);
    _mm512_mask_storeu_ps(dgamma_part + c, m, _mm512_fmadd_ps(vdy, xhat, _mm512_maskz_loadu_ps(m, dgamma_part + c)));
    _mm512_mask_storeu_ps(dbeta_part + c, m, _mm512_add_ps(vdy, _mm512_maskz_loadu_ps(m, dbeta_part + c)));
  }
  const float inv_c = 1.0f / static_cast<float>(C);
  const __m512 a = _mm512_set1_ps(_mm512_reduce_add_ps(sum_g) * inv_c);
  const __m512 b = _mm512_set1_ps(_mm512_reduce_add_ps(sum_gx) * inv_c);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + c), vmean), vrstd);
    __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + c), _mm512_maskz_loadu_ps(m, gamma + c));
    __m512 v = _mm512_mul_ps(vrstd, _mm512_fnmadd_ps(xhat, b, _mm512_sub_ps(g, a)));
    if (AccDx) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, dx + c));
    _mm512_mask_storeu_ps(dx + c, m, v);
  }
}

template <bool AccDx>
FT_AVX2 void layernorm_backward_row_avx2(float* dx, float* dgamma_part, float* dbeta_part, const float* dy,
                                         const float* x, const float* gamma, float mean, float rstd, int64_t C) {
  const __m256 vmean = _mm256_set1_ps(mean), vrstd = _mm256_set1_ps(rstd);
  __m256 sum_g = _mm256_setzero_ps(), sum_gx = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 vdy = load8(dy + c, n);
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load8(x + c, n), vmean), vrstd);
    const __m256 g = _mm256_mul_ps(vdy, load8(gamma + c, n));  // 0 past the row: so are its terms below
    sum_g = _mm256_add_ps(sum_g, g);
    sum_gx = _mm256_fmadd_ps(g, xhat, sum_gx);
    store8(dgamma_part + c, n, _mm256_fmadd_ps(vdy, xhat, load8(dgamma_part + c, n)));
    store8(dbeta_part + c, n, _mm256_add_ps(vdy, load8(dbeta_part + c, n)));
  }
  const float inv_c = 1.0f / static_cast<float>(C);
  const __m256 a = _mm256_set1_ps(reduce_add8(sum_g) * inv_c);
  const __m256 b = _mm256_set1_ps(reduce_add8(sum_gx) * inv_c);
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load8(x + c, n), vmean), vrstd);
    const __m256 g = _mm256_mul_ps(load8(dy + c, n), load8(gamma + c, n));
    __m256 v = _mm256_mul_ps(vrstd, _mm256_fnmadd_ps(xhat, b, _mm256_sub_ps(g, a)));
    if (AccDx) v = _mm256_add_ps(v, load8(dx + c, n));
    store8(dx + c, n, v);
  }
}

// ---- kernels ---------------------------------------------------------------------------

using ForwardRowFn = void (*)(float*, float*, float*, const float*, const float*, const float*, int64_t, float);
using BackwardRowFn = void (*)(float*, float*, float*, const float*, const float*, const float*, float, float, int64_t);
using AddRowFn = void (*)(float*, float*, float*, float*, const float*, const float*, const float*, const float*, int64_t,
                          float);

class LayerNormKernel final : public Kernel {
 public:
  LayerNormKernel(int64_t rows, int64_t C, float eps)
      : rows_(rows), C_(C), eps_(eps), row_fn_(pick_path<ForwardRowFn>(layernorm_row_portable, layernorm_row_avx2, layernorm_row_avx512)) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());      // (R, C)
    const float* gamma = static_cast<const float*>(args.inputs[1].data());  // (C)
    const float* beta = static_cast<const float*>(args.inputs[2].data());   // (C)
    float* y = static_cast<float*>(args.outputs[0].data());                 // (R, C)
    float* mean = static_cast<float*>(args.outputs[1].data());              // (R)
    float* rstd = static_cast<float*>(args.outputs[2].data());              // (R)
    const int64_t C = C_;
    parallel_for(rows_, threads_for(rows_ * C, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) row_fn_(y + r * C, mean + r, rstd + r, x + r * C, gamma, beta, C, eps_);
    });
  }

 private:
  int64_t rows_, C_;
  float eps_;
  ForwardRowFn row_fn_;
};

// AddLayerNorm: row by row, sum = dropout(x) + residual (or x + residual when p is 0), then the
// LayerNorm of that row while it is in cache. Each element of x is read before its sum is
// written, so the sum may take over x's memory (kInPlace). With dropout the row goes through the
// Dropout kernel's loop and then LayerNorm's; without, add_layernorm_row_* does the same
// operations in the same order; either way the result is bit for bit the unfused kernels'.
class AddLayerNormKernel final : public Kernel {
 public:
  AddLayerNormKernel(int64_t rows, int64_t C, float eps, double p, uint64_t seed, StreamIndexMap map)
      : rows_(rows),
        C_(C),
        eps_(eps),
        p_(static_cast<float>(p)),
        scale_(static_cast<float>(1.0 / (1.0 - p))),  // as the Dropout kernel rounds it
        seed_(seed),
        map_(map),
        row_fn_(pick_path<ForwardRowFn>(layernorm_row_portable, layernorm_row_avx2, layernorm_row_avx512)),
        add_row_fn_(pick_path<AddRowFn>(add_layernorm_row_portable, add_layernorm_row_avx2, add_layernorm_row_avx512)),
        dropout_fn_(p > 0.0 ? dropout_range_fn() : nullptr) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());         // (R, C)
    const float* residual = static_cast<const float*>(args.inputs[1].data());  // (R, C)
    const float* gamma = static_cast<const float*>(args.inputs[2].data());     // (C)
    const float* beta = static_cast<const float*>(args.inputs[3].data());      // (C)
    float* sum = static_cast<float*>(args.outputs[0].data());                  // (R, C), may alias x
    float* y = static_cast<float*>(args.outputs[1].data());                    // (R, C)
    float* mean = static_cast<float*>(args.outputs[2].data());                 // (R)
    float* rstd = static_cast<float*>(args.outputs[3].data());                 // (R)
    const int64_t C = C_;
    const uint64_t offset = ctx.rng_offset;
    // Philox dominates when dropout is on: parallelise as early as the Dropout kernel does.
    const int64_t work = rows_ * C * (dropout_fn_ ? 8 : 1);
    parallel_for(rows_, threads_for(work, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t first = r * C;
        if (dropout_fn_) {
          map_.for_each_run(first, first + C, [&](int64_t b, int64_t e, uint64_t stream) {
            dropout_fn_(sum + b, x + b, residual + b, e - b, stream, seed_, offset, p_, scale_);
          });
          row_fn_(y + first, mean + r, rstd + r, sum + first, gamma, beta, C, eps_);
        } else {
          add_row_fn_(y + first, mean + r, rstd + r, sum + first, x + first, residual + first, gamma, beta, C, eps_);
        }
      }
    });
  }

 private:
  int64_t rows_, C_;
  float eps_, p_, scale_;
  uint64_t seed_;
  StreamIndexMap map_;
  ForwardRowFn row_fn_;
  AddRowFn add_row_fn_;
  DropoutRangeFn dropout_fn_;
};

class LayerNormBackwardKernel final : public Kernel {
 public:
  LayerNormBackwardKernel(int64_t rows, int64_t C) : rows_(rows), C_(C) {
    write_fn_ = pick_path<BackwardRowFn>(layernorm_backward_row_portable<false>, layernorm_backward_row_avx2<false>,
                                         layernorm_backward_row_avx512<false>);
    add_fn_ = pick_path<BackwardRowFn>(layernorm_backward_row_portable<true>, layernorm_backward_row_avx2<true>,
                                       layernorm_backward_row_avx512<true>);
  }

  bool accumulates() const override { return true; }
  size_t scratch_bytes(int num_threads) const override {
    return static_cast<size_t>(std::max(num_threads, 1)) * partial_stride() * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    Buffers buf;
    buf.dy = static_cast<const float*>(args.inputs[0].data());
    buf.x = static_cast<const float*>(args.inputs[1].data());
    buf.gamma = static_cast<const float*>(args.inputs[2].data());
    buf.mean = static_cast<const float*>(args.inputs[3].data());
    buf.rstd = static_cast<const float*>(args.inputs[4].data());
    buf.dx = static_cast<float*>(args.outputs[0].data());
    buf.dgamma = static_cast<float*>(args.outputs[1].data());
    buf.dbeta = static_cast<float*>(args.outputs[2].data());
    buf.partials = static_cast<float*>(args.scratch);
    buf.row_fn = accumulate_flag(args, 0) ? add_fn_ : write_fn_;
    buf.acc_dgamma = accumulate_flag(args, 1);
    buf.acc_dbeta = accumulate_flag(args, 2);

    const int threads = rows_ < ctx.num_threads ? 1 : threads_for(rows_ * C_, ctx.num_threads);
    rows_then_columns(
        threads, [&](int t, int nt) { rows_chunk(buf, t, nt); },
        [&](int t, int nt) { reduce_columns(buf, t, nt, nt); });
  }

 private:
  struct Buffers {
    const float *dy, *x, *gamma, *mean, *rstd;  // (R, C), (R, C), (C), (R), (R)
    float *dx, *dgamma, *dbeta;                 // (R, C), (C), (C)
    float* partials;                            // (threads, 2, C) padded to partial_stride()
    BackwardRowFn row_fn;
    bool acc_dgamma, acc_dbeta;
  };

  size_t partial_stride() const { return align_up(static_cast<size_t>(2 * C_) * sizeof(float)) / sizeof(float); }

  // Thread t of nt: its rows into dx and into its own dgamma/dbeta partials.
  void rows_chunk(const Buffers& buf, int t, int nt) const {
    const int64_t C = C_;
    float* dgamma_part = buf.partials + static_cast<size_t>(t) * partial_stride();
    float* dbeta_part = dgamma_part + C;
    std::memset(dgamma_part, 0, static_cast<size_t>(2 * C) * sizeof(float));
    const int64_t begin = rows_ * t / nt, end = rows_ * (t + 1) / nt;
    for (int64_t r = begin; r < end; ++r)
      buf.row_fn(buf.dx + r * C, dgamma_part, dbeta_part, buf.dy + r * C, buf.x + r * C, buf.gamma, buf.mean[r],
                 buf.rstd[r], C);
  }

  // Thread t of nt: columns of its share, summing the `parts` partials in order.
  void reduce_columns(const Buffers& buf, int t, int nt, int parts) const {
    const int64_t C = C_;
    const int64_t begin = C * t / nt, end = C * (t + 1) / nt;
    const size_t stride = partial_stride();
    for (int64_t c = begin; c < end; ++c) {
      float sum_gamma = 0.0f, sum_beta = 0.0f;
      for (int p = 0; p < parts; ++p) {
        sum_gamma += buf.partials[p * stride + c];
        sum_beta += buf.partials[p * stride + C + c];
      }
      buf.dgamma[c] = buf.acc_dgamma ? buf.dgamma[c] + sum_gamma : sum_gamma;
      buf.dbeta[c] = buf.acc_dbeta ? buf.dbeta[c] + sum_beta : sum_beta;
    }
  }

  int64_t rows_, C_;
  BackwardRowFn write_fn_, add_fn_;
};

}  // namespace

std::unique_ptr<Kernel> make_layernorm_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  if (x.rank() < 1 || x[-1] == 0) return nullptr;
  if (call.op == OpKind::AddLayerNorm) {
    const ops::AddLayerNormParams& params = call.params<ops::AddLayerNormParams>();
    return std::make_unique<AddLayerNormKernel>(x.numel() / x[-1], x[-1], static_cast<float>(params.eps),
                                                params.dropout.p, params.dropout.seed,
                                                stream_index_map(params.dropout));
  }
  return std::make_unique<LayerNormKernel>(x.numel() / x[-1], x[-1],
                                           static_cast<float>(call.params<ops::LayerNormParams>().eps));
}

std::unique_ptr<Kernel> make_layernorm_backward_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 1);
  if (x.rank() < 1 || x[-1] == 0) return nullptr;
  return std::make_unique<LayerNormBackwardKernel>(x.numel() / x[-1], x[-1]);
}

}  // namespace fusetrain::kernels::cpu_basic
