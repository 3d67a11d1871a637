// Reference elementwise kernels: Fill, Add/Sub/Mul/Div (numpy broadcasting),
// Scale, Gelu, Tanh, Relu, Pow, Sqrt, Erf and their backward ops, Dropout, Cast, Copy.
// Values are computed in double and rounded to the output dtype on store.
//
// Shape letters: any shape; elementwise ops see tensors as flat arrays of n
// elements, broadcast ops map each output position to its input elements.
#include <cmath>

#include "kernels/ref/ref_kernels.h"
#include "kernels/rng.h"

namespace fusetrain::kernels::ref {
namespace {

constexpr double kSqrt2 = 1.41421356237309504880;
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // √(2/π)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1/√(2π)
constexpr double kGeluCubic = 0.044715;
constexpr double kTwoOverSqrtPi = 1.12837916709551257390;  // 2/√π

}  // namespace

double gelu_forward(double x, bool tanh_approximation) {
  if (tanh_approximation) return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
  return 0.5 * x * (1.0 + std::erf(x / kSqrt2));
}

double gelu_derivative(double x, bool tanh_approximation) {
  if (tanh_approximation) {
    double t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
    double du_dx = kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * x * x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx;
  }
  double cdf = 0.5 * (1.0 + std::erf(x / kSqrt2));
  double pdf = kInvSqrt2Pi * std::exp(-0.5 * x * x);
  return cdf + x * pdf;
}

namespace {

bool parse_approximate(const KernelCall& call) {
  return ops::gelu_approximation(call.op_params) == ops::GeluApproximation::Tanh;
}

// ---- Fill -------------------------------------------------------------------

// out: `shape` of `dtype`, every element = value (accumulate: += value).
class FillRef final : public RefKernel {
 public:
  FillRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()), dtype_(output_dtype(call, 0)), value_(call.params<ops::FillParams>().value) {}

  void run(const KernelArgs& args, const StepContext&) override {
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < numel_; ++i) store(out, dtype_, i, value_, acc);
  }

 private:
  int64_t numel_;
  DType dtype_;
  double value_;
};

// ---- one-input and two-input maps over equal shapes ---------------------------

// out[i] = f(x[i]); x and out may have different dtypes (both floating).
template <typename F>
class UnaryMapRef final : public RefKernel {
 public:
  UnaryMapRef(const KernelCall& call, F f)
      : numel_(output_shape(call, 0).numel()),
        in_dtype_(input_dtype(call, 0)),
        out_dtype_(output_dtype(call, 0)),
        f_(f) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < numel_; ++i) store(out, out_dtype_, i, f_(load(x, in_dtype_, i)), acc);
  }

 private:
  int64_t numel_;
  DType in_dtype_, out_dtype_;
  F f_;
};

// out[i] = f(dy[i], saved[i]) for the backward ops (all f32 by inference).
template <typename F>
class BackwardMapRef final : public RefKernel {
 public:
  BackwardMapRef(const KernelCall& call, F f)
      : numel_(output_shape(call, 0).numel()),
        dy_dtype_(input_dtype(call, 0)),
        saved_dtype_(input_dtype(call, 1)),
        out_dtype_(output_dtype(call, 0)),
        f_(f) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* dy = args.inputs[0].data();
    const void* saved = args.inputs[1].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < numel_; ++i)
      store(out, out_dtype_, i, f_(load(dy, dy_dtype_, i), load(saved, saved_dtype_, i)), acc);
  }

 private:
  int64_t numel_;
  DType dy_dtype_, saved_dtype_, out_dtype_;
  F f_;
};

template <typename F>
std::unique_ptr<Kernel> make_unary(const KernelCall& call, F f) {
  return std::make_unique<UnaryMapRef<F>>(call, f);
}

template <typename F>
std::unique_ptr<Kernel> make_backward(const KernelCall& call, F f) {
  return std::make_unique<BackwardMapRef<F>>(call, f);
}

// ---- Add, Sub, Mul, Div ---------------------------------------------------------

// a, b broadcast (numpy rules) to out; same floating dtype throughout.
class BinaryRef final : public RefKernel {
 public:
  BinaryRef(const KernelCall& call)
      : op_(call.op),
        numel_(output_shape(call, 0).numel()),
        dtype_(output_dtype(call, 0)),
        a_index_(broadcast_index(input_shape(call, 0), output_shape(call, 0))),
        b_index_(broadcast_index(input_shape(call, 1), output_shape(call, 0))) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* a = args.inputs[0].data();
    const void* b = args.inputs[1].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < numel_; ++i) {
      double x = load(a, dtype_, a_index_.offset(i));
      double y = load(b, dtype_, b_index_.offset(i));
      store(out, dtype_, i, apply(x, y), acc);
    }
  }

 private:
  double apply(double x, double y) const {
    switch (op_) {
      case OpKind::Add:
        return x + y;
      case OpKind::Sub:
        return x - y;
      case OpKind::Mul:
        return x * y;
      case OpKind::Div:
        return x / y;
      default:
        break;
    }
    return 0.0;
  }

  OpKind op_;
  int64_t numel_;
  DType dtype_;
  StridedIndex a_index_, b_index_;
};

