// Tuned activation kernels, f32: Gelu (erf and tanh forms), Tanh, Relu and
// GeluBackward (dy, x), TanhBackward (dy, y), ReluBackward (dy, x); portable, AVX2 and AVX-512 paths. The input x (or the saved
// value) may be bf16, widened exactly to f32 block by block; a forward op's bf16 output
// (out_dtype) is computed in f32 and rounded block by block.
//
// Shape legend: any shape, seen as n contiguous elements; out may alias the
// first input (kInPlace), which is safe because element i is read before it
// is written.
#include <algorithm>
#include <cmath>

#include "fusetrain/core/half.h"

#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

enum class Act { GeluErf, GeluTanh, Tanh, Relu };

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // √(2/π)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;   // 1/√(2π)
constexpr float kGeluCubic = 0.044715f;

// ---- scalar formulas (portable path) ----------------------------------------------

template <Act A>
float act_forward(float x) {
  if constexpr (A == Act::GeluErf)
    return 0.5f * x * (1.0f + std::erf(x * kInvSqrt2));
  else if constexpr (A == Act::GeluTanh)
    return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
  else if constexpr (A == Act::Tanh)
    return std::tanh(x);
  else
    return x > 0.0f ? x : 0.0f;
}

// dy * f'(.) where `saved` is x (Gelu, Relu) or y = tanh(x) (Tanh).
template <Act A>
float act_backward(float dy, float saved) {
  const float x = saved;
  if constexpr (A == Act::GeluErf) {
    float cdf = 0.5f * (1.0f + std::erf(x * kInvSqrt2));
    float pdf = kInvSqrt2Pi * std::exp(-0.5f * x * x);
    return dy * (cdf + x * pdf);
  } else if constexpr (A == Act::GeluTanh) {
    float t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
    float du_dx = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    return dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du_dx);
  } else if constexpr (A == Act::Tanh) {
    return dy * (1.0f - saved * saved);
  } else {
    return x > 0.0f ? dy : 0.0f;
  }
}

template <Act A>
void forward_portable(float* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = act_forward<A>(x[i]);
}

template <Act A>
void backward_portable(float* out, const float* dy, const float* saved, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = act_backward<A>(dy[i], saved[i]);
}

// The GELU and its backward of one x together (each as its own function computes it; inlined into one loop, the
// compiler forms the shared erf once): y = f(x), dx = dy·f′(x); dx may be dy.
template <Act A>
void pair_portable(float* dx, float* y, const float* dy, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    y[i] = act_forward<A>(xi);
    dx[i] = act_backward<A>(dy[i], xi);
  }
}

// ---- AVX-512 ------------------------------------------------------------------------

template <Act A>
FT_AVX512_INLINE __m512 act_forward16(__m512 x) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  if constexpr (A == Act::GeluErf) {
    __m512 e = erf16(_mm512_mul_ps(x, _mm512_set1_ps(kInvSqrt2)));
    return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, e));
  } else if constexpr (A == Act::GeluTanh) {
    __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi), _mm512_fmadd_ps(_mm512_set1_ps(kGeluCubic), x3, x));
    return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh16(u)));
  } else if constexpr (A == Act::Tanh) {
    return tanh16(x);
  } else {
    return _mm512_max_ps(x, _mm512_setzero_ps());  // NaN -> 0 like x > 0 ? x : 0
  }
}

