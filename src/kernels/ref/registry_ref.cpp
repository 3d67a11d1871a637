// make_ref_kernel: the plain-loop reference kernel for every op in ops.def.
// The switch has no default, so a new op without a reference kernel fails to
// compile (-Werror=switch).
//
// Shape letters: B batch, T query length, S key length, H heads, D head size,
// C channels, V vocabulary, R rows.
#include "kernels/factories.h"
#include "kernels/ref/ref_kernels.h"

namespace fusetrain::kernels {

namespace ref {

std::vector<int64_t> contiguous_strides(const Shape& shape) {
  std::vector<int64_t> strides(static_cast<size_t>(shape.rank()), 1);
  for (int64_t a = shape.rank() - 1; a > 0; --a)
    strides[static_cast<size_t>(a - 1)] = strides[static_cast<size_t>(a)] * shape[a];
  return strides;
}

StridedIndex broadcast_index(const Shape& in, const Shape& out) {
  FT_CHECK(in.rank() <= out.rank(), "cannot broadcast ", in.to_string(), " to ", out.to_string());
  StridedIndex index;
  index.dims = out.dims();
  index.strides.assign(static_cast<size_t>(out.rank()), 0);
  std::vector<int64_t> in_strides = contiguous_strides(in);
  const int64_t lead = out.rank() - in.rank();
  for (int64_t a = 0; a < in.rank(); ++a) {
    FT_CHECK(in[a] == out[a + lead] || in[a] == 1, "cannot broadcast ", in.to_string(), " to ", out.to_string());
    index.strides[static_cast<size_t>(a + lead)] = in[a] == 1 ? 0 : in_strides[static_cast<size_t>(a)];
  }
  return index;
}

std::string node_label(const KernelCall& call) { return str(ops::op_name(call.op), " \"", call.name, "\""); }

}  // namespace ref

std::unique_ptr<Kernel> make_ref_kernel(const KernelCall& call) {
  using ops::OpKind;
  switch (call.op) {
    // forward ops
    case OpKind::Fill:
      return ref::make_fill_ref(call);
    case OpKind::MatMul:
      return ref::make_matmul_ref(call);
    case OpKind::Linear:
    case OpKind::LinearGelu:
      return ref::make_linear_ref(call);
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Mul:
    case OpKind::Div:
      return ref::make_binary_ref(call);
    case OpKind::Scale:
      return ref::make_scale_ref(call);
    case OpKind::Gelu:
      return ref::make_gelu_ref(call);
    case OpKind::Tanh:
      return ref::make_tanh_ref(call);
    case OpKind::Relu:
      return ref::make_relu_ref(call);
    case OpKind::Pow:
    case OpKind::Sqrt:
    case OpKind::Erf:
      return ref::make_math_ref(call);
    case OpKind::Softmax:
      return ref::make_softmax_ref(call);
    case OpKind::LayerNorm:
    case OpKind::AddLayerNorm:
      return ref::make_layernorm_ref(call);
    case OpKind::RMSNorm:
      return ref::make_rmsnorm_ref(call);
    case OpKind::RoPE:
      return ref::make_rope_ref(call);
    case OpKind::Conv:
    case OpKind::ConvBackwardData:
    case OpKind::ConvBackwardWeight:
      return ref::make_conv_ref(call);
    case OpKind::SwiGLU:
    case OpKind::SwiGLUBackward:
      return ref::make_swiglu_ref(call);
    case OpKind::Embedding:
      return ref::make_embedding_ref(call);
    case OpKind::Dropout:
      return ref::make_dropout_ref(call);
    case OpKind::DropoutAdd:
      return ref::make_dropout_add_ref(call);
    case OpKind::Reshape:
      return ref::make_reshape_ref(call);
    case OpKind::Transpose:
      return ref::make_transpose_ref(call);
    case OpKind::Split:
      return ref::make_split_ref(call);
    case OpKind::Concat:
      return ref::make_concat_ref(call);
    case OpKind::Slice:
      return ref::make_slice_ref(call);
    case OpKind::ReduceSum:
    case OpKind::ReduceMean:
      return ref::make_reduce_ref(call);
    case OpKind::Cast:
      return ref::make_cast_ref(call);
    case OpKind::SoftmaxCrossEntropy:
      return ref::make_cross_entropy_ref(call);
    case OpKind::Attention:
      return ref::make_attention_ref(call);
    // ops that gradient rules emit
    case OpKind::Copy:
      return ref::make_copy_ref(call);
    case OpKind::ExpandTo:
      return ref::make_expand_to_ref(call);
    case OpKind::ReduceSumTo:
      return ref::make_reduce_sum_to_ref(call);
    case OpKind::CastColumnSum:
      return ref::make_cast_column_sum_ref(call);
    case OpKind::MatMulGeluBackward:
      return ref::make_matmul_gelu_backward_ref(call);
    case OpKind::GeluBackward:
      return ref::make_gelu_backward_ref(call);
    case OpKind::TanhBackward:
      return ref::make_tanh_backward_ref(call);
    case OpKind::ReluBackward:
      return ref::make_relu_backward_ref(call);
    case OpKind::ErfBackward:
      return ref::make_erf_backward_ref(call);
    case OpKind::SoftmaxBackward:
      return ref::make_softmax_backward_ref(call);
    case OpKind::LayerNormBackward:
      return ref::make_layernorm_backward_ref(call);
    case OpKind::RMSNormBackward:
      return ref::make_rmsnorm_backward_ref(call);
    case OpKind::EmbeddingBackward:
      return ref::make_embedding_backward_ref(call);
    case OpKind::SliceBackward:
      return ref::make_slice_backward_ref(call);
    case OpKind::SoftmaxCrossEntropyBackward:
      return ref::make_cross_entropy_backward_ref(call);
    case OpKind::SigmoidCrossEntropy:
      return ref::make_sigmoid_cross_entropy_ref(call);
    case OpKind::LinearCrossEntropy:
      return ref::make_linear_cross_entropy_ref(call);
    case OpKind::TokenStats:
      return ref::make_token_stats_ref(call);
    case OpKind::TokenLogProbs:
      return ref::make_token_log_probs_ref(call);
    case OpKind::TokenLogProbsBackward:
      return ref::make_token_log_probs_backward_ref(call);
    case OpKind::LinearLogProbs:
    case OpKind::LinearLogProbsWeightGrad:
      return ref::make_linear_log_probs_ref(call);
    case OpKind::PreferenceLoss:
    case OpKind::PreferenceLossBackward:
      return ref::make_preference_loss_ref(call);
    case OpKind::CtcLoss:
    case OpKind::CtcLossBackward:
      return ref::make_ctc_loss_ref(call);
    case OpKind::Pool:
    case OpKind::PoolBackward:
      return ref::make_pool_ref(call);
    case OpKind::QuantizedLinear:
    case OpKind::QuantizedLinearBackward:
      return ref::make_quantized_linear_ref(call);
    case OpKind::SigmoidCrossEntropyBackward:
      return ref::make_sigmoid_cross_entropy_backward_ref(call);
    case OpKind::AttentionBackward:
      return ref::make_attention_backward_ref(call);
  }
  throw Error(str("make_ref_kernel: ", ref::node_label(call), " has an unknown op kind ", static_cast<int>(call.op)));
}

}  // namespace fusetrain::kernels
