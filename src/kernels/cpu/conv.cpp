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
// A plane correlation reads a zero-padded f32 copy of its input plane, so its loops have no bounds to test: each
// run of 16 output columns is one 16-lane vector (GCC's vector extension: one zmm on the AVX-512 path, two ymm on
// AVX2, four xmm on the portable one) accumulated over every tap in registers, then added to the output once.

#define FT_CONV_INLINE inline __attribute__((always_inline))
// The engine compiles with -ffp-contract=off (each operation rounds as torch's separate ops do); a convolution's sum
// of products is one fused multiply-add per tap here, as oneDNN's and PyTorch's convolutions form it.
// GCC takes it as a function attribute; clang (the wheel's and the sanitizers' compiler) as a pragma opening the
// loops' blocks (FT_CONV_CONTRACT).
#if defined(__clang__)
#define FT_CONV_FMA
#define FT_CONV_CONTRACT _Pragma("clang fp contract(fast)")
#else
#define FT_CONV_FMA __attribute__((optimize("fp-contract=fast")))
#define FT_CONV_CONTRACT
#endif

typedef float V16 __attribute__((vector_size(64)));  // 16 floats
constexpr int64_t kLanes = 16;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// 16 floats at p (any 4-byte alignment) as one vector: a packed struct's member, which both GCC and clang read and
// write with unaligned vector moves (a typedef with lowered alignment is not enough: clang keeps the vector's 64-byte
// alignment and emits vmovaps). Macros, so that no vector crosses a function boundary in the paths' code.
struct Unaligned16 {
  V16 v;
} __attribute__((packed, may_alias));
#define FT_LANES16(p) (reinterpret_cast<Unaligned16*>(p)->v)
#define FT_LOAD16(p) (reinterpret_cast<const Unaligned16*>(p)->v)

// out (OH, OW) += Σ_{i, j} taps[i, j] · in at (oh·sh − pt + i·dh, ow·sw − pl + j·dw) of an (H, W) input plane, read
// from `padded`: the plane at (pt, pl) inside Hp × Wp zeros, as wide as the last vector of columns reads.
struct Correlation {
  int64_t H = 0, W = 0, OH = 0, OW = 0, KH = 1, KW = 1, sh = 1, sw = 1, dh = 1, dw = 1, pt = 0, pl = 0;
  int64_t Hp = 0, Wp = 0;

  Correlation(int64_t h, int64_t w, int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t stride_h,
              int64_t stride_w, int64_t dil_h, int64_t dil_w, int64_t pad_top, int64_t pad_left)
      : H(h), W(w), OH(oh), OW(ow), KH(kh), KW(kw), sh(stride_h), sw(stride_w), dh(dil_h), dw(dil_w), pt(pad_top),
        pl(pad_left) {
    Hp = (OH - 1) * sh + (KH - 1) * dh + 1;
    Wp = (round_up(OW, kLanes) - 1) * sw + (KW - 1) * dw + 1;
  }
  /// The input plane (f32, or bf16 widened) into `padded` (Hp·Wp floats); rows and columns never read are dropped.
  void pad(const void* in, bool bf16, float* padded) const {
    std::fill(padded, padded + Hp * Wp, 0.0f);
    const int64_t w0 = std::max<int64_t>(0, -pl), w1 = std::min(W, Wp - pl);
    if (w0 >= w1) return;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = h + pt;
      if (r < 0 || r >= Hp) continue;
      float* dst = padded + r * Wp + pl + w0;
      if (bf16)
        bf16_to_float(dst, static_cast<const uint16_t*>(in) + h * W + w0, size_t(w1 - w0));
      else
        std::memcpy(dst, static_cast<const float*>(in) + h * W + w0, sizeof(float) * size_t(w1 - w0));
    }
  }
};

