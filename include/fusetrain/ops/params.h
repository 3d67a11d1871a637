// Typed op parameters: one plain struct per op that has attributes, named by the Params
// column of ops.def. ir::decode_params fills them from a node's attributes once, at graph
// build or lowering time; shape inference, the reference kernels and the CPU kernels all
// read these structs and never an attribute string. Defaults are written here, once.
//
// Attribute names and meanings: docs/ops.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <variant>
#include <vector>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/quant.h"
#include "fusetrain/ops/op.h"

namespace fusetrain::ops {

/// Parameters of an op without attributes.
struct NoParams {};

/// Fill: a constant tensor.
struct FillParams {
  std::vector<int64_t> shape;  ///< "shape" (required)
  double value = 0.0;          ///< "value" (required)
  DType dtype = DType::f32;    ///< "dtype"
};

/// MatMul of a (…, M, K) and b (…, K, N).
struct MatMulParams {
  bool trans_a = false;          ///< "trans_a": a is stored (…, K, M)
  bool trans_b = false;          ///< "trans_b": b is stored (…, N, K)
  DType out_dtype = DType::f32;  ///< "out_dtype"
};

/// The GELU formula: erf form ("none") or tanh approximation ("tanh").
enum class GeluApproximation : uint8_t { None, Tanh };

/// Gelu.
struct GeluParams {
  GeluApproximation approximate = GeluApproximation::None;  ///< "approximate"
  DType out_dtype = DType::f32;                              ///< "out_dtype": f32 or bf16
};

/// GeluBackward.
struct GeluBackwardParams {
  GeluApproximation approximate = GeluApproximation::None;  ///< "approximate"
};

/// MatMulGeluBackward: GELU's input gradient dx = (a·b)·gelu′(x), its column sums and gelu(x), from one GEMM.
struct MatMulGeluBackwardParams {
  bool trans_a = false;                                      ///< "trans_a": a is stored (K, M)
  bool trans_b = false;                                      ///< "trans_b": b is stored (N, K)
  GeluApproximation approximate = GeluApproximation::None;  ///< "approximate"
  DType out_dtype = DType::f32;                              ///< "out_dtype" of dx: f32, or bf16 (rounded)
  bool column_sum = false;   ///< "column_sum": output 1 is dx's f32 sums over every axis but the last (a bias gradient)
  bool gelu_out = false;     ///< "gelu_out": the last output is gelu(x), in gelu_dtype
  DType gelu_dtype = DType::f32;  ///< "gelu_dtype": f32 or bf16
};

/// Linear: y = x·wᵀ + bias.
struct LinearParams {
  DType out_dtype = DType::f32;  ///< "out_dtype" of y: f32, or bf16 (the f32 result rounded to nearest even)
};

/// LinearGelu: y = gelu(z), z = x·wᵀ + bias.
struct LinearGeluParams {
  GeluApproximation approximate = GeluApproximation::None;  ///< "approximate"
  DType z_dtype = DType::f32;                                ///< "z_dtype": f32 or bf16
  DType out_dtype = DType::f32;                              ///< "out_dtype" of y: f32 or bf16
};

/// Scale: alpha·x.
struct ScaleParams {
  double alpha = 1.0;  ///< "alpha" (required)
};

/// Pow: x^exponent.
struct PowParams {
  double exponent = 1.0;  ///< "exponent" (required)
};

/// LayerNorm.
struct LayerNormParams {
  double eps = 0.0;  ///< "eps" (required, positive)
};

/// Dropout and DropoutAdd (and the dropout half of AddLayerNorm): keep(e) = uniform(seed,
/// step, index(e)) >= p. Element e draws stream index e, or, when index_block is not 0,
/// (e / index_block)·index_stride + index_start + e % index_block (kernels/rng.h).
struct DropoutParams {
  double p = 0.0;            ///< "p" (required for Dropout and DropoutAdd)
  uint64_t seed = 0;         ///< "seed": the stream id (required for Dropout and DropoutAdd)
  int64_t index_block = 0;   ///< "index_block"
  int64_t index_stride = 0;  ///< "index_stride"
  int64_t index_start = 0;   ///< "index_start"
};

/// AddLayerNorm: LayerNorm(dropout(x) + residual).
struct AddLayerNormParams {
  double eps = 0.0;       ///< "eps" (required, positive)
  DropoutParams dropout;  ///< "p", "seed" and the stream index map, all optional (p 0: no dropout)
};

/// Embedding.
struct EmbeddingParams {
  int64_t padding_idx = -1;  ///< "padding_idx": this row gets no gradient (-1: none)
};

/// EmbeddingBackward.
struct EmbeddingBackwardParams {
  int64_t num_embeddings = 0;  ///< "num_embeddings" V (required)
  int64_t padding_idx = -1;    ///< "padding_idx": skipped (-1: none)
};

/// Reshape (one extent may be -1), ExpandTo and ReduceSumTo (the target shape).
struct ShapeParams {
  std::vector<int64_t> shape;  ///< "shape" (required)
};

/// Transpose: output axis i is input axis perm[i].
struct TransposeParams {
  std::vector<int64_t> perm;  ///< "perm" (required)
};

/// Split along an axis.
struct SplitParams {
  int64_t axis = 0;            ///< "axis" (required)
  std::vector<int64_t> sizes;  ///< "sizes" (required)
};

/// Concat along an axis.
struct ConcatParams {
  int64_t axis = 0;  ///< "axis" (required)
};

/// Slice: elements [start, end) along axis.
struct SliceParams {
  int64_t axis = 0;   ///< "axis" (required)
  int64_t start = 0;  ///< "start" (required)
  int64_t end = 0;    ///< "end" (required)
};

/// SliceBackward: zeros of `shape` with dy written at [start, end) along axis.
struct SliceBackwardParams {
  std::vector<int64_t> shape;  ///< "shape" (required): the forward input's
  int64_t axis = 0;            ///< "axis" (required)
  int64_t start = 0;           ///< "start" (required)
  int64_t end = 0;             ///< "end" (required)
};

/// ReduceSum and ReduceMean.
struct ReduceParams {
  std::vector<int64_t> axes;  ///< "axes" (required)
  bool keepdims = false;      ///< "keepdims"
};

/// Cast.
struct CastParams {
  DType dtype = DType::f32;  ///< "dtype" (required)
};

/// SoftmaxCrossEntropy and its backward.
struct CrossEntropyParams {
  int64_t ignore_index = -100;  ///< "ignore_index": rows with this target do not count
};

/// LinearCrossEntropy.
struct LinearCrossEntropyParams {
  int64_t ignore_index = -100;  ///< "ignore_index": rows with this target do not count
  int64_t chunk_rows = 0;       ///< "chunk_rows": 0 chooses (about 32 MiB of f32 logits per chunk)
  bool weight_grad = true;      ///< "weight_grad": also form dw and dbias (outputs 2, 3); 0 for a frozen head
  bool token_stats = false;     ///< "token_stats": a last output (3) as TokenStats computes it (fused from one)
};

/// TokenLogProbs, LinearLogProbs and their gradients: per-row log-probabilities of the targets.
struct LogProbsParams {
  int64_t ignore_index = -100;  ///< "ignore_index": rows with this target get log-probability 0 and no gradient
  int64_t chunk_rows = 0;       ///< "chunk_rows" (LinearLogProbs): 0 chooses, as LinearCrossEntropy
  bool input_grad = false;      ///< "input_grad" (LinearLogProbs): also form d(log p)/dx per row (unit gradients)
  bool row_stats = false;       ///< "row_stats": a last output (rows..., 3): entropy, top-1 hit, mean logit
};

/// PreferenceLoss (DPO) and its backward. Sequences arrive as 2P: P chosen, then the P rejected of the same pairs.
struct PreferenceParams {
  std::string loss_type = "sigmoid";  ///< "loss_type": sigmoid, hinge or ipo, as TRL names them
  double beta = 0.1;                  ///< "beta"
};

/// CtcLoss and its backward: connectionist temporal classification (Graves et al. 2006) over log_softmax(logits),
/// as torch.nn.functional.ctc_loss computes it. An example's target is its labels >= 0 in order (padding -100 is
/// skipped, as transformers' masked_select does); its frames are the first `input lengths` (all T without them).
struct CtcParams {
  int64_t blank = 0;           ///< "blank": the blank class (transformers: config.pad_token_id)
  bool zero_infinity = false;  ///< "zero_infinity": an impossible alignment's loss and gradient are 0, not inf
  bool per_target = false;     ///< "per_target": each loss divided by its target length (at least 1), "mean"'s step
};

/// QuantizedLinear and its backward: a frozen (rows, cols) weight in a quantised layout (quant::QuantMatrix).
struct QuantizedParams {
  int64_t rows = 0;        ///< "rows": output features N (required)
  int64_t cols = 0;        ///< "cols": input features K (required)
  int64_t bits = 4;        ///< "bits": 4 (NF4/FP4 blocks: inputs weight, absmax, code) or 8 (LLM.int8 rows:
                           ///< inputs weight, absmax; one absmax a row, no code)
  int64_t blocksize = 64;  ///< "blocksize": elements per absmax (4-bit), a power of two from 32 to 4096
  bool bf16 = true;        ///< "bf16": the dequantised weight is rounded to bf16 (the compute dtype)
  bool round_output = false;  ///< "round_output": the f32 result is rounded to bf16 (a bf16 product's own dtype)

