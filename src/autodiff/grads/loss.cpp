// Gradients of the loss and of attention.
#include "autodiff/grad_context.h"
#include "fusetrain/core/error.h"
#include "fusetrain/ops/params.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

template <>
void grad_rule<OpKind::SoftmaxCrossEntropy>(GradContext& ctx) {
  // Input 1 holds target ids and is never differentiated; output 1 (lse) is saved state.
  ctx.set_grad_input(0, ctx.g.add(OpKind::SoftmaxCrossEntropyBackward,
                                  {ctx.grad_output(0), ctx.input(0), ctx.input(1), ctx.output(1)}, ctx.attrs()));
}

// The forward already formed d(loss)/d(x, w, bias) for a unit upstream gradient (outputs 1-3);
// backward scales them by the gradient that reached the loss, unless that is the constant 1.
template <>
void grad_rule<OpKind::LinearCrossEntropy>(GradContext& ctx) {
  for (size_t i = 1; i < ctx.num_outputs(); ++i)
    FT_CHECK(ctx.grad_output(i) == ir::kNone, "LinearCrossEntropy ", ctx.node().name, ": output ", i,
             " is a gradient (or the token statistics) the op formed itself and is not differentiated");
  const ValueId dloss = ctx.grad_output(0);
  const ir::Value& d = ctx.g.value(dloss);
  const bool unit = d.producer != ir::kNone && ctx.g.node(d.producer).op == OpKind::Fill &&
                    ctx.g.node(d.producer).attrs.get_float("value", 0.0) == 1.0;
  auto scaled = [&](ValueId unit_grad) { return unit ? unit_grad : ctx.b.mul(unit_grad, dloss); };
  ctx.set_grad_input(0, scaled(ctx.output(1)));
  if (!ctx.node().attrs.get_int("weight_grad", 1)) {  // a frozen head
    FT_CHECK(!ctx.needs_grad(1) && !(ctx.num_inputs() == 4 && ctx.needs_grad(3)), "LinearCrossEntropy ",
             ctx.node().name, ": weight_grad is 0 but the weight or bias takes a gradient");
    return;
  }
  ctx.set_grad_input(1, scaled(ctx.output(2)));
  if (ctx.num_inputs() == 4) ctx.set_grad_input(3, scaled(ctx.output(3)));
}

template <>
void grad_rule<OpKind::TokenLogProbs>(GradContext& ctx) {
  for (size_t i = 1; i < ctx.num_outputs(); ++i)
    FT_CHECK(ctx.grad_output(i) == ir::kNone, "TokenLogProbs ", ctx.node().name,
             ": the row statistics are not differentiated");
  ctx.set_grad_input(0, ctx.g.add(OpKind::TokenLogProbsBackward, {ctx.grad_output(0), ctx.input(0), ctx.input(1)},
                                  ctx.attrs()));
}

// The forward formed d(log p)/dx of each row for a unit gradient (output 2 with input_grad): dx scales each row by
// the gradient its log-probability received. dw and dbias need those gradients and are formed in backward, from the
// chunks of logits again (LinearLogProbsWeightGrad, with the forward's lse).
template <>
void grad_rule<OpKind::LinearLogProbs>(GradContext& ctx) {
  for (size_t i = 1; i < ctx.num_outputs(); ++i)
    FT_CHECK(ctx.grad_output(i) == ir::kNone, "LinearLogProbs ", ctx.node().name, ": output ", i,
             " (lse, the unit gradients or the row statistics) is not differentiated");
  const ValueId dlogp = ctx.grad_output(0);
  if (ctx.needs_grad(0)) {
    FT_CHECK(ctx.node().attrs.get_int("input_grad", 0), "LinearLogProbs ", ctx.node().name,
             ": x takes a gradient but input_grad is 0");
    std::vector<int64_t> column = ctx.input_shape(2).dims();
    column.push_back(1);
    ctx.set_grad_input(0, ctx.b.mul(ctx.output(2), ctx.b.reshape(dlogp, column)));
  }
  const bool bias = ctx.num_inputs() == 4 && ctx.needs_grad(3);
  if (!ctx.needs_grad(1) && !bias) return;
  ir::Attrs attrs = ctx.attrs();
  attrs.set("input_grad", int64_t{0});
  attrs.set("row_stats", int64_t{0});
  std::vector<ValueId> inputs{dlogp, ctx.input(0), ctx.input(1), ctx.input(2), ctx.output(1)};
  if (ctx.num_inputs() == 4) inputs.push_back(ctx.input(3));  // the logits are formed again, with their bias
  std::vector<ValueId> grads = ctx.g.add_node(OpKind::LinearLogProbsWeightGrad, inputs, attrs);
  if (ctx.needs_grad(1)) ctx.set_grad_input(1, grads[0]);
  if (bias) ctx.set_grad_input(3, grads[1]);
}