template <Act A>
FT_AVX512_INLINE __m512 act_backward16(__m512 dy, __m512 saved) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  const __m512 x = saved;
  if constexpr (A == Act::GeluErf) {
    __m512 cdf = _mm512_mul_ps(half, _mm512_add_ps(one, erf16(_mm512_mul_ps(x, _mm512_set1_ps(kInvSqrt2)))));
    __m512 pdf =
        _mm512_mul_ps(_mm512_set1_ps(kInvSqrt2Pi), exp16(_mm512_mul_ps(_mm512_set1_ps(-0.5f), _mm512_mul_ps(x, x))));
    return _mm512_mul_ps(dy, _mm512_fmadd_ps(x, pdf, cdf));
  } else if constexpr (A == Act::GeluTanh) {
    __m512 x2 = _mm512_mul_ps(x, x);
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi),
                             _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluCubic), x2), x, x));
    __m512 t = tanh16(u);
    __m512 du_dx =
        _mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi), _mm512_fmadd_ps(_mm512_set1_ps(3.0f * kGeluCubic), x2, one));
    __m512 sech2 = _mm512_fnmadd_ps(t, t, one);
    __m512 d = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(half, x), sech2), du_dx,
                               _mm512_mul_ps(half, _mm512_add_ps(one, t)));
    return _mm512_mul_ps(dy, d);
  } else if constexpr (A == Act::Tanh) {
    return _mm512_mul_ps(dy, _mm512_fnmadd_ps(saved, saved, one));
  } else {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), dy);
  }
}

template <Act A>
FT_AVX512 void forward_avx512(float* out, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, act_forward16<A>(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, act_forward16<A>(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

template <Act A>
FT_AVX512 void pair_avx512(float* dx, float* y, const float* dy, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : tail_mask(n - i);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
    _mm512_mask_storeu_ps(y + i, m, act_forward16<A>(xv));
    _mm512_mask_storeu_ps(dx + i, m, act_backward16<A>(_mm512_maskz_loadu_ps(m, dy + i), xv));
  }
}

template <Act A>
FT_AVX512 void backward_avx512(float* out, const float* dy, const float* saved, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, act_backward16<A>(_mm512_loadu_ps(dy + i), _mm512_loadu_ps(saved + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m,
                          act_backward16<A>(_mm512_maskz_loadu_ps(m, dy + i), _mm512_maskz_loadu_ps(m, saved + i)));
  }
}

// ---- AVX2 + FMA (the AVX-512 formulas on 8 lanes) ----------------------------------------

template <Act A>
FT_AVX2_INLINE __m256 act_forward8(__m256 x) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  if constexpr (A == Act::GeluErf) {
    __m256 e = erf8(_mm256_mul_ps(x, _mm256_set1_ps(kInvSqrt2)));
    return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, e));
  } else if constexpr (A == Act::GeluTanh) {
    __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi), _mm256_fmadd_ps(_mm256_set1_ps(kGeluCubic), x3, x));
    return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(u)));
  } else if constexpr (A == Act::Tanh) {
    return tanh8(x);
  } else {
    return _mm256_max_ps(x, _mm256_setzero_ps());  // NaN -> 0 like x > 0 ? x : 0
  }
}

template <Act A>
FT_AVX2_INLINE __m256 act_backward8(__m256 dy, __m256 saved) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 x = saved;
  if constexpr (A == Act::GeluErf) {
    __m256 cdf = _mm256_mul_ps(half, _mm256_add_ps(one, erf8(_mm256_mul_ps(x, _mm256_set1_ps(kInvSqrt2)))));
    __m256 pdf =
        _mm256_mul_ps(_mm256_set1_ps(kInvSqrt2Pi), exp8(_mm256_mul_ps(_mm256_set1_ps(-0.5f), _mm256_mul_ps(x, x))));
    return _mm256_mul_ps(dy, _mm256_fmadd_ps(x, pdf, cdf));
  } else if constexpr (A == Act::GeluTanh) {
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi),
                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluCubic), x2), x, x));
    __m256 t = tanh8(u);
    __m256 du_dx =
        _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi), _mm256_fmadd_ps(_mm256_set1_ps(3.0f * kGeluCubic), x2, one));
    __m256 sech2 = _mm256_fnmadd_ps(t, t, one);
    __m256 d = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), sech2), du_dx,
                               _mm256_mul_ps(half, _mm256_add_ps(one, t)));
    return _mm256_mul_ps(dy, d);
  } else if constexpr (A == Act::Tanh) {
    return _mm256_mul_ps(dy, _mm256_fnmadd_ps(saved, saved, one));
  } else {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ), dy);
  }
}

template <Act A>
FT_AVX2 void forward_avx2(float* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(out + i, n - i, act_forward8<A>(load8(x + i, n - i)));
}

