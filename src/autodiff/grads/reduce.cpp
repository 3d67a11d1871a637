// Gradients of reductions.
#include <algorithm>

#include "autodiff/grad_context.h"

namespace fusetrain::autodiff {

using ir::OpKind;
using ir::ValueId;

namespace {

// Broadcasts the reduced gradient back to the input shape.
ValueId expand_back(GradContext& ctx) {
  const Shape& in = ctx.input_shape(0);
  std::vector<int64_t> axes = ctx.attrs().get_ints("axes");
  for (int64_t& a : axes) a = normalize_axis(a, in.rank(), "reduce");
  std::vector<int64_t> kept = in.dims();
  for (int64_t a : axes) kept[static_cast<size_t>(a)] = 1;
  ValueId dy = ctx.b.reshape(ctx.grad_output(0), kept);
  return ctx.g.add(OpKind::ExpandTo, {dy}, {{"shape", in.dims()}});
}

}  // namespace

template <>
void grad_rule<OpKind::ReduceSum>(GradContext& ctx) {
  ctx.set_grad_input(0, expand_back(ctx));
}

template <>
void grad_rule<OpKind::ReduceMean>(GradContext& ctx) {
  double count = static_cast<double>(ctx.input_shape(0).numel()) /
                 static_cast<double>(std::max<int64_t>(1, ctx.g.value(ctx.output(0)).shape.numel()));
  ctx.set_grad_input(0, ctx.b.scale(expand_back(ctx), 1.0 / count));
}

}  // namespace fusetrain::autodiff