// A quantised weight is frozen: only x (and a bias) take a gradient. dx = dy · dequant(W), the GEMM dequantising
// the weight as it packs it, as forward does.
template <>
void grad_rule<OpKind::QuantizedLinear>(GradContext& ctx) {
  // Inputs 1 .. bias_at - 1 hold the weight: codes, absmax and (4-bit) the format's values; a bias follows.
  const size_t bias_at = ctx.attrs().get_int("bits", 4) == 4 ? 4 : 3;
  for (size_t i = 1; i < bias_at; ++i)
    FT_CHECK(!ctx.needs_grad(i), "QuantizedLinear ", ctx.node().name, ": the quantised weight is frozen");
  const ValueId dy = ctx.grad_output(0);
  if (ctx.needs_grad(0)) {
    // A bf16 x: dy rounded once to bf16 for the GEMM, as Linear's backward does.
    // dx of a bf16 x is a bf16 product: rounded as autograd's bf16 GEMM rounds it.
    const bool bf16 = ctx.input_dtype(0) != DType::f32;
    const ValueId dy_gemm = bf16 ? ctx.b.cast(dy, ctx.input_dtype(0)) : dy;
    ir::Attrs attrs = ctx.attrs();
    attrs.set("round_output", int64_t{bf16});
    std::vector<ValueId> inputs{dy_gemm};
    for (size_t i = 1; i < bias_at; ++i) inputs.push_back(ctx.input(i));
    ctx.set_grad_input(0, ctx.g.add(OpKind::QuantizedLinearBackward, inputs, attrs));
  }
  if (ctx.num_inputs() == bias_at + 1 && ctx.needs_grad(bias_at)) {
    const Shape& sy = ctx.g.value(dy).shape;
    ctx.set_grad_input(bias_at, ctx.b.reduce_sum(ctx.b.reshape(dy, {sy.numel() / sy[-1], sy[-1]}), {0}));
  }
}

template <>
void grad_rule<OpKind::PreferenceLoss>(GradContext& ctx) {
  FT_CHECK(!ctx.needs_grad(1) && !ctx.needs_grad(2), "PreferenceLoss ", ctx.node().name,
           ": the reference log-probabilities and the lengths are not differentiated");
  ctx.set_grad_input(0, ctx.g.add(OpKind::PreferenceLossBackward,
                                  {ctx.grad_output(0), ctx.input(0), ctx.input(1), ctx.input(2)}, ctx.attrs()));
}

template <>
void grad_rule<OpKind::CtcLoss>(GradContext& ctx) {
  std::vector<ValueId> inputs{ctx.grad_output(0), ctx.input(0), ctx.input(1)};
  if (ctx.num_inputs() == 3) inputs.push_back(ctx.input(2));
  ctx.set_grad_input(0, ctx.g.add(OpKind::CtcLossBackward, inputs, ctx.attrs()));
}

template <>
void grad_rule<OpKind::SigmoidCrossEntropy>(GradContext& ctx) {
  ctx.set_grad_input(0,
                     ctx.g.add(OpKind::SigmoidCrossEntropyBackward, {ctx.grad_output(0), ctx.input(0), ctx.input(1)}));
  if (ctx.needs_grad(1)) {
    // d/dy of mean(max(x,0) − x·y + log(1+e^−|x|)) = −x / N
    double n = static_cast<double>(ctx.input_shape(1).numel());
    ValueId dy =
        ctx.b.scale(ctx.b.mul(ctx.g.add(OpKind::ExpandTo, {ctx.grad_output(0)}, {{"shape", ctx.input_shape(0).dims()}}),
                              ctx.input(0)),
                    -1.0 / n);
    ctx.set_grad_input(1, dy);
  }
}

template <>
void grad_rule<OpKind::Attention>(GradContext& ctx) {
  ops::AttentionParams layout;  // where the score bias and the extras are
  layout.score_bias = ctx.attrs().get_int("score_bias", 0) != 0;
  const size_t first_extra = layout.first_extra(false), bias_at = layout.bias_input(false);
  for (size_t i = first_extra; i < ctx.num_inputs(); ++i)
    FT_CHECK(!ctx.needs_grad(i), "Attention ", ctx.node().name,
             ": the additive mask depends on a parameter; masks are not differentiated (a learned bias is the "
             "score bias)");
  std::vector<ValueId> inputs{ctx.grad_output(0), ctx.input(0),  ctx.input(1),
                              ctx.input(2),       ctx.output(0), ctx.output(1)};
  // The score bias, the additive mask and key_begin follow; only the score bias gets a gradient.
  for (size_t i = bias_at; i < ctx.num_inputs(); ++i) inputs.push_back(ctx.input(i));
  std::vector<ValueId> grads = ctx.g.add_node(OpKind::AttentionBackward, inputs, ctx.attrs());
  for (size_t i = 0; i < 3; ++i) ctx.set_grad_input(i, grads[i]);
  // The bias's gradient is dS (B, H, T, S), summed over the axes the bias broadcasts.
  if (layout.score_bias && ctx.needs_grad(bias_at))
    ctx.set_grad_input(bias_at, ctx.sum_to(grads[3], ctx.input_shape(bias_at)));
}

}  // namespace fusetrain::autodiff
