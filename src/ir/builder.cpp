#include "fusetrain/ir/builder.h"

namespace fusetrain::ir {

ValueId GraphBuilder::fill(Shape shape, double value, DType dtype) {
  return g_.add(OpKind::Fill, {},
                {{"shape", shape.dims()}, {"value", value}, {"dtype", std::string(dtype_name(dtype))}});
}

ValueId GraphBuilder::matmul(ValueId a, ValueId b, bool trans_a, bool trans_b) {
  return g_.add(OpKind::MatMul, {a, b}, {{"trans_a", int64_t{trans_a}}, {"trans_b", int64_t{trans_b}}});
}

ValueId GraphBuilder::linear(ValueId x, ValueId w, ValueId bias) {
  if (bias == kNone) return g_.add(OpKind::Linear, {x, w});
  return g_.add(OpKind::Linear, {x, w, bias});
}

ValueId GraphBuilder::add(ValueId a, ValueId b) { return g_.add(OpKind::Add, {a, b}); }
ValueId GraphBuilder::sub(ValueId a, ValueId b) { return g_.add(OpKind::Sub, {a, b}); }
ValueId GraphBuilder::mul(ValueId a, ValueId b) { return g_.add(OpKind::Mul, {a, b}); }
ValueId GraphBuilder::div(ValueId a, ValueId b) { return g_.add(OpKind::Div, {a, b}); }
ValueId GraphBuilder::scale(ValueId x, double alpha) { return g_.add(OpKind::Scale, {x}, {{"alpha", alpha}}); }

ValueId GraphBuilder::gelu(ValueId x, const std::string& approximate) {
  return g_.add(OpKind::Gelu, {x}, {{"approximate", approximate}});
}
ValueId GraphBuilder::tanh(ValueId x) { return g_.add(OpKind::Tanh, {x}); }
ValueId GraphBuilder::relu(ValueId x) { return g_.add(OpKind::Relu, {x}); }
ValueId GraphBuilder::softmax(ValueId x) { return g_.add(OpKind::Softmax, {x}); }

ValueId GraphBuilder::layer_norm(ValueId x, ValueId gamma, ValueId beta, double eps) {
  return g_.add_node(OpKind::LayerNorm, {x, gamma, beta}, {{"eps", eps}})[0];
}

ValueId GraphBuilder::rms_norm(ValueId x, ValueId weight, double eps) {
  return g_.add_node(OpKind::RMSNorm, {x, weight}, {{"eps", eps}})[0];
}

ValueId GraphBuilder::rope(ValueId x, ValueId cos, ValueId sin, bool inverse) {
  return g_.add(OpKind::RoPE, {x, cos, sin}, {{"inverse", int64_t{inverse ? 1 : 0}}});
}

ValueId GraphBuilder::conv(ValueId x, ValueId w, ValueId bias, std::vector<int64_t> strides,
                           std::vector<int64_t> pads, std::vector<int64_t> dilations, int64_t group) {
  Attrs attrs;
  if (!strides.empty()) attrs.set("strides", std::move(strides));
  if (!pads.empty()) attrs.set("pads", std::move(pads));
  if (!dilations.empty()) attrs.set("dilations", std::move(dilations));
  if (group != 1) attrs.set("group", group);
  std::vector<ValueId> inputs = {x, w};
  if (bias != kNone) inputs.push_back(bias);
  return g_.add(OpKind::Conv, inputs, attrs);
}

ValueId GraphBuilder::pool(ValueId x, bool max, std::vector<int64_t> kernel, std::vector<int64_t> strides,
                           std::vector<int64_t> pads, std::vector<int64_t> dilations, bool ceil_mode,
                           bool count_include_pad) {
  Attrs attrs;
  attrs.set("max", int64_t{max});
  attrs.set("kernel", std::move(kernel));
  if (!strides.empty()) attrs.set("strides", std::move(strides));
  if (!pads.empty()) attrs.set("pads", std::move(pads));
  if (!dilations.empty()) attrs.set("dilations", std::move(dilations));
  if (ceil_mode) attrs.set("ceil_mode", int64_t{1});
  if (count_include_pad) attrs.set("count_include_pad", int64_t{1});
  return g_.add(OpKind::Pool, {x}, attrs);
}

ValueId GraphBuilder::swiglu(ValueId gate, ValueId up) { return g_.add(OpKind::SwiGLU, {gate, up}); }

ValueId GraphBuilder::embedding(ValueId weight, ValueId ids, int64_t padding_idx) {
  if (padding_idx < 0) return g_.add(OpKind::Embedding, {weight, ids});
  return g_.add(OpKind::Embedding, {weight, ids}, {{"padding_idx", padding_idx}});
}

ValueId GraphBuilder::dropout(ValueId x, double p) {
  return g_.add(OpKind::Dropout, {x}, {{"p", p}, {"seed", next_stream()}});
}

ValueId GraphBuilder::reshape(ValueId x, std::vector<int64_t> shape) {
  return g_.add(OpKind::Reshape, {x}, {{"shape", std::move(shape)}});
}

ValueId GraphBuilder::transpose(ValueId x, std::vector<int64_t> perm) {
  return g_.add(OpKind::Transpose, {x}, {{"perm", std::move(perm)}});
}

std::vector<ValueId> GraphBuilder::split(ValueId x, int64_t axis, std::vector<int64_t> sizes) {
  return g_.add_node(OpKind::Split, {x}, {{"axis", axis}, {"sizes", std::move(sizes)}});
}

ValueId GraphBuilder::concat(std::vector<ValueId> xs, int64_t axis) {
  return g_.add(OpKind::Concat, std::move(xs), {{"axis", axis}});
}

ValueId GraphBuilder::slice(ValueId x, int64_t axis, int64_t start, int64_t end) {
  return g_.add(OpKind::Slice, {x}, {{"axis", axis}, {"start", start}, {"end", end}});
}

ValueId GraphBuilder::reduce_sum(ValueId x, std::vector<int64_t> axes, bool keepdims) {
  return g_.add(OpKind::ReduceSum, {x}, {{"axes", std::move(axes)}, {"keepdims", int64_t{keepdims}}});
}

ValueId GraphBuilder::reduce_mean(ValueId x, std::vector<int64_t> axes, bool keepdims) {
  return g_.add(OpKind::ReduceMean, {x}, {{"axes", std::move(axes)}, {"keepdims", int64_t{keepdims}}});
}

ValueId GraphBuilder::cast(ValueId x, DType dtype) {
  return g_.add(OpKind::Cast, {x}, {{"dtype", std::string(dtype_name(dtype))}});
}

ValueId GraphBuilder::softmax_cross_entropy(ValueId logits, ValueId targets, int64_t ignore_index) {
  return g_.add_node(OpKind::SoftmaxCrossEntropy, {logits, targets}, {{"ignore_index", ignore_index}})[0];
}

ValueId GraphBuilder::token_stats(ValueId logits, ValueId targets, int64_t ignore_index) {
  return g_.add(OpKind::TokenStats, {logits, targets}, {{"ignore_index", ignore_index}});
}

std::vector<ValueId> GraphBuilder::token_log_probs(ValueId logits, ValueId targets, bool row_stats,
                                                  int64_t ignore_index) {
  return g_.add_node(OpKind::TokenLogProbs, {logits, targets},
                     {{"ignore_index", ignore_index}, {"row_stats", int64_t{row_stats}}});
}

ValueId GraphBuilder::preference_loss(ValueId logps, ValueId ref_logps, ValueId lengths, const std::string& loss_type,
                                      double beta) {
  return g_.add(OpKind::PreferenceLoss, {logps, ref_logps, lengths}, {{"loss_type", loss_type}, {"beta", beta}});
}

ValueId GraphBuilder::ctc_loss(ValueId logits, ValueId labels, ValueId input_lengths, int64_t blank, bool zero_infinity,
                               bool per_target) {
  std::vector<ValueId> inputs{logits, labels};
  if (input_lengths != ir::kNone) inputs.push_back(input_lengths);
  return g_.add(OpKind::CtcLoss, inputs,
                {{"blank", blank}, {"zero_infinity", int64_t{zero_infinity}}, {"per_target", int64_t{per_target}}});
}

ValueId GraphBuilder::sigmoid_cross_entropy(ValueId logits, ValueId targets) {
  return g_.add(OpKind::SigmoidCrossEntropy, {logits, targets});
}

ValueId GraphBuilder::attention(ValueId q, ValueId k, ValueId v, ValueId mask, double scale, bool causal,
                                double dropout_p, DType out_dtype, int64_t window, double softcap,
                                ValueId key_begin, ValueId bias) {
  std::vector<ValueId> inputs{q, k, v};
  if (bias != kNone) inputs.push_back(bias);
  if (mask != kNone) inputs.push_back(mask);
  if (key_begin != kNone) inputs.push_back(key_begin);
  Attrs attrs{{"scale", scale}, {"causal", int64_t{causal}}, {"dropout_p", dropout_p}, {"seed", next_stream()}};
  if (out_dtype != DType::f32) attrs.set("out_dtype", std::string(dtype_name(out_dtype)));
  if (window > 0) attrs.set("window", window);
  if (softcap > 0) attrs.set("softcap", softcap);
  if (bias != kNone) attrs.set("score_bias", int64_t{1});
  return g_.add_node(OpKind::Attention, std::move(inputs), std::move(attrs))[0];
}

}  // namespace fusetrain::ir
