// Bias + GELU into the Linear's GEMM epilogue: LinearGelu (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/remove_nodes.h"

namespace fusetrain::passes {

using ir::kNone;
using ir::NodeId;
using ir::OpKind;
using ir::ValueId;

FusionReport fuse_linear_gelu(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  std::vector<bool> dead(g.nodes().size(), false);
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    ir::Node& gelu = g.node(id);
    if (gelu.op != OpKind::Gelu) continue;
    const ValueId z = gelu.inputs[0];
    const ir::Value& pre = g.value(z);
    if (pre.producer == kNone || g.is_output(z) || consumers[static_cast<size_t>(z)].size() != 1) continue;
    const ir::Node& linear = g.node(pre.producer);
    if (linear.op != OpKind::Linear) continue;
    // The Gelu node becomes the fused node: it keeps its output (y = gelu(z)) and now also
    // produces z, which only it read.
    gelu.op = OpKind::LinearGelu;
    gelu.inputs = linear.inputs;
    gelu.attrs = {{"approximate", gelu.attrs.get_string("approximate", "none")}};
    gelu.outputs.push_back(z);
    g.value(z).producer = gelu.id;
    g.value(z).output_index = 1;
    dead[static_cast<size_t>(linear.id)] = true;
    report.fused += 1;
  }
  if (report.fused > 0) report.nodes_removed = remove_nodes(g, dead);
  return report;
}

}  // namespace fusetrain::passes