template <Act A>
FT_AVX2 void backward_avx2(float* out, const float* dy, const float* saved, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    store8(out + i, n - i, act_backward8<A>(load8(dy + i, n - i), load8(saved + i, n - i)));
}

template <Act A>
FT_AVX2 void pair_avx2(float* dx, float* y, const float* dy, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 xv = load8(x + i, n - i);
    store8(y + i, n - i, act_forward8<A>(xv));
    store8(dx + i, n - i, act_backward8<A>(load8(dy + i, n - i), xv));
  }
}

// ---- kernels ------------------------------------------------------------------------

using ForwardFn = void (*)(float* out, const float* x, int64_t n);
using BackwardFn = void (*)(float* out, const float* dy, const float* saved, int64_t n);

// Elements [begin, end) of a bf16 tensor widened (exactly) to f32 a block at a time, each block
// handed to `body(first, widened, count)`.
constexpr int64_t kWidenBlock = 512;

template <typename Body>
void widened_blocks(const uint16_t* x, int64_t begin, int64_t end, Body body) {
  alignas(64) float block[kWidenBlock];
  for (int64_t i = begin; i < end; i += kWidenBlock) {
    const int64_t n = std::min(kWidenBlock, end - i);
    bf16_to_float(block, x + i, static_cast<size_t>(n));
    body(i, block, n);
  }
}

// Results computed in f32 a block at a time and rounded to bf16 (the Cast kernel's rounding):
// `compute(first, block, count)` fills block with elements [first, first + count).
template <typename Compute>
void rounded_blocks(uint16_t* out, int64_t begin, int64_t end, RoundBf16Fn round, Compute compute) {
  alignas(64) float block[kWidenBlock];
  for (int64_t i = begin; i < end; i += kWidenBlock) {
    const int64_t n = std::min(kWidenBlock, end - i);
    compute(i, block, n);
    round(out + i, block, n);
  }
}

// out (R...) = f(x), n elements; x f32, or bf16 widened block by block; out f32, or rounded to bf16.
class ActivationKernel final : public Kernel {
 public:
  ActivationKernel(int64_t numel, ForwardFn fn, bool bf16_x, RoundBf16Fn round_out)
      : numel_(numel), fn_(fn), bf16_x_(bf16_x), round_out_(round_out) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    // f32 results of elements [begin, end) into out (f32 elements from out_at).
    auto compute = [&](float* out, int64_t begin, int64_t end) {
      if (bf16_x_)
        widened_blocks(static_cast<const uint16_t*>(args.inputs[0].data()), begin, end,
                       [&](int64_t i, const float* xf, int64_t n) { fn_(out + (i - begin), xf, n); });
      else
        fn_(out, static_cast<const float*>(args.inputs[0].data()) + begin, end - begin);
    };
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          if (!round_out_) return compute(static_cast<float*>(args.outputs[0].data()) + begin, begin, end);
          rounded_blocks(static_cast<uint16_t*>(args.outputs[0].data()), begin, end, round_out_,
                         [&](int64_t i, float* block, int64_t n) { compute(block, i, i + n); });
        },
        16);
  }

 private:
  int64_t numel_;
  ForwardFn fn_;
  bool bf16_x_;
  RoundBf16Fn round_out_;  // null: f32 output
};

// dx = dy * f'(saved), n elements; saved f32, or bf16 widened block by block.
class ActivationBackwardKernel final : public Kernel {
 public:
  ActivationBackwardKernel(int64_t numel, BackwardFn fn, bool bf16_saved)
      : numel_(numel), fn_(fn), bf16_saved_(bf16_saved) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* dy = static_cast<const float*>(args.inputs[0].data());
    float* out = static_cast<float*>(args.outputs[0].data());
    if (bf16_saved_) {
      const uint16_t* saved = static_cast<const uint16_t*>(args.inputs[1].data());
      parallel_for(
          numel_, threads_for(numel_, ctx.num_threads),
          [&](int64_t begin, int64_t end, int) {
            widened_blocks(saved, begin, end,
                           [&](int64_t i, const float* sf, int64_t n) { fn_(out + i, dy + i, sf, n); });
          },
          16);
      return;
    }
    const float* saved = static_cast<const float*>(args.inputs[1].data());
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) { fn_(out + begin, dy + begin, saved + begin, end - begin); }, 16);
  }

 private:
  int64_t numel_;
  BackwardFn fn_;
  bool bf16_saved_;
};

