// GELU's backward as the epilogue of the GEMM that forms its incoming gradient (see fusion.h).
#include <vector>

#include "fusetrain/passes/fusion.h"
#include "passes/names.h"

namespace fusetrain::passes {
namespace {

// Whether `v` is read by exactly one node and is no graph output.
bool read_once(const ir::Graph& g, const std::vector<std::vector<NodeId>>& consumers, ValueId v) {
  return consumers[static_cast<size_t>(v)].size() == 1 && !g.is_output(v);
}

// The MatMul whose f32 result reaches `dy` through Reshapes alone, each value on the way read by nothing else, and
// that is one GEMM (b 2-D, a untransposed when it has batch axes); kNone if there is none. `reshapes` receives the
// Reshapes on the way.
NodeId product_of(const ir::Graph& g, const std::vector<std::vector<NodeId>>& consumers, ValueId dy,
                  std::vector<NodeId>& reshapes) {
  ValueId v = dy;
  for (;;) {
    if (!read_once(g, consumers, v) || g.value(v).producer == kNone) return kNone;
    const ir::Node& producer = g.node(g.value(v).producer);
    if (producer.op == OpKind::Reshape) {
      reshapes.push_back(producer.id);
      v = producer.inputs[0];
      continue;
    }
    if (producer.op != OpKind::MatMul || g.value(v).dtype != DType::f32) return kNone;
    const ir::Value& a = g.value(producer.inputs[0]);
    const ir::Value& b = g.value(producer.inputs[1]);
    if ((a.dtype != DType::f32 && a.dtype != DType::bf16) || b.shape.rank() != 2 ||
        (a.shape.rank() > 2 && producer.attrs.get_int("trans_a", 0) != 0))
      return kNone;
    return producer.id;
  }
}

// A GELU of x computed again in backward after `after` (recompute_gelu_outputs), of the same form, not yet taken;
// kNone if there is none.
NodeId recomputed_gelu(const ir::Graph& g, const std::vector<std::vector<NodeId>>& consumers, ValueId x,
                       NodeId after, const std::string& approximate) {
  for (NodeId id : consumers[static_cast<size_t>(x)]) {
    const ir::Node& n = g.node(id);
    if (n.op == OpKind::Gelu && id > after && !g.is_removed(id) && n.phase == ir::Phase::Backward &&
        n.attrs.get_string("approximate", "none") == approximate && !g.is_output(n.outputs[0]))
      return id;
  }
  return kNone;
}

}  // namespace

FusionReport fuse_matmul_gelu_backward(ir::Graph& g) {
  FusionReport report;
  const std::vector<std::vector<NodeId>> consumers = g.consumers();
  for (NodeId id = 0; id < static_cast<NodeId>(g.nodes().size()); ++id) {
    const ir::Node& gb = g.node(id);
    if (gb.op != OpKind::GeluBackward || g.is_removed(id)) continue;
    const ValueId x = gb.inputs[1], dx = gb.outputs[0];
    const Shape& xs = g.value(x).shape;
    std::vector<NodeId> reshapes;
    const NodeId mm_id = product_of(g, consumers, gb.inputs[0], reshapes);
    if (mm_id == kNone) continue;
    const ir::Node& mm = g.node(mm_id);
    // The fused node runs where the MatMul did: x must be ready there, and the product must fill x row for row.
    const NodeId x_producer = g.value(x).producer;
    if ((x_producer != kNone && x_producer > mm_id) || xs.rank() < 1 || g.value(mm.outputs[0]).shape[-1] != xs[-1])
      continue;
    const std::string approximate = gb.attrs.get_string("approximate", "none");
    ir::Attrs attrs{{"trans_a", mm.attrs.get_int("trans_a", 0)},
                    {"trans_b", mm.attrs.get_int("trans_b", 0)},
                    {"approximate", approximate}};
    // dx cast to bf16 for the next GEMMs and summed for the bias gradient (CastColumnSum): both from the epilogue.
    std::vector<ValueId> outputs{dx};
    NodeId cast_sum = kNone;
    if (read_once(g, consumers, dx)) {
      const ir::Node& reader = g.node(consumers[static_cast<size_t>(dx)][0]);
      if (reader.op == OpKind::CastColumnSum && g.value(reader.outputs[0]).dtype == DType::bf16) cast_sum = reader.id;
    }
    if (cast_sum != kNone) {
      outputs = g.node(cast_sum).outputs;
      attrs.set("out_dtype", std::string("bf16"));
      attrs.set("column_sum", int64_t{1});
    }
    const NodeId gelu = recomputed_gelu(g, consumers, x, mm_id, approximate);
    if (gelu != kNone) {
      const ValueId y = g.node(gelu).outputs[0];
      outputs.push_back(y);
      attrs.set("gelu_out", int64_t{1});
      attrs.set("gelu_dtype", std::string(g.value(y).dtype == DType::bf16 ? "bf16" : "f32"));
    }
    g.fuse_into(mm_id, OpKind::MatMulGeluBackward, {mm.inputs[0], mm.inputs[1], x}, attrs, outputs);
    g.remove_node(id);
    for (NodeId r : reshapes) g.remove_node(r);
    if (cast_sum != kNone) g.remove_node(cast_sum);
    if (gelu != kNone) g.remove_node(gelu);
    report.fused += 1;
  }
  report.nodes_removed = g.commit();
  return report;
}

}  // namespace fusetrain::passes