  /// Inputs before the optional bias: x and the weight's tensors.
  size_t bias_input() const { return bits == 4 ? 4 : 3; }
  /// The weight held by the op's inputs 1.. (packed codes, absmax, code).
  quant::QuantMatrix matrix(const void* data, const float* absmax, const float* code) const {
    int shift = 0;
    while ((int64_t{1} << shift) < blocksize) ++shift;
    return {static_cast<const uint8_t*>(data), absmax, bits == 4 ? code : nullptr, rows, cols, shift, bf16, bits == 8};
  }
};

/// Attention and AttentionBackward.
struct AttentionParams {
  double scale = 1.0;                   ///< "scale" (required)
  bool causal = false;                  ///< "causal": query t sees keys s <= t + S - T
  int64_t window = 0;                   ///< "window": with causal, only keys s > t + S - T - window (0: all)
  double softcap = 0.0;                 ///< "softcap": scores become softcap·tanh(scores / softcap) before the mask
                                        ///< is added (Gemma 2's attention logit soft-capping); 0: none
  bool seq_major = false;               ///< "seq_major": (B, T, H, D) tensors instead of (B, H, T, D)
  double dropout_p = 0.0;               ///< "dropout_p"
  uint64_t seed = 0;                    ///< "seed": the dropout stream id
  std::optional<int64_t> rng_rows;      ///< "rng_rows": query rows of the dropout stream (absent: T)
  int64_t rng_row_start = 0;            ///< "rng_row_start": the first of those rows these T rows are
  DType out_dtype = DType::f32;         ///< "out_dtype" of out: f32 or bf16
  bool score_bias = false;              ///< "score_bias": an f32 bias (B|1, H|1, T, S) added to the scaled scores
                                        ///< follows q, k, v (Attention) or dout, q, k, v, out, lse (backward), which
                                        ///< then also returns its gradient (B, H, T, S): T5's relative positions,
                                        ///< Swin's window bias. Not with softcap.