// R output rows from oh at the columns [ow0, ow0 + 16): R independent accumulators, so the multiply-adds of
// successive taps do not wait on each other (one accumulator ran at a quarter of the FMA units' rate).
template <int R>
FT_CONV_INLINE void correlate_rows(const Correlation& c, const float* padded, const float* taps, float* out,
                                   int64_t oh, int64_t ow0, bool overwrite, float init) {
  FT_CONV_CONTRACT
  V16 acc[R] = {};
  const int64_t row_step = c.sh * c.Wp;
  for (int64_t i = 0; i < c.KH; ++i) {
    const float* t = taps + i * c.KW;
    const float* in = padded + (oh * c.sh + i * c.dh) * c.Wp + ow0 * c.sw;
    if (c.sw == 1) {  // the accumulators stay in registers: the row loop is unrolled and branch-free
      for (int64_t j = 0; j < c.KW; ++j) {
        const float tap = t[j];
        const float* at = in + j * c.dw;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r] += tap * FT_LOAD16(at + r * row_step);
      }
    } else {
      for (int64_t j = 0; j < c.KW; ++j)
        for (int r = 0; r < R; ++r) {
          V16 v;
          for (int64_t k = 0; k < kLanes; ++k) v[k] = in[r * row_step + j * c.dw + k * c.sw];
          acc[r] += t[j] * v;
        }
    }
  }
  const int64_t n = std::min(kLanes, c.OW - ow0);
  for (int r = 0; r < R; ++r) {
    float* row = out + (oh + r) * c.OW + ow0;
    if (n == kLanes) {
      if (overwrite)
        FT_LANES16(row) = acc[r] + init;
      else
        FT_LANES16(row) += acc[r];
    } else {
      for (int64_t k = 0; k < n; ++k) row[k] = overwrite ? acc[r][k] + init : row[k] + acc[r][k];
    }
  }
}

// out (OH, OW) += the correlation, or (overwrite) out = init + the correlation: a first or only input channel
// writes its plane once rather than filling it and adding (the planes are memory-bound).
FT_CONV_INLINE void correlate_body(const Correlation& c, const float* padded, const float* taps, float* out,
                                   bool overwrite, float init) {
  for (int64_t ow0 = 0; ow0 < c.OW; ow0 += kLanes) {
    int64_t oh = 0;
    for (; oh + 8 <= c.OH; oh += 8) correlate_rows<8>(c, padded, taps, out, oh, ow0, overwrite, init);
    if (oh + 4 <= c.OH) {
      correlate_rows<4>(c, padded, taps, out, oh, ow0, overwrite, init);
      oh += 4;
    }
    if (oh + 2 <= c.OH) {
      correlate_rows<2>(c, padded, taps, out, oh, ow0, overwrite, init);
      oh += 2;
    }
    if (oh < c.OH) correlate_rows<1>(c, padded, taps, out, oh, ow0, overwrite, init);
  }
}

// sums[i, j0 .. j0 + NJ) += Σ_{oh, ow} dy[oh, ow] · x at the tap's input position: dy padded to rows of
// round_up(OW, 16) (zeros past OW), x as Correlation::pad leaves it. NJ vector sums live in registers.
template <int NJ>
FT_CONV_INLINE void weight_taps(const Correlation& c, const float* dy, const float* x, int64_t i, int64_t j0,
                                double* sums) {
  FT_CONV_CONTRACT
  const int64_t row = round_up(c.OW, kLanes);
  V16 acc[NJ] = {};
  if (c.sw == 1) {  // the accumulators stay in registers: the tap loop is unrolled and branch-free
    for (int64_t oh = 0; oh < c.OH; ++oh) {
      const float* d = dy + oh * row;
      const float* in = x + (oh * c.sh + i * c.dh) * c.Wp + j0 * c.dw;
      for (int64_t ow0 = 0; ow0 < row; ow0 += kLanes) {
        const V16 g = FT_LOAD16(d + ow0);
#pragma GCC unroll 8
        for (int jj = 0; jj < NJ; ++jj) acc[jj] += g * FT_LOAD16(in + ow0 + jj * c.dw);
      }
    }
  } else {
    for (int64_t oh = 0; oh < c.OH; ++oh) {
      const float* d = dy + oh * row;
      const float* in = x + (oh * c.sh + i * c.dh) * c.Wp + j0 * c.dw;
      for (int64_t ow0 = 0; ow0 < row; ow0 += kLanes)
        for (int jj = 0; jj < NJ; ++jj) {
          V16 v;
          for (int64_t k = 0; k < kLanes; ++k) v[k] = in[(ow0 + k) * c.sw + jj * c.dw];
          acc[jj] += FT_LOAD16(d + ow0) * v;
        }
    }
  }
  for (int jj = 0; jj < NJ; ++jj) {
    double total = 0.0;
    for (int64_t k = 0; k < kLanes; ++k) total += acc[jj][k];
    sums[i * c.KW + j0 + jj] += total;
  }
}

