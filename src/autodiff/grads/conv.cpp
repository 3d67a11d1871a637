// Gradients of Conv and Pool.
#include "autodiff/grad_context.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

// y = conv(x, w) + bias:  dx = ConvBackwardData(dy, w) (the transposed convolution), dw = ConvBackwardWeight(dy, x)
// (each output's correlation with its patches), dbias = Σ over batch and positions of dy.
template <>
void grad_rule<OpKind::Conv>(GradContext& ctx) {
  const ValueId dy = ctx.grad_output(0);
  // bf16 x and w: the backward products take dy rounded once to bf16 and accumulate in f32, as Linear's.
  const ValueId dy_operand = ctx.input_dtype(0) != DType::f32 ? ctx.b.cast(dy, ctx.input_dtype(0)) : dy;
  if (ctx.needs_grad(0)) {
    ir::Attrs attrs = ctx.attrs();
    attrs.set("shape", ctx.input_shape(0).dims());
    ctx.set_grad_input(0, ctx.g.add(OpKind::ConvBackwardData, {dy_operand, ctx.input(1)}, attrs));
  }
  if (ctx.needs_grad(1)) {
    ir::Attrs attrs = ctx.attrs();
    attrs.set("shape", ctx.input_shape(1).dims());
    ctx.set_grad_input(1, ctx.g.add(OpKind::ConvBackwardWeight, {dy_operand, ctx.input(0)}, attrs));
  }
  if (ctx.num_inputs() == 3 && ctx.needs_grad(2)) {
    std::vector<int64_t> axes = {0};
    for (int64_t a = 2; a < ctx.input_shape(0).rank(); ++a) axes.push_back(a);
    ctx.set_grad_input(2, ctx.b.reduce_sum(dy, axes));
  }
}

// y = pool(x): dx = PoolBackward(dy, x): each output's gradient to its window's first maximum (max), or spread
// over the window's in-range positions divided as the forward divided (average).
template <>
void grad_rule<OpKind::Pool>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.g.add(OpKind::PoolBackward, {ctx.grad_output(0), ctx.input(0)}, ctx.attrs()));
}

}  // namespace fusetrain::autodiff
