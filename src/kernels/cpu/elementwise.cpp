// Tuned elementwise kernels: Fill, Add/Sub/Mul/Div (numpy broadcasting), Scale,
// Copy, Cast (f32 <-> bf16, f32 <-> f16); portable, AVX2 and AVX-512 paths (f16 casts: core/half.cpp).
//
// Shape legend: any shape; n elements in total. Binary ops walk the merged
// broadcast space of out as runs along its last axis, each operand with stride
// 0 (broadcast) or 1 within a run.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "fusetrain/core/half.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

enum class BinaryOp { Add, Sub, Mul, Div };

template <BinaryOp Op>
inline float apply(float x, float y) {
  if constexpr (Op == BinaryOp::Add)
    return x + y;
  else if constexpr (Op == BinaryOp::Sub)
    return x - y;
  else if constexpr (Op == BinaryOp::Mul)
    return x * y;
  else
    return x / y;
}

template <BinaryOp Op>
FT_AVX512_INLINE __m512 apply16(__m512 x, __m512 y) {
  if constexpr (Op == BinaryOp::Add)
    return _mm512_add_ps(x, y);
  else if constexpr (Op == BinaryOp::Sub)
    return _mm512_sub_ps(x, y);
  else if constexpr (Op == BinaryOp::Mul)
    return _mm512_mul_ps(x, y);
  else
    return _mm512_div_ps(x, y);
}

// One run: out[i] (+)= a[i * sa] op b[i * sb], sa and sb in {0, 1}.
using BinaryRunFn = void (*)(float* out, const float* a, int64_t sa, const float* b, int64_t sb, int64_t n);

template <BinaryOp Op, bool Acc>
void binary_run_portable(float* out, const float* a, int64_t sa, const float* b, int64_t sb, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float v = apply<Op>(a[i * sa], b[i * sb]);
    out[i] = Acc ? out[i] + v : v;
  }
}

FT_AVX512_INLINE __m512 load_strided16(const float* p, int64_t stride, int64_t i, __mmask16 m) {
  return stride != 0 ? _mm512_maskz_loadu_ps(m, p + i) : _mm512_set1_ps(p[0]);
}

template <BinaryOp Op, bool Acc>
FT_AVX512 void binary_run_avx512(float* out, const float* a, int64_t sa, const float* b, int64_t sb, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = apply16<Op>(load_strided16(a, sa, i, 0xFFFF), load_strided16(b, sb, i, 0xFFFF));
    if (Acc) v = _mm512_add_ps(_mm512_loadu_ps(out + i), v);
    _mm512_storeu_ps(out + i, v);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = apply16<Op>(load_strided16(a, sa, i, m), load_strided16(b, sb, i, m));
    if (Acc) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + i), v);
    _mm512_mask_storeu_ps(out + i, m, v);
  }
}

template <BinaryOp Op>
FT_AVX2_INLINE __m256 apply8(__m256 x, __m256 y) {
  if constexpr (Op == BinaryOp::Add)
    return _mm256_add_ps(x, y);
  else if constexpr (Op == BinaryOp::Sub)
    return _mm256_sub_ps(x, y);
  else if constexpr (Op == BinaryOp::Mul)
    return _mm256_mul_ps(x, y);
  else
    return _mm256_div_ps(x, y);
}

FT_AVX2_INLINE __m256 load_strided8(const float* p, int64_t stride, int64_t i, int64_t n) {
  return stride != 0 ? load8(p + i, n) : _mm256_set1_ps(p[0]);
}

template <BinaryOp Op, bool Acc>
FT_AVX2 void binary_run_avx2(float* out, const float* a, int64_t sa, const float* b, int64_t sb, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = apply8<Op>(load_strided8(a, sa, i, n - i), load_strided8(b, sb, i, n - i));
    if (Acc) v = _mm256_add_ps(load8(out + i, n - i), v);
    store8(out + i, n - i, v);
  }
}

template <BinaryOp Op>
void pick_binary(BinaryRunFn* write, BinaryRunFn* add) {
  *write = pick_path<BinaryRunFn>(binary_run_portable<Op, false>, binary_run_avx2<Op, false>,
                                  binary_run_avx512<Op, false>);
  *add = pick_path<BinaryRunFn>(binary_run_portable<Op, true>, binary_run_avx2<Op, true>, binary_run_avx512<Op, true>);
}

// out = a op b, f32, a and b broadcast to out.
class BinaryKernel final : public Kernel {
 public:
  BinaryKernel(const StridedSpace& space, int64_t numel, BinaryRunFn write, BinaryRunFn add)
      : space_(space), numel_(numel), write_(write), add_(add) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* a = static_cast<const float*>(args.inputs[0].data());
    const float* b = static_cast<const float*>(args.inputs[1].data());
    float* out = static_cast<float*>(args.outputs[0].data());
    BinaryRunFn fn = accumulate_flag(args, 0) ? add_ : write_;
    const StridedSpace& s = space_;
    const int64_t sa = s.stride_a[s.rank - 1], sb = s.stride_b[s.rank - 1];
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          for_each_run(s, begin, end, [&](int64_t pos, int64_t off_a, int64_t off_b, int64_t len) {
            fn(out + pos, a + off_a, sa, b + off_b, sb, len);
          });
        },
        16);
  }

 private:
  StridedSpace space_;
  int64_t numel_;
  BinaryRunFn write_, add_;
};