  /// Query rows of the dropout stream for a query length T.
  int64_t stream_rows(int64_t T) const { return rng_rows.value_or(T); }
  /// The input index of the score bias (when score_bias) in Attention (false) or AttentionBackward (true).
  size_t bias_input(bool backward) const { return backward ? 6 : 3; }
  /// The input index of the first optional extra (mask, key_begin: AttentionExtras), after the score bias.
  size_t first_extra(bool backward) const { return bias_input(backward) + (score_bias ? 1 : 0); }
};

/// Where Attention's optional inputs are. They follow q, k, v (Attention) or dout, q, k, v, out, lse
/// (AttentionBackward) and the score bias when there is one, at index `first` (AttentionParams::first_extra): the
/// f32 additive key mask, then the i64 key_begin (B, T), each optional and told apart by dtype. key_begin[b, t] is
/// the first key query t of batch element b may see (causal only; non-decreasing along t): packed sequences, each
/// query seeing only its own example's keys. -1: absent.
struct AttentionExtras {
  int mask = -1;
  int key_begin = -1;
  /// From the number of inputs and whether input `first` is integer.
  static AttentionExtras locate(size_t num_inputs, size_t first, bool first_is_integer) {
    AttentionExtras e;
    if (num_inputs >= first + 2) {
      e.mask = static_cast<int>(first);
      e.key_begin = static_cast<int>(first + 1);
    } else if (num_inputs == first + 1) {
      (first_is_integer ? e.key_begin : e.mask) = static_cast<int>(first);
    }
    return e;
  }
};

/// Checks a key_begin input (B, T) over S keys: each value in [0, t + S − T] (a query sees at least its own key)
/// and non-decreasing along t. Throws Error naming the first value that is not.
inline void check_key_begin(const int64_t* key_begin, int64_t B, int64_t T, int64_t S) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v = key_begin[b * T + t];
      FT_CHECK(v >= 0 && v <= t + S - T, "Attention: key_begin[", b, ", ", t, "] is ", v, "; expected a key in [0, ",
               t + S - T, "]");
      FT_CHECK(t == 0 || v >= key_begin[b * T + t - 1], "Attention: key_begin[", b, ", ", t, "] is ", v,
               ", before key_begin[", b, ", ", t - 1, "] = ", key_begin[b * T + t - 1],
               " (it must not decrease along a row)");
    }
}

