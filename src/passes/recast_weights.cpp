// Weight copies in another dtype (bf16 copies of f32 weights, f32 copies of a LoRA model's bf16 base) cast again
// for backward (see recompute.h).
#include <algorithm>

#include "fusetrain/core/error.h"
#include "fusetrain/passes/recompute.h"
#include "passes/names.h"

namespace fusetrain::passes {

RecastReport recast_weights_for_backward(ir::Graph& graph) {
  RecastReport report;
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  const NodeId original_nodes = static_cast<NodeId>(graph.nodes().size());
  for (NodeId n = 0; n < original_nodes; ++n) {
    const ir::Node& cast = graph.node(n);
    if (cast.phase != ir::Phase::Forward || cast.op != ir::OpKind::Cast) continue;
    const ValueId weight = cast.inputs[0], copy = cast.outputs[0];
    if ((graph.value(weight).kind != ir::ValueKind::Param && graph.value(weight).kind != ir::ValueKind::Frozen) ||
        graph.value(copy).dtype == graph.value(weight).dtype ||
        graph.is_output(copy))
      continue;
    std::vector<NodeId> backward_readers;
    bool forward_reader = false;
    for (NodeId c : consumers[static_cast<size_t>(copy)]) {
      if (graph.node(c).phase == ir::Phase::Backward)
        backward_readers.push_back(c);
      else
        forward_reader = true;
    }
    if (backward_readers.empty() || !forward_reader) continue;
    const NodeId first_reader = *std::min_element(backward_readers.begin(), backward_readers.end());
    const ValueId recast = graph.insert_before(first_reader, ir::OpKind::Cast, {weight}, cast.attrs,
                                               cast.name + ":recast")[0];
    graph.replace_uses_if(copy, recast, [](const ir::Node& reader) { return reader.phase == ir::Phase::Backward; });
    report.casts += 1;
    report.bytes_freed += static_cast<size_t>(graph.value(copy).shape.numel()) * dtype_size(graph.value(copy).dtype);
  }
  graph.commit();
  return report;
}

}  // namespace fusetrain::passes
