// GELU, SwiGLU and attention results in bf16 under bf16 mixed precision, as autocast hands them on (see fusion.h).
#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {

// v is the f32 result of a product whose operands are bf16 (a projection under bf16 mixed precision).
bool from_bf16_product(const ir::Graph& g, ValueId v) {
  const ir::Value& x = g.value(v);
  if (x.dtype != DType::f32 || x.producer == kNone || g.is_output(v)) return false;
  const ir::Node& product = g.node(x.producer);
  return (product.op == OpKind::Linear || product.op == OpKind::MatMul) &&
         g.value(product.inputs[0]).dtype == DType::bf16;
}

// Input `at` of node `id` read through a Cast to bf16.
void round_input(ir::Graph& g, NodeId id, size_t at) {
  const ValueId rounded =
      g.insert_before(id, OpKind::Cast, {g.node(id).inputs[at]}, ir::Attrs{{"dtype", std::string("bf16")}})[0];
  g.node(id).inputs[at] = rounded;
}

// y is now bf16: a reader's Cast to bf16 goes, a Reshape or Transpose (when `through_views`) carries bf16 on to its
// own readers, and every other reader gets one widening Cast.
void hand_over_bf16(ir::Graph& g, ValueId y, const std::vector<std::vector<NodeId>>& consumers, bool through_views) {
  ValueId widened = kNone;
  for (const NodeId r : consumers[static_cast<size_t>(y)]) {  // in node order
    const ir::Node& reader = g.node(r);
    const ValueId out = reader.outputs[0];
    if (reader.op == OpKind::Cast && g.value(out).dtype == DType::bf16) {
      g.replace_all_uses(out, y);
      g.remove_node(r);
      continue;
    }
    if (through_views && (reader.op == OpKind::Reshape || reader.op == OpKind::Transpose) && !g.is_output(out)) {
      g.value(out).dtype = DType::bf16;
      hand_over_bf16(g, out, consumers, true);
      continue;
    }
    if (widened == kNone)
      widened = g.insert_before(r, OpKind::Cast, {y}, ir::Attrs{{"dtype", std::string("f32")}})[0];
    for (ValueId& in : g.node(r).inputs)
      if (in == y) in = widened;
  }
}

}  // namespace

FusionReport round_activation_inputs(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  const NodeId count = static_cast<NodeId>(g.nodes().size());
  for (NodeId id = 0; id < count; ++id) {
    const ir::Node& n = g.node(id);
    if (n.op == OpKind::Gelu && n.inputs.size() == 1 && from_bf16_product(g, n.inputs[0])) {
      round_input(g, id, 0);  // Gelu reads bf16 and still writes f32: only its input changes
      report.fused += 1;
    } else if (n.op == OpKind::SwiGLU && n.inputs.size() == 2 && from_bf16_product(g, n.inputs[0]) &&
               from_bf16_product(g, n.inputs[1]) && !g.is_output(n.outputs[0])) {
      const ValueId y = n.outputs[0];
      round_input(g, id, 0);
      round_input(g, id, 1);
      g.value(y).dtype = DType::bf16;
      hand_over_bf16(g, y, consumers, false);
      report.fused += 1;
    } else if (n.op == OpKind::Attention && g.value(n.inputs[0]).dtype == DType::bf16 &&
               g.value(n.outputs[0]).dtype == DType::f32 && !g.is_output(n.outputs[0])) {
      // bf16 q, k, v: the output in bf16 too, as scaled_dot_product_attention's under autocast (and backward's
      // Di from it); the heads merge carries it to the output projection.
      const ValueId y = n.outputs[0];
      g.node(id).attrs.set("out_dtype", std::string("bf16"));
      g.value(y).dtype = DType::bf16;
      hand_over_bf16(g, y, consumers, true);
      report.fused += 1;
    }
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
