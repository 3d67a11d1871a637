// Reference Softmax, LayerNorm (and AddLayerNorm) and RMSNorm, forward and backward. Row statistics
// (maxima, softmax denominators, means, variances, column sums) are computed in
// double; outputs are rounded once on store.
//
// Shape letters: R rows (product of all leading axes), C channels (last axis).
#include <algorithm>
#include <cmath>

#include "kernels/ref/ref_kernels.h"
#include "kernels/rng.h"

namespace fusetrain::kernels::ref {
namespace {

// y (R, C) = softmax(x (R, C)) over C. y may alias x.
void softmax_forward(void* y, DType y_dtype, const void* x, DType x_dtype, int64_t R, int64_t C, bool accumulate) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r * C;
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < C; ++c) max = std::max(max, load(x, x_dtype, row + c));
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += std::exp(load(x, x_dtype, row + c) - max);
    for (int64_t c = 0; c < C; ++c)
      store(y, y_dtype, row + c, std::exp(load(x, x_dtype, row + c) - max) / sum, accumulate);
  }
}

// dx (R, C) = y · (dy − Σ_c dy·y), per row. dx may alias dy.
void softmax_backward(float* dx, const float* dy, const float* y, int64_t R, int64_t C, bool accumulate) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r * C;
    double dot = 0.0;
    for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(dy[row + c]) * y[row + c];
    for (int64_t c = 0; c < C; ++c) {
      double v = static_cast<double>(y[row + c]) * (static_cast<double>(dy[row + c]) - dot);
      store(dx, DType::f32, row + c, v, accumulate);
    }
  }
}

// y (R, C) = (x − mean) · rstd · gamma + beta; mean (R), rstd (R) = 1/√(var + eps),
// var the biased variance (two-pass, in double).
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* gamma, const float* beta,
                       int64_t R, int64_t C, double eps, const bool accumulate[3]) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * C;
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += xr[c];
    const double m = sum / static_cast<double>(C);
    double squares = 0.0;
    for (int64_t c = 0; c < C; ++c) squares += (xr[c] - m) * (xr[c] - m);
    const double var = squares / static_cast<double>(C);
    const double s = 1.0 / std::sqrt(var + eps);
    for (int64_t c = 0; c < C; ++c)
      store(y, DType::f32, r * C + c, (xr[c] - m) * s * gamma[c] + beta[c], accumulate[0]);
    store(mean, DType::f32, r, m, accumulate[1]);
    store(rstd, DType::f32, r, s, accumulate[2]);
  }
}

// With x̂ = (x − mean)·rstd and g = dy·gamma, per row:
//   dx = rstd · (g − mean_C(g) − x̂ · mean_C(g·x̂))
//   dgamma = Σ_rows dy·x̂,  dbeta = Σ_rows dy   (column sums in double)
// dy, x, dx: (R, C); gamma, dgamma, dbeta: (C); mean, rstd: (R).
// column_sums: 2·C doubles of scratch. dx may alias dy.
void layernorm_backward(float* dx, float* dgamma, float* dbeta, const float* dy, const float* x, const float* gamma,
                        const float* mean, const float* rstd, int64_t R, int64_t C, const bool accumulate[3],
                        double* column_sums) {
  double* dgamma_sum = column_sums;
  double* dbeta_sum = column_sums + C;
  for (int64_t c = 0; c < C; ++c) dgamma_sum[c] = dbeta_sum[c] = 0.0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r * C;
    const double m = mean[r], s = rstd[r];
    double g_sum = 0.0, g_xhat_sum = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      double xhat = (x[row + c] - m) * s;
      double g = static_cast<double>(dy[row + c]) * gamma[c];
      g_sum += g;
      g_xhat_sum += g * xhat;
    }
    const double g_mean = g_sum / static_cast<double>(C);
    const double g_xhat_mean = g_xhat_sum / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double d = dy[row + c];  // read before dx[row + c] may overwrite it
      const double xhat = (x[row + c] - m) * s;
      dgamma_sum[c] += d * xhat;
      dbeta_sum[c] += d;
      store(dx, DType::f32, row + c, s * (d * gamma[c] - g_mean - xhat * g_xhat_mean), accumulate[0]);
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    store(dgamma, DType::f32, c, dgamma_sum[c], accumulate[1]);
    store(dbeta, DType::f32, c, dbeta_sum[c], accumulate[2]);
  }
}

class SoftmaxRef final : public RefKernel {
 public:
  SoftmaxRef(const KernelCall& call) : x_dtype_(input_dtype(call, 0)), y_dtype_(output_dtype(call, 0)) {
    const Shape& x = input_shape(call, 0);
    C_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    softmax_forward(args.outputs[0].data(), y_dtype_, args.inputs[0].data(), x_dtype_, R_, C_,
                    accumulate_flag(args, 0));
  }

