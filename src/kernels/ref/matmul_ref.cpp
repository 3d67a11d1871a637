// Reference MatMul and Linear: triple loops, inputs converted to double (f32 or
// bf16), dot products accumulated in double, rounded once on store.
//
// Shape letters: M rows of the result, N columns, K the contracted extent,
// R rows of x (product of its leading axes), batch = product of leading axes.
#include <vector>

#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

// c[batch] (M, N) = op(a[batch]) · op(b[batch])
//   a: (batch, M, K), or (batch, K, M) with trans_a; batch stride 0 when a is 2-D
//   b: (batch, K, N), or (batch, N, K) with trans_b; batch stride 0 when b is 2-D
void matmul_forward(void* c, DType c_dtype, const void* a, const void* b, DType ab_dtype, int64_t batch, int64_t M,
                    int64_t N, int64_t K, bool trans_a, bool trans_b, int64_t a_batch_stride, int64_t b_batch_stride,
                    bool accumulate) {
  for (int64_t p = 0; p < batch; ++p) {
    const int64_t a0 = p * a_batch_stride, b0 = p * b_batch_stride, c0 = p * M * N;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          double x = load(a, ab_dtype, a0 + (trans_a ? k * M + m : m * K + k));
          double y = load(b, ab_dtype, b0 + (trans_b ? n * K + k : k * N + n));
          sum += x * y;
        }
        store(c, c_dtype, c0 + m * N + n, sum, accumulate);
      }
    }
  }
}

// y (R, N) = x (R, K) · wᵀ + bias;  w: (N, K), bias: (N) f32 or null
void linear_forward(void* y, const void* x, const void* w, const void* bias, DType xw_dtype, int64_t R, int64_t N,
                    int64_t K, bool accumulate) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t n = 0; n < N; ++n) {
      double sum = bias != nullptr ? load(bias, DType::f32, n) : 0.0;
      for (int64_t k = 0; k < K; ++k) sum += load(x, xw_dtype, r * K + k) * load(w, xw_dtype, n * K + k);
      store(y, DType::f32, r * N + n, sum, accumulate);
    }
  }
}

class MatMulRef final : public RefKernel {
 public:
  MatMulRef(const KernelCall& call)
      : trans_a_(call.params<ops::MatMulParams>().trans_a),
        trans_b_(call.params<ops::MatMulParams>().trans_b),
        ab_dtype_(input_dtype(call, 0)),
        c_dtype_(output_dtype(call, 0)) {
    const Shape& a = input_shape(call, 0);
    const Shape& b = input_shape(call, 1);
    const Shape& c = output_shape(call, 0);
    M_ = c[-2];
    N_ = c[-1];
    K_ = trans_a_ ? a[-2] : a[-1];
    batch_ = c.numel(0, c.rank() - 2);
    // A 2-D operand is shared by every batch entry of the other one.
    a_batch_stride_ = a.rank() > 2 ? M_ * K_ : 0;
    b_batch_stride_ = b.rank() > 2 ? K_ * N_ : 0;
  }

  void run(const KernelArgs& args, const StepContext&) override {
    matmul_forward(args.outputs[0].data(), c_dtype_, args.inputs[0].data(), args.inputs[1].data(), ab_dtype_, batch_,
                   M_, N_, K_, trans_a_, trans_b_, a_batch_stride_, b_batch_stride_, accumulate_flag(args, 0));
  }

 private:
  bool trans_a_, trans_b_;
  DType ab_dtype_, c_dtype_;
  int64_t M_ = 0, N_ = 0, K_ = 0, batch_ = 1, a_batch_stride_ = 0, b_batch_stride_ = 0;
};

// Linear, and LinearGelu: z = Linear into output 1, then output 0 = gelu(z). A bf16 z is rounded
// from the f32 product and GELU applied to the rounded value; a bf16 y is GELU's result rounded, a Linear's the
// f32 product rounded.
class LinearRef final : public RefKernel {
 public:
  LinearRef(const KernelCall& call)
      : xw_dtype_(input_dtype(call, 0)),
        has_bias_(call.inputs.size() == 3),
        gelu_(call.op == OpKind::LinearGelu),
        tanh_(ops::gelu_approximation(call.op_params) == ops::GeluApproximation::Tanh),
        bf16_z_(gelu_ && output_dtype(call, 1) == DType::bf16),
        bf16_y_(output_dtype(call, 0) == DType::bf16) {
    const Shape& x = input_shape(call, 0);
    K_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
    N_ = input_shape(call, 1)[0];
  }

