// Low-precision weight copies cast again for backward (see recompute.h).
#include <algorithm>
#include <map>

#include "fusetrain/core/error.h"
#include "fusetrain/passes/recompute.h"
#include "passes/remove_nodes.h"

namespace fusetrain::passes {

using ir::kNone;
using ir::NodeId;
using ir::ValueId;

RecastReport recast_weights_for_backward(ir::Graph& graph, size_t backward_begin) {
  RecastReport report;
  FT_CHECK(backward_begin <= graph.nodes().size(), "recast: backward begins at node ", backward_begin,
           " but the graph has ", graph.nodes().size(), " nodes");
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  const NodeId original_nodes = static_cast<NodeId>(graph.nodes().size());
  std::multimap<NodeId, NodeId> before;  // first backward reader -> the clone placed just before it
  for (NodeId n = 0; n < static_cast<NodeId>(backward_begin); ++n) {
    const ir::Node cast = graph.node(n);  // a copy: add_node may grow the node list
    if (cast.op != ir::OpKind::Cast) continue;
    const ValueId weight = cast.inputs[0], copy = cast.outputs[0];
    if (graph.value(weight).kind != ir::ValueKind::Param || graph.value(copy).dtype == DType::f32 ||
        graph.is_output(copy))
      continue;
    std::vector<NodeId> backward_readers;
    bool forward_reader = false;
    for (NodeId c : consumers[static_cast<size_t>(copy)]) {
      if (static_cast<size_t>(c) >= backward_begin)
        backward_readers.push_back(c);
      else
        forward_reader = true;
    }
    if (backward_readers.empty() || !forward_reader) continue;
    const ValueId recast = graph.add(ir::OpKind::Cast, {weight}, cast.attrs, cast.name + ":recast");
    for (NodeId c : backward_readers)
      for (ValueId& in : graph.node(c).inputs)
        if (in == copy) in = recast;
    before.emplace(*std::min_element(backward_readers.begin(), backward_readers.end()),
                   static_cast<NodeId>(graph.nodes().size() - 1));
    report.casts += 1;
    report.bytes_freed += static_cast<size_t>(graph.value(copy).shape.numel()) * dtype_size(graph.value(copy).dtype);
  }
  if (report.casts == 0) return report;
  place_before(graph, original_nodes, before);
  return report;
}

}  // namespace fusetrain::passes
