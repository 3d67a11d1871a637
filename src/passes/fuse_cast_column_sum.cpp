// A cast of a gradient and the bias gradient's ReduceSum of it, into CastColumnSum (see fusion.h).
#include <algorithm>
#include <vector>

#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {

// Whether `sum` (a ReduceSum) sums its input over every axis but the last, without keeping them.
bool sums_leading_axes(const ir::Graph& g, const ir::Node& sum) {
  if (sum.attrs.get_int("keepdims", 0) != 0) return false;
  const int64_t rank = g.value(sum.inputs[0]).shape.rank();
  std::vector<int64_t> axes = sum.attrs.get_ints("axes");
  for (int64_t& a : axes) a = a < 0 ? a + rank : a;
  std::sort(axes.begin(), axes.end());
  if (static_cast<int64_t>(axes.size()) != rank - 1) return false;
  for (int64_t a = 0; a + 1 < rank; ++a)
    if (axes[static_cast<size_t>(a)] != a) return false;
  return true;
}

// A ReduceSum of x (read directly or through Reshapes that keep its last axis) over every other axis, not yet
// fused; kNone if there is none. `through` receives the Reshapes between them that nothing reads once the sum is
// gone: a Reshape whose result something else reads stays, and so does every Reshape before it on the way.
NodeId column_sum_of(const ir::Graph& g, const std::vector<std::vector<NodeId>>& consumers, ValueId x,
                     const std::vector<bool>& taken, std::vector<NodeId>& through) {
  const int64_t n = g.value(x).shape[-1];
  for (NodeId id : consumers[static_cast<size_t>(x)]) {
    const ir::Node& reader = g.node(id);
    const ValueId out = reader.outputs.empty() ? kNone : reader.outputs[0];
    if (reader.op == OpKind::ReduceSum && !taken[static_cast<size_t>(id)] && sums_leading_axes(g, reader)) return id;
    if (reader.op == OpKind::Reshape && g.value(out).shape.rank() >= 1 && g.value(out).shape[-1] == n) {
      std::vector<NodeId> inner;
      const NodeId found = column_sum_of(g, consumers, out, taken, inner);
      if (found == kNone) continue;
      // This Reshape goes if its one reader is the sum, or the next Reshape on the way, which goes too.
      const std::vector<NodeId>& readers = consumers[static_cast<size_t>(out)];
      if (!g.is_output(out) && readers.size() == 1 && readers[0] == (inner.empty() ? found : inner.front()))
        through.push_back(id);
      through.insert(through.end(), inner.begin(), inner.end());
      return found;
    }
  }
  return kNone;
}

}  // namespace

FusionReport fuse_cast_column_sum(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  std::vector<bool> taken(g.nodes().size(), false);
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    const ir::Node& cast = g.node(id);
    if (cast.op != OpKind::Cast || g.is_removed(id)) continue;
    const ValueId x = cast.inputs[0], y = cast.outputs[0];
    const ir::Value& xv = g.value(x);
    const DType to = g.value(y).dtype;
    if (xv.dtype != DType::f32 || (to != DType::bf16 && to != DType::f16) || xv.shape.rank() < 2) continue;
    const int64_t n = xv.shape[-1];
    if (n < 2 || xv.shape.numel() / n < 2) continue;  // CastColumnSum's kernels take R, N >= 2
    std::vector<NodeId> through;
    const NodeId sum_id = column_sum_of(g, consumers, x, taken, through);
    if (sum_id == kNone) continue;
    const ValueId s = g.node(sum_id).outputs[0];
    // The fused node takes the place of whichever of the two runs first: x is ready there, y's readers follow
    // the cast and s's readers follow the sum.
    const NodeId at = std::min(id, sum_id), other = std::max(id, sum_id);
    g.fuse_into(at, OpKind::CastColumnSum, {x}, {{"dtype", cast.attrs.get_string("dtype")}}, {y, s});
    g.remove_node(other);
    for (NodeId reshape : through) g.remove_node(reshape);
    taken[static_cast<size_t>(sum_id)] = true;
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