FT_CONV_INLINE void weight_body(const Correlation& c, const float* dy, const float* x, double* sums) {
  for (int64_t i = 0; i < c.KH; ++i)
    for (int64_t j0 = 0; j0 < c.KW; j0 += 8) {
      switch (std::min<int64_t>(8, c.KW - j0)) {
        case 8: weight_taps<8>(c, dy, x, i, j0, sums); break;
        case 7: weight_taps<7>(c, dy, x, i, j0, sums); break;
        case 6: weight_taps<6>(c, dy, x, i, j0, sums); break;
        case 5: weight_taps<5>(c, dy, x, i, j0, sums); break;
        case 4: weight_taps<4>(c, dy, x, i, j0, sums); break;
        case 3: weight_taps<3>(c, dy, x, i, j0, sums); break;
        case 2: weight_taps<2>(c, dy, x, i, j0, sums); break;
        default: weight_taps<1>(c, dy, x, i, j0, sums); break;
      }
    }
}

using CorrelatePlane = void (*)(const Correlation&, const float*, const float*, float*, bool, float);
using WeightPlane = void (*)(const Correlation&, const float*, const float*, double*);

void correlate(const Correlation& c, const float* in, const float* t, float* out, bool overwrite, float init) {
  correlate_body(c, in, t, out, overwrite, init);
}
FT_CONV_FMA __attribute__((target("avx2,fma"))) void correlate_avx2(const Correlation& c, const float* in,
                                                                     const float* t, float* out, bool overwrite,
                                                                     float init) {
  correlate_body(c, in, t, out, overwrite, init);
}
FT_CONV_FMA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void correlate_avx512(
    const Correlation& c, const float* in, const float* t, float* out, bool overwrite, float init) {
  correlate_body(c, in, t, out, overwrite, init);
}
void weight_plane(const Correlation& c, const float* dy, const float* x, double* s) { weight_body(c, dy, x, s); }
FT_CONV_FMA __attribute__((target("avx2,fma"))) void weight_plane_avx2(const Correlation& c, const float* dy, const float* x,
                                                            double* s) {
  weight_body(c, dy, x, s);
}
FT_CONV_FMA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void weight_plane_avx512(const Correlation& c,
                                                                                            const float* dy,
                                                                                            const float* x,
                                                                                            double* s) {
  weight_body(c, dy, x, s);
}

