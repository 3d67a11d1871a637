// Dropout + residual add into DropoutAdd (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {

FusionReport fuse_dropout_add(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  // A Dropout output read only by `add`, f32 and of the add's own shape (no broadcasting).
  auto fusable_dropout = [&](ValueId v, const ir::Node& add) -> const ir::Node* {
    const ir::Value& value = g.value(v);
    if (value.producer == kNone || g.is_output(v) || value.dtype != DType::f32) return nullptr;
    const ir::Node& d = g.node(value.producer);
    if (d.op != OpKind::Dropout || g.is_removed(d.id)) return nullptr;
    const std::vector<NodeId>& readers = consumers[static_cast<size_t>(v)];
    if (readers.size() != 1 || readers[0] != add.id) return nullptr;
    return value.shape == g.value(add.outputs[0]).shape ? &d : nullptr;
  };
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    const ir::Node& add = g.node(id);
    if (add.op != OpKind::Add || add.inputs[0] == add.inputs[1]) continue;
    for (int side = 0; side < 2; ++side) {
      const ir::Node* dropout = fusable_dropout(add.inputs[static_cast<size_t>(side)], add);
      const ValueId residual = add.inputs[static_cast<size_t>(1 - side)];
      if (!dropout || g.value(residual).shape != g.value(add.outputs[0]).shape ||
          g.value(residual).dtype != DType::f32)
        continue;
      g.set_op(id, OpKind::DropoutAdd, {dropout->inputs[0], residual}, dropout->attrs);
      g.remove_node(dropout->id);
      report.fused += 1;
      break;
    }
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
