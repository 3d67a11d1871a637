// Tuned pooling: Pool (max or average) and PoolBackward on f32, each channel plane on its own, planes split
// across threads (so every element is computed in one order whatever the thread count).
//
// Shape legend as ops::PoolGeometry: x (B, C, H, W), windows KH x KW with strides, padding and dilations, y (B, C,
// OH, OW). A max window's in-range rows and columns are found once (no per-tap bounds test inside its loops).
//   max:      y = the first largest in-range value (torch's index rule: a later NaN replaces it); dx gets dy there
//   average:  y = Σ in-range / divisor (the window clipped to the padded input with count_include_pad, else its
//             in-range positions); dx gets dy / divisor at each in-range position
// Average pooling is separable: each input row's sums over every output column's window (H x OW, per-thread
// scratch), then each output's sum of its window's rows, so a 3x3 window costs 6 adds rather than 9 and the
// window-wide loops run over contiguous columns (vectorised by the compiler where the stride is 1). Backward is the
// same two passes transposed: dy / divisor scattered to the rows' sums, then to the columns. The loops over a row's
// columns carry `omp simd` (GCC's -O2 cost model will not version them for aliasing on its own), and the divisor is a
// row's share times a column's, both small integers exact in f32. PoolFormer-S12's 12 token mixers (224x224, batch
// 8, Zen 4; bench/RESULTS.md "Pooling"): Pool + PoolBackward 66.3 ms a step with a per-window loop, 19.5 ms so.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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
    if (p_.max) return;
    // Each output row's and column's in-range taps and extent clipped to the padded input: a divisor is the
    // product of one of each.
    auto axis = [](int64_t outputs, int64_t stride, int64_t lead, int64_t trail, int64_t kernel, int64_t size,
                   std::vector<int64_t>& lo, std::vector<int64_t>& hi, std::vector<int64_t>& padded) {
      for (int64_t o = 0; o < outputs; ++o) {
        const int64_t start = o * stride - lead;
        int64_t l, h;
        taps(start, 1, kernel, size, l, h);
        lo.push_back(l);
        hi.push_back(h);
        padded.push_back(std::min(start + kernel, size + trail) - start);
      }
    };
    axis(g_.OH, g_.stride_h, g_.pad_top, g_.pad_bottom, g_.KH, g_.H, row_lo_, row_hi_, row_padded_);
    axis(g_.OW, g_.stride_w, g_.pad_left, g_.pad_right, g_.KW, g_.W, col_lo_, col_hi_, col_padded_);
    for (int64_t ow = 0; ow < g_.OW; ++ow) {
      const size_t c = size_t(ow);
      col_share_.push_back(float(p_.count_include_pad ? col_padded_[c] : col_hi_[c] - col_lo_[c]));
    }
    // Output columns whose windows lie wholly inside the input: the row pass's vector loop.
    while (col_first_ < g_.OW && col_lo_[size_t(col_first_)] > 0) ++col_first_;
    col_last_ = g_.OW;
    while (col_last_ > col_first_ && col_hi_[size_t(col_last_ - 1)] < g_.KW) --col_last_;
  }

  size_t scratch_bytes(int num_threads) const override {
    return p_.max ? 0 : size_t(num_threads) * plane_scratch() * sizeof(float);
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const ops::PoolGeometry& g = g_;
    const float* x = static_cast<const float*>(args.inputs[backward_ ? 1 : 0].data());
    const float* dy = backward_ ? static_cast<const float*>(args.inputs[0].data()) : nullptr;
    float* out = static_cast<float*>(args.outputs[0].data());
    const int64_t in_plane = g.H * g.W, out_plane = g.OH * g.OW;
    const int64_t work = g.B * g.C * out_plane * g.KH * g.KW;
    parallel_for(g.B * g.C, threads_for(work, ctx.num_threads), [&](int64_t begin, int64_t end, int thread) {
      float* rows = p_.max ? nullptr : static_cast<float*>(args.scratch) + size_t(thread) * plane_scratch();
      for (int64_t plane = begin; plane < end; ++plane) {
        const float* xp = x + plane * in_plane;
        if (!p_.max && backward_)
          average_backward_plane(dy + plane * out_plane, rows, out + plane * in_plane);
        else if (!p_.max)
          average_forward_plane(xp, rows, out + plane * out_plane);
        else if (backward_)
          max_backward_plane(xp, dy + plane * out_plane, out + plane * in_plane);
        else
          max_forward_plane(xp, out + plane * out_plane);
      }
    });
  }

 private:
  // Max pooling: the first maximum (h·W + w) of output (oh, ow)'s window, torch's rule; -1 for a window without
  // in-range taps.
  int64_t argmax(const float* xp, int64_t oh, int64_t ow) const {
    const ops::PoolGeometry& g = g_;
    const int64_t h0 = oh * g.stride_h - g.pad_top, w0 = ow * g.stride_w - g.pad_left;
    int64_t i_lo, i_hi, j_lo, j_hi;
    taps(h0, g.dil_h, g.KH, g.H, i_lo, i_hi);
    taps(w0, g.dil_w, g.KW, g.W, j_lo, j_hi);
    int64_t best_at = -1;
    float best = -INFINITY;
    for (int64_t i = i_lo; i < i_hi; ++i) {
      const int64_t h = h0 + i * g.dil_h;
      for (int64_t j = j_lo; j < j_hi; ++j) {
        const int64_t at = h * g.W + w0 + j * g.dil_w;
        const float v = xp[at];
        if (best_at < 0 || v > best || std::isnan(v)) best = v, best_at = at;
      }
    }
    return best_at;
  }

  void max_forward_plane(const float* xp, float* yp) const {
    for (int64_t oh = 0; oh < g_.OH; ++oh)
      for (int64_t ow = 0; ow < g_.OW; ++ow) {
        const int64_t at = argmax(xp, oh, ow);
        yp[oh * g_.OW + ow] = at < 0 ? -INFINITY : xp[at];
      }
  }

  void max_backward_plane(const float* xp, const float* dyp, float* dxp) const {
    std::memset(dxp, 0, sizeof(float) * size_t(g_.H * g_.W));
    for (int64_t oh = 0; oh < g_.OH; ++oh)
      for (int64_t ow = 0; ow < g_.OW; ++ow) {
        const int64_t at = argmax(xp, oh, ow);
        if (at >= 0) dxp[at] += dyp[oh * g_.OW + ow];
      }
  }

  // One plane's H x OW row sums, 16 floats of padding so each thread's block starts on its own cache line.
  size_t plane_scratch() const { return size_t(g_.H * g_.OW + 16) / 16 * 16; }

  // Output row oh's share of its windows' divisors: with col_share_[ow], the divisor is their product (exact in
  // f32: small integers), so a row's divisions run as one vector loop.
  float row_share(int64_t oh) const {
    const size_t r = size_t(oh);
    return float(p_.count_include_pad ? row_padded_[r] : row_hi_[r] - row_lo_[r]);
  }

  void average_forward_plane(const float* xp, float* rows, float* yp) const {
    const ops::PoolGeometry& g = g_;
    for (int64_t h = 0; h < g.H; ++h) {  // rows[h, ow] = Σ over ow's window's columns of x[h, ·]
      const float* xr = xp + h * g.W;
      float* rr = rows + h * g.OW;
      for (int64_t ow = 0; ow < g.OW; ++ow) {
        if (ow == col_first_ && col_first_ < col_last_) {  // whole windows: one pass per tap over the columns
          const int64_t n = col_last_ - col_first_, step = g.stride_w;
          const float* base = xr + col_first_ * step - g.pad_left;
          std::fill(rr + col_first_, rr + col_last_, 0.0f);
          for (int64_t j = 0; j < g.KW; ++j)
            if (step == 1)
#pragma omp simd
              for (int64_t k = 0; k < n; ++k) rr[col_first_ + k] += base[k + j];
            else
              for (int64_t k = 0; k < n; ++k) rr[col_first_ + k] += base[k * step + j];
          ow = col_last_ - 1;
          continue;
        }
        const int64_t w0 = ow * g.stride_w - g.pad_left;
        float sum = 0;
        for (int64_t j = col_lo_[size_t(ow)]; j < col_hi_[size_t(ow)]; ++j) sum += xr[w0 + j];
        rr[ow] = sum;
      }
    }
    for (int64_t oh = 0; oh < g.OH; ++oh) {  // y[oh, ·] = Σ over oh's window's rows of rows[·] / divisor
      float* yr = yp + oh * g.OW;
      const int64_t h0 = oh * g.stride_h - g.pad_top;
      std::fill(yr, yr + g.OW, 0.0f);
      for (int64_t i = row_lo_[size_t(oh)]; i < row_hi_[size_t(oh)]; ++i) {
        const float* rr = rows + (h0 + i) * g.OW;
#pragma omp simd
        for (int64_t ow = 0; ow < g.OW; ++ow) yr[ow] += rr[ow];
      }
      const float share = row_share(oh);
      const float* col = col_share_.data();
#pragma omp simd
      for (int64_t ow = 0; ow < g.OW; ++ow) yr[ow] /= share * col[ow];
    }
  }

  void average_backward_plane(const float* dyp, float* rows, float* dxp) const {
    const ops::PoolGeometry& g = g_;
    std::fill(rows, rows + g.H * g.OW, 0.0f);
    for (int64_t oh = 0; oh < g.OH; ++oh) {  // rows[h, ow] += dy[oh, ow] / divisor for each of oh's rows h
      const float* dr = dyp + oh * g.OW;
      const int64_t h0 = oh * g.stride_h - g.pad_top;
      const float share = row_share(oh);
      const float* col = col_share_.data();
      for (int64_t i = row_lo_[size_t(oh)]; i < row_hi_[size_t(oh)]; ++i) {
        float* rr = rows + (h0 + i) * g.OW;
#pragma omp simd
        for (int64_t ow = 0; ow < g.OW; ++ow) rr[ow] += dr[ow] / (share * col[ow]);
      }
    }
    std::memset(dxp, 0, sizeof(float) * size_t(g.H * g.W));
    for (int64_t h = 0; h < g.H; ++h) {  // dx[h, w] += rows[h, ow] for each ow whose window holds w
      const float* rr = rows + h * g.OW;
      float* dr = dxp + h * g.W;
      for (int64_t ow = 0; ow < g.OW; ++ow) {
        if (ow == col_first_ && col_first_ < col_last_) {
          const int64_t n = col_last_ - col_first_, step = g.stride_w;
          float* base = dr + col_first_ * step - g.pad_left;
          for (int64_t j = 0; j < g.KW; ++j)
            if (step == 1)
#pragma omp simd
              for (int64_t k = 0; k < n; ++k) base[k + j] += rr[col_first_ + k];
            else
              for (int64_t k = 0; k < n; ++k) base[k * step + j] += rr[col_first_ + k];
          ow = col_last_ - 1;
          continue;
        }
        const int64_t w0 = ow * g.stride_w - g.pad_left;
        for (int64_t j = col_lo_[size_t(ow)]; j < col_hi_[size_t(ow)]; ++j) dr[w0 + j] += rr[ow];
      }
    }
  }

  bool backward_;
  ops::PoolParams p_;
  ops::PoolGeometry g_;
  // Average pooling: per output row and column, the in-range taps [lo, hi) and the extent clipped to the padded
  // input; output columns [col_first_, col_last_) have whole windows.
  std::vector<int64_t> row_lo_, row_hi_, row_padded_, col_lo_, col_hi_, col_padded_;
  std::vector<float> col_share_;  // each output column's share of its divisor
  int64_t col_first_ = 0, col_last_ = 0;
};

}  // namespace

std::unique_ptr<Kernel> make_pool_kernel(const KernelCall& call) { return std::make_unique<PoolKernel>(call); }

}  // namespace fusetrain::kernels::cpu_basic
