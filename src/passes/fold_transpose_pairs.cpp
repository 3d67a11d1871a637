// Transpose -> Reshape -> Transpose chains that put every element back in its place, into one Reshape (see
// fusion.h).
#include <optional>
#include <vector>

#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {

// Each axis of a value as the run of the source's axes (those of extent above 1) it spans, in order.
using AxisGroups = std::vector<std::vector<int64_t>>;

AxisGroups permute(const AxisGroups& groups, const std::vector<int64_t>& perm) {
  AxisGroups out;
  for (int64_t axis : perm) out.push_back(groups[static_cast<size_t>(axis)]);
  return out;
}

// The groups after a Reshape from `from` to `to` extents, when every new axis merges whole neighbouring axes (or is
// 1); nullopt when the Reshape splits an axis.
std::optional<AxisGroups> merge(const AxisGroups& groups, const Shape& from, const Shape& to) {
  AxisGroups out;
  int64_t i = 0;
  for (int64_t j = 0; j < to.rank(); ++j) {
    std::vector<int64_t> group;
    int64_t extent = 1;
    while (extent < to[j] && i < from.rank()) {
      extent *= from[i];
      group.insert(group.end(), groups[static_cast<size_t>(i)].begin(), groups[static_cast<size_t>(i)].end());
      ++i;
    }
    if (extent != to[j]) return std::nullopt;
    out.push_back(group);
  }
  for (; i < from.rank(); ++i)
    if (from[i] != 1) return std::nullopt;
  return out;
}

// The node producing v when it is `op` and v has one reader (and is no graph output); null otherwise.
const ir::Node* sole_producer(const ir::Graph& g, const std::vector<std::vector<NodeId>>& consumers, ValueId v,
                              OpKind op) {
  const ir::Value& value = g.value(v);
  if (value.producer == kNone || g.is_output(v) || consumers[static_cast<size_t>(v)].size() != 1) return nullptr;
  const ir::Node& node = g.node(value.producer);
  return node.op == op ? &node : nullptr;
}

}  // namespace

FusionReport fold_transpose_pairs(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    const ir::Node& second = g.node(id);
    if (second.op != OpKind::Transpose || g.is_removed(id)) continue;
    const ir::Node* reshape = sole_producer(g, consumers, second.inputs[0], OpKind::Reshape);
    if (!reshape) continue;
    const ir::Node* first = sole_producer(g, consumers, reshape->inputs[0], OpKind::Transpose);
    if (!first) continue;
    const ValueId x = first->inputs[0];
    const Shape& source = g.value(x).shape;
    AxisGroups groups;
    std::vector<int64_t> order;  // the source's axes of extent above 1, in order
    for (int64_t a = 0; a < source.rank(); ++a) {
      groups.push_back(source[a] == 1 ? std::vector<int64_t>{} : std::vector<int64_t>{a});
      if (source[a] != 1) order.push_back(a);
    }
    const std::optional<AxisGroups> merged =
        merge(permute(groups, first->attrs.get_ints("perm")), g.value(first->outputs[0]).shape,
              g.value(reshape->outputs[0]).shape);
    if (!merged) continue;
    std::vector<int64_t> result;
    for (const std::vector<int64_t>& group : permute(*merged, second.attrs.get_ints("perm")))
      result.insert(result.end(), group.begin(), group.end());
    if (result != order) continue;  // some element moves: a real transpose
    const NodeId reshape_id = reshape->id, first_id = first->id;
    const std::vector<int64_t> dims = g.value(second.outputs[0]).shape.dims();
    g.set_op(id, OpKind::Reshape, {x}, {{"shape", dims}});
    g.remove_node(reshape_id);
    g.remove_node(first_id);
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
