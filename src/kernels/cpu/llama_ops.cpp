// Tuned kernels of the Llama-family ops: RMSNorm and its backward, RoPE (and its inverse, the
// backward), SwiGLU and its backward; portable, AVX2 and AVX-512 paths.
//
// Shape legend: R rows (product of the leading axes), C channels, B batch, T sequence, H heads,
// D head size (even), D/2 = half.
//   RMSNorm:         x (R, C), weight (C) -> y (R, C), rstd (R); rstd = 1/√(mean_C(x²) + eps)
//   RMSNormBackward: dy (R, C), x (R, C), weight (C), rstd (R) -> dx (R, C) (may alias dy), dweight (C)
//                    with x̂ = x·rstd, g = dy·weight: dx = rstd·(g − x̂·mean_C(g·x̂)), dweight = Σ_R dy·x̂
//   RoPE:            x (B, T, H, D), cos, sin (B, T, R), R <= D -> y (B, T, H, D)
//   SwiGLU:          gate, up (n) f32 or bf16 -> silu(gate)·up in their dtype
//   SwiGLUBackward:  dy (n) f32, gate, up (n) -> dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))), dup = dy·silu(g), f32
// Each thread sums dweight for its rows into its own (C) slice of scratch; the slices are added
// in thread order afterwards, so the result is deterministic for a given thread count.
#include <cmath>
#include <cstring>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/half.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// ---- RMSNorm forward, one row ---------------------------------------------------------------

void rmsnorm_row_portable(float* y, float* rstd_out, const float* x, const float* w, int64_t C, float eps) {
  float squares = 0.0f;
  for (int64_t c = 0; c < C; ++c) squares += x[c] * x[c];
  const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(C) + eps);
  for (int64_t c = 0; c < C; ++c) y[c] = x[c] * rstd * w[c];
  *rstd_out = rstd;
}

FT_AVX512 void rmsnorm_row_avx512(float* y, float* rstd_out, const float* x, const float* w, int64_t C, float eps) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
    s0 = _mm512_fmadd_ps(a, a, s0);
    s1 = _mm512_fmadd_ps(b, b, s1);
  }
  for (; c < C; c += 16) {
    const __m512 a = _mm512_maskz_loadu_ps(tail_mask(C - c), x + c);
    s0 = _mm512_fmadd_ps(a, a, s0);
  }
  const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / static_cast<float>(C) + eps);
  const __m512 vr = _mm512_set1_ps(rstd);
  for (c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr), _mm512_maskz_loadu_ps(m, w + c));
    _mm512_mask_storeu_ps(y + c, m, v);
  }
  *rstd_out = rstd;
}

FT_AVX2 void rmsnorm_row_avx2(float* y, float* rstd_out, const float* x, const float* w, int64_t C, float eps) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + 8);
    s0 = _mm256_fmadd_ps(a, a, s0);
    s1 = _mm256_fmadd_ps(b, b, s1);
  }
  for (; c < C; c += 8) {
    const __m256 a = load8(x + c, C - c);
    s0 = _mm256_fmadd_ps(a, a, s0);
  }
  const float rstd = 1.0f / std::sqrt(reduce_add8(_mm256_add_ps(s0, s1)) / static_cast<float>(C) + eps);
  const __m256 vr = _mm256_set1_ps(rstd);
  for (c = 0; c < C; c += 8)
    store8(y + c, C - c, _mm256_mul_ps(_mm256_mul_ps(load8(x + c, C - c), vr), load8(w + c, C - c)));
  *rstd_out = rstd;
}

using RmsRowFn = void (*)(float*, float*, const float*, const float*, int64_t, float);

