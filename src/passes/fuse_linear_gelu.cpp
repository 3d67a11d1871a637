// Bias + GELU into the Linear's GEMM epilogue: LinearGelu (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {

FusionReport fuse_linear_gelu(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  // The producer of v when v is read by nothing but one node and is not a graph output.
  auto sole_producer = [&](ValueId v) -> const ir::Node* {
    const ir::Value& value = g.value(v);
    if (value.producer == kNone || g.is_output(v) || consumers[static_cast<size_t>(v)].size() != 1) return nullptr;
    return &g.node(value.producer);
  };
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    ir::Node& gelu = g.node(id);
    if (gelu.op != OpKind::Gelu) continue;
    const ValueId z = gelu.inputs[0];  // the Linear's output, or its bf16 cast
    const ir::Node* linear = sole_producer(z);
    const ir::Node* cast = nullptr;
    if (linear && linear->op == OpKind::Cast && g.value(z).dtype == DType::bf16) {
      cast = linear;
      linear = sole_producer(cast->inputs[0]);
    }
    if (!linear || linear->op != OpKind::Linear) continue;
    // The Gelu node becomes the fused node: it keeps its output (y = gelu(z)) and now also
    // produces z (or z rounded to bf16), which only it read.
    ir::Attrs attrs{{"approximate", gelu.attrs.get_string("approximate", "none")}};
    if (cast) {
      attrs.set("z_dtype", std::string("bf16"));
      g.remove_node(cast->id);
    }
    g.fuse_into(gelu.id, OpKind::LinearGelu, linear->inputs, attrs, {gelu.outputs[0], z});
    g.remove_node(linear->id);
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