// ---- Dropout ------------------------------------------------------------------

// y[i] = keep(i) ? x[i] / (1 - p) : 0, keep(i) = uniform(seed, rng_offset, map(i)) >= p.
class DropoutRef final : public RefKernel {
 public:
  DropoutRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()),
        dtype_(output_dtype(call, 0)),
        p_(call.params<ops::DropoutParams>().p),
        seed_(call.params<ops::DropoutParams>().seed),
        map_(stream_index_map(call.params<ops::DropoutParams>())) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const void* x = args.inputs[0].data();
    void* y = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    const float p = static_cast<float>(p_);
    for (int64_t i = 0; i < numel_; ++i) {
      bool keep = dropout_keep(seed_, ctx.rng_offset, map_(i), p);
      store(y, dtype_, i, keep ? load(x, dtype_, i) / (1.0 - p_) : 0.0, acc);
    }
  }

 private:
  int64_t numel_;
  DType dtype_;
  double p_;
  uint64_t seed_;
  StreamIndexMap map_;
};

// y[i] = dropout(x)[i] + residual[i], computed in double, rounded once.
class DropoutAddRef final : public RefKernel {
 public:
  DropoutAddRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()),
        p_(call.params<ops::DropoutParams>().p),
        seed_(call.params<ops::DropoutParams>().seed),
        map_(stream_index_map(call.params<ops::DropoutParams>())) {}

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const float* x = args.inputs[0].data_as<float>();
    const float* residual = args.inputs[1].data_as<float>();
    const bool acc = accumulate_flag(args, 0);
    const float p = static_cast<float>(p_);
    for (int64_t i = 0; i < numel_; ++i) {
      bool keep = dropout_keep(seed_, ctx.rng_offset, map_(i), p);
      double dropped = keep ? static_cast<double>(static_cast<float>(x[i] / (1.0 - p_))) : 0.0;
      store(args.outputs[0].data(), DType::f32, i, dropped + residual[i], acc);
    }
  }

 private:
  int64_t numel_;
  double p_;
  uint64_t seed_;
  StreamIndexMap map_;
};

// ---- Cast -----------------------------------------------------------------------

// Converts between any two of the six dtypes:
//   float -> float: one rounding (nearest even) from the exact f32 value;
//   int -> float: one rounding from the integer to f32, then stored;
//   float -> int: truncation toward zero, saturating, NaN -> 0;
//   int -> int: two's-complement wrap (i64 -> i32 keeps the low 32 bits).
// With accumulate the converted value is added in the destination's arithmetic.
class CastRef final : public RefKernel {
 public:
  CastRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()), src_(input_dtype(call, 0)), dst_(output_dtype(call, 0)) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < numel_; ++i) {
      if (is_floating(src_)) {
        store(out, dst_, i, load(x, src_, i), acc);  // load of a float dtype is exact
      } else if (is_floating(dst_)) {
        store(out, dst_, i, static_cast<double>(static_cast<float>(load_index(x, src_, i))), acc);
      } else {
        store_integer(out, i, load_index(x, src_, i), acc);
      }
    }
  }

 private:
  void store_integer(void* out, int64_t i, int64_t v, bool acc) const {
    switch (dst_) {
      case DType::i64: {
        int64_t* p = static_cast<int64_t*>(out) + i;
        *p = acc ? wrapping_add(*p, v) : v;
        return;
      }
      case DType::i32: {
        int32_t* p = static_cast<int32_t*>(out) + i;
        *p = acc ? wrapping_add(*p, static_cast<int32_t>(v)) : static_cast<int32_t>(v);
        return;
      }
      case DType::u8: {
        uint8_t* p = static_cast<uint8_t*>(out) + i;
        *p = static_cast<uint8_t>(acc ? *p + static_cast<uint8_t>(v) : static_cast<uint8_t>(v));
        return;
      }
      case DType::f32:
      case DType::bf16:
      case DType::f16:
        return;  // handled by store() in run()
    }
  }

  int64_t numel_;
  DType src_, dst_;
};

// ---- Copy -------------------------------------------------------------------------

// out = x bit for bit (any dtype); accumulate adds.
class CopyRef final : public RefKernel {
 public:
  CopyRef(const KernelCall& call)
      : numel_(output_shape(call, 0).numel()), dtype_(output_dtype(call, 0)) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const void* x = args.inputs[0].data();
    void* out = args.outputs[0].data();
    const bool acc = accumulate_flag(args, 0);
    for (int64_t i = 0; i < numel_; ++i) copy_element(out, i, x, i, dtype_, acc);
  }

 private:
  int64_t numel_;
  DType dtype_;
};

}  // namespace

std::unique_ptr<Kernel> make_fill_ref(const KernelCall& call) { return std::make_unique<FillRef>(call); }

std::unique_ptr<Kernel> make_binary_ref(const KernelCall& call) {
  return std::make_unique<BinaryRef>(call);
}

