// Gradients of data-movement ops and Embedding.
#include <algorithm>

#include "autodiff/grad_context.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

template <>
void grad_rule<OpKind::Reshape>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.b.reshape(ctx.grad_output(0), ctx.input_shape(0).dims()));
}

template <>
void grad_rule<OpKind::Transpose>(GradContext& ctx) {
  const std::vector<int64_t>& perm = ctx.attrs().get_ints("perm");
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  ctx.set_grad_input(0, ctx.b.transpose(ctx.grad_output(0), inverse));
}

template <>
void grad_rule<OpKind::Split>(GradContext& ctx) {
  std::vector<ValueId> pieces;
  for (size_t i = 0; i < ctx.num_outputs(); ++i) pieces.push_back(ctx.grad_output_or_zeros(i));
  ctx.set_grad_input(0, ctx.b.concat(pieces, ctx.attrs().get_int("axis")));
}

template <>
void grad_rule<OpKind::Concat>(GradContext& ctx) {
  int64_t axis = normalize_axis(ctx.attrs().get_int("axis"), ctx.input_shape(0).rank(), "Concat");
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < ctx.num_inputs(); ++i) sizes.push_back(ctx.input_shape(i)[axis]);
  std::vector<ValueId> pieces = ctx.b.split(ctx.grad_output(0), axis, sizes);
  for (size_t i = 0; i < ctx.num_inputs(); ++i) ctx.set_grad_input(i, pieces[i]);
}

template <>
void grad_rule<OpKind::Slice>(GradContext& ctx) {
  ir::Attrs attrs = ctx.attrs();
  attrs.set("shape", ctx.input_shape(0).dims());
  ctx.set_grad_input(0, ctx.g.add(OpKind::SliceBackward, {ctx.grad_output(0)}, attrs));
}

template <>
void grad_rule<OpKind::Embedding>(GradContext& ctx) {
  // Input 1 holds token ids and is never differentiated.
  ValueId dy = ctx.grad_output(0);
  if (ctx.g.value(dy).dtype != DType::f32) dy = ctx.b.cast(dy, DType::f32);
  ValueId dw = ctx.g.add(OpKind::EmbeddingBackward, {dy, ctx.input(1)},
                         {{"num_embeddings", ctx.input_shape(0)[0]},
                          {"padding_idx", ctx.attrs().get_int("padding_idx", -1)}});
  ctx.set_grad_input(0, dw);
}

}  // namespace fusetrain::autodiff
