// Gradients of LayerNorm, RMSNorm, RoPE and Softmax.
#include "autodiff/grad_context.h"
#include "fusetrain/core/error.h"

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
void grad_rule<OpKind::RMSNorm>(GradContext& ctx) {
  // Output 1 (rstd) is a statistic saved for this rule; no gradient flows through it.
  std::vector<ValueId> grads =
      ctx.g.add_node(OpKind::RMSNormBackward, {ctx.grad_output(0), ctx.input(0), ctx.input(1), ctx.output(1)});
  for (size_t i = 0; i < 2; ++i) ctx.set_grad_input(i, grads[i]);
}

// RoPE is a rotation per pair (x1[i], x2[i]): its transpose, the rotation the other way, carries dy back to x.
// cos and sin come from position ids, so no gradient flows to them.
template <>
void grad_rule<OpKind::RoPE>(GradContext& ctx) {
  FT_CHECK(!ctx.needs_grad(1) && !ctx.needs_grad(2), "RoPE: cos and sin take no gradient (they are position tables)");
  const bool inverse = ctx.attrs().get_int("inverse", 0) != 0;
  ctx.set_grad_input(0, ctx.b.rope(ctx.grad_output(0), ctx.input(1), ctx.input(2), !inverse));
}

// Outputs sum = dropout(x) + residual, then y, mean, rstd. LayerNorm's backward gives d(sum) (plus
// sum's own gradient when something else reads it); the residual takes it as it is and x through the
// same dropout mask, redrawn.
template <>
void grad_rule<OpKind::AddLayerNorm>(GradContext& ctx) {
  ValueId dsum = ctx.grad_output(0);
  ValueId dgamma = ir::kNone, dbeta = ir::kNone;
  if (ctx.grad_output(1) != ir::kNone) {
    std::vector<ValueId> grads = ctx.g.add_node(
        OpKind::LayerNormBackward, {ctx.grad_output(1), ctx.output(0), ctx.input(2), ctx.output(2), ctx.output(3)});
    dsum = dsum == ir::kNone ? grads[0] : ctx.b.add(grads[0], dsum);
    dgamma = grads[1];
    dbeta = grads[2];
  }
  if (dsum != ir::kNone && ctx.needs_grad(0)) {
    const double p = ctx.attrs().get_float("p", 0.0);
    ctx.set_grad_input(
        0, p > 0.0 ? ctx.g.add(OpKind::Dropout, {dsum}, ir::dropout_attrs(ctx.attrs())) : dsum);
  }
  if (dsum != ir::kNone && ctx.needs_grad(1)) ctx.set_grad_input(1, dsum);
  if (dgamma != ir::kNone) ctx.set_grad_input(2, dgamma);
  if (dbeta != ir::kNone) ctx.set_grad_input(3, dbeta);
}

template <>
void grad_rule<OpKind::Softmax>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.g.add(OpKind::SoftmaxBackward, {ctx.grad_output(0), ctx.output(0)}));
}

}  // namespace fusetrain::autodiff
