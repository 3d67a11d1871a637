#include "fusetrain/ops/params.h"

#include <algorithm>
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
    "LinearParams",       "ConvParams",        "CtcParams",             "PoolParams"};

static_assert(params_index_of<PoolParams>() == kParamsNames.size() - 1);
static_assert(params_index_of<LogProbsParams>() == 23 && params_index_of<AttentionParams>() == 26);
static_assert(params_index_of<MatMulParams>() == 2 && params_index_of<ShapeParams>() == 13);

}  // namespace

const char* params_name(size_t index) { return index < kParamsNames.size() ? kParamsNames[index] : "?"; }

}  // namespace fusetrain::ops

namespace fusetrain::ops {

PoolGeometry PoolGeometry::of(const PoolParams& p, const std::vector<int64_t>& x) {
  PoolGeometry g;
  const size_t rank = x.size();
  FT_CHECK(rank == 3 || rank == 4, "Pool: x should be (B, C, L) or (B, C, H, W), found rank ", rank);
  const size_t n = rank - 2;
  g.spatial = int64_t(n);
  auto list = [&](const std::vector<int64_t>& v, size_t want, int64_t fallback, const char* name) {
    FT_CHECK(v.empty() || v.size() == want, "Pool: \"", name, "\" has ", v.size(), " values; expected ", want);
    std::vector<int64_t> out = v.empty() ? std::vector<int64_t>(want, fallback) : v;
    for (int64_t e : out) FT_CHECK(fallback == 0 ? e >= 0 : e >= 1, "Pool: \"", name, "\" holds ", e);
    return out;
  };
  FT_CHECK(p.kernel.size() == n, "Pool: \"kernel\" has ", p.kernel.size(), " sizes; expected ", n);
  const std::vector<int64_t> k = list(p.kernel, n, 1, "kernel"), s = list(p.strides, n, 1, "strides"),
                             d = list(p.dilations, n, 1, "dilations"), pad = list(p.pads, 2 * n, 0, "pads");
  FT_CHECK(p.max || std::all_of(d.begin(), d.end(), [](int64_t e) { return e == 1; }),
           "Pool: average pooling with dilations (torch's avg_pool has none)");
  g.B = x[0];
  g.C = x[1];
  if (n == 2) {
    g.H = x[2];
    g.KH = k[0];
    g.stride_h = s[0];
    g.dil_h = d[0];
    g.pad_top = pad[0];
    g.pad_bottom = pad[2];
  }
  g.W = x[rank - 1];
  g.KW = k[n - 1];
  g.stride_w = s[n - 1];
  g.dil_w = d[n - 1];
  g.pad_left = pad[n - 1];
  g.pad_right = pad[2 * n - 1];
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