class RMSNormKernel final : public Kernel {
 public:
  RMSNormKernel(int64_t rows, int64_t C, float eps)
      : rows_(rows), C_(C), eps_(eps), row_fn_(pick_path<RmsRowFn>(rmsnorm_row_portable, rmsnorm_row_avx2, rmsnorm_row_avx512)) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());
    const float* w = static_cast<const float*>(args.inputs[1].data());
    float* y = static_cast<float*>(args.outputs[0].data());
    float* rstd = static_cast<float*>(args.outputs[1].data());
    const int64_t C = C_;
    parallel_for(rows_, threads_for(rows_ * C, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) row_fn_(y + r * C, rstd + r, x + r * C, w, C, eps_);
    });
  }

 private:
  int64_t rows_, C_;
  float eps_;
  RmsRowFn row_fn_;
};

// ---- RMSNorm backward, one row ----------------------------------------------------------------
// Two passes over the row: Σ g·x̂ (and dweight += dy·x̂), then dx. dx may alias dy: the second pass
// reads element c of dy before it writes element c of dx.

template <bool AccDx>
void rmsnorm_backward_row_portable(float* dx, float* dweight, const float* dy, const float* x, const float* w,
                                   float rstd, int64_t C) {
  float g_xhat = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    const float xhat = x[c] * rstd;
    g_xhat += dy[c] * w[c] * xhat;
    dweight[c] += dy[c] * xhat;
  }
  const float mean = g_xhat / static_cast<float>(C);
  for (int64_t c = 0; c < C; ++c) {
    const float v = rstd * (dy[c] * w[c] - x[c] * rstd * mean);
    dx[c] = AccDx ? dx[c] + v : v;
  }
}

template <bool AccDx>
FT_AVX512 void rmsnorm_backward_row_avx512(float* dx, float* dweight, const float* dy, const float* x, const float* w,
                                           float rstd, int64_t C) {
  const __m512 vr = _mm512_set1_ps(rstd);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    const __m512 d = _mm512_maskz_loadu_ps(m, dy + c);
    const __m512 xhat = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_maskz_loadu_ps(m, w + c)), xhat, acc);
    _mm512_mask_storeu_ps(dweight + c, m, _mm512_fmadd_ps(d, xhat, _mm512_maskz_loadu_ps(m, dweight + c)));
  }
  const __m512 vmean = _mm512_set1_ps(_mm512_reduce_add_ps(acc) / static_cast<float>(C));
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + c), _mm512_maskz_loadu_ps(m, w + c));
    const __m512 xhat = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr);
    __m512 v = _mm512_mul_ps(vr, _mm512_fnmadd_ps(xhat, vmean, g));
    if (AccDx) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, dx + c));
    _mm512_mask_storeu_ps(dx + c, m, v);
  }
}

template <bool AccDx>
FT_AVX2 void rmsnorm_backward_row_avx2(float* dx, float* dweight, const float* dy, const float* x, const float* w,
                                       float rstd, int64_t C) {
  const __m256 vr = _mm256_set1_ps(rstd);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 d = load8(dy + c, n);
    const __m256 xhat = _mm256_mul_ps(load8(x + c, n), vr);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, load8(w + c, n)), xhat, acc);
    store8(dweight + c, n, _mm256_fmadd_ps(d, xhat, load8(dweight + c, n)));
  }
  const __m256 vmean = _mm256_set1_ps(reduce_add8(acc) / static_cast<float>(C));
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 g = _mm256_mul_ps(load8(dy + c, n), load8(w + c, n));
    const __m256 xhat = _mm256_mul_ps(load8(x + c, n), vr);
    __m256 v = _mm256_mul_ps(vr, _mm256_fnmadd_ps(xhat, vmean, g));
    if (AccDx) v = _mm256_add_ps(v, load8(dx + c, n));
    store8(dx + c, n, v);
  }
}

using RmsBackwardRowFn = void (*)(float*, float*, const float*, const float*, const float*, float, int64_t);

