// Conv, ConvBackwardData and ConvBackwardWeight on the CPU, by one of two methods (conv_method_for picks per shape):
//
//   direct: loops over planes, one (input plane, output plane, filter) triple at a time, the inner loop a run of
//     output columns against one kernel tap (contiguous at stride 1, so it vectorises at the path's width); each
//     thread owns whole output planes (forward), input planes (data) or output channels (weight). Taken for
//     depthwise convolutions (one input channel per filter, one filter per group: ConvNeXt's 7×7);
//   im2col + the GEMM: per image and group, the patches of x as a (C/group·KH·KW, OH·OW) matrix `cols`,
//       y[b, g] (O/g, OH·OW)   = w_g (O/g, patch) · cols
//       dcols (patch, OH·OW)   = w_gᵀ · dy[b, g],  then dx[b, g] += col2im(dcols)
//       dw_g (O/g, patch)     += dy[b, g] · colsᵀ
//     with a 1×1 stride-1 unpadded kernel (pointwise) using x, dx as cols, dcols directly.
// bench/RESULTS.md ("Convolution kernels") has the per-shape measurements behind the choice. Operands are f32 or
// bf16 (the GEMM's bf16 products; the direct loops widen bf16 planes to f32 in scratch); results are f32, every
// product summed in f32. All three honour KernelArgs::accumulate.
//
// Shape letters as ops::ConvGeometry: B batch, C / O input / output channels, H W input, OH OW output, KH KW kernel.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "fusetrain/core/half.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/dense_kernels.h"
#include "kernels/cpu/gemm.h"

namespace fusetrain::kernels {
namespace {

using cpu_basic::parallel_for;
using cpu_basic::threads_for;

size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// The output columns [lo, hi) whose input column ow·stride + offset lies in [0, extent).
void valid_range(int64_t offset, int64_t stride, int64_t extent, int64_t out, int64_t& lo, int64_t& hi) {
  lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  hi = extent - 1 - offset < 0 ? 0 : (extent - 1 - offset) / stride + 1;
  hi = std::min(hi, out);
  lo = std::min(lo, hi);
}

// cols (patch rows, OH·OW) of the channels [0, cg) of one image's group x (cg, H, W), element type T.
template <typename T>
void im2col(const ops::ConvGeometry& g, const T* x, T* cols, int threads) {
  const int64_t n = g.OH * g.OW;
  parallel_for(g.patch(), threads_for(g.patch() * n, threads), [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c = r / (g.KH * g.KW), i = (r / g.KW) % g.KH, j = r % g.KW;
      T* row = cols + r * n;
      int64_t lo, hi;
      const int64_t offset = j * g.dil_w - g.pad_left;
      valid_range(offset, g.stride_w, g.W, g.OW, lo, hi);
      for (int64_t oh = 0; oh < g.OH; ++oh) {
        T* out = row + oh * g.OW;
        const int64_t ih = oh * g.stride_h - g.pad_top + i * g.dil_h;
        if (ih < 0 || ih >= g.H) {
          std::memset(out, 0, sizeof(T) * size_t(g.OW));
          continue;
        }
        const T* in = x + (c * g.H + ih) * g.W + offset;
        std::memset(out, 0, sizeof(T) * size_t(lo));
        if (g.stride_w == 1)
          std::memcpy(out + lo, in + lo, sizeof(T) * size_t(hi - lo));
        else
          for (int64_t ow = lo; ow < hi; ++ow) out[ow] = in[ow * g.stride_w];
        std::memset(out + hi, 0, sizeof(T) * size_t(g.OW - hi));
      }
    }
  });
}

// dx (cg, H, W) += col2im(dcols (patch, OH·OW)): each channel's rows land only in that channel's plane.
void col2im_add(const ops::ConvGeometry& g, const float* dcols, float* dx, int threads) {
  const int64_t n = g.OH * g.OW, cg = g.channels_per_group();
  parallel_for(cg, threads_for(g.patch() * n, threads), [&](int64_t begin, int64_t end, int) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t i = 0; i < g.KH; ++i)
        for (int64_t j = 0; j < g.KW; ++j) {
          const float* row = dcols + ((c * g.KH + i) * g.KW + j) * n;
          int64_t lo, hi;
          const int64_t offset = j * g.dil_w - g.pad_left;
          valid_range(offset, g.stride_w, g.W, g.OW, lo, hi);
          for (int64_t oh = 0; oh < g.OH; ++oh) {
            const int64_t ih = oh * g.stride_h - g.pad_top + i * g.dil_h;
            if (ih < 0 || ih >= g.H) continue;
            float* __restrict out = dx + (c * g.H + ih) * g.W + offset;
            const float* __restrict in = row + oh * g.OW;
            if (g.stride_w == 1)
              for (int64_t ow = lo; ow < hi; ++ow) out[ow] += in[ow];
            else
              for (int64_t ow = lo; ow < hi; ++ow) out[ow * g.stride_w] += in[ow];
          }
        }
  });
}

