// Reference QuantizedLinear and its backward: the weight dequantised element by element (quant::QuantMatrix), the
// products summed in double.
#include "fusetrain/core/quant.h"
#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

class QuantizedLinearRef final : public RefKernel {
 public:
  QuantizedLinearRef(const KernelCall& call)
      : backward_(call.op == OpKind::QuantizedLinearBackward),
        params_(call.params<ops::QuantizedParams>()),
        x_dtype_(input_dtype(call, 0)),
        has_bias_(call.inputs.size() > params_.bias_input()) {
    const Shape& x = input_shape(call, 0);
    R_ = x.numel() / x[-1];
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const quant::QuantMatrix w = params_.matrix(args.inputs[1].data(), args.inputs[2].data_as<float>(),
                                                params_.bits == 4 ? args.inputs[3].data_as<float>() : nullptr);
    const int64_t N = params_.rows, K = params_.cols;
    const int64_t in = backward_ ? N : K, out = backward_ ? K : N;
    const void* x = args.inputs[0].data();
    for (int64_t r = 0; r < R_; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double sum = has_bias_ ? load(args.inputs[params_.bias_input()].data(), DType::f32, o) : 0.0;
        for (int64_t i = 0; i < in; ++i)  // forward: W(o, i); backward: W(i, o)
          sum += load(x, x_dtype_, r * in + i) * static_cast<double>(backward_ ? w.at(i, o) : w.at(o, i));
        if (params_.round_output) sum = bf16_to_float(float_to_bf16(static_cast<float>(sum)));
        store(args.outputs[0].data(), DType::f32, r * out + o, sum, accumulate_flag(args, 0));
      }
  }

 private:
  bool backward_;
  ops::QuantizedParams params_;
  DType x_dtype_;
  bool has_bias_;
  int64_t R_ = 0;
};

}  // namespace

std::unique_ptr<Kernel> make_quantized_linear_ref(const KernelCall& call) {
  return std::make_unique<QuantizedLinearRef>(call);
}

}  // namespace fusetrain::kernels::ref