/// RoPE: rotary position embedding of the last axis's two halves.
struct RoPEParams {
  bool inverse = false;  ///< "inverse": rotate by −θ (the transpose: RoPE's backward)
};

/// Conv, ConvBackwardData and ConvBackwardWeight: a 1-D or 2-D convolution as ONNX's Conv (cross-correlation, NCHW).
/// Absent lists take their defaults for the input's spatial rank.
struct ConvParams {
  std::vector<int64_t> strides;    ///< "strides": one per spatial axis (absent: 1)
  std::vector<int64_t> pads;       ///< "pads": each spatial axis's leading padding, then each one's trailing (absent: 0)
  std::vector<int64_t> dilations;  ///< "dilations": one per spatial axis (absent: 1)
  int64_t group = 1;               ///< "group": channels split into this many independent convolutions
  std::vector<int64_t> shape;      ///< "shape" (backward ops, required): the gradient's shape, x's (data) or w's
                                   ///< (weight)
};

/// The sizes every windowed op shares (Conv, Pool), a 1-D one as 2-D with height 1: x (B, C, H, W), windows KH x KW
/// with their strides, padding and dilations, the output's OH x OW.
struct WindowGeometry {
  int64_t B = 0, C = 0, H = 1, W = 0, KH = 1, KW = 0, OH = 1, OW = 0;
  int64_t stride_h = 1, stride_w = 1, pad_top = 0, pad_left = 0, pad_bottom = 0, pad_right = 0, dil_h = 1, dil_w = 1;
  int64_t spatial = 2;  ///< the spatial rank, 1 or 2

  /// An attribute's `want` values (`fallback` each when `v` is empty): Error "<op>: "<name>" has ..." for another
  /// count, "... holds e" for a value below 1 (below 0 for a fallback of 0).
  static std::vector<int64_t> axis_values(const char* op, const std::vector<int64_t>& v, size_t want,
                                          int64_t fallback, const char* name);
  /// Every size but OH and OW from x's dims (rank 3 or 4, the caller's check), the window sizes (one per spatial
  /// axis) and the attributes (empty: strides and dilations 1, pads 0), which are checked as axis_values does.
  void set_windows(const char* op, const std::vector<int64_t>& x, const std::vector<int64_t>& kernel,
                   const std::vector<int64_t>& strides, const std::vector<int64_t>& pads,
                   const std::vector<int64_t>& dilations);
};

/// One convolution's sizes: x (B, C, H, W), w (O, C / group, KH, KW), y (B, O, OH, OW),
/// OH = (H + pad_top + pad_bottom − dil_h·(KH − 1) − 1) / stride_h + 1 (and so for the width).
struct ConvGeometry : WindowGeometry {
  int64_t O = 0;
  int64_t group = 1;

  int64_t channels_per_group() const { return C / group; }
  int64_t outputs_per_group() const { return O / group; }
  /// Rows of one group's im2col matrix: C/group · KH · KW.
  int64_t patch() const { return channels_per_group() * KH * KW; }
  /// One output channel per input channel, each with its own filter (ConvNeXt's 7×7).
  bool depthwise() const { return group == C && O == C; }
  /// A 1×1 kernel, stride 1, no padding: y = W·x per image, no im2col.
  bool pointwise() const {
    return KH == 1 && KW == 1 && stride_h == 1 && stride_w == 1 && pad_top == 0 && pad_left == 0 &&
           pad_bottom == 0 && pad_right == 0;
  }
  /// y's dims (B, O, OW) or (B, O, OH, OW).
  std::vector<int64_t> output_dims() const {
    return spatial == 1 ? std::vector<int64_t>{B, O, OW} : std::vector<int64_t>{B, O, OH, OW};
  }