// A plane of n elements as f32: the plane itself (f32) or its widened copy in `buffer` (bf16).
const float* as_f32(const void* plane, bool bf16, int64_t n, float* buffer) {
  if (!bf16) return static_cast<const float*>(plane);
  bf16_to_float(buffer, static_cast<const uint16_t*>(plane), size_t(n));
  return buffer;
}

// ---- the direct method's plane loops, compiled for each path (pick_path) ----------------------------------------
// Each pairs one input plane with one output plane through one filter's KH·KW taps. The inner loop runs over output
// columns against one tap, unit-stride at stride 1, so the compiler vectorises it at the width of the path.

#define FT_CONV_INLINE inline __attribute__((always_inline))

// y (OH, OW) += Σ_taps taps[i, j] · x (H, W) at (oh·sh − pt + i·dh, ow·sw − pl + j·dw).
FT_CONV_INLINE void forward_plane_body(const ops::ConvGeometry& g, const float* x, const float* taps, float* y) {
  for (int64_t oh = 0; oh < g.OH; ++oh) {
    float* __restrict row = y + oh * g.OW;
    for (int64_t i = 0; i < g.KH; ++i) {
      const int64_t ih = oh * g.stride_h - g.pad_top + i * g.dil_h;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t j = 0; j < g.KW; ++j) {
        const float tap = taps[i * g.KW + j];
        const int64_t offset = j * g.dil_w - g.pad_left;
        int64_t lo, hi;
        valid_range(offset, g.stride_w, g.W, g.OW, lo, hi);
        const float* __restrict in = x + ih * g.W + offset;
        if (g.stride_w == 1)
          for (int64_t ow = lo; ow < hi; ++ow) row[ow] += tap * in[ow];
        else
          for (int64_t ow = lo; ow < hi; ++ow) row[ow] += tap * in[ow * g.stride_w];
      }
    }
  }
}

// dx (H, W) += the transpose: each dy (OH, OW) element times each tap, at the input position it read.
FT_CONV_INLINE void data_plane_body(const ops::ConvGeometry& g, const float* dy, const float* taps, float* dx) {
  for (int64_t oh = 0; oh < g.OH; ++oh) {
    const float* __restrict row = dy + oh * g.OW;
    for (int64_t i = 0; i < g.KH; ++i) {
      const int64_t ih = oh * g.stride_h - g.pad_top + i * g.dil_h;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t j = 0; j < g.KW; ++j) {
        const float tap = taps[i * g.KW + j];
        const int64_t offset = j * g.dil_w - g.pad_left;
        int64_t lo, hi;
        valid_range(offset, g.stride_w, g.W, g.OW, lo, hi);
        float* __restrict out = dx + ih * g.W + offset;
        if (g.stride_w == 1)
          for (int64_t ow = lo; ow < hi; ++ow) out[ow] += tap * row[ow];
        else
          for (int64_t ow = lo; ow < hi; ++ow) out[ow * g.stride_w] += tap * row[ow];
      }
    }
  }
}

// sums[i, j] += Σ_positions dy · x at the tap's input position; each output row's sum in f32, added in double.
FT_CONV_INLINE void weight_plane_body(const ops::ConvGeometry& g, const float* dy, const float* x, double* sums) {
  for (int64_t oh = 0; oh < g.OH; ++oh) {
    const float* __restrict row = dy + oh * g.OW;
    for (int64_t i = 0; i < g.KH; ++i) {
      const int64_t ih = oh * g.stride_h - g.pad_top + i * g.dil_h;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t j = 0; j < g.KW; ++j) {
        const int64_t offset = j * g.dil_w - g.pad_left;
        int64_t lo, hi;
        valid_range(offset, g.stride_w, g.W, g.OW, lo, hi);
        const float* __restrict in = x + ih * g.W + offset;
        float sum = 0.0f;
        if (g.stride_w == 1) {
#pragma omp simd reduction(+ : sum)
          for (int64_t ow = lo; ow < hi; ++ow) sum += row[ow] * in[ow];
        } else {
          for (int64_t ow = lo; ow < hi; ++ow) sum += row[ow] * in[ow * g.stride_w];
        }
        sums[i * g.KW + j] += sum;
      }
    }
  }
}

