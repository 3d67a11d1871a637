// Transpose folding into attention (see fusion.h).
#include <algorithm>

#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {

namespace {

// The node producing v when it is a Transpose swapping axes 1 and 2 of a 4-D value.
const ir::Node* heads_transpose(const ir::Graph& g, ValueId v) {
  NodeId p = g.value(v).producer;
  if (p == kNone) return nullptr;
  const ir::Node& n = g.node(p);
  if (n.op != OpKind::Transpose || g.value(v).shape.rank() != 4) return nullptr;
  return n.attrs.get_ints("perm") == std::vector<int64_t>{0, 2, 1, 3} ? &n : nullptr;
}

}  // namespace

FusionReport fold_attention_transposes(ir::Graph& g) {
  FusionReport report;
  std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    ir::Node& n = g.node(id);
    if (n.op != OpKind::Attention || n.attrs.get_int("seq_major", 0) != 0) continue;
    const ir::Node* in[3] = {heads_transpose(g, n.inputs[0]), heads_transpose(g, n.inputs[1]),
                             heads_transpose(g, n.inputs[2])};
    if (!in[0] || !in[1] || !in[2]) continue;
    const ValueId out = n.outputs[0];
    const std::vector<NodeId>& readers = consumers[static_cast<size_t>(out)];
    if (g.is_output(out) || g.is_output(n.outputs[1]) || readers.size() != 1) continue;
    const ir::Node& back = g.node(readers[0]);
    if (!heads_transpose(g, back.outputs[0]) || g.is_output(back.outputs[0])) continue;

    // Read the (B, T, H, D) values, write (B, T, H, D), and let the transpose's readers read that.
    for (int i = 0; i < 3; ++i) n.inputs[static_cast<size_t>(i)] = in[i]->inputs[0];
    n.attrs.set("seq_major", int64_t{1});
    g.value(out).shape = g.value(back.outputs[0]).shape;
    g.replace_all_uses(back.outputs[0], out);
    g.remove_node(back.id);
    for (const ir::Node* t : in) {
      std::vector<NodeId>& r = consumers[static_cast<size_t>(t->outputs[0])];
      r.erase(std::find(r.begin(), r.end(), id));
      if (r.empty() && !g.is_output(t->outputs[0])) g.remove_node(t->id);
    }
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