  /// From x's and w's dims; throws Error naming what does not fit (rank, channels, group, attribute lengths, a
  /// kernel larger than the padded input).
  static ConvGeometry of(const ConvParams& p, const std::vector<int64_t>& x, const std::vector<int64_t>& w);
};

/// Pool and PoolBackward: max or average pooling over windows of each channel of x (B, C, [H,] W), as ONNX's MaxPool
/// and AveragePool and torch's max_pool / avg_pool define them. A window's out-of-range positions are padding: max
/// ignores them; average divides by the window's size with them (count_include_pad, clipped at the padded edge) or
/// by its in-range positions alone. Max's gradient goes to the first maximum of each window (torch's indices).
struct PoolParams {
  bool max = true;                 ///< "max": max pooling; false: average pooling
  std::vector<int64_t> kernel;     ///< "kernel": one size per spatial axis (required)
  std::vector<int64_t> strides;    ///< "strides": one per spatial axis (absent: 1)
  std::vector<int64_t> pads;       ///< "pads": each spatial axis's leading, then each trailing padding (absent: 0)
  std::vector<int64_t> dilations;  ///< "dilations": one per spatial axis (absent: 1)
  bool ceil_mode = false;          ///< "ceil_mode": output sizes rounded up (a last window starting inside the input)
  bool count_include_pad = false;  ///< "count_include_pad": average pooling divides by padded windows' full size
};

/// One pooling's sizes: x (B, C, H, W), windows KH x KW, y (B, C, OH, OW).
struct PoolGeometry : WindowGeometry {
  std::vector<int64_t> output_dims() const {
    return spatial == 1 ? std::vector<int64_t>{B, C, OW} : std::vector<int64_t>{B, C, OH, OW};
  }
  /// From x's dims; throws Error naming what does not fit (rank, attribute lengths, padding of a whole window or
  /// more, a window larger than the padded input).
  static PoolGeometry of(const PoolParams& p, const std::vector<int64_t>& x);
};

/// The parameters of any op: one alternative per struct above.
using OpParams =
    std::variant<NoParams, FillParams, MatMulParams, GeluParams, GeluBackwardParams, LinearGeluParams, ScaleParams,
                 PowParams, LayerNormParams, DropoutParams, AddLayerNormParams, EmbeddingParams,
                 EmbeddingBackwardParams, ShapeParams, TransposeParams, SplitParams, ConcatParams, SliceParams,
                 SliceBackwardParams, ReduceParams, CastParams, CrossEntropyParams, LinearCrossEntropyParams,
                 LogProbsParams, PreferenceParams, QuantizedParams, AttentionParams, RoPEParams, LinearParams,
                 ConvParams, CtcParams, PoolParams, MatMulGeluBackwardParams>;

namespace detail {
template <OpKind K>
struct ParamsOfOp;
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) \
  template <>                                               \
  struct ParamsOfOp<OpKind::Name> {                         \
    using type = Params;                                    \
  };
#include "fusetrain/ops/ops.def"
#undef FT_OP

template <typename P, size_t I = 0>
constexpr size_t variant_index() {
  static_assert(I < std::variant_size_v<OpParams>, "a Params struct of ops.def is not an alternative of OpParams");
  if constexpr (std::is_same_v<std::variant_alternative_t<I, OpParams>, P>)
    return I;
  else
    return variant_index<P, I + 1>();
}
}  // namespace detail

/// The parameter struct of op K, as the Params column of ops.def names it.
template <OpKind K>
using ParamsOf = typename detail::ParamsOfOp<K>::type;

/// Index in OpParams of the alternative that holds P.
template <typename P>
constexpr size_t params_index_of() {
  return detail::variant_index<P>();
}

/// Index in OpParams of op `kind`'s parameter struct (ParamsOf<kind>).
constexpr size_t params_index(OpKind kind) {
  switch (kind) {
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) \
  case OpKind::Name:                                        \
    return params_index_of<Params>();
#include "fusetrain/ops/ops.def"
#undef FT_OP
  }
  return 0;
}

/// The GELU form held by Gelu, GeluBackward or LinearGelu parameters (None for other ops).
inline GeluApproximation gelu_approximation(const OpParams& params) {
  return std::visit(
      [](const auto& p) {
        if constexpr (requires { p.approximate; })
          return p.approximate;
        else
          return GeluApproximation::None;
      },
      params);
}

/// Name of an OpParams alternative ("AttentionParams"), for messages.
const char* params_name(size_t index);

}  // namespace fusetrain::ops
