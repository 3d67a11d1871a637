// ReLU's backward reads the output that backward keeps anyway instead of the input (see recompute.h).
#include "fusetrain/passes/recompute.h"
#include "passes/names.h"

namespace fusetrain::passes {

ReluBackwardReport relu_backward_from_output(ir::Graph& graph) {
  ReluBackwardReport report;
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  auto backward_readers = [&](ValueId v) {
    std::vector<NodeId> readers;
    for (NodeId c : consumers[static_cast<size_t>(v)])
      if (graph.node(c).phase == ir::Phase::Backward) readers.push_back(c);
    return readers;
  };
  for (const ir::Node& relu : graph.nodes()) {
    if (relu.phase != ir::Phase::Forward || relu.op != OpKind::Relu) continue;
    const ValueId z = relu.inputs[0], y = relu.outputs[0];
    const ir::Value &zv = graph.value(z), &yv = graph.value(y);
    if (zv.dtype != yv.dtype || zv.shape != yv.shape || backward_readers(y).empty()) continue;
    bool moved = false, other = false;  // whether a ReluBackward now reads y; whether backward reads z otherwise
    for (NodeId c : backward_readers(z)) {
      ir::Node& reader = graph.node(c);
      if (reader.op == OpKind::ReluBackward && reader.inputs[1] == z && reader.inputs[0] != z) {
        reader.inputs[1] = y;  // y > 0 exactly where z > 0
        moved = true;
      } else {
        other = true;
      }
    }
    if (!moved) continue;
    report.relus += 1;
    if (!other && !graph.is_output(z))
      report.bytes_freed += static_cast<size_t>(zv.shape.numel()) * dtype_size(zv.dtype);
  }
  graph.commit();
  return report;
}

}  // namespace fusetrain::passes