 private:
  DType x_dtype_, y_dtype_;
  int64_t R_ = 0, C_ = 0;
};

class SoftmaxBackwardRef final : public RefKernel {
 public:
  SoftmaxBackwardRef(const KernelCall& call) {
    const Shape& dy = input_shape(call, 0);
    C_ = dy[-1];
    R_ = dy.numel(0, dy.rank() - 1);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    // inputs: dy, y (the forward output)
    softmax_backward(args.outputs[0].data_as<float>(), args.inputs[0].data_as<float>(), args.inputs[1].data_as<float>(),
                     R_, C_, accumulate_flag(args, 0));
  }

 private:
  int64_t R_ = 0, C_ = 0;
};

// LayerNorm, and AddLayerNorm: sum = dropout(x) + residual (each element in double, rounded once
// to f32, as DropoutAdd's reference) into output 0, then LayerNorm of the rounded sum.
class LayerNormRef final : public RefKernel {
 public:
  LayerNormRef(const KernelCall& call)
      : eps_(call.op == OpKind::AddLayerNorm ? call.params<ops::AddLayerNormParams>().eps
                                             : call.params<ops::LayerNormParams>().eps),
        add_(call.op == OpKind::AddLayerNorm),
        p_(add_ ? call.params<ops::AddLayerNormParams>().dropout.p : 0.0),
        seed_(add_ ? call.params<ops::AddLayerNormParams>().dropout.seed : 0),
        map_(add_ ? stream_index_map(call.params<ops::AddLayerNormParams>().dropout) : StreamIndexMap{}) {
    const Shape& x = input_shape(call, 0);
    C_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
  }

  size_t scratch_bytes(int) const override { return add_ ? static_cast<size_t>(R_ * C_) * sizeof(float) : 0; }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const size_t o = add_ ? 1 : 0;  // where y, mean, rstd start
    const bool acc[3] = {accumulate_flag(args, o), accumulate_flag(args, o + 1), accumulate_flag(args, o + 2)};
    // LayerNorm: x, gamma, beta -> y, mean, rstd. AddLayerNorm: x, residual, gamma, beta -> sum, y, mean, rstd.
    const float* x = args.inputs[0].data_as<float>();
    const size_t affine = add_ ? 2 : 1;
    if (add_) {
      float* sum = static_cast<float*>(args.scratch);
      const float* residual = args.inputs[1].data_as<float>();
      const float p = static_cast<float>(p_);
      for (int64_t i = 0; i < R_ * C_; ++i) {
        const bool keep = p_ == 0.0 || dropout_keep(seed_, ctx.rng_offset, map_(i), p);
        const double dropped = keep ? static_cast<double>(static_cast<float>(x[i] / (1.0 - p_))) : 0.0;
        sum[i] = static_cast<float>(dropped + residual[i]);
        store(args.outputs[0].data(), DType::f32, i, sum[i], accumulate_flag(args, 0));
      }
      x = sum;
    }
    layernorm_forward(args.outputs[o].data_as<float>(), args.outputs[o + 1].data_as<float>(),
                      args.outputs[o + 2].data_as<float>(), x, args.inputs[affine].data_as<float>(),
                      args.inputs[affine + 1].data_as<float>(), R_, C_, eps_, acc);
  }

 private:
  double eps_;
  bool add_;
  double p_;
  uint64_t seed_;
  StreamIndexMap map_;
  int64_t R_ = 0, C_ = 0;
};

class LayerNormBackwardRef final : public RefKernel {
 public:
  LayerNormBackwardRef(const KernelCall& call) {
    const Shape& x = input_shape(call, 1);
    C_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
  }

  size_t scratch_bytes(int) const override { return 2 * static_cast<size_t>(C_) * sizeof(double); }

  void run(const KernelArgs& args, const StepContext&) override {
    const bool acc[3] = {accumulate_flag(args, 0), accumulate_flag(args, 1), accumulate_flag(args, 2)};
    // inputs: dy, x, gamma, mean, rstd; outputs: dx, dgamma, dbeta
    layernorm_backward(args.outputs[0].data_as<float>(), args.outputs[1].data_as<float>(),
                       args.outputs[2].data_as<float>(), args.inputs[0].data_as<float>(),
                       args.inputs[1].data_as<float>(), args.inputs[2].data_as<float>(),
                       args.inputs[3].data_as<float>(), args.inputs[4].data_as<float>(), R_, C_, acc,
                       static_cast<double*>(args.scratch));
  }

