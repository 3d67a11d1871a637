// Tuned pooling: Pool (max or average) and PoolBackward on f32, each channel plane on its own, planes split
// across threads (so every element is computed in one order whatever the thread count).
//
// Shape legend as ops::PoolGeometry: x (B, C, H, W), windows KH x KW with strides, padding and dilations, y (B, C,
// OH, OW). A window's in-range rows and columns are found once (no per-tap bounds test inside the loops).
//   max:      y = the first largest in-range value (torch's index rule: a later NaN replaces it); dx gets dy there
//   average:  y = Σ in-range / divisor (the window clipped to the padded input with count_include_pad, else its
//             in-range positions); dx gets dy / divisor at each in-range position
#include <cmath>
#include <cstring>

#include "kernels/cpu/basic_kernels.h"

namespace fusetrain::kernels::cpu_basic {
namespace {

// The taps [lo, hi) of a window starting at `start` (in input coordinates, padding included) whose positions
// start + k·dil fall inside [0, size).
inline void taps(int64_t start, int64_t dil, int64_t count, int64_t size, int64_t& lo, int64_t& hi) {
  lo = start >= 0 ? 0 : (-start + dil - 1) / dil;
  hi = start + (count - 1) * dil < size ? count : (size - 1 - start) / dil + 1;
  if (hi < lo) hi = lo;
}

class PoolKernel final : public Kernel {
 public:
  explicit PoolKernel(const KernelCall& call) : backward_(call.op == ops::OpKind::PoolBackward),
                                                p_(call.params<ops::PoolParams>()) {
    g_ = ops::PoolGeometry::of(p_, call.inputs[backward_ ? 1 : 0].shape.dims());
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const ops::PoolGeometry& g = g_;
    const float* x = static_cast<const float*>(args.inputs[backward_ ? 1 : 0].data());
    const float* dy = backward_ ? static_cast<const float*>(args.inputs[0].data()) : nullptr;
    float* out = static_cast<float*>(args.outputs[0].data());
    const int64_t in_plane = g.H * g.W, out_plane = g.OH * g.OW;
    const int64_t work = g.B * g.C * out_plane * g.KH * g.KW;
    parallel_for(g.B * g.C, threads_for(work, ctx.num_threads), [&](int64_t begin, int64_t end, int) {
      for (int64_t plane = begin; plane < end; ++plane) {
        const float* xp = x + plane * in_plane;
        if (backward_)
          backward_plane(xp, dy + plane * out_plane, out + plane * in_plane);
        else
          forward_plane(xp, out + plane * out_plane);
      }
    });
  }

 private:
  // One output position's window: its first row and column (padding included), its in-range taps, its divisor.
  struct Window {
    int64_t h0, w0, i_lo, i_hi, j_lo, j_hi;
    float divisor;
  };

  Window window(int64_t oh, int64_t ow) const {
    const ops::PoolGeometry& g = g_;
    Window win;
    win.h0 = oh * g.stride_h - g.pad_top;
    win.w0 = ow * g.stride_w - g.pad_left;
    taps(win.h0, g.dil_h, g.KH, g.H, win.i_lo, win.i_hi);
    taps(win.w0, g.dil_w, g.KW, g.W, win.j_lo, win.j_hi);
    const int64_t padded = (std::min(win.h0 + g.KH, g.H + g.pad_bottom) - win.h0) *
                           (std::min(win.w0 + g.KW, g.W + g.pad_right) - win.w0);
    win.divisor = float(p_.count_include_pad ? padded : (win.i_hi - win.i_lo) * (win.j_hi - win.j_lo));
    return win;
  }

  // The position (h·W + w) of the window's first maximum, torch's rule; -1 for a window without taps.
  int64_t argmax(const float* xp, const Window& win) const {
    const ops::PoolGeometry& g = g_;
    int64_t best_at = -1;
    float best = -INFINITY;
    for (int64_t i = win.i_lo; i < win.i_hi; ++i) {
      const int64_t h = win.h0 + i * g.dil_h;
      for (int64_t j = win.j_lo; j < win.j_hi; ++j) {
        const int64_t at = h * g.W + win.w0 + j * g.dil_w;
        const float v = xp[at];
        if (best_at < 0 || v > best || std::isnan(v)) best = v, best_at = at;
      }
    }
    return best_at;
  }

  void forward_plane(const float* xp, float* yp) const {
    const ops::PoolGeometry& g = g_;
    for (int64_t oh = 0; oh < g.OH; ++oh)
      for (int64_t ow = 0; ow < g.OW; ++ow) {
        const Window win = window(oh, ow);
        if (p_.max) {
          const int64_t at = argmax(xp, win);
          yp[oh * g.OW + ow] = at < 0 ? -INFINITY : xp[at];
          continue;
        }
        float sum = 0;
        for (int64_t i = win.i_lo; i < win.i_hi; ++i) {
          const float* row = xp + (win.h0 + i) * g.W + win.w0;
          for (int64_t j = win.j_lo; j < win.j_hi; ++j) sum += row[j];
        }
        yp[oh * g.OW + ow] = sum / win.divisor;
      }
  }

  void backward_plane(const float* xp, const float* dyp, float* dxp) const {
    const ops::PoolGeometry& g = g_;
    std::memset(dxp, 0, sizeof(float) * size_t(g.H * g.W));
    for (int64_t oh = 0; oh < g.OH; ++oh)
      for (int64_t ow = 0; ow < g.OW; ++ow) {
        const Window win = window(oh, ow);
        const float grad = dyp[oh * g.OW + ow];
        if (p_.max) {
          const int64_t at = argmax(xp, win);
          if (at >= 0) dxp[at] += grad;
          continue;
        }
        const float share = grad / win.divisor;
        for (int64_t i = win.i_lo; i < win.i_hi; ++i) {
          float* row = dxp + (win.h0 + i) * g.W + win.w0;
          for (int64_t j = win.j_lo; j < win.j_hi; ++j) row[j] += share;
        }
      }
  }

  bool backward_;
  ops::PoolParams p_;
  ops::PoolGeometry g_;
};

}  // namespace

std::unique_ptr<Kernel> make_pool_kernel(const KernelCall& call) { return std::make_unique<PoolKernel>(call); }

}  // namespace fusetrain::kernels::cpu_basic