class RMSNormBackwardKernel final : public Kernel {
 public:
  RMSNormBackwardKernel(int64_t rows, int64_t C) : rows_(rows), C_(C) {
    write_fn_ = pick_path<RmsBackwardRowFn>(rmsnorm_backward_row_portable<false>, rmsnorm_backward_row_avx2<false>,
                                            rmsnorm_backward_row_avx512<false>);
    add_fn_ = pick_path<RmsBackwardRowFn>(rmsnorm_backward_row_portable<true>, rmsnorm_backward_row_avx2<true>,
                                          rmsnorm_backward_row_avx512<true>);
  }

  bool accumulates() const override { return true; }
  size_t scratch_bytes(int num_threads) const override {
    return static_cast<size_t>(std::max(num_threads, 1)) * stride() * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* dy = static_cast<const float*>(args.inputs[0].data());
    const float* x = static_cast<const float*>(args.inputs[1].data());
    const float* w = static_cast<const float*>(args.inputs[2].data());
    const float* rstd = static_cast<const float*>(args.inputs[3].data());
    float* dx = static_cast<float*>(args.outputs[0].data());
    float* dweight = static_cast<float*>(args.outputs[1].data());
    float* partials = static_cast<float*>(args.scratch);
    const RmsBackwardRowFn row_fn = accumulate_flag(args, 0) ? add_fn_ : write_fn_;
    const bool acc_dweight = accumulate_flag(args, 1);
    const int64_t C = C_;
    auto rows_chunk = [&](int t, int nt) {
      float* part = partials + static_cast<size_t>(t) * stride();
      std::memset(part, 0, static_cast<size_t>(C) * sizeof(float));
      const int64_t begin = rows_ * t / nt, end = rows_ * (t + 1) / nt;
      for (int64_t r = begin; r < end; ++r) row_fn(dx + r * C, part, dy + r * C, x + r * C, w, rstd[r], C);
    };
    auto reduce_columns = [&](int t, int nt) {  // the nt partials, in thread order
      const int64_t begin = C * t / nt, end = C * (t + 1) / nt;
      for (int64_t c = begin; c < end; ++c) {
        float sum = 0.0f;
        for (int p = 0; p < nt; ++p) sum += partials[static_cast<size_t>(p) * stride() + static_cast<size_t>(c)];
        dweight[c] = acc_dweight ? dweight[c] + sum : sum;
      }
    };
    rows_then_columns(rows_ < ctx.num_threads ? 1 : threads_for(rows_ * C, ctx.num_threads), rows_chunk,
                      reduce_columns);
  }

 private:
  size_t stride() const { return align_up(static_cast<size_t>(C_) * sizeof(float)) / sizeof(float); }

  int64_t rows_, C_;
  RmsBackwardRowFn write_fn_, add_fn_;
};

// ---- RoPE, one (b, t) row of H heads ----------------------------------------------------------
// Forward: (x1·c1 − x2·s1, x2·c2 + x1·s2); inverse: (x1·c1 + x2·s2, x2·c2 − x1·s1), where x1, x2 are the halves
// of a head's first R elements and c1, c2 (s1, s2) the halves of cos (sin), R wide; elements R .. D pass through
// (partial rotary). Both halves of a pair are read before either is written, so y may be x.

template <bool Inverse, bool Acc>
void rope_row_portable(float* y, const float* x, const float* cos, const float* sin, int64_t H, int64_t D,
                       int64_t R) {
  const int64_t half = R / 2;
  for (int64_t h = 0; h < H; ++h) {
    const float* xh = x + h * D;
    float* yh = y + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = xh[i], x2 = xh[half + i];
      const float y1 = Inverse ? x1 * cos[i] + x2 * sin[half + i] : x1 * cos[i] - x2 * sin[i];
      const float y2 = Inverse ? x2 * cos[half + i] - x1 * sin[i] : x2 * cos[half + i] + x1 * sin[half + i];
      yh[i] = Acc ? yh[i] + y1 : y1;
      yh[half + i] = Acc ? yh[half + i] + y2 : y2;
    }
    for (int64_t i = R; i < D; ++i) yh[i] = Acc ? yh[i] + xh[i] : xh[i];
  }
}