// ---- unary f32 maps: Fill (no input), Scale, Copy -------------------------------

template <bool Acc>
void scale_portable(float* out, const float* x, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Acc ? out[i] + alpha * x[i] : alpha * x[i];
}

template <bool Acc>
FT_AVX512 void scale_avx512(float* out, const float* x, float alpha, int64_t n) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, x + i));
    if (Acc) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + i), v);
    _mm512_mask_storeu_ps(out + i, m, v);
  }
}

template <bool Acc>
FT_AVX2 void scale_avx2(float* out, const float* x, float alpha, int64_t n) {
  const __m256 va = _mm256_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = _mm256_mul_ps(va, load8(x + i, n - i));
    if (Acc) v = _mm256_add_ps(load8(out + i, n - i), v);
    store8(out + i, n - i, v);
  }
}

using ScaleFn = void (*)(float* out, const float* x, float alpha, int64_t n);

template <bool Acc>
ScaleFn scale_fn() {
  return pick_path<ScaleFn>(scale_portable<Acc>, scale_avx2<Acc>, scale_avx512<Acc>);
}

// out (+)= alpha * x, f32.
class ScaleKernel final : public Kernel {
 public:
  ScaleKernel(int64_t numel, float alpha)
      : numel_(numel), alpha_(alpha), write_(scale_fn<false>()), add_(scale_fn<true>()) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = static_cast<const float*>(args.inputs[0].data());
    float* out = static_cast<float*>(args.outputs[0].data());
    const ScaleFn fn = accumulate_flag(args, 0) ? add_ : write_;
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) { fn(out + begin, x + begin, alpha_, end - begin); }, 16);
  }

 private:
  int64_t numel_;
  float alpha_;
  ScaleFn write_, add_;
};

// out (+)= value, f32.
class FillKernel final : public Kernel {
 public:
  FillKernel(int64_t numel, float value) : numel_(numel), value_(value) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    float* out = static_cast<float*>(args.outputs[0].data());
    const bool acc = accumulate_flag(args, 0);
    const float value = value_;
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          if (acc) {
            for (int64_t i = begin; i < end; ++i) out[i] += value;
          } else if (value == 0.0f && !std::signbit(value)) {
            std::memset(out + begin, 0, static_cast<size_t>(end - begin) * sizeof(float));
          } else {
            std::fill(out + begin, out + end, value);
          }
        },
        16);
  }

 private:
  int64_t numel_;
  float value_;
};

// ---- bf16 helpers ------------------------------------------------------------------

void bf16_to_f32_portable(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]);
}

FT_AVX512 void bf16_to_f32_avx512(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, bf16_to_f32_16(_mm256_maskz_loadu_epi16(m, x + i)));
  }
}

void f32_to_bf16_portable(uint16_t* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(x[i]);
}

FT_AVX512 void f32_to_bf16_avx512(uint16_t* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm256_mask_storeu_epi16(out + i, m, f32_to_bf16_16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

FT_AVX2 void bf16_to_f32_avx2(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(out + i, n - i, load8_bf16(x + i, n - i));
}

FT_AVX2 void f32_to_bf16_avx2(uint16_t* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8_bf16(out + i, n - i, load8(x + i, n - i));
}

using WidenFn = void (*)(float*, const uint16_t*, int64_t);
WidenFn widen_bf16_fn() { return pick_path<WidenFn>(bf16_to_f32_portable, bf16_to_f32_avx2, bf16_to_f32_avx512); }

// out = bf16(f32(out) + f32(x)): one rounding per element.
void bf16_add_portable(uint16_t* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(out[i]) + bf16_to_float(x[i]));
}

FT_AVX512 void bf16_add_avx512(uint16_t* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 sum = _mm512_add_ps(bf16_to_f32_16(_mm256_maskz_loadu_epi16(m, out + i)),
                               bf16_to_f32_16(_mm256_maskz_loadu_epi16(m, x + i)));
    _mm256_mask_storeu_epi16(out + i, m, f32_to_bf16_16(sum));
  }
}

FT_AVX2 void bf16_add_avx2(uint16_t* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    store8_bf16(out + i, n - i, _mm256_add_ps(load8_bf16(out + i, n - i), load8_bf16(x + i, n - i)));
}

using Bf16AddFn = void (*)(uint16_t* out, const uint16_t* x, int64_t n);