  bool accumulates() const override { return !gelu_ && !bf16_y_; }
  size_t scratch_bytes(int) const override {
    return gelu_ || bf16_y_ ? static_cast<size_t>(R_ * N_) * sizeof(float) : 0;
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const void* bias = has_bias_ ? args.inputs[2].data() : nullptr;
    if (!gelu_ && bf16_y_) {
      float* product = static_cast<float*>(args.scratch);
      linear_forward(product, args.inputs[0].data(), args.inputs[1].data(), bias, xw_dtype_, R_, N_, K_, false);
      uint16_t* y = static_cast<uint16_t*>(args.outputs[0].data());
      for (int64_t i = 0; i < R_ * N_; ++i) y[i] = float_to_bf16(product[i]);
      return;
    }
    if (!gelu_) {
      linear_forward(args.outputs[0].data(), args.inputs[0].data(), args.inputs[1].data(), bias, xw_dtype_, R_, N_, K_,
                     accumulate_flag(args, 0));
      return;
    }
    // gelu(z) into y, f32 or rounded to bf16.
    void* y = args.outputs[0].data();
    auto store_y = [&](int64_t i, double v) {
      if (bf16_y_)
        static_cast<uint16_t*>(y)[i] = float_to_bf16(static_cast<float>(v));
      else
        static_cast<float*>(y)[i] = static_cast<float>(v);
    };
    float* product = static_cast<float*>(args.scratch);
    linear_forward(product, args.inputs[0].data(), args.inputs[1].data(), bias, xw_dtype_, R_, N_, K_, false);
    for (int64_t i = 0; i < R_ * N_; ++i) {
      if (bf16_z_) {
        const uint16_t z = float_to_bf16(product[i]);
        static_cast<uint16_t*>(args.outputs[1].data())[i] = z;
        store_y(i, gelu_forward(bf16_to_float(z), tanh_));
      } else {
        static_cast<float*>(args.outputs[1].data())[i] = product[i];
        store_y(i, gelu_forward(product[i], tanh_));
      }
    }
  }

 private:
  DType xw_dtype_;
  bool has_bias_;
  bool gelu_, tanh_, bf16_z_, bf16_y_;
  int64_t R_ = 0, N_ = 0, K_ = 0;
};

// MatMulGeluBackward: dy = a·b (the product rounded to f32, as MatMul stores it), dx = dy·gelu′(x) in out_dtype,
// [the column sums of dx in double], [gelu(x) in gelu_dtype]. a, b are one product: b 2-D, a (R, K) or (K, R).
class MatMulGeluBackwardRef final : public RefKernel {
 public:
  MatMulGeluBackwardRef(const KernelCall& call)
      : p_(call.params<ops::MatMulGeluBackwardParams>()), ab_dtype_(input_dtype(call, 0)), x_dtype_(input_dtype(call, 2)) {
    const Shape& b = input_shape(call, 1);
    N_ = p_.trans_b ? b[0] : b[1];
    K_ = p_.trans_b ? b[1] : b[0];
    M_ = input_shape(call, 2).numel() / N_;
  }

  size_t scratch_bytes(int) const override { return static_cast<size_t>(M_ * N_) * sizeof(float); }

  void run(const KernelArgs& args, const StepContext&) override {
    float* dy = static_cast<float*>(args.scratch);
    matmul_forward(dy, DType::f32, args.inputs[0].data(), args.inputs[1].data(), ab_dtype_, 1, M_, N_, K_, p_.trans_a,
                   p_.trans_b, 0, 0, false);
    const bool tanh = p_.approximate == ops::GeluApproximation::Tanh;
    const void* x = args.inputs[2].data();
    void* dx = args.outputs[0].data();
    void* gelu = p_.gelu_out ? args.outputs[p_.column_sum ? 2 : 1].data() : nullptr;
    std::vector<double> sums(static_cast<size_t>(p_.column_sum ? N_ : 0), 0.0);
    for (int64_t i = 0; i < M_ * N_; ++i) {
      const double xi = load(x, x_dtype_, i);
      const double g = static_cast<double>(dy[i]) * gelu_derivative(xi, tanh);
      store(dx, p_.out_dtype, i, g, accumulate_flag(args, 0));
      if (p_.column_sum) sums[static_cast<size_t>(i % N_)] += static_cast<double>(static_cast<float>(g));
      if (gelu) store(gelu, p_.gelu_dtype, i, gelu_forward(xi, tanh), accumulate_flag(args, args.outputs.size() - 1));
    }
    for (int64_t j = 0; j < static_cast<int64_t>(sums.size()); ++j)
      store(args.outputs[1].data(), DType::f32, j, sums[static_cast<size_t>(j)], accumulate_flag(args, 1));
  }

 private:
  ops::MatMulGeluBackwardParams p_;
  DType ab_dtype_, x_dtype_;
  int64_t M_ = 0, N_ = 0, K_ = 0;
};

}  // namespace

std::unique_ptr<Kernel> make_matmul_gelu_backward_ref(const KernelCall& call) {
  return std::make_unique<MatMulGeluBackwardRef>(call);
}

std::unique_ptr<Kernel> make_matmul_ref(const KernelCall& call) {
  return std::make_unique<MatMulRef>(call);
}

std::unique_ptr<Kernel> make_linear_ref(const KernelCall& call) {
  return std::make_unique<LinearRef>(call);
}

}  // namespace fusetrain::kernels::ref