template <bool Inverse, bool Acc>
FT_AVX512 void rope_row_avx512(float* y, const float* x, const float* cos, const float* sin, int64_t H, int64_t D,
                               int64_t R) {
  const int64_t half = R / 2;
  for (int64_t h = 0; h < H; ++h) {
    const float* xh = x + h * D;
    float* yh = y + h * D;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 x1 = _mm512_maskz_loadu_ps(m, xh + i), x2 = _mm512_maskz_loadu_ps(m, xh + half + i);
      const __m512 c1 = _mm512_maskz_loadu_ps(m, cos + i), c2 = _mm512_maskz_loadu_ps(m, cos + half + i);
      const __m512 s1 = _mm512_maskz_loadu_ps(m, sin + i), s2 = _mm512_maskz_loadu_ps(m, sin + half + i);
      __m512 y1 = Inverse ? _mm512_fmadd_ps(x2, s2, _mm512_mul_ps(x1, c1)) : _mm512_fnmadd_ps(x2, s1, _mm512_mul_ps(x1, c1));
      __m512 y2 = Inverse ? _mm512_fnmadd_ps(x1, s1, _mm512_mul_ps(x2, c2)) : _mm512_fmadd_ps(x1, s2, _mm512_mul_ps(x2, c2));
      if (Acc) {
        y1 = _mm512_add_ps(y1, _mm512_maskz_loadu_ps(m, yh + i));
        y2 = _mm512_add_ps(y2, _mm512_maskz_loadu_ps(m, yh + half + i));
      }
      _mm512_mask_storeu_ps(yh + i, m, y1);
      _mm512_mask_storeu_ps(yh + half + i, m, y2);
    }
    for (int64_t i = R; i < D; i += 16) {
      const __mmask16 m = tail_mask(D - i);
      __m512 v = _mm512_maskz_loadu_ps(m, xh + i);
      if (Acc) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, yh + i));
      _mm512_mask_storeu_ps(yh + i, m, v);
    }
  }
}

template <bool Inverse, bool Acc>
FT_AVX2 void rope_row_avx2(float* y, const float* x, const float* cos, const float* sin, int64_t H, int64_t D,
                             int64_t R) {
  const int64_t half = R / 2;
  for (int64_t h = 0; h < H; ++h) {
    const float* xh = x + h * D;
    float* yh = y + h * D;
    for (int64_t i = 0; i < half; i += 8) {
      const int64_t n = half - i;
      const __m256 x1 = load8(xh + i, n), x2 = load8(xh + half + i, n);
      const __m256 c1 = load8(cos + i, n), c2 = load8(cos + half + i, n);
      const __m256 s1 = load8(sin + i, n), s2 = load8(sin + half + i, n);
      __m256 y1 = Inverse ? _mm256_fmadd_ps(x2, s2, _mm256_mul_ps(x1, c1)) : _mm256_fnmadd_ps(x2, s1, _mm256_mul_ps(x1, c1));
      __m256 y2 = Inverse ? _mm256_fnmadd_ps(x1, s1, _mm256_mul_ps(x2, c2)) : _mm256_fmadd_ps(x1, s2, _mm256_mul_ps(x2, c2));
      if (Acc) {
        y1 = _mm256_add_ps(y1, load8(yh + i, n));
        y2 = _mm256_add_ps(y2, load8(yh + half + i, n));
      }
      store8(yh + i, n, y1);
      store8(yh + half + i, n, y2);
    }
    for (int64_t i = R; i < D; i += 8) {
      __m256 v = load8(xh + i, D - i);
      if (Acc) v = _mm256_add_ps(v, load8(yh + i, D - i));
      store8(yh + i, D - i, v);
    }
  }
}

using RopeRowFn = void (*)(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);

