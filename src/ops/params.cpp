#include "fusetrain/ops/params.h"

#include <array>

#include "fusetrain/core/error.h"

namespace fusetrain::ops {
namespace {

// In OpParams order.
constexpr std::array<const char*, std::variant_size_v<OpParams>> kParamsNames = {
    "NoParams",           "FillParams",        "MatMulParams",          "GeluParams",
    "GeluBackwardParams", "LinearGeluParams",  "ScaleParams",           "PowParams",
    "LayerNormParams",    "DropoutParams",     "AddLayerNormParams",    "EmbeddingParams",
    "EmbeddingBackwardParams", "ShapeParams",  "TransposeParams",       "SplitParams",
    "ConcatParams",       "SliceParams",       "SliceBackwardParams",   "ReduceParams",
    "CastParams",         "CrossEntropyParams", "LinearCrossEntropyParams", "LogProbsParams",
    "PreferenceParams",   "QuantizedParams",   "AttentionParams",       "RoPEParams",
    "LinearParams",       "ConvParams",        "CtcParams",             "PoolParams",
    "MatMulGeluBackwardParams"};

static_assert(params_index_of<MatMulGeluBackwardParams>() == kParamsNames.size() - 1);
static_assert(params_index_of<LogProbsParams>() == 23 && params_index_of<AttentionParams>() == 26);
static_assert(params_index_of<MatMulParams>() == 2 && params_index_of<ShapeParams>() == 13);

}  // namespace

const char* params_name(size_t index) { return index < kParamsNames.size() ? kParamsNames[index] : "?"; }

}  // namespace fusetrain::ops

namespace fusetrain::ops {

std::vector<int64_t> WindowGeometry::axis_values(const char* op, const std::vector<int64_t>& v, size_t want,
                                                 int64_t fallback, const char* name) {
  FT_CHECK(v.empty() || v.size() == want, op, ": \"", name, "\" has ", v.size(), " values; expected ", want);
  std::vector<int64_t> out = v.empty() ? std::vector<int64_t>(want, fallback) : v;
  for (int64_t e : out) FT_CHECK(fallback == 0 ? e >= 0 : e >= 1, op, ": \"", name, "\" holds ", e);
  return out;
}

void WindowGeometry::set_windows(const char* op, const std::vector<int64_t>& x, const std::vector<int64_t>& kernel,
                                 const std::vector<int64_t>& strides, const std::vector<int64_t>& pads,
                                 const std::vector<int64_t>& dilations) {
  const size_t rank = x.size(), n = rank - 2;
  const std::vector<int64_t> s = axis_values(op, strides, n, 1, "strides"),
                             d = axis_values(op, dilations, n, 1, "dilations"),
                             pad = axis_values(op, pads, 2 * n, 0, "pads");
  spatial = int64_t(n);
  B = x[0];
  C = x[1];
  if (n == 2) {
    H = x[2];
    KH = kernel[0];
    stride_h = s[0];
    dil_h = d[0];
    pad_top = pad[0];
    pad_bottom = pad[2];
  }
  W = x[rank - 1];
  KW = kernel[n - 1];
  stride_w = s[n - 1];
  dil_w = d[n - 1];
  pad_left = pad[n - 1];
  pad_right = pad[2 * n - 1];
}

ConvGeometry ConvGeometry::of(const ConvParams& p, const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  ConvGeometry g;
  const size_t rank = x.size();
  FT_CHECK(rank == 3 || rank == 4, "Conv: x should be (B, C, L) or (B, C, H, W), found rank ", rank);
  FT_CHECK(w.size() == rank, "Conv: the weight has rank ", w.size(), "; expected ", rank, " as x");
  g.set_windows("Conv", x, std::vector<int64_t>(w.begin() + 2, w.end()), p.strides, p.pads, p.dilations);
  g.O = w[0];
  g.group = p.group;
  FT_CHECK(g.group >= 1 && g.C % g.group == 0 && g.O % g.group == 0, "Conv: group ", g.group, " does not divide ",
           g.C, " input and ", g.O, " output channels");
  FT_CHECK(w[1] == g.C / g.group, "Conv: the weight has ", w[1], " input channels per group; x's ", g.C,
           " channels in ", g.group, " groups give ", g.C / g.group);
  const int64_t span_h = g.dil_h * (g.KH - 1) + 1, span_w = g.dil_w * (g.KW - 1) + 1;
  FT_CHECK(g.KH >= 1 && g.KW >= 1 && g.H + g.pad_top + g.pad_bottom >= span_h &&
               g.W + g.pad_left + g.pad_right >= span_w,
           "Conv: a kernel spanning (", span_h, ", ", span_w, ") over a padded input of (",
           g.H + g.pad_top + g.pad_bottom, ", ", g.W + g.pad_left + g.pad_right, ")");
  g.OH = (g.H + g.pad_top + g.pad_bottom - span_h) / g.stride_h + 1;
  g.OW = (g.W + g.pad_left + g.pad_right - span_w) / g.stride_w + 1;
  return g;
}

PoolGeometry PoolGeometry::of(const PoolParams& p, const std::vector<int64_t>& x) {
  PoolGeometry g;
  const size_t rank = x.size();
  FT_CHECK(rank == 3 || rank == 4, "Pool: x should be (B, C, L) or (B, C, H, W), found rank ", rank);
  FT_CHECK(p.kernel.size() == rank - 2, "Pool: \"kernel\" has ", p.kernel.size(), " sizes; expected ", rank - 2);
  g.set_windows("Pool", x, axis_values("Pool", p.kernel, rank - 2, 1, "kernel"), p.strides, p.pads, p.dilations);
  FT_CHECK(p.max || (g.dil_h == 1 && g.dil_w == 1), "Pool: average pooling with dilations (torch's avg_pool has none)");
  const int64_t span_h = g.dil_h * (g.KH - 1) + 1, span_w = g.dil_w * (g.KW - 1) + 1;
  // Padding of a whole window or more would make windows of padding alone.
  FT_CHECK(g.pad_top < span_h && g.pad_bottom < span_h && g.pad_left < span_w && g.pad_right < span_w,
           "Pool: padding (", g.pad_top, ", ", g.pad_left, ", ", g.pad_bottom, ", ", g.pad_right,
           ") as large as a window spanning (", span_h, ", ", span_w, ")");
  FT_CHECK(g.H + g.pad_top + g.pad_bottom >= span_h && g.W + g.pad_left + g.pad_right >= span_w,
           "Pool: a window spanning (", span_h, ", ", span_w, ") over a padded input of (",
           g.H + g.pad_top + g.pad_bottom, ", ", g.W + g.pad_left + g.pad_right, ")");
  auto out = [&](int64_t in, int64_t lead, int64_t trail, int64_t span, int64_t stride) {
    const int64_t room = in + lead + trail - span;
    int64_t o = (p.ceil_mode ? (room + stride - 1) / stride : room / stride) + 1;
    if (p.ceil_mode && (o - 1) * stride >= in + lead) --o;  // the last window starts inside the input (torch's rule)
    return o;
  };
  g.OH = out(g.H, g.pad_top, g.pad_bottom, span_h, g.stride_h);
  g.OW = out(g.W, g.pad_left, g.pad_right, span_w, g.stride_w);
  return g;
}

}  // namespace fusetrain::ops
