// GELU outputs computed again in backward from the z it keeps anyway (see recompute.h).
#include <algorithm>

#include "fusetrain/core/error.h"
#include "fusetrain/passes/recompute.h"
#include "passes/names.h"

namespace fusetrain::passes {

GeluRecomputeReport recompute_gelu_outputs(ir::Graph& graph) {
  GeluRecomputeReport report;
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  auto is_backward = [&](NodeId c) { return graph.node(c).phase == ir::Phase::Backward; };
  auto backward_readers = [&](ValueId v) {
    std::vector<NodeId> readers;
    for (NodeId c : consumers[static_cast<size_t>(v)])
      if (is_backward(c)) readers.push_back(c);
    return readers;
  };
  const NodeId original_nodes = static_cast<NodeId>(graph.nodes().size());
  for (NodeId n = 0; n < original_nodes; ++n) {
    const ir::Node& gelu = graph.node(n);
    if (gelu.phase != ir::Phase::Forward || (gelu.op != OpKind::Gelu && gelu.op != OpKind::LinearGelu)) continue;
    const ValueId y = gelu.outputs[0];
    const ValueId z = gelu.op == OpKind::Gelu ? gelu.inputs[0] : gelu.outputs[1];
    if (graph.is_output(y) || backward_readers(z).empty()) continue;  // z must be kept for backward anyway
    // What backward reads: y itself, or its cast to the matmul dtype (mixed precision).
    ValueId kept = y;
    const ir::Node* cast = nullptr;
    if (backward_readers(y).empty()) {
      for (NodeId c : consumers[static_cast<size_t>(y)])
        if (!is_backward(c) && graph.node(c).op == OpKind::Cast && !graph.is_output(graph.node(c).outputs[0]) &&
            !backward_readers(graph.node(c).outputs[0]).empty())
          cast = &graph.node(c);
      if (!cast) continue;
      kept = cast->outputs[0];
    }
    const std::vector<NodeId> readers = backward_readers(kept);
    if (readers.empty()) continue;
    const ir::Attrs cast_attrs = cast ? cast->attrs : ir::Attrs{};
    const std::string cast_name = cast ? cast->name : "";
    const NodeId first = *std::min_element(readers.begin(), readers.end());
    // Placed just before the first backward reader, a Gelu before its Cast (insertion order).
    ValueId again = graph.insert_before(first, OpKind::Gelu, {z},
                                        {{"approximate", gelu.attrs.get_string("approximate", "none")}},
                                        gelu.name + ":recompute")[0];
    if (cast) again = graph.insert_before(first, OpKind::Cast, {again}, cast_attrs, cast_name + ":recompute")[0];
    graph.replace_uses_if(kept, again, [&](const ir::Node& reader) {
      return reader.phase == ir::Phase::Backward && reader.id < original_nodes;
    });
    report.gelus += 1;
    report.bytes_freed += static_cast<size_t>(graph.value(kept).shape.numel()) * dtype_size(graph.value(kept).dtype);
  }
  graph.commit();
  return report;
}

}  // namespace fusetrain::passes
