// Identical casts in forward merged into one, and casts of GELU results folded into the GELU
// (see recompute.h).
#include <map>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/passes/recompute.h"
#include "passes/names.h"

namespace fusetrain::passes {

MergeCastsReport merge_duplicate_casts(ir::Graph& graph) {
  MergeCastsReport report;
  std::map<std::pair<ValueId, DType>, ValueId> first;  // (input, dtype) -> the first cast's output
  for (const ir::Node& cast : graph.nodes()) {
    if (cast.phase != ir::Phase::Forward || cast.op != ir::OpKind::Cast || graph.is_output(cast.outputs[0])) continue;
    const ValueId out = cast.outputs[0];
    auto [it, inserted] = first.emplace(std::make_pair(cast.inputs[0], graph.value(out).dtype), out);
    if (inserted) continue;
    graph.replace_all_uses(out, it->second);
    graph.remove_node(cast.id);
    report.casts += 1;
    report.bytes_saved += static_cast<size_t>(graph.value(out).shape.numel()) * dtype_size(graph.value(out).dtype);
  }
  graph.commit();
  return report;
}

OutputCastsReport fold_output_casts(ir::Graph& graph) {
  OutputCastsReport report;
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  for (const ir::Node& cast : graph.nodes()) {
    if (cast.op != ir::OpKind::Cast || graph.value(cast.outputs[0]).dtype != DType::bf16 ||
        graph.is_output(cast.outputs[0]))
      continue;
    const ValueId y = cast.inputs[0];
    const ir::Value& value = graph.value(y);
    if (value.producer == ir::kNone || value.dtype != DType::f32 || graph.is_output(y) ||
        consumers[static_cast<size_t>(y)].size() != 1)
      continue;
    ir::Node& producer = graph.node(value.producer);
    const bool gelu = producer.op == ir::OpKind::Gelu || (producer.op == ir::OpKind::LinearGelu && value.output_index == 0);
    if (!gelu) continue;
    producer.attrs.set("out_dtype", std::string("bf16"));
    graph.value(y).dtype = DType::bf16;
    graph.replace_all_uses(cast.outputs[0], y);
    graph.remove_node(cast.id);
    report.casts += 1;
    report.bytes_saved += static_cast<size_t>(value.shape.numel()) * dtype_size(DType::f32);
  }
  graph.commit();
  return report;
}

}  // namespace fusetrain::passes