template <bool Acc>
RopeRowFn rope_row_fn(bool inverse) {
  return inverse ? pick_path<RopeRowFn>(rope_row_portable<true, Acc>, rope_row_avx2<true, Acc>, rope_row_avx512<true, Acc>)
                 : pick_path<RopeRowFn>(rope_row_portable<false, Acc>, rope_row_avx2<false, Acc>,
                                        rope_row_avx512<false, Acc>);
}

class RoPEKernel final : public Kernel {
 public:
  RoPEKernel(int64_t rows, int64_t H, int64_t D, int64_t R, bool inverse) : rows_(rows), H_(H), D_(D), R_(R) {
    write_fn_ = rope_row_fn<false>(inverse);
    add_fn_ = rope_row_fn<true>(inverse);
  }

  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());
    const float* cos = static_cast<const float*>(args.inputs[1].data());
    const float* sin = static_cast<const float*>(args.inputs[2].data());
    float* y = static_cast<float*>(args.outputs[0].data());
    const RopeRowFn fn = accumulate_flag(args, 0) ? add_fn_ : write_fn_;
    const int64_t row = H_ * D_;
    parallel_for(rows_, threads_for(rows_ * row, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) fn(y + r * row, x + r * row, cos + r * R_, sin + r * R_, H_, D_, R_);
    });
  }

 private:
  int64_t rows_, H_, D_, R_;
  RopeRowFn write_fn_, add_fn_;
};

// ---- SwiGLU ---------------------------------------------------------------------------------------
// A block of up to 16 elements at a time; bf16 operands are widened exactly and a bf16 result is rounded
// to nearest even, as the Cast kernel rounds. With bf16 operands silu(gate) is rounded to bf16 before the
// product, as PyTorch's bf16 silu hands its result to the multiply; backward's dup reads that rounded silu.

template <typename T>
float load_one(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>)
    return p[i];
  else
    return bf16_to_float(p[i]);
}

template <typename T>
FT_AVX512_INLINE __m512 load16(const T* p, int64_t i, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_maskz_loadu_ps(m, p + i);
  else
    return bf16_to_f32_16(_mm256_maskz_loadu_epi16(m, p + i));
}

FT_AVX512_INLINE __m512 sigmoid16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

template <typename T>
void swiglu_portable(void* out, const T* gate, const T* up, int64_t begin, int64_t end, bool acc) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_one(gate, i);
    float silu = g / (1.0f + std::exp(-g));
    if constexpr (!std::is_same_v<T, float>) silu = bf16_to_float(float_to_bf16(silu));
    const float v = silu * load_one(up, i);
    if constexpr (std::is_same_v<T, float>) {
      float* o = static_cast<float*>(out);
      o[i] = acc ? o[i] + v : v;
    } else {
      uint16_t* o = static_cast<uint16_t*>(out);
      o[i] = float_to_bf16(acc ? bf16_to_float(o[i]) + v : v);
    }
  }
}

template <typename T>
FT_AVX512 void swiglu_avx512(void* out, const T* gate, const T* up, int64_t begin, int64_t end, bool acc) {
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = tail_mask(end - i);
    const __m512 g = load16(gate, i, m);
    __m512 silu = _mm512_mul_ps(g, sigmoid16(g));
    if constexpr (!std::is_same_v<T, float>) silu = round_bf16_16(silu);
    __m512 v = _mm512_mul_ps(silu, load16(up, i, m));
    if constexpr (std::is_same_v<T, float>) {
      float* o = static_cast<float*>(out);
      if (acc) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, o + i));
      _mm512_mask_storeu_ps(o + i, m, v);
    } else {
      uint16_t* o = static_cast<uint16_t*>(out);
      if (acc) v = _mm512_add_ps(v, load16(o, i, m));
      _mm256_mask_storeu_epi16(o + i, m, f32_to_bf16_16(v));
    }
  }
}

