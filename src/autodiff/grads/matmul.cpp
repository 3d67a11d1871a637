// Gradients of MatMul, Linear and LinearGelu.
#include "autodiff/grad_context.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

// C = op(A)·op(B) with op = transpose when the flag is set.
//   d op(A) = dC·op(B)ᵀ      d op(B) = op(A)ᵀ·dC
template <>
void grad_rule<OpKind::MatMul>(GradContext& ctx) {
  bool ta = ctx.attrs().get_int("trans_a", 0) != 0;
  bool tb = ctx.attrs().get_int("trans_b", 0) != 0;
  ValueId a = ctx.input(0), b = ctx.input(1), dc = ctx.grad_output(0);
  const Shape& sa = ctx.input_shape(0);
  const Shape& sb = ctx.input_shape(1);
  // Low-precision operands: the backward GEMMs also take low-precision inputs
  // (dC is rounded once) and accumulate in f32; gradients are always f32.
  if (ctx.input_dtype(0) != DType::f32) dc = ctx.b.cast(dc, ctx.input_dtype(0));

  if (ctx.needs_grad(0)) {
    // When A is broadcast over B's batch, sum_to folds the batch away.
    ValueId da = ta ? ctx.b.matmul(b, dc, tb, true) : ctx.b.matmul(dc, b, false, !tb);
    da = ctx.sum_to(da, sa);
    ctx.set_grad_input(0, da);
  }
  if (ctx.needs_grad(1)) {
    ValueId db;
    if (sb.rank() == 2 && sa.rank() > 2 && !ta) {
      // B broadcast over A's batch: fold the batch into one GEMM over all rows.
      int64_t rows = ctx.g.value(a).shape.numel() / sa[-1];
      ValueId a2 = ctx.b.reshape(a, {rows, sa[-1]});
      ValueId dc2 = ctx.b.reshape(dc, {rows, ctx.g.value(dc).shape[-1]});
      db = tb ? ctx.b.matmul(dc2, a2, true, false) : ctx.b.matmul(a2, dc2, true, false);
    } else {
      db = tb ? ctx.b.matmul(dc, a, true, ta) : ctx.b.matmul(a, dc, !ta, false);
      db = ctx.sum_to(db, sb);
    }
    ctx.set_grad_input(1, db);
  }
}

namespace {

// y = x·wᵀ + bias, x (R..., K), w (N, K), given dy:
//   dx = dy·w    dw = dyᵀ·x (rows folded)    dbias = Σ_rows dy
void linear_grads(GradContext& ctx, ValueId dy) {
  ValueId x = ctx.input(0), w = ctx.input(1);
  const Shape& sx = ctx.input_shape(0);
  const Shape& sw = ctx.input_shape(1);
  int64_t rows = sx.numel() / sx[-1];
  // Low-precision x and w: the backward GEMMs take dy rounded once to the same
  // precision and accumulate in f32; gradients are always f32.
  ValueId dy_gemm = ctx.input_dtype(0) != DType::f32 ? ctx.b.cast(dy, ctx.input_dtype(0)) : dy;
  if (ctx.needs_grad(0)) {
    ValueId dx2 = ctx.b.matmul(ctx.b.reshape(dy_gemm, {rows, sw[0]}), w, false, false);
    ctx.set_grad_input(0, ctx.b.reshape(dx2, sx.dims()));
  }
  if (ctx.needs_grad(1)) {
    // One statement each, x's reshape first: a call's arguments are evaluated in an order the compiler chooses, and
    // the node order (which the schedule, and so the order of sums, follows) must not depend on the compiler.
    ValueId x2 = ctx.b.reshape(x, {rows, sx[-1]});
    ValueId dy2 = ctx.b.reshape(dy_gemm, {rows, sw[0]});
    ctx.set_grad_input(1, ctx.b.matmul(dy2, x2, true, false));
  }
  if (ctx.num_inputs() == 3 && ctx.needs_grad(2))
    ctx.set_grad_input(2, ctx.b.reduce_sum(ctx.b.reshape(dy, {rows, sw[0]}), {0}));
}

}  // namespace

template <>
void grad_rule<OpKind::Linear>(GradContext& ctx) {
  ValueId dy = ctx.grad_output(0);
  if (ctx.g.value(dy).dtype != DType::f32) dy = ctx.b.cast(dy, DType::f32);  // bf16 y (out_dtype)
  linear_grads(ctx, dy);
}

// Outputs y = gelu(z) and z = x·wᵀ + bias:  dz = gelu'(z)·dy (+ z's own gradient), then Linear's rule.
template <>
void grad_rule<OpKind::LinearGelu>(GradContext& ctx) {
  ValueId dz = ctx.grad_output(0);
  if (dz != ir::kNone && ctx.g.value(dz).dtype != DType::f32) dz = ctx.b.cast(dz, DType::f32);  // bf16 y (out_dtype)
  if (dz != ir::kNone)
    dz = ctx.g.add(OpKind::GeluBackward, {dz, ctx.output(1)},
                   {{"approximate", ctx.attrs().get_string("approximate", "none")}});
  if (ctx.grad_output(1) != ir::kNone) dz = dz == ir::kNone ? ctx.grad_output(1) : ctx.b.add(dz, ctx.grad_output(1));
  linear_grads(ctx, dz);
}

}  // namespace fusetrain::autodiff