std::unique_ptr<Kernel> make_scale_ref(const KernelCall& call) {
  const double alpha = call.params<ops::ScaleParams>().alpha;
  return make_unary(call, [alpha](double x) { return alpha * x; });
}

std::unique_ptr<Kernel> make_gelu_ref(const KernelCall& call) {
  const bool tanh_approximation = parse_approximate(call);
  return make_unary(call, [tanh_approximation](double x) { return gelu_forward(x, tanh_approximation); });
}

std::unique_ptr<Kernel> make_gelu_backward_ref(const KernelCall& call) {
  // inputs: dy, x (the forward input)
  const bool tanh_approximation = parse_approximate(call);
  return make_backward(
      call, [tanh_approximation](double dy, double x) { return dy * gelu_derivative(x, tanh_approximation); });
}

std::unique_ptr<Kernel> make_tanh_ref(const KernelCall& call) {
  return make_unary(call, [](double x) { return std::tanh(x); });
}

std::unique_ptr<Kernel> make_tanh_backward_ref(const KernelCall& call) {
  // inputs: dy, y (the forward output)
  return make_backward(call, [](double dy, double y) { return dy * (1.0 - y * y); });
}

std::unique_ptr<Kernel> make_relu_ref(const KernelCall& call) {
  return make_unary(call, [](double x) { return x > 0.0 ? x : 0.0; });
}

std::unique_ptr<Kernel> make_relu_backward_ref(const KernelCall& call) {
  // inputs: dy, x (the forward input)
  return make_backward(call, [](double dy, double x) { return x > 0.0 ? dy : 0.0; });
}

// SwiGLU: out = silu(gate)·up with silu(g) = g·σ(g); backward dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))),
// dup = dy·silu(g). gate and up share a dtype (f32 or bf16); out has it, dgate and dup are f32. With bf16
// operands silu(g) is rounded to bf16 before the product (and in dup), as PyTorch's bf16 silu is.
class SwiGLURef final : public RefKernel {
 public:
  SwiGLURef(const KernelCall& call)
      : backward_(call.op == OpKind::SwiGLUBackward),
        numel_(output_shape(call, 0).numel()),
        dtype_(input_dtype(call, backward_ ? 1 : 0)),
        out_dtype_(output_dtype(call, 0)) {}

  void run(const KernelArgs& args, const StepContext&) override {
    const size_t first = backward_ ? 1 : 0;
    const void* gate = args.inputs[first].data();
    const void* up = args.inputs[first + 1].data();
    for (int64_t i = 0; i < numel_; ++i) {
      const double g = load(gate, dtype_, i), u = load(up, dtype_, i);
      const double sigmoid = 1.0 / (1.0 + std::exp(-g));
      double silu = g * sigmoid;
      if (dtype_ == DType::bf16) silu = bf16_to_float(float_to_bf16(static_cast<float>(silu)));
      if (!backward_) {
        store(args.outputs[0].data(), out_dtype_, i, silu * u, accumulate_flag(args, 0));
        continue;
      }
      const double dy = load(args.inputs[0].data(), DType::f32, i);
      store(args.outputs[0].data(), DType::f32, i, dy * u * sigmoid * (1.0 + g * (1.0 - sigmoid)),
            accumulate_flag(args, 0));
      store(args.outputs[1].data(), DType::f32, i, dy * silu, accumulate_flag(args, 1));
    }
  }

 private:
  bool backward_;
  int64_t numel_;
  DType dtype_, out_dtype_;
};

std::unique_ptr<Kernel> make_swiglu_ref(const KernelCall& call) { return std::make_unique<SwiGLURef>(call); }

std::unique_ptr<Kernel> make_math_ref(const KernelCall& call) {
  if (call.op == OpKind::Sqrt) return make_unary(call, [](double x) { return std::sqrt(x); });
  if (call.op == OpKind::Erf) return make_unary(call, [](double x) { return std::erf(x); });
  const double exponent = call.params<ops::PowParams>().exponent;
  return make_unary(call, [exponent](double x) { return std::pow(x, exponent); });
}

std::unique_ptr<Kernel> make_erf_backward_ref(const KernelCall& call) {
  // inputs: dy, x (the forward input); erf'(x) = 2/√π · exp(-x²)
  return make_backward(call, [](double dy, double x) { return dy * kTwoOverSqrtPi * std::exp(-x * x); });
}

std::unique_ptr<Kernel> make_dropout_ref(const KernelCall& call) {
  return std::make_unique<DropoutRef>(call);
}

std::unique_ptr<Kernel> make_dropout_add_ref(const KernelCall& call) {
  return std::make_unique<DropoutAddRef>(call);
}

std::unique_ptr<Kernel> make_cast_ref(const KernelCall& call) { return std::make_unique<CastRef>(call); }

std::unique_ptr<Kernel> make_copy_ref(const KernelCall& call) { return std::make_unique<CopyRef>(call); }

}  // namespace fusetrain::kernels::ref