template <typename T>
FT_AVX2_INLINE __m256 load8_any(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    return load8(p, n);
  else
    return load8_bf16(p, n);
}

FT_AVX2_INLINE __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

template <typename T>
FT_AVX2 void swiglu_avx2(void* out, const T* gate, const T* up, int64_t begin, int64_t end, bool acc) {
  for (int64_t i = begin; i < end; i += 8) {
    const int64_t n = end - i;
    const __m256 g = load8_any(gate + i, n);
    __m256 silu = _mm256_mul_ps(g, sigmoid8(g));
    if constexpr (!std::is_same_v<T, float>) silu = round_bf16_8(silu);
    __m256 v = _mm256_mul_ps(silu, load8_any(up + i, n));
    if constexpr (std::is_same_v<T, float>) {
      float* o = static_cast<float*>(out);
      if (acc) v = _mm256_add_ps(v, load8(o + i, n));
      store8(o + i, n, v);
    } else {
      uint16_t* o = static_cast<uint16_t*>(out);
      if (acc) v = _mm256_add_ps(v, load8_bf16(o + i, n));
      store8_bf16(o + i, n, v);
    }
  }
}

template <typename T>
void swiglu_backward_portable(float* dgate, float* dup, const float* dy, const T* gate, const T* up, int64_t begin,
                              int64_t end, bool acc_gate, bool acc_up) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_one(gate, i), u = load_one(up, i);
    const float s = 1.0f / (1.0f + std::exp(-g));
    const float dg = dy[i] * u * s * (1.0f + g * (1.0f - s));
    const float du = std::is_same_v<T, float> ? dy[i] * g * s : dy[i] * bf16_to_float(float_to_bf16(g * s));
    dgate[i] = acc_gate ? dgate[i] + dg : dg;
    dup[i] = acc_up ? dup[i] + du : du;
  }
}

template <typename T>
FT_AVX512 void swiglu_backward_avx512(float* dgate, float* dup, const float* dy, const T* gate, const T* up,
                                      int64_t begin, int64_t end, bool acc_gate, bool acc_up) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = tail_mask(end - i);
    const __m512 g = load16(gate, i, m), u = load16(up, i, m), d = _mm512_maskz_loadu_ps(m, dy + i);
    const __m512 s = sigmoid16(g);
    // dg = dy·u·s·(1 + g·(1 − s)), du = dy·g·s
    __m512 dg = _mm512_mul_ps(_mm512_mul_ps(d, u), _mm512_mul_ps(s, _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one)));
    __m512 silu = _mm512_mul_ps(g, s);
    if constexpr (!std::is_same_v<T, float>) silu = round_bf16_16(silu);
    __m512 du = _mm512_mul_ps(d, silu);
    if (acc_gate) dg = _mm512_add_ps(dg, _mm512_maskz_loadu_ps(m, dgate + i));
    if (acc_up) du = _mm512_add_ps(du, _mm512_maskz_loadu_ps(m, dup + i));
    _mm512_mask_storeu_ps(dgate + i, m, dg);
    _mm512_mask_storeu_ps(dup + i, m, du);
  }
}

template <typename T>
FT_AVX2 void swiglu_backward_avx2(float* dgate, float* dup, const float* dy, const T* gate, const T* up, int64_t begin,
                                  int64_t end, bool acc_gate, bool acc_up) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = begin; i < end; i += 8) {
    const int64_t n = end - i;
    const __m256 g = load8_any(gate + i, n), u = load8_any(up + i, n), d = load8(dy + i, n);
    const __m256 s = sigmoid8(g);
    __m256 dg = _mm256_mul_ps(_mm256_mul_ps(d, u), _mm256_mul_ps(s, _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one)));
    __m256 silu = _mm256_mul_ps(g, s);
    if constexpr (!std::is_same_v<T, float>) silu = round_bf16_8(silu);
    __m256 du = _mm256_mul_ps(d, silu);
    if (acc_gate) dg = _mm256_add_ps(dg, load8(dgate + i, n));
    if (acc_up) du = _mm256_add_ps(du, load8(dup + i, n));
    store8(dgate + i, n, dg);
    store8(dup + i, n, du);
  }
}

