// bf16 casts of weights folded into the GEMMs that read them (see recompute.h).
#include "fusetrain/passes/recompute.h"
#include "passes/remove_nodes.h"

namespace fusetrain::passes {

using ir::kNone;
using ir::NodeId;
using ir::OpKind;
using ir::ValueId;

namespace {

// True if `reader` takes `copy` only as the weight of a product whose other operand is bf16 and
// that the tuned kernels compute with an f32 weight: a Linear's w, or a single (unbatched)
// MatMul's b with an f32 result.
bool reads_as_gemm_weight(const ir::Graph& g, const ir::Node& reader, ValueId copy) {
  if (reader.inputs[0] == copy || reader.inputs[1] != copy) return false;
  for (size_t i = 2; i < reader.inputs.size(); ++i)
    if (reader.inputs[i] == copy) return false;
  const ir::Value& a = g.value(reader.inputs[0]);
  if (a.dtype != DType::bf16) return false;
  if (reader.op == OpKind::Linear || reader.op == OpKind::LinearGelu) return true;
  if (reader.op != OpKind::MatMul || g.value(reader.outputs[0]).dtype != DType::f32) return false;
  return a.shape.rank() == 2 || reader.attrs.get_int("trans_a", 0) == 0;  // one GEMM over a's rows
}

}  // namespace

FoldCastsReport fold_weight_casts(ir::Graph& graph) {
  FoldCastsReport report;
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  std::vector<bool> dead(graph.nodes().size(), false);
  for (NodeId n = 0; n < static_cast<NodeId>(graph.nodes().size()); ++n) {
    const ir::Node& cast = graph.node(n);
    if (cast.op != OpKind::Cast) continue;
    const ValueId weight = cast.inputs[0], copy = cast.outputs[0];
    const ir::Value& w = graph.value(weight);
    if (w.kind != ir::ValueKind::Param || w.dtype != DType::f32 || w.shape.rank() != 2 ||
        graph.value(copy).dtype != DType::bf16 || graph.is_output(copy))
      continue;
    const std::vector<NodeId>& readers = consumers[static_cast<size_t>(copy)];
    bool foldable = !readers.empty();
    for (NodeId r : readers) foldable = foldable && reads_as_gemm_weight(graph, graph.node(r), copy);
    if (!foldable) continue;
    for (NodeId r : readers) graph.node(r).inputs[1] = weight;
    dead[static_cast<size_t>(n)] = true;
    report.casts += 1;
    report.readers += static_cast<int64_t>(readers.size());
    report.bytes_saved += static_cast<size_t>(w.shape.numel()) * dtype_size(DType::bf16);
  }
  if (report.casts > 0) remove_nodes(graph, dead);
  return report;
}

}  // namespace fusetrain::passes
