// Reference convolution: Conv, ConvBackwardData and ConvBackwardWeight as plain loops in double over the definition
//   y[b, o, oh, ow] = bias[o] + Σ_{c in o's group, i, j} w[o, c, i, j] · x[b, g·C/group + c, oh·sh − pt + i·dh,
//                                                                              ow·sw − pl + j·dw]
// (out-of-range x reads as 0); the two backward ops apply the same index map the other way round.
//
// Shape letters as ops::ConvGeometry: B batch, C / O input / output channels, H W input, OH OW output, KH KW kernel.
#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

class ConvRef final : public RefKernel {
 public:
  explicit ConvRef(const KernelCall& call) : op_(call.op) {
    const auto& p = call.params<ops::ConvParams>();
    const std::vector<int64_t>& x = op_ == OpKind::Conv                 ? input_shape(call, 0).dims()
                                    : op_ == OpKind::ConvBackwardWeight ? input_shape(call, 1).dims()
                                                                        : p.shape;
    const std::vector<int64_t>& w = op_ == OpKind::ConvBackwardWeight ? p.shape : input_shape(call, 1).dims();
    g_ = ops::ConvGeometry::of(p, x, w);
    has_bias_ = op_ == OpKind::Conv && call.inputs.size() == 3;
    for (const TensorDesc& t : call.inputs) dtypes_.push_back(t.dtype);
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const ops::ConvGeometry& g = g_;
    const int64_t cg = g.channels_per_group(), og = g.outputs_per_group();
    // Element offsets of x, w and y for one term of the sum.
    auto x_at = [&](int64_t b, int64_t c, int64_t h, int64_t w) { return ((b * g.C + c) * g.H + h) * g.W + w; };
    auto w_at = [&](int64_t o, int64_t c, int64_t i, int64_t j) { return ((o * cg + c) * g.KH + i) * g.KW + j; };
    auto y_at = [&](int64_t b, int64_t o, int64_t h, int64_t w) { return ((b * g.O + o) * g.OH + h) * g.OW + w; };
    const bool accumulate = accumulate_flag(args, 0);
    // Each output element's sum in double, stored once.
    std::vector<double> sum(size_t(op_ == OpKind::Conv                 ? g.B * g.O * g.OH * g.OW
                                   : op_ == OpKind::ConvBackwardData ? g.B * g.C * g.H * g.W
                                                                      : g.O * cg * g.KH * g.KW),
                            0.0);
    const void* in0 = args.inputs[0].data();
    const void* in1 = args.inputs[1].data();
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t o = 0; o < g.O; ++o)
        for (int64_t oh = 0; oh < g.OH; ++oh)
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            const int64_t yi = y_at(b, o, oh, ow);
            for (int64_t c = 0; c < cg; ++c)
              for (int64_t i = 0; i < g.KH; ++i)
                for (int64_t j = 0; j < g.KW; ++j) {
                  const int64_t h = oh * g.stride_h - g.pad_top + i * g.dil_h;
                  const int64_t w = ow * g.stride_w - g.pad_left + j * g.dil_w;
                  if (h < 0 || h >= g.H || w < 0 || w >= g.W) continue;
                  const int64_t xi = x_at(b, (o / og) * cg + c, h, w), wi = w_at(o, c, i, j);
                  if (op_ == OpKind::Conv)  // inputs x, w
                    sum[size_t(yi)] += load(in0, dtypes_[0], xi) * load(in1, dtypes_[1], wi);
                  else if (op_ == OpKind::ConvBackwardData)  // inputs dy, w
                    sum[size_t(xi)] += load(in0, dtypes_[0], yi) * load(in1, dtypes_[1], wi);
                  else  // inputs dy, x
                    sum[size_t(wi)] += load(in0, dtypes_[0], yi) * load(in1, dtypes_[1], xi);
                }
          }
    if (has_bias_)
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t o = 0; o < g.O; ++o)
          for (int64_t k = 0; k < g.OH * g.OW; ++k)
            sum[size_t((b * g.O + o) * g.OH * g.OW + k)] += load(args.inputs[2].data(), dtypes_[2], o);
    for (size_t i = 0; i < sum.size(); ++i)
      store(args.outputs[0].data(), DType::f32, int64_t(i), sum[i], accumulate);
  }

 private:
  OpKind op_;
  ops::ConvGeometry g_;
  bool has_bias_ = false;
  std::vector<DType> dtypes_;
};

}  // namespace

std::unique_ptr<Kernel> make_conv_ref(const KernelCall& call) { return std::make_unique<ConvRef>(call); }

}  // namespace fusetrain::kernels::ref
