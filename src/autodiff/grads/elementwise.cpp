// Gradients of elementwise ops: arithmetic with broadcasting, activations,
// dropout and casts.
#include "autodiff/grad_context.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

template <>
void grad_rule<OpKind::Add>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.needs_grad(0)) ctx.set_grad_input(0, ctx.sum_to(dy, ctx.input_shape(0)));
  if (ctx.needs_grad(1)) ctx.set_grad_input(1, ctx.sum_to(dy, ctx.input_shape(1)));
}

template <>
void grad_rule<OpKind::Sub>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.needs_grad(0)) ctx.set_grad_input(0, ctx.sum_to(dy, ctx.input_shape(0)));
  if (ctx.needs_grad(1)) ctx.set_grad_input(1, ctx.b.scale(ctx.sum_to(dy, ctx.input_shape(1)), -1.0));
}

template <>
void grad_rule<OpKind::Mul>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.needs_grad(0)) ctx.set_grad_input(0, ctx.sum_to(ctx.b.mul(dy, ctx.input(1)), ctx.input_shape(0)));
  if (ctx.needs_grad(1)) ctx.set_grad_input(1, ctx.sum_to(ctx.b.mul(dy, ctx.input(0)), ctx.input_shape(1)));
}

// y = a / b:  da = dy / b,  db = -(dy / b) · y
template <>
void grad_rule<OpKind::Div>(GradContext& ctx) {
  ValueId dy_over_b = ctx.b.div(ctx.grad_output(0), ctx.input(1));
  if (ctx.needs_grad(0)) ctx.set_grad_input(0, ctx.sum_to(dy_over_b, ctx.input_shape(0)));
  if (ctx.needs_grad(1)) {
    ValueId db = ctx.b.scale(ctx.b.mul(dy_over_b, ctx.output(0)), -1.0);
    ctx.set_grad_input(1, ctx.sum_to(db, ctx.input_shape(1)));
  }
}

template <>
void grad_rule<OpKind::Scale>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.b.scale(ctx.grad_output(0), ctx.attrs().get_float("alpha")));
}

template <>
void grad_rule<OpKind::Gelu>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.g.value(dy).dtype != DType::f32) dy = ctx.b.cast(dy, DType::f32);  // a bf16 result (out_dtype)
  ctx.set_grad_input(0, ctx.g.add(OpKind::GeluBackward, {dy, ctx.input(0)},
                                  {{"approximate", ctx.attrs().get_string("approximate", "none")}}));
}

template <>
void grad_rule<OpKind::Tanh>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.g.add(OpKind::TanhBackward, {ctx.grad_output(0), ctx.output(0)}));
}

// d/dgate = dy·up·σ(g)(1 + g(1 − σ(g))), d/dup = dy·silu(g): one pass over dy, gate and up.
template <>
void grad_rule<OpKind::SwiGLU>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.g.value(dy).dtype != DType::f32) dy = ctx.b.cast(dy, DType::f32);  // a bf16 result
  std::vector<ValueId> grads = ctx.g.add_node(OpKind::SwiGLUBackward, {dy, ctx.input(0), ctx.input(1)});
  for (size_t i = 0; i < 2; ++i) ctx.set_grad_input(i, grads[i]);
}

template <>
void grad_rule<OpKind::Relu>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.g.value(dy).dtype != DType::f32) dy = ctx.b.cast(dy, DType::f32);  // a bf16 result
  ctx.set_grad_input(0, ctx.g.add(OpKind::ReluBackward, {dy, ctx.input(0)}));
}

// d x^e = e·x^(e-1).
template <>
void grad_rule<OpKind::Pow>(GradContext& ctx) {
  const double e = ctx.attrs().get_float("exponent");
  ValueId slope = ctx.b.scale(ctx.g.add(OpKind::Pow, {ctx.input(0)}, {{"exponent", e - 1.0}}), e);
  ctx.set_grad_input(0, ctx.b.mul(ctx.grad_output(0), slope));
}

// d sqrt(x) = 1 / (2·sqrt(x)), from the forward output.
template <>
void grad_rule<OpKind::Sqrt>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.b.div(ctx.b.scale(ctx.grad_output(0), 0.5), ctx.output(0)));
}

template <>
void grad_rule<OpKind::Erf>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.g.add(OpKind::ErfBackward, {ctx.grad_output(0), ctx.input(0)}));
}

// The mask is a pure function of (seed, step, element), so dropout with the
// same attributes applied to dy is exactly the backward.
template <>
void grad_rule<OpKind::Dropout>(GradContext& ctx) {
  ctx.set_grad_input(0, ctx.g.add(OpKind::Dropout, {ctx.grad_output(0)}, ctx.attrs()));
}

// d/dx is dropout's (the same mask, redrawn); d/dresidual is dy itself.
template <>
void grad_rule<OpKind::DropoutAdd>(GradContext& ctx) {
  if (ctx.needs_grad(0)) ctx.set_grad_input(0, ctx.g.add(OpKind::Dropout, {ctx.grad_output(0)}, ctx.attrs()));
  if (ctx.needs_grad(1)) ctx.set_grad_input(1, ctx.grad_output(0));
}

// Gradients are kept in f32 whatever the forward precision, so a cast passes
// its gradient through (converting a low-precision one to f32).
template <>
void grad_rule<OpKind::Cast>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  ctx.set_grad_input(0, ctx.g.value(dy).dtype == DType::f32 ? dy : ctx.b.cast(dy, DType::f32));
}

}  // namespace fusetrain::autodiff
