// A typed front end for building graphs: one method per op.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fusetrain/ir/graph.h"

namespace fusetrain::ir {

/// Builds forward graphs op by op. Shape comments use B batch, T sequence,
/// C channels, H heads, D head size, V vocabulary.
class GraphBuilder {
 public:
  /// Builds into `graph`; `seed` seeds every dropout stream created here.
  explicit GraphBuilder(Graph& graph, uint64_t seed = 0) : g_(graph), seed_(seed) {}

  Graph& graph() { return g_; }
  ValueId input(const std::string& name, Shape shape, DType dtype = DType::f32) {
    return g_.add_input(name, std::move(shape), dtype);
  }
  ValueId param(const std::string& name, Shape shape) { return g_.add_param(name, std::move(shape)); }

  /// A constant tensor filled with `value`.
  ValueId fill(Shape shape, double value, DType dtype = DType::f32);
  /// a (..., M, K) x b (..., K, N) -> (..., M, N); trans_a/trans_b read a as (..., K, M), b as (..., N, K).
  /// Batch dims must match, or one side is 2-D and is broadcast.
  ValueId matmul(ValueId a, ValueId b, bool trans_a = false, bool trans_b = false);
  /// x (..., K), w (N, K), optional bias (N) -> x wᵀ + bias (..., N). Pass kNone for no bias.
  ValueId linear(ValueId x, ValueId w, ValueId bias = kNone);
  /// Elementwise with numpy broadcasting.
  ValueId add(ValueId a, ValueId b);
  ValueId sub(ValueId a, ValueId b);
  ValueId mul(ValueId a, ValueId b);
  ValueId div(ValueId a, ValueId b);
  /// alpha * x.
  ValueId scale(ValueId x, double alpha);
  /// GELU; approximate "none" (erf) or "tanh".
  ValueId gelu(ValueId x, const std::string& approximate = "none");
  ValueId tanh(ValueId x);
  ValueId relu(ValueId x);
  /// Softmax over the last axis.
  ValueId softmax(ValueId x);
  /// LayerNorm over the last axis: x (..., C), gamma (C), beta (C).
  ValueId layer_norm(ValueId x, ValueId gamma, ValueId beta, double eps = 1e-5);
  /// RMSNorm over the last axis (Llama's): x (..., C) · 1/√(mean(x²) + eps) · weight (C).
  ValueId rms_norm(ValueId x, ValueId weight, double eps = 1e-6);
  /// Rotary position embedding (Llama's): x (B, T, H, D) with halves x1, x2 becomes (x1·cos − x2·sin, x2·cos + x1·sin)
  /// per half of cos and sin (B, T, D); inverse rotates the other way.
  ValueId rope(ValueId x, ValueId cos, ValueId sin, bool inverse = false);
  /// 1-D or 2-D convolution as ONNX's Conv (cross-correlation): x (B, C, [H,] W), w (O, C/group, [KH,] KW), optional
  /// bias (O) f32 -> (B, O, [OH,] OW) f32. x and w f32 or both bf16. Empty `strides`, `pads` (leading per axis, then
  /// trailing) and `dilations` take their defaults (1, 0, 1).
  ValueId conv(ValueId x, ValueId w, ValueId bias = kNone, std::vector<int64_t> strides = {},
               std::vector<int64_t> pads = {}, std::vector<int64_t> dilations = {}, int64_t group = 1);
  /// Max (`max`) or average pooling of x (B, C, [H,] W) f32 over windows of `kernel` (one size per spatial axis);
  /// strides, pads (leading then trailing) and dilations as Conv's (empty: 1, 0, 1). See ops::PoolParams.
  ValueId pool(ValueId x, bool max, std::vector<int64_t> kernel, std::vector<int64_t> strides = {},
               std::vector<int64_t> pads = {}, std::vector<int64_t> dilations = {}, bool ceil_mode = false,
               bool count_include_pad = false);
  /// SwiGLU's gating product silu(gate)·up, silu(g) = g·σ(g): gate and up of one shape and dtype (f32 or bf16),
  /// the result in that dtype.
  ValueId swiglu(ValueId gate, ValueId up);
  /// weight (V, C), ids (...) of i64 or i32 -> (..., C). Row `padding_idx` (if >= 0)
  /// receives no gradient, as torch.nn.Embedding(padding_idx=...).
  ValueId embedding(ValueId weight, ValueId ids, int64_t padding_idx = -1);
  /// Inverted dropout with probability p; each call gets its own counter-based stream.
  ValueId dropout(ValueId x, double p);
  /// Same elements, new shape; one extent may be -1.
  ValueId reshape(ValueId x, std::vector<int64_t> shape);
  /// Permutes axes: output axis i is input axis perm[i].
  ValueId transpose(ValueId x, std::vector<int64_t> perm);
  /// Splits along `axis` into pieces of the given sizes.
  std::vector<ValueId> split(ValueId x, int64_t axis, std::vector<int64_t> sizes);
  ValueId concat(std::vector<ValueId> xs, int64_t axis);
  /// Elements [start, end) along axis.
  ValueId slice(ValueId x, int64_t axis, int64_t start, int64_t end);
  ValueId reduce_sum(ValueId x, std::vector<int64_t> axes, bool keepdims = false);
  ValueId reduce_mean(ValueId x, std::vector<int64_t> axes, bool keepdims = false);
  ValueId cast(ValueId x, DType dtype);
  /// logits (..., V), targets (...) i64 -> mean loss over targets != ignore_index (scalar f32).
  ValueId softmax_cross_entropy(ValueId logits, ValueId targets, int64_t ignore_index = -100);
  /// logits (..., V), targets (...) i64 -> (3) f32 over the rows whose target is not ignore_index: the summed
  /// entropy of their softmax, how many have the target as their first largest logit, and how many there are
  /// (TRL's entropy and mean_token_accuracy). Not differentiated.
  ValueId token_stats(ValueId logits, ValueId targets, int64_t ignore_index = -100);
  /// logits (..., V), targets (...) i64 -> log softmax(logits)[target] per row (...) f32, 0 where the target is
  /// ignore_index. With `row_stats`, also (..., 3): each row's entropy, whether its target is the first largest
  /// logit, and its mean logit (0 on ignored rows; not differentiated). Returns {log-probs[, stats]}.
  std::vector<ValueId> token_log_probs(ValueId logits, ValueId targets, bool row_stats = false,
                                       int64_t ignore_index = -100);
  /// The DPO loss (TRL's loss_type sigmoid, hinge or ipo) of 2P sequences, P chosen then P rejected: their summed
  /// log-probabilities `logps`, the reference model's `ref_logps`, and their completion `lengths` (ipo), all (2P)
  /// f32 -> the mean over pairs (scalar f32). Differentiated in `logps` only.
  ValueId preference_loss(ValueId logps, ValueId ref_logps, ValueId lengths, const std::string& loss_type,
                          double beta);
  /// The CTC loss of each example (B) f32: logits (B, T, V), labels (B, L) i64 whose entries >= 0 are the target in
  /// order, optional `input_lengths` (B) i64 (kNone: every example has all T frames). See ops::CtcParams.
  ValueId ctc_loss(ValueId logits, ValueId labels, ValueId input_lengths, int64_t blank, bool zero_infinity,
                   bool per_target);
  /// logits and targets in [0, 1], same shape -> mean binary cross-entropy with logits (scalar f32).
  ValueId sigmoid_cross_entropy(ValueId logits, ValueId targets);
  /// Scaled dot-product attention. q (B, H, T, D), k/v (B, H, S, D), all f32 or all bf16, optional
  /// additive key mask (B, S) (pass kNone); returns (B, H, T, D) in `out_dtype` (f32 or bf16).
  /// `window` > 0 (causal only): each query sees just the `window` newest keys, its own included.
  /// `softcap` > 0: the scores become softcap·tanh(scores / softcap) before the mask (Gemma 2).
  /// `key_begin` (B, T) i64 (causal only, or kNone): query t sees no key before key_begin[b, t], so packed
  /// examples attend only within themselves (non-decreasing along t; see ops::AttentionExtras).
  /// `bias` (B|1, H|1, T, S) f32 (or kNone) is added to the scaled scores before the mask and is differentiated
  /// (a learned position bias: T5's relative buckets); not with `softcap`.
  ValueId attention(ValueId q, ValueId k, ValueId v, ValueId mask, double scale, bool causal = false,
                    double dropout_p = 0.0, DType out_dtype = DType::f32, int64_t window = 0, double softcap = 0.0,
                    ValueId key_begin = kNone, ValueId bias = kNone);

 private:
  int64_t next_stream() { return static_cast<int64_t>(seed_ * 1000003ull + stream_++); }
  Graph& g_;
  uint64_t seed_;
  uint64_t stream_ = 0;
};

}  // namespace fusetrain::ir