 private:
  int64_t R_ = 0, C_ = 0;
};

// RMSNorm: y (R, C) = x · rstd · weight, rstd (R) = 1/√(mean_C(x²) + eps), the mean of squares in double.
class RMSNormRef final : public RefKernel {
 public:
  RMSNormRef(const KernelCall& call) : eps_(call.params<ops::LayerNormParams>().eps) {
    const Shape& x = input_shape(call, 0);
    C_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const float* x = args.inputs[0].data_as<float>();
    const float* weight = args.inputs[1].data_as<float>();
    const bool acc_y = accumulate_flag(args, 0), acc_rstd = accumulate_flag(args, 1);
    for (int64_t r = 0; r < R_; ++r) {
      const float* xr = x + r * C_;
      double squares = 0.0;
      for (int64_t c = 0; c < C_; ++c) squares += static_cast<double>(xr[c]) * xr[c];
      const double s = 1.0 / std::sqrt(squares / static_cast<double>(C_) + eps_);
      for (int64_t c = 0; c < C_; ++c) store(args.outputs[0].data(), DType::f32, r * C_ + c, xr[c] * s * weight[c], acc_y);
      store(args.outputs[1].data(), DType::f32, r, s, acc_rstd);
    }
  }

 private:
  double eps_;
  int64_t R_ = 0, C_ = 0;
};

// With x̂ = x·rstd and g = dy·weight, per row: dx = rstd · (g − x̂ · mean_C(g·x̂)); dweight = Σ_rows dy·x̂ (column
// sums in double). dx may alias dy.
class RMSNormBackwardRef final : public RefKernel {
 public:
  RMSNormBackwardRef(const KernelCall& call) {
    const Shape& x = input_shape(call, 1);
    C_ = x[-1];
    R_ = x.numel(0, x.rank() - 1);
  }

  size_t scratch_bytes(int) const override { return static_cast<size_t>(C_) * sizeof(double); }

  void run(const KernelArgs& args, const StepContext&) override {
    // inputs: dy, x, weight, rstd; outputs: dx, dweight
    const float* dy = args.inputs[0].data_as<float>();
    const float* x = args.inputs[1].data_as<float>();
    const float* weight = args.inputs[2].data_as<float>();
    const float* rstd = args.inputs[3].data_as<float>();
    auto* dweight_sum = static_cast<double*>(args.scratch);
    for (int64_t c = 0; c < C_; ++c) dweight_sum[c] = 0.0;
    const bool acc_dx = accumulate_flag(args, 0), acc_dweight = accumulate_flag(args, 1);
    for (int64_t r = 0; r < R_; ++r) {
      const int64_t row = r * C_;
      const double s = rstd[r];
      double g_xhat = 0.0;
      for (int64_t c = 0; c < C_; ++c) {
        const double xhat = x[row + c] * s;
        g_xhat += static_cast<double>(dy[row + c]) * weight[c] * xhat;
        dweight_sum[c] += static_cast<double>(dy[row + c]) * xhat;
      }
      const double mean_g_xhat = g_xhat / static_cast<double>(C_);
      for (int64_t c = 0; c < C_; ++c) {
        const double xhat = x[row + c] * s;
        const double g = static_cast<double>(dy[row + c]) * weight[c];
        store(args.outputs[0].data(), DType::f32, row + c, s * (g - xhat * mean_g_xhat), acc_dx);
      }
    }
    for (int64_t c = 0; c < C_; ++c) store(args.outputs[1].data(), DType::f32, c, dweight_sum[c], acc_dweight);
  }

 private:
  int64_t R_ = 0, C_ = 0;
};

}  // namespace

std::unique_ptr<Kernel> make_softmax_ref(const KernelCall& call) {
  return std::make_unique<SoftmaxRef>(call);
}

std::unique_ptr<Kernel> make_softmax_backward_ref(const KernelCall& call) {
  return std::make_unique<SoftmaxBackwardRef>(call);
}

std::unique_ptr<Kernel> make_layernorm_ref(const KernelCall& call) {
  return std::make_unique<LayerNormRef>(call);
}

std::unique_ptr<Kernel> make_layernorm_backward_ref(const KernelCall& call) {
  return std::make_unique<LayerNormBackwardRef>(call);
}

std::unique_ptr<Kernel> make_rmsnorm_ref(const KernelCall& call) { return std::make_unique<RMSNormRef>(call); }

std::unique_ptr<Kernel> make_rmsnorm_backward_ref(const KernelCall& call) {
  return std::make_unique<RMSNormBackwardRef>(call);
}

}  // namespace fusetrain::kernels::ref