// Work per element is an exp and a divide: parallelise earlier than a plain add would.
constexpr int64_t kSwiGLUCost = 8;

template <typename T>
class SwiGLUKernel final : public Kernel {
 public:
  using Fn = void (*)(void*, const T*, const T*, int64_t, int64_t, bool);
  explicit SwiGLUKernel(int64_t n) : n_(n), fn_(pick_path<Fn>(swiglu_portable<T>, swiglu_avx2<T>, swiglu_avx512<T>)) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const T* gate = static_cast<const T*>(args.inputs[0].data());
    const T* up = static_cast<const T*>(args.inputs[1].data());
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    parallel_for(
        n_, threads_for(n_ * kSwiGLUCost, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) { fn_(out, gate, up, begin, end, acc); }, 16);
  }

 private:
  int64_t n_;
  Fn fn_;
};

template <typename T>
class SwiGLUBackwardKernel final : public Kernel {
 public:
  using Fn = void (*)(float*, float*, const float*, const T*, const T*, int64_t, int64_t, bool, bool);
  explicit SwiGLUBackwardKernel(int64_t n)
      : n_(n), fn_(pick_path<Fn>(swiglu_backward_portable<T>, swiglu_backward_avx2<T>, swiglu_backward_avx512<T>)) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* dy = static_cast<const float*>(args.inputs[0].data());
    const T* gate = static_cast<const T*>(args.inputs[1].data());
    const T* up = static_cast<const T*>(args.inputs[2].data());
    float* dgate = static_cast<float*>(args.outputs[0].data());
    float* dup = static_cast<float*>(args.outputs[1].data());
    const bool acc_gate = accumulate_flag(args, 0), acc_up = accumulate_flag(args, 1);
    parallel_for(
        n_, threads_for(n_ * kSwiGLUCost, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) { fn_(dgate, dup, dy, gate, up, begin, end, acc_gate, acc_up); }, 16);
  }

 private:
  int64_t n_;
  Fn fn_;
};

}  // namespace

std::unique_ptr<Kernel> make_rmsnorm_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  if (x.rank() < 1 || x[-1] == 0) return nullptr;
  return std::make_unique<RMSNormKernel>(x.numel() / x[-1], x[-1],
                                         static_cast<float>(call.params<ops::LayerNormParams>().eps));
}

std::unique_ptr<Kernel> make_rmsnorm_backward_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 1);
  if (x.rank() < 1 || x[-1] == 0) return nullptr;
  return std::make_unique<RMSNormBackwardKernel>(x.numel() / x[-1], x[-1]);
}

std::unique_ptr<Kernel> make_rope_kernel(const KernelCall& call) {
  const Shape& x = input_shape(call, 0);
  return std::make_unique<RoPEKernel>(x[0] * x[1], x[2], x[3], call.inputs[1].shape[2],
                                      call.params<ops::RoPEParams>().inverse);
}

std::unique_ptr<Kernel> make_swiglu_kernel(const KernelCall& call) {
  const bool backward = call.op == OpKind::SwiGLUBackward;
  const int64_t n = output_shape(call, 0).numel();
  const bool bf16 = input_dtype(call, backward ? 1 : 0) == DType::bf16;
  if (backward) {
    if (bf16) return std::make_unique<SwiGLUBackwardKernel<uint16_t>>(n);
    return std::make_unique<SwiGLUBackwardKernel<float>>(n);
  }
  if (bf16) return std::make_unique<SwiGLUKernel<uint16_t>>(n);
  return std::make_unique<SwiGLUKernel<float>>(n);
}

}  // namespace fusetrain::kernels::cpu_basic
