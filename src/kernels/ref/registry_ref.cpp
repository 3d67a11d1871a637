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

std::string node_label(const ir::Node& node) { return str(ir::op_name(node.op), " \"", node.name, "\""); }

}  // namespace ref

std::unique_ptr<Kernel> make_ref_kernel(const ir::Graph& graph, const ir::Node& node) {
  using ir::OpKind;
  switch (node.op) {
    // forward ops
    case OpKind::Fill:
      return ref::make_fill_ref(graph, node);
    case OpKind::MatMul:
      return ref::make_matmul_ref(graph, node);
    case OpKind::Linear:
    case OpKind::LinearGelu:
      return ref::make_linear_ref(graph, node);
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Mul:
    case OpKind::Div:
      return ref::make_binary_ref(graph, node);
    case OpKind::Scale:
      return ref::make_scale_ref(graph, node);
    case OpKind::Gelu:
      return ref::make_gelu_ref(graph, node);
    case OpKind::Tanh:
      return ref::make_tanh_ref(graph, node);
    case OpKind::Relu:
      return ref::make_relu_ref(graph, node);
    case OpKind::Pow:
    case OpKind::Sqrt:
    case OpKind::Erf:
      return ref::make_math_ref(graph, node);
    case OpKind::Softmax:
      return ref::make_softmax_ref(graph, node);
    case OpKind::LayerNorm:
    case OpKind::AddLayerNorm:
      return ref::make_layernorm_ref(graph, node);
    case OpKind::Embedding:
      return ref::make_embedding_ref(graph, node);
    case OpKind::Dropout:
      return ref::make_dropout_ref(graph, node);
    case OpKind::DropoutAdd:
      return ref::make_dropout_add_ref(graph, node);
    case OpKind::Reshape:
      return ref::make_reshape_ref(graph, node);
    case OpKind::Transpose:
      return ref::make_transpose_ref(graph, node);
    case OpKind::Split:
      return ref::make_split_ref(graph, node);
    case OpKind::Concat:
      return ref::make_concat_ref(graph, node);
    case OpKind::Slice:
      return ref::make_slice_ref(graph, node);
    case OpKind::ReduceSum:
    case OpKind::ReduceMean:
      return ref::make_reduce_ref(graph, node);
    case OpKind::Cast:
      return ref::make_cast_ref(graph, node);
    case OpKind::SoftmaxCrossEntropy:
      return ref::make_cross_entropy_ref(graph, node);
    case OpKind::Attention:
      return ref::make_attention_ref(graph, node);
    // ops that gradient rules emit
    case OpKind::Copy:
      return ref::make_copy_ref(graph, node);
    case OpKind::ExpandTo:
      return ref::make_expand_to_ref(graph, node);
    case OpKind::ReduceSumTo:
      return ref::make_reduce_sum_to_ref(graph, node);
    case OpKind::GeluBackward:
      return ref::make_gelu_backward_ref(graph, node);
    case OpKind::TanhBackward:
      return ref::make_tanh_backward_ref(graph, node);
    case OpKind::ReluBackward:
      return ref::make_relu_backward_ref(graph, node);
    case OpKind::ErfBackward:
      return ref::make_erf_backward_ref(graph, node);
    case OpKind::SoftmaxBackward:
      return ref::make_softmax_backward_ref(graph, node);
    case OpKind::LayerNormBackward:
      return ref::make_layernorm_backward_ref(graph, node);
    case OpKind::EmbeddingBackward:
      return ref::make_embedding_backward_ref(graph, node);
    case OpKind::SliceBackward:
      return ref::make_slice_backward_ref(graph, node);
    case OpKind::SoftmaxCrossEntropyBackward:
      return ref::make_cross_entropy_backward_ref(graph, node);
    case OpKind::SigmoidCrossEntropy:
      return ref::make_sigmoid_cross_entropy_ref(graph, node);
    case OpKind::LinearCrossEntropy:
      return ref::make_linear_cross_entropy_ref(graph, node);
    case OpKind::SigmoidCrossEntropyBackward:
      return ref::make_sigmoid_cross_entropy_backward_ref(graph, node);
    case OpKind::AttentionBackward:
      return ref::make_attention_backward_ref(graph, node);
  }
  throw Error(str("make_ref_kernel: ", ref::node_label(node), " has an unknown op kind ", static_cast<int>(node.op)));
}

}  // namespace fusetrain::kernels
