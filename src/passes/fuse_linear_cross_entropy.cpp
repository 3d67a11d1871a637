// Language-model head + loss: LinearCrossEntropy (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {

// Whether v may take a gradient: false only when it is an input or a frozen weight (LoRA's base), possibly cast,
// reshaped or transposed; any other computed value counts as taking one.
bool takes_gradient(const ir::Graph& g, ValueId v) {
  for (;;) {
    const ir::Value& value = g.value(v);
    if (value.producer == kNone) return value.kind == ir::ValueKind::Param;
    const ir::Node& n = g.node(value.producer);
    if (n.op != OpKind::Cast && n.op != OpKind::Reshape && n.op != OpKind::Transpose) return true;
    v = n.inputs[0];
  }
}

}  // namespace

FusionReport fuse_linear_cross_entropy(ir::Graph& g, int64_t chunk_rows) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  auto unread = [&](ValueId v) { return !g.is_output(v) && consumers[static_cast<size_t>(v)].empty(); };
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    ir::Node& loss = g.node(id);
    if (loss.op != OpKind::SoftmaxCrossEntropy) continue;
    const ValueId logits = loss.inputs[0], lse = loss.outputs[1];
    const ir::Value& l = g.value(logits);
    // The logits' readers: the loss, and perhaps a TokenStats of the same targets (its sums come from the fused op).
    NodeId stats = kNone;
    bool other_reader = false;
    for (NodeId reader : consumers[static_cast<size_t>(logits)]) {
      const ir::Node& r = g.node(reader);
      if (reader == id) continue;
      if (r.op == OpKind::TokenStats && stats == kNone && r.inputs[1] == loss.inputs[1] &&
          r.attrs.get_int("ignore_index", -100) == loss.attrs.get_int("ignore_index", -100))
        stats = reader;
      else
        other_reader = true;
    }
    if (l.producer == kNone || g.is_output(logits) || other_reader || !unread(lse)) continue;
    const ir::Node& linear = g.node(l.producer);
    const DType dtype = g.value(linear.inputs[0]).dtype;
    if (linear.op != OpKind::Linear || (dtype != DType::f32 && dtype != DType::bf16)) continue;
    const ValueId x = linear.inputs[0], w = linear.inputs[1];
    // The loss node becomes the fused node. It keeps the loss; lse's value becomes dx; dw and dbias are new.
    std::vector<ValueId> inputs{x, w, loss.inputs[1]};
    if (linear.inputs.size() == 3) inputs.push_back(linear.inputs[2]);
    loss.op = OpKind::LinearCrossEntropy;
    loss.inputs = inputs;
    loss.attrs = {{"ignore_index", loss.attrs.get_int("ignore_index", -100)}, {"chunk_rows", chunk_rows}};
    g.value(lse).shape = g.value(x).shape;
    g.value(lse).dtype = DType::f32;
    // A frozen head (LoRA) needs neither dw nor dbias: the kernel skips the dw GEMM, a third of its work.
    const bool weight_grad = takes_gradient(g, w) || (linear.inputs.size() == 3 && takes_gradient(g, linear.inputs[2]));
    if (!weight_grad) {
      loss.attrs.set("weight_grad", int64_t{0});
    } else {
      const Shape w_shape = g.value(w).shape;
      g.add_node_output(id, w_shape, DType::f32);
      g.add_node_output(id, Shape{w_shape[0]}, DType::f32);
    }
    if (stats != kNone) {  // the TokenStats output becomes the fused op's last output
      ir::Node& fused = g.node(id);
      const ValueId sums = g.node(stats).outputs[0];
      fused.attrs.set("token_stats", int64_t{1});
      g.value(sums).producer = id;
      g.value(sums).output_index = static_cast<int>(fused.outputs.size());
      fused.outputs.push_back(sums);
      g.node(stats).outputs.clear();
      g.remove_node(stats);
    }
    g.remove_node(linear.id);
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

FusionReport fuse_linear_log_probs(ir::Graph& g, bool input_grad, int64_t chunk_rows) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    ir::Node& node = g.node(id);
    if (node.op != OpKind::TokenLogProbs) continue;
    const ValueId logits = node.inputs[0];
    const ir::Value& l = g.value(logits);
    if (l.producer == kNone || g.is_output(logits) || consumers[static_cast<size_t>(logits)].size() != 1) continue;
    const ir::Node& linear = g.node(l.producer);
    const DType dtype = g.value(linear.inputs[0]).dtype;
    if (linear.op != OpKind::Linear || (dtype != DType::f32 && dtype != DType::bf16)) continue;
    const ValueId x = linear.inputs[0], w = linear.inputs[1];
    const bool row_stats = node.attrs.get_int("row_stats", 0) != 0;
    const ValueId stats = row_stats ? node.outputs[1] : kNone;
    std::vector<ValueId> inputs{x, w, node.inputs[1]};
    if (linear.inputs.size() == 3) inputs.push_back(linear.inputs[2]);
    node.op = OpKind::LinearLogProbs;
    node.inputs = inputs;
    node.attrs = {{"ignore_index", node.attrs.get_int("ignore_index", -100)},
                  {"chunk_rows", chunk_rows},
                  {"input_grad", int64_t{input_grad}},
                  {"row_stats", int64_t{row_stats}}};
    node.outputs.resize(1);
    const Shape rows = g.value(node.outputs[0]).shape;
    g.add_node_output(id, rows, DType::f32);  // lse
    if (input_grad) g.add_node_output(id, g.value(x).shape, DType::f32);
    if (row_stats) {  // the statistics stay the last output
      ir::Node& fused = g.node(id);
      g.value(stats).output_index = static_cast<int>(fused.outputs.size());
      fused.outputs.push_back(stats);
    }
    g.remove_node(linear.id);
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