// out = x (memcpy), or with accumulate out += x; f32 or bf16.
class CopyKernel final : public Kernel {
 public:
  CopyKernel(int64_t numel, DType dtype)
      : numel_(numel),
        dtype_(dtype),
        add_f32_(scale_fn<true>()),
        add_bf16_(pick_path<Bf16AddFn>(bf16_add_portable, bf16_add_avx2, bf16_add_avx512)) {}
  bool accumulates() const override { return true; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    if (!acc && out == x) return;
    const size_t size = dtype_size(dtype_);
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          const int64_t n = end - begin;
          if (!acc) {
            std::memcpy(static_cast<char*>(out) + begin * size, static_cast<const char*>(x) + begin * size, n * size);
          } else if (dtype_ == DType::f32) {
            add_f32_(static_cast<float*>(out) + begin, static_cast<const float*>(x) + begin, 1.0f, n);
          } else {
            add_bf16_(static_cast<uint16_t*>(out) + begin, static_cast<const uint16_t*>(x) + begin, n);
          }
        },
        16);
  }

 private:
  int64_t numel_;
  DType dtype_;
  ScaleFn add_f32_;
  Bf16AddFn add_bf16_;
};

// out = x converted: f32 -> bf16 or f16 (nearest even; f16 overflows to inf) or
// back to f32 (exact); same dtype is a copy.
class CastKernel final : public Kernel {
 public:
  CastKernel(int64_t numel, DType from, DType to)
      : numel_(numel), from_(from), to_(to), round_(round_to_bf16_fn()), widen_(widen_bf16_fn()) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    if (from_ == to_ && out == x) return;
    parallel_for(
        numel_, threads_for(numel_, ctx.num_threads),
        [&](int64_t begin, int64_t end, int) {
          const int64_t n = end - begin;
          if (from_ == to_) {
            const size_t size = dtype_size(from_);
            std::memcpy(static_cast<char*>(out) + begin * size, static_cast<const char*>(x) + begin * size, n * size);
          } else if (from_ == DType::f32 && to_ == DType::f16) {
            float_to_f16(static_cast<uint16_t*>(out) + begin, static_cast<const float*>(x) + begin, n);
          } else if (from_ == DType::f16) {
            f16_to_float(static_cast<float*>(out) + begin, static_cast<const uint16_t*>(x) + begin, n);
          } else if (from_ == DType::f32) {
            round_(static_cast<uint16_t*>(out) + begin, static_cast<const float*>(x) + begin, n);
          } else {
            widen_(static_cast<float*>(out) + begin, static_cast<const uint16_t*>(x) + begin, n);
          }
        },
        16);
  }

 private:
  int64_t numel_;
  DType from_, to_;
  RoundBf16Fn round_;
  WidenFn widen_;
};

}  // namespace

RoundBf16Fn round_to_bf16_fn() {
  return pick_path<RoundBf16Fn>(f32_to_bf16_portable, f32_to_bf16_avx2, f32_to_bf16_avx512);
}

std::unique_ptr<Kernel> make_fill_kernel(const KernelCall& call) {
  if (output_dtype(call, 0) != DType::f32) return nullptr;
  const float value = static_cast<float>(call.params<ops::FillParams>().value);
  return std::make_unique<FillKernel>(output_shape(call, 0).numel(), value);
}

std::unique_ptr<Kernel> make_binary_kernel(const KernelCall& call) {
  if (output_dtype(call, 0) != DType::f32) return nullptr;
  StridedSpace space;
  const Shape& a = input_shape(call, 0);
  const Shape& b = input_shape(call, 1);
  if (!broadcast_space(output_shape(call, 0), a, &b, &space)) return nullptr;
  BinaryRunFn write = nullptr, add = nullptr;
  switch (call.op) {
    case OpKind::Add:
      pick_binary<BinaryOp::Add>(&write, &add);
      break;
    case OpKind::Sub:
      pick_binary<BinaryOp::Sub>(&write, &add);
      break;
    case OpKind::Mul:
      pick_binary<BinaryOp::Mul>(&write, &add);
      break;
    case OpKind::Div:
      pick_binary<BinaryOp::Div>(&write, &add);
      break;
    default:
      return nullptr;
  }
  return std::make_unique<BinaryKernel>(space, output_shape(call, 0).numel(), write, add);
}

std::unique_ptr<Kernel> make_scale_kernel(const KernelCall& call) {
  if (output_dtype(call, 0) != DType::f32) return nullptr;
  const float alpha = static_cast<float>(call.params<ops::ScaleParams>().alpha);
  return std::make_unique<ScaleKernel>(output_shape(call, 0).numel(), alpha);
}

std::unique_ptr<Kernel> make_copy_kernel(const KernelCall& call) {
  DType t = output_dtype(call, 0);
  if (t != DType::f32 && t != DType::bf16) return nullptr;
  return std::make_unique<CopyKernel>(output_shape(call, 0).numel(), t);
}

std::unique_ptr<Kernel> make_cast_kernel(const KernelCall& call) {
  DType from = input_dtype(call, 0), to = output_dtype(call, 0);
  auto low = [](DType t) { return t == DType::bf16 || t == DType::f16; };
  bool supported = from == to || (from == DType::f32 && low(to)) || (low(from) && to == DType::f32);
  if (!supported) return nullptr;
  return std::make_unique<CastKernel>(output_shape(call, 0).numel(), from, to);
}

}  // namespace fusetrain::kernels::cpu_basic
