// GELU on bf16 inputs after bf16 projections (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {

FusionReport round_activation_inputs(ir::Graph& g) {
  FusionReport report;
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    const ir::Node& n = g.node(id);
    if (n.op != OpKind::Gelu || n.inputs.size() != 1) continue;
    // Its input: the f32 result of a product whose operands are bf16 (a projection under bf16 mixed precision).
    const ir::Value& x = g.value(n.inputs[0]);
    if (x.dtype != DType::f32 || x.producer == kNone || g.is_output(n.inputs[0])) continue;
    const ir::Node& product = g.node(x.producer);
    if ((product.op != OpKind::Linear && product.op != OpKind::MatMul) ||
        g.value(product.inputs[0]).dtype != DType::bf16)
      continue;
    // Gelu reads bf16 and still writes f32: only its input changes.
    const ValueId rounded =
        g.insert_before(id, OpKind::Cast, {n.inputs[0]}, ir::Attrs{{"dtype", std::string("bf16")}})[0];
    g.node(id).inputs[0] = rounded;
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
