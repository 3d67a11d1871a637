// Residual add + LayerNorm into AddLayerNorm (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {

FusionReport fuse_add_layernorm(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    ir::Node& ln = g.node(id);
    if (ln.op != OpKind::LayerNorm) continue;
    const ValueId sum = ln.inputs[0];
    const ir::Value& value = g.value(sum);
    if (value.producer == kNone) continue;
    const ir::Node& add = g.node(value.producer);
    if ((add.op != OpKind::Add && add.op != OpKind::DropoutAdd) || add.inputs[0] == add.inputs[1]) continue;
    bool same_shapes = true;
    for (ValueId in : add.inputs)
      same_shapes = same_shapes && g.value(in).shape == value.shape && g.value(in).dtype == DType::f32;
    if (!same_shapes) continue;
    // The fused node sits where the LayerNorm was, so the sum appears there: every other
    // reader of it must come later.
    bool readers_after = true;
    for (NodeId reader : consumers[static_cast<size_t>(sum)]) readers_after = readers_after && reader >= id;
    if (!readers_after) continue;
    ir::Attrs attrs{{"eps", ln.attrs.get_float("eps")}};
    if (add.op == OpKind::DropoutAdd) {
      const ir::Attrs dropout = ir::dropout_attrs(add.attrs);
      for (const auto& [name, value] : dropout.items()) attrs.set(name, value);
    }
    std::vector<ValueId> outputs = ln.outputs;
    outputs.insert(outputs.begin(), sum);  // output 0, so it may take over x's memory
    g.fuse_into(id, OpKind::AddLayerNorm, {add.inputs[0], add.inputs[1], ln.inputs[1], ln.inputs[2]}, attrs,
                outputs);
    g.remove_node(add.id);
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