// dx (H, W) += the transposed correlation of a strided convolution: each dy (OH, OW) element times each tap, added
// at the input position it read. (At stride 1 the transpose is a correlation of the padded dy with the flipped taps,
// which ConvKernel runs instead.)
void scatter_plane(const ops::ConvGeometry& g, const float* dy, const float* taps, float* dx) {
  for (int64_t oh = 0; oh < g.OH; ++oh) {
    const float* row = dy + oh * g.OW;
    for (int64_t i = 0; i < g.KH; ++i) {
      const int64_t ih = oh * g.stride_h - g.pad_top + i * g.dil_h;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t j = 0; j < g.KW; ++j) {
        const float tap = taps[i * g.KW + j];
        const int64_t offset = j * g.dil_w - g.pad_left;
        int64_t lo, hi;
        valid_range(offset, g.stride_w, g.W, g.OW, lo, hi);
        float* out = dx + ih * g.W + offset;
        for (int64_t ow = lo; ow < hi; ++ow) out[ow * g.stride_w] += tap * row[ow];
      }
    }
  }
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
    correlate_ = cpu_basic::pick_path<CorrelatePlane>(correlate, correlate_avx2, correlate_avx512);
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

  // The forward correlation of x into y, and (stride 1, no padding beyond the kernel's reach) the backward one of
  // dy into dx: dy padded by dil·(K − 1) − pad, the taps flipped.
  Correlation forward_correlation() const {
    return Correlation(g_.H, g_.W, g_.OH, g_.OW, g_.KH, g_.KW, g_.stride_h, g_.stride_w, g_.dil_h, g_.dil_w,
                       g_.pad_top, g_.pad_left);
  }
  Correlation transposed_correlation() const {
    return Correlation(g_.OH, g_.OW, g_.H, g_.W, g_.KH, g_.KW, 1, 1, g_.dil_h, g_.dil_w,
                       g_.dil_h * (g_.KH - 1) - g_.pad_top, g_.dil_w * (g_.KW - 1) - g_.pad_left);
  }
  bool transposable() const {
    return g_.stride_h == 1 && g_.stride_w == 1 && g_.pad_top <= g_.dil_h * (g_.KH - 1) &&
           g_.pad_left <= g_.dil_w * (g_.KW - 1);
  }

  // Per-thread buffers: one filter's tap sums (double) and taps (f32, flipped for the backward correlation), a
  // padded input plane (or, for the strided backward, dy widened), and dy padded to whole vectors (weight).
  struct Buffers {
    double* sums;
    float* taps;
    float* plane;
    float* dy;
  };
  size_t plane_floats() const {
    const Correlation f = forward_correlation();
    int64_t n = std::max(f.Hp * f.Wp, g_.OH * g_.OW);
    if (transposable()) {
      const Correlation t = transposed_correlation();
      n = std::max(n, t.Hp * t.Wp);
    }
    return size_t(n);
  }
  size_t buffer_bytes() const {
    const size_t taps = size_t(g_.KH * g_.KW), dy = size_t(g_.OH * round_up(g_.OW, kLanes));
    return round64(taps * sizeof(double)) + round64((taps + plane_floats() + dy) * sizeof(float));
  }
  Buffers buffers(void* scratch, int thread) const {
    char* base = static_cast<char*>(scratch) + size_t(thread) * buffer_bytes();
    double* sums = reinterpret_cast<double*>(base);
    float* taps = reinterpret_cast<float*>(base + round64(size_t(g_.KH * g_.KW) * sizeof(double)));
    float* plane = taps + g_.KH * g_.KW;
    return {sums, taps, plane, plane + plane_floats()};
  }
  // The taps of filter (o, c) as f32, flipped in both axes when `flip`.
  const float* taps(const void* w, int64_t o, int64_t c, float* buffer, bool flip = false) const {
    const int64_t n = g_.KH * g_.KW, at = (o * g_.channels_per_group() + c) * n;
    const float* t = as_f32(static_cast<const char*>(w) + size_t(at) * elem_, bf16_, n, buffer);
    if (!flip) return t;
    if (t != buffer) std::copy(t, t + n, buffer);
    std::reverse(buffer, buffer + n);  // (i, j) -> (KH − 1 − i, KW − 1 − j): the row-major order reversed
    return buffer;
  }
  const void* plane_at(const void* t, int64_t index, int64_t size) const {
    return static_cast<const char*>(t) + size_t(index * size) * elem_;
  }
  int64_t direct_work() const { return g_.B * g_.O * g_.channels_per_group() * g_.OH * g_.OW * g_.KH * g_.KW; }

  // y[b, o] = bias[o] + Σ_{c in o's group} filter (o, c) over x[b, c], one output plane per (b, o) and thread.
  void direct_forward(const KernelArgs& args, float* y, bool accumulate, int threads) const {
    const int64_t in_plane = g_.H * g_.W, out_plane = g_.OH * g_.OW, cg = g_.channels_per_group(),
                  og = g_.outputs_per_group();
    const float* bias = has_bias_ ? static_cast<const float*>(args.inputs[2].data()) : nullptr;
    const Correlation corr = forward_correlation();
    parallel_for(g_.B * g_.O, threads_for(direct_work(), threads), [&](int64_t begin, int64_t end, int thread) {
      const Buffers buf = buffers(args.scratch, thread);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = p / g_.O, o = p % g_.O;
        float* yp = y + p * out_plane;
        if (accumulate && bias)
          for (int64_t k = 0; k < out_plane; ++k) yp[k] += bias[o];
        for (int64_t c = 0; c < cg; ++c) {  // the first channel writes y (with the bias) unless it accumulates
          corr.pad(plane_at(args.inputs[0].data(), b * g_.C + (o / og) * cg + c, in_plane), bf16_, buf.plane);
          correlate_(corr, buf.plane, taps(args.inputs[1].data(), o, c, buf.taps), yp, c == 0 && !accumulate,
                     bias ? bias[o] : 0.0f);
        }
      }
    });
  }

  // dx[b, c] = Σ_{o of c's group} filter (o, c) transposed over dy[b, o], one input plane per (b, c) and thread.
  void direct_data(const KernelArgs& args, float* dx, bool accumulate, int threads) const {
    const int64_t in_plane = g_.H * g_.W, out_plane = g_.OH * g_.OW, cg = g_.channels_per_group(),
                  og = g_.outputs_per_group();
    const bool transposed = transposable();
    const Correlation corr = transposed_correlation();
    parallel_for(g_.B * g_.C, threads_for(direct_work(), threads), [&](int64_t begin, int64_t end, int thread) {
      const Buffers buf = buffers(args.scratch, thread);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = p / g_.C, c = p % g_.C, gi = c / cg;
        float* xp = dx + p * in_plane;
        if (!accumulate && !transposed) std::fill(xp, xp + in_plane, 0.0f);
        for (int64_t o = gi * og; o < (gi + 1) * og; ++o) {
          const void* dy = plane_at(args.inputs[0].data(), b * g_.O + o, out_plane);
          if (transposed) {  // the first filter writes dx unless it accumulates
            corr.pad(dy, bf16_, buf.plane);
            correlate_(corr, buf.plane, taps(args.inputs[1].data(), o, c - gi * cg, buf.taps, true), xp,
                       o == gi * og && !accumulate, 0.0f);
          } else {
            scatter_plane(g_, as_f32(dy, bf16_, out_plane, buf.plane),
                          taps(args.inputs[1].data(), o, c - gi * cg, buf.taps), xp);
          }
        }
      }
    });
  }

  // dw[o, c] = Σ_b dy[b, o] correlated with x[b, c] at each tap, one output channel per thread at a time.
  void direct_weight(const KernelArgs& args, float* dw, bool accumulate, int threads) const {
    const int64_t in_plane = g_.H * g_.W, out_plane = g_.OH * g_.OW, taps_n = g_.KH * g_.KW,
                  cg = g_.channels_per_group(), og = g_.outputs_per_group(), row = round_up(g_.OW, kLanes);
    const Correlation corr = forward_correlation();
    parallel_for(g_.O, threads_for(direct_work(), threads), [&](int64_t begin, int64_t end, int thread) {
      const Buffers buf = buffers(args.scratch, thread);
      for (int64_t o = begin; o < end; ++o)
        for (int64_t c = 0; c < cg; ++c) {
          std::fill(buf.sums, buf.sums + taps_n, 0.0);
          for (int64_t b = 0; b < g_.B; ++b) {
            // dy[b, o] in rows of whole vectors, zeros past OW (their products with x's padding then add nothing)
            const void* dy = plane_at(args.inputs[0].data(), b * g_.O + o, out_plane);
            for (int64_t oh = 0; oh < g_.OH; ++oh) {
              float* dst = buf.dy + oh * row;
              if (bf16_)
                bf16_to_float(dst, static_cast<const uint16_t*>(dy) + oh * g_.OW, size_t(g_.OW));
              else
                std::memcpy(dst, static_cast<const float*>(dy) + oh * g_.OW, sizeof(float) * size_t(g_.OW));
              std::fill(dst + g_.OW, dst + row, 0.0f);
            }
            corr.pad(plane_at(args.inputs[1].data(), b * g_.C + (o / og) * cg + c, in_plane), bf16_, buf.plane);
            weight_plane_(corr, buf.dy, buf.plane, buf.sums);
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
  CorrelatePlane correlate_ = nullptr;
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