bool parse_act(const KernelCall& call, Act* act) {
  switch (call.op) {
    case OpKind::Gelu:
    case OpKind::GeluBackward:
      *act = ops::gelu_approximation(call.op_params) == ops::GeluApproximation::Tanh ? Act::GeluTanh : Act::GeluErf;
      return true;
    case OpKind::Tanh:
    case OpKind::TanhBackward:
      *act = Act::Tanh;
      return true;
    case OpKind::Relu:
    case OpKind::ReluBackward:
      *act = Act::Relu;
      return true;
    default:
      return false;
  }
}

template <Act A>
ForwardFn forward_fn() {
  return pick_path<ForwardFn>(forward_portable<A>, forward_avx2<A>, forward_avx512<A>);
}

template <Act A>
BackwardFn backward_fn() {
  return pick_path<BackwardFn>(backward_portable<A>, backward_avx2<A>, backward_avx512<A>);
}

}  // namespace

std::unique_ptr<Kernel> make_activation_kernel(const KernelCall& call) {
  Act act;
  const DType x_dtype = input_dtype(call, 0);
  const DType out_dtype = output_dtype(call, 0);
  if (!parse_act(call, &act) || (x_dtype != DType::f32 && x_dtype != DType::bf16) ||
      (out_dtype != DType::f32 && out_dtype != DType::bf16))
    return nullptr;
  ForwardFn fn = nullptr;
  switch (act) {
    case Act::GeluErf:
      fn = forward_fn<Act::GeluErf>();
      break;
    case Act::GeluTanh:
      fn = forward_fn<Act::GeluTanh>();
      break;
    case Act::Tanh:
      fn = forward_fn<Act::Tanh>();
      break;
    case Act::Relu:
      fn = forward_fn<Act::Relu>();
      break;
  }
  return std::make_unique<ActivationKernel>(output_shape(call, 0).numel(), fn, x_dtype == DType::bf16,
                                            out_dtype == DType::bf16 ? round_to_bf16_fn() : nullptr);
}

GeluFn gelu_fn(bool tanh_form) {
  return tanh_form ? forward_fn<Act::GeluTanh>() : forward_fn<Act::GeluErf>();
}

GeluBackwardFn gelu_backward_fn(bool tanh_form) {
  return tanh_form ? backward_fn<Act::GeluTanh>() : backward_fn<Act::GeluErf>();
}

GeluPairFn gelu_pair_fn(bool tanh_form) {
  if (tanh_form)
    return pick_path<GeluPairFn>(pair_portable<Act::GeluTanh>, pair_avx2<Act::GeluTanh>, pair_avx512<Act::GeluTanh>);
  return pick_path<GeluPairFn>(pair_portable<Act::GeluErf>, pair_avx2<Act::GeluErf>, pair_avx512<Act::GeluErf>);
}

std::unique_ptr<Kernel> make_activation_backward_kernel(const KernelCall& call) {
  Act act;
  const DType saved_dtype = input_dtype(call, 1);
  if (!parse_act(call, &act) || input_dtype(call, 0) != DType::f32 ||
      (saved_dtype != DType::f32 && saved_dtype != DType::bf16))
    return nullptr;
  BackwardFn fn = nullptr;
  switch (act) {
    case Act::GeluErf:
      fn = backward_fn<Act::GeluErf>();
      break;
    case Act::GeluTanh:
      fn = backward_fn<Act::GeluTanh>();
      break;
    case Act::Tanh:
      fn = backward_fn<Act::Tanh>();
      break;
    case Act::Relu:
      fn = backward_fn<Act::Relu>();
      break;
  }
  return std::make_unique<ActivationBackwardKernel>(output_shape(call, 0).numel(), fn, saved_dtype == DType::bf16);
}

}  // namespace fusetrain::kernels::cpu_basic
