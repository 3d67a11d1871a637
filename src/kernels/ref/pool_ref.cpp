// Reference pooling: Pool and PoolBackward as plain loops in double over the definition. Window (oh, ow) covers
// x[b, c, oh·sh − pt + i·dh, ow·sw − pl + j·dw] for i < KH, j < KW; positions outside x are padding.
//   max:     y = the largest in-range value (the first of equal values gets the gradient; a NaN wins, the last one,
//            as torch's)
//   average: y = Σ in-range / divisor, divisor = the window clipped to the padded input (count_include_pad) or the
//            in-range positions alone
#include <cmath>

#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels::ref {
namespace {

class PoolRef final : public RefKernel {
 public:
  explicit PoolRef(const KernelCall& call) : op_(call.op), p_(call.params<ops::PoolParams>()) {
    g_ = ops::PoolGeometry::of(p_, input_shape(call, op_ == OpKind::Pool ? 0 : 1).dims());
  }

  void run(const KernelArgs& args, const StepContext&) override {
    const ops::PoolGeometry& g = g_;
    const bool backward = op_ == OpKind::PoolBackward;
    const void* x = args.inputs[backward ? 1 : 0].data();
    const void* dy = backward ? args.inputs[0].data() : nullptr;
    const bool accumulate = accumulate_flag(args, 0);
    std::vector<double> out(size_t(backward ? g.B * g.C * g.H * g.W : g.B * g.C * g.OH * g.OW), 0.0);
    for (int64_t plane = 0; plane < g.B * g.C; ++plane)
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          const int64_t yi = (plane * g.OH + oh) * g.OW + ow;
          double best = -INFINITY, sum = 0;
          int64_t best_at = -1, in_range = 0;
          for (int64_t i = 0; i < g.KH; ++i)
            for (int64_t j = 0; j < g.KW; ++j) {
              const int64_t h = oh * g.stride_h - g.pad_top + i * g.dil_h;
              const int64_t w = ow * g.stride_w - g.pad_left + j * g.dil_w;
              if (h < 0 || h >= g.H || w < 0 || w >= g.W) continue;
              const int64_t xi = (plane * g.H + h) * g.W + w;
              const double v = load(x, DType::f32, xi);
              if (best_at < 0 || v > best || std::isnan(v)) best = v, best_at = xi;
              sum += v;
              ++in_range;
            }
          // The divisor: the window clipped to the padded input, or its in-range positions.
          const int64_t h0 = oh * g.stride_h - g.pad_top, w0 = ow * g.stride_w - g.pad_left;
          const int64_t padded =
              (std::min(h0 + g.KH, g.H + g.pad_bottom) - h0) * (std::min(w0 + g.KW, g.W + g.pad_right) - w0);
          const double divisor = double(p_.count_include_pad ? padded : in_range);
          if (!backward) {
            out[size_t(yi)] = p_.max ? best : sum / divisor;
            continue;
          }
          const double grad = load(dy, DType::f32, yi);
          if (p_.max) {
            if (best_at >= 0) out[size_t(best_at)] += grad;
            continue;
          }
          for (int64_t i = 0; i < g.KH; ++i)
            for (int64_t j = 0; j < g.KW; ++j) {
              const int64_t h = h0 + i, w = w0 + j;
              if (h >= 0 && h < g.H && w >= 0 && w < g.W) out[size_t((plane * g.H + h) * g.W + w)] += grad / divisor;
            }
        }
    for (size_t i = 0; i < out.size(); ++i) store(args.outputs[0].data(), DType::f32, int64_t(i), out[i], accumulate);
  }

 private:
  OpKind op_;
  ops::PoolParams p_;
  ops::PoolGeometry g_;
};

}  // namespace

std::unique_ptr<Kernel> make_pool_ref(const KernelCall& call) { return std::make_unique<PoolRef>(call); }

}  // namespace fusetrain::kernels::ref
