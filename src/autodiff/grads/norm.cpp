// Gradients of LayerNorm and Softmax.
#include "autodiff/grad_context.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

template <>
void grad_rule<OpKind::LayerNorm>(GradContext& ctx) {
  // Outputs 1 and 2 (mean, rstd) are statistics saved for this rule; no gradient flows through them.
  std::vector<ValueId> grads = ctx.g.add_node(
      OpKind::LayerNormBackward, {ctx.grad_output(0), ctx.input(0), ctx.input(1), ctx.output(1), ctx.output(2)});
  for (size_t i = 0; i < 3; ++i) ctx.set_grad_input(i, grads[i]);
}

template <>
void grad_rule<OpKind::Softmax>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.g.add(OpKind::SoftmaxBackward, {ctx.grad_output(0), ctx.output(0)}));
}

}  // namespace fusetrain::autodiff