using ForwardPlane = void (*)(const ops::ConvGeometry&, const float*, const float*, float*);
using WeightPlane = void (*)(const ops::ConvGeometry&, const float*, const float*, double*);

void forward_plane(const ops::ConvGeometry& g, const float* x, const float* t, float* y) {
  forward_plane_body(g, x, t, y);
}
__attribute__((target("avx2,fma"))) void forward_plane_avx2(const ops::ConvGeometry& g, const float* x,
                                                             const float* t, float* y) {
  forward_plane_body(g, x, t, y);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void forward_plane_avx512(
    const ops::ConvGeometry& g, const float* x, const float* t, float* y) {
  forward_plane_body(g, x, t, y);
}
void data_plane(const ops::ConvGeometry& g, const float* dy, const float* t, float* dx) {
  data_plane_body(g, dy, t, dx);
}
__attribute__((target("avx2,fma"))) void data_plane_avx2(const ops::ConvGeometry& g, const float* dy, const float* t,
                                                          float* dx) {
  data_plane_body(g, dy, t, dx);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void data_plane_avx512(
    const ops::ConvGeometry& g, const float* dy, const float* t, float* dx) {
  data_plane_body(g, dy, t, dx);
}
void weight_plane(const ops::ConvGeometry& g, const float* dy, const float* x, double* s) {
  weight_plane_body(g, dy, x, s);
}
__attribute__((target("avx2,fma"))) void weight_plane_avx2(const ops::ConvGeometry& g, const float* dy,
                                                            const float* x, double* s) {
  weight_plane_body(g, dy, x, s);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void weight_plane_avx512(
    const ops::ConvGeometry& g, const float* dy, const float* x, double* s) {
  weight_plane_body(g, dy, x, s);
}

std::atomic<ConvMethod> forced_method{ConvMethod::chosen};

class ConvKernel final : public Kernel {
 public:
  explicit ConvKernel(const KernelCall& call) : op_(call.op) {
    const auto& p = call.params<ops::ConvParams>();
    const std::vector<int64_t>& x = op_ == OpKind::Conv                 ? call.inputs[0].shape.dims()
                                    : op_ == OpKind::ConvBackwardWeight ? call.inputs[1].shape.dims()
                                                                        : p.shape;
    const std::vector<int64_t>& w = op_ == OpKind::ConvBackwardWeight ? p.shape : call.inputs[1].shape.dims();
    g_ = ops::ConvGeometry::of(p, x, w);
    bf16_ = call.inputs[0].dtype == DType::bf16;
    has_bias_ = op_ == OpKind::Conv && call.inputs.size() == 3;
    elem_ = bf16_ ? 2 : 4;
    const ConvMethod forced = forced_method.load(std::memory_order_relaxed);
    direct_ = forced == ConvMethod::chosen ? conv_method_for(g_) == ConvMethod::direct : forced == ConvMethod::direct;
    forward_plane_ = cpu_basic::pick_path<ForwardPlane>(forward_plane, forward_plane_avx2, forward_plane_avx512);
    data_plane_ = cpu_basic::pick_path<ForwardPlane>(data_plane, data_plane_avx2, data_plane_avx512);
    weight_plane_ = cpu_basic::pick_path<WeightPlane>(weight_plane, weight_plane_avx2, weight_plane_avx512);
    const int64_t n = g_.OH * g_.OW;
    switch (op_) {
      case OpKind::Conv:  // y_g (og, n) = w_g (og, patch) · cols (patch, n)
        gemm_ = GemmShape{g_.outputs_per_group(), n, g_.patch(), false, false, g_.patch(), n, n};
        break;
      case OpKind::ConvBackwardData:  // dcols (patch, n) = w_gᵀ · dy_g (og, n); w_g stored (og, patch)
        gemm_ = GemmShape{g_.patch(), n, g_.outputs_per_group(), true, false, g_.patch(), n, n};
        break;
      default:  // dw_g (og, patch) += dy_g (og, n) · colsᵀ; cols stored (patch, n)
        gemm_ = GemmShape{g_.outputs_per_group(), g_.patch(), n, false, true, n, n, g_.patch()};
        break;
    }
  }

  bool accumulates() const override { return true; }

  size_t scratch_bytes(int num_threads) const override {
    if (direct_) return size_t(num_threads) * buffer_bytes();
    return cols_bytes() +
           (bf16_ ? gemm_bf16_scratch_bytes(gemm_, num_threads) : gemm_f32_scratch_bytes(gemm_, num_threads));
  }

  void run(const KernelArgs& args, const StepContext& ctx) override {
    const bool accumulate = !args.accumulate.empty() && args.accumulate[0];
    float* out = static_cast<float*>(args.outputs[0].data());
    if (op_ == OpKind::Conv)
      direct_ ? direct_forward(args, out, accumulate, ctx.num_threads)
              : gemm_forward(args, out, accumulate, ctx.num_threads);
    else if (op_ == OpKind::ConvBackwardData)
      direct_ ? direct_data(args, out, accumulate, ctx.num_threads) : gemm_data(args, out, accumulate, ctx.num_threads);
    else
      direct_ ? direct_weight(args, out, accumulate, ctx.num_threads)
              : gemm_weight(args, out, accumulate, ctx.num_threads);
  }

 private:
  // ---- im2col + the GEMM ----

  void gemm(const void* a, const void* b, float beta, float* c, void* scratch, int threads) const {
    if (bf16_)
      gemm_bf16(gemm_, 1.0f, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), beta, c, scratch,
                threads);
    else
      gemm_f32(gemm_, 1.0f, static_cast<const float*>(a), static_cast<const float*>(b), beta, c, scratch, threads);
  }

  // The patches of one image's group into `cols`, or the group's channels themselves when pointwise.
  const void* patches(const char* x_group, char* cols, int threads) const {
    if (g_.pointwise()) return x_group;
    if (bf16_)
      im2col(g_, reinterpret_cast<const uint16_t*>(x_group), reinterpret_cast<uint16_t*>(cols), threads);
    else
      im2col(g_, reinterpret_cast<const float*>(x_group), reinterpret_cast<float*>(cols), threads);
    return cols;
  }

  // The im2col matrix of one image's group (f32 dcols for ConvBackwardData); none when pointwise.
  size_t cols_bytes() const {
    if (g_.pointwise()) return 0;
    return round64(size_t(g_.patch() * g_.OH * g_.OW) * (op_ == OpKind::ConvBackwardData ? sizeof(float) : elem_));
  }

  // Element offsets of image b's group gi in x (C channels of H·W) and in y (O channels of OH·OW).
  int64_t x_group_offset(int64_t b, int64_t gi) const {
    return (b * g_.C + gi * g_.channels_per_group()) * g_.H * g_.W;
  }
  int64_t y_group_offset(int64_t b, int64_t gi) const {
    return (b * g_.O + gi * g_.outputs_per_group()) * g_.OH * g_.OW;
  }

  void gemm_forward(const KernelArgs& args, float* y, bool accumulate, int threads) const {
    const char* x = static_cast<const char*>(args.inputs[0].data());
    const char* w = static_cast<const char*>(args.inputs[1].data());
    char* cols = static_cast<char*>(args.scratch);
    void* gemm_scratch = cols + cols_bytes();
    const int64_t n = g_.OH * g_.OW, og = g_.outputs_per_group();
    for (int64_t b = 0; b < g_.B; ++b)
      for (int64_t gi = 0; gi < g_.group; ++gi) {
        const void* source = patches(x + size_t(x_group_offset(b, gi)) * elem_, cols, threads);
        float* yg = y + y_group_offset(b, gi);
        gemm(w + size_t(gi * og * g_.patch()) * elem_, source, accumulate ? 1.0f : 0.0f, yg, gemm_scratch, threads);
        if (has_bias_) {
          const float* bias = static_cast<const float*>(args.inputs[2].data()) + gi * og;
          parallel_for(og, threads_for(og * n, threads), [&](int64_t begin, int64_t end, int) {
            for (int64_t o = begin; o < end; ++o)
              for (int64_t k = 0; k < n; ++k) yg[o * n + k] += bias[o];
          });
        }
      }
  }

  void gemm_data(const KernelArgs& args, float* dx, bool accumulate, int threads) const {
    const char* dy = static_cast<const char*>(args.inputs[0].data());
    const char* w = static_cast<const char*>(args.inputs[1].data());
    float* dcols = static_cast<float*>(args.scratch);
    void* gemm_scratch = static_cast<char*>(args.scratch) + cols_bytes();
    const int64_t og = g_.outputs_per_group();
    if (!accumulate && !g_.pointwise()) std::memset(dx, 0, sizeof(float) * size_t(g_.B * g_.C * g_.H * g_.W));
    for (int64_t b = 0; b < g_.B; ++b)
      for (int64_t gi = 0; gi < g_.group; ++gi) {
        float* dxg = dx + x_group_offset(b, gi);
        const char* dyg = dy + size_t(y_group_offset(b, gi)) * elem_;
        const char* wg = w + size_t(gi * og * g_.patch()) * elem_;
        if (g_.pointwise()) {
          gemm(wg, dyg, accumulate ? 1.0f : 0.0f, dxg, gemm_scratch, threads);
          continue;
        }
        gemm(wg, dyg, 0.0f, dcols, gemm_scratch, threads);
        col2im_add(g_, dcols, dxg, threads);
      }
  }

  void gemm_weight(const KernelArgs& args, float* dw, bool accumulate, int threads) const {
    const char* dy = static_cast<const char*>(args.inputs[0].data());
    const char* x = static_cast<const char*>(args.inputs[1].data());
    char* cols = static_cast<char*>(args.scratch);
    void* gemm_scratch = cols + cols_bytes();
    const int64_t og = g_.outputs_per_group();
    if (g_.B == 0 && !accumulate) std::memset(dw, 0, sizeof(float) * size_t(g_.O * g_.patch()));
    for (int64_t b = 0; b < g_.B; ++b)
      for (int64_t gi = 0; gi < g_.group; ++gi) {
        const void* source = patches(x + size_t(x_group_offset(b, gi)) * elem_, cols, threads);
        gemm(dy + size_t(y_group_offset(b, gi)) * elem_, source, accumulate || b > 0 ? 1.0f : 0.0f,
             dw + gi * og * g_.patch(), gemm_scratch, threads);
      }
  }

  // ---- the direct method ----

  // Per-thread buffers: one filter pair's tap sums (double) and taps (f32), then, with bf16 operands, a widened x
  // plane and a widened dy plane.
  struct Buffers {
    double* sums;
    float* taps;
    float* x;
    float* dy;
  };
  size_t buffer_bytes() const {
    const size_t taps = size_t(g_.KH * g_.KW), planes = bf16_ ? size_t(g_.H * g_.W + g_.OH * g_.OW) : 0;
    return round64(taps * sizeof(double) + (taps + planes) * sizeof(float));
  }
  Buffers buffers(void* scratch, int thread) const {
    char* base = static_cast<char*>(scratch) + size_t(thread) * buffer_bytes();
    double* sums = reinterpret_cast<double*>(base);
    float* taps = reinterpret_cast<float*>(sums + g_.KH * g_.KW);
    return {sums, taps, taps + g_.KH * g_.KW, taps + g_.KH * g_.KW + g_.H * g_.W};
  }
  // The taps of filter (o, c) as f32.
  const float* taps(const void* w, int64_t o, int64_t c, float* buffer) const {
    const int64_t at = (o * g_.channels_per_group() + c) * g_.KH * g_.KW;
    return as_f32(static_cast<const char*>(w) + size_t(at) * elem_, bf16_, g_.KH * g_.KW, buffer);
  }
  const float* plane(const void* t, int64_t index, int64_t size, float* buffer) const {
    return as_f32(static_cast<const char*>(t) + size_t(index * size) * elem_, bf16_, size, buffer);
  }
  int64_t direct_work() const { return g_.B * g_.O * g_.channels_per_group() * g_.OH * g_.OW * g_.KH * g_.KW; }

  // y[b, o] = bias[o] + Σ_{c in o's group} filter (o, c) over x[b, c], one output plane per (b, o) and thread.
  void direct_forward(const KernelArgs& args, float* y, bool accumulate, int threads) const {
    const int64_t in_plane = g_.H * g_.W, out_plane = g_.OH * g_.OW, cg = g_.channels_per_group(),
                  og = g_.outputs_per_group();
    const float* bias = has_bias_ ? static_cast<const float*>(args.inputs[2].data()) : nullptr;
    parallel_for(g_.B * g_.O, threads_for(direct_work(), threads), [&](int64_t begin, int64_t end, int thread) {
      const Buffers buf = buffers(args.scratch, thread);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = p / g_.O, o = p % g_.O;
        float* yp = y + p * out_plane;
        if (!accumulate)
          std::fill(yp, yp + out_plane, bias ? bias[o] : 0.0f);
        else if (bias)
          for (int64_t k = 0; k < out_plane; ++k) yp[k] += bias[o];
        for (int64_t c = 0; c < cg; ++c) {
          const float* xp = plane(args.inputs[0].data(), b * g_.C + (o / og) * cg + c, in_plane, buf.x);
          forward_plane_(g_, xp, taps(args.inputs[1].data(), o, c, buf.taps), yp);
        }
      }
    });
  }

  // dx[b, c] = Σ_{o of c's group} filter (o, c) transposed over dy[b, o], one input plane per (b, c) and thread.
  void direct_data(const KernelArgs& args, float* dx, bool accumulate, int threads) const {
    const int64_t in_plane = g_.H * g_.W, out_plane = g_.OH * g_.OW, cg = g_.channels_per_group(),
                  og = g_.outputs_per_group();
    parallel_for(g_.B * g_.C, threads_for(direct_work(), threads), [&](int64_t begin, int64_t end, int thread) {
      const Buffers buf = buffers(args.scratch, thread);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = p / g_.C, c = p % g_.C, gi = c / cg;
        float* xp = dx + p * in_plane;
        if (!accumulate) std::fill(xp, xp + in_plane, 0.0f);
        for (int64_t o = gi * og; o < (gi + 1) * og; ++o) {
          const float* dyp = plane(args.inputs[0].data(), b * g_.O + o, out_plane, buf.dy);
          data_plane_(g_, dyp, taps(args.inputs[1].data(), o, c - gi * cg, buf.taps), xp);
        }
      }
    });
  }

  // dw[o, c] = Σ_b dy[b, o] correlated with x[b, c] at each tap, one output channel per thread at a time.
  void direct_weight(const KernelArgs& args, float* dw, bool accumulate, int threads) const {
    const int64_t in_plane = g_.H * g_.W, out_plane = g_.OH * g_.OW, taps_n = g_.KH * g_.KW,
                  cg = g_.channels_per_group(), og = g_.outputs_per_group();
    parallel_for(g_.O, threads_for(direct_work(), threads), [&](int64_t begin, int64_t end, int thread) {
      const Buffers buf = buffers(args.scratch, thread);
      for (int64_t o = begin; o < end; ++o)
        for (int64_t c = 0; c < cg; ++c) {
          std::fill(buf.sums, buf.sums + taps_n, 0.0);
          for (int64_t b = 0; b < g_.B; ++b) {
            const float* dyp = plane(args.inputs[0].data(), b * g_.O + o, out_plane, buf.dy);
            const float* xp = plane(args.inputs[1].data(), b * g_.C + (o / og) * cg + c, in_plane, buf.x);
            weight_plane_(g_, dyp, xp, buf.sums);
          }
          float* out = dw + (o * cg + c) * taps_n;
          for (int64_t k = 0; k < taps_n; ++k)
            out[k] = static_cast<float>(accumulate ? double(out[k]) + buf.sums[k] : buf.sums[k]);
        }
    });
  }

  OpKind op_;
  ops::ConvGeometry g_;
  bool bf16_ = false, has_bias_ = false, direct_ = false;
  size_t elem_ = 4;
  GemmShape gemm_{};
  ForwardPlane forward_plane_ = nullptr, data_plane_ = nullptr;
  WeightPlane weight_plane_ = nullptr;
};

}  // namespace

ConvMethod conv_method_for(const ops::ConvGeometry& g) {
  // One input channel per filter and one filter per group (depthwise): the im2col matrix is as large as the taps
  // times the input, and each GEMM has a single row; the direct loops read each plane once per tap instead.
  return g.channels_per_group() == 1 && g.outputs_per_group() == 1 ? ConvMethod::direct : ConvMethod::im2col;
}

void set_conv_method(ConvMethod method) { forced_method.store(method, std::memory_order_relaxed); }

std::unique_ptr<Kernel> make_cpu_conv_kernel(const KernelCall& call) { return std::make_unique<ConvKernel>(call); }

}  // namespace fusetrain::kernels
