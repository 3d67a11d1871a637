// Gradients of MatMul and Linear.
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
  bool low_precision = ctx.input_dtype(0) != DType::f32;
  // Low-precision operands: gradients flow in f32, the operand is cast to f32.
  auto operand = [&](ValueId v) { return low_precision ? ctx.b.cast(v, DType::f32) : v; };
  auto to_input_dtype = [&](ValueId g, size_t i) { return low_precision ? ctx.b.cast(g, ctx.input_dtype(i)) : g; };

  if (ctx.needs_grad(0)) {
    // When A is broadcast over B's batch, sum_to folds the batch away.
    ValueId da = ta ? ctx.b.matmul(operand(b), dc, tb, true) : ctx.b.matmul(dc, operand(b), false, !tb);
    da = ctx.sum_to(da, sa);
    ctx.set_grad_input(0, to_input_dtype(da, 0));
  }
  if (ctx.needs_grad(1)) {
    ValueId db;
    if (sb.rank() == 2 && sa.rank() > 2 && !ta) {
      // B broadcast over A's batch: fold the batch into one GEMM over all rows.
      int64_t rows = ctx.g.value(a).shape.numel() / sa[-1];
      ValueId a2 = ctx.b.reshape(operand(a), {rows, sa[-1]});
      ValueId dc2 = ctx.b.reshape(dc, {rows, ctx.g.value(dc).shape[-1]});
      db = tb ? ctx.b.matmul(dc2, a2, true, false) : ctx.b.matmul(a2, dc2, true, false);
    } else {
      db = tb ? ctx.b.matmul(dc, operand(a), true, ta) : ctx.b.matmul(operand(a), dc, !ta, false);
      db = ctx.sum_to(db, sb);
    }
    ctx.set_grad_input(1, to_input_dtype(db, 1));
  }
}

// y = x·wᵀ + bias, x (R..., K), w (N, K).
//   dx = dy·w    dw = dyᵀ·x (rows folded)    dbias = Σ_rows dy
template <>
void grad_rule<OpKind::Linear>(GradContext& ctx) {
  ValueId x = ctx.input(0), w = ctx.input(1), dy = ctx.grad_output(0);
  const Shape& sx = ctx.input_shape(0);
  const Shape& sw = ctx.input_shape(1);
  bool low_precision = ctx.input_dtype(0) != DType::f32;
  int64_t rows = sx.numel() / sx[-1];
  if (ctx.needs_grad(0)) {
    ValueId dy_in = low_precision ? ctx.b.cast(dy, ctx.input_dtype(1)) : dy;
    ValueId dx2 = ctx.b.matmul(ctx.b.reshape(dy_in, {rows, sw[0]}), w, false, false);
    ValueId dx = ctx.b.reshape(dx2, sx.dims());
    ctx.set_grad_input(0, low_precision ? ctx.b.cast(dx, ctx.input_dtype(0)) : dx);
  }
  if (ctx.needs_grad(1)) {
    ValueId x_in = low_precision ? ctx.b.cast(x, DType::f32) : x;
    ValueId dw = ctx.b.matmul(ctx.b.reshape(dy, {rows, sw[0]}), ctx.b.reshape(x_in, {rows, sx[-1]}), true, false);
    ctx.set_grad_input(1, low_precision ? ctx.b.cast(dw, ctx.input_dtype(1)) : dw);
  }
  if (ctx.num_inputs() == 3 && ctx.needs_grad(2))
    ctx.set_grad_input(2, ctx.b.reduce_sum(ctx.b.reshape(dy, {rows, sw[0]}), {0}));
}

}  // namespace fusetrain::autodiff
