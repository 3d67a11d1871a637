// Identical casts in forward merged into one, and casts of GELU results folded into the GELU
// (see recompute.h).
#include <map>
#include <utility>

#include "fusetrain/core/error.h"
#include "fusetrain/passes/recompute.h"
#include "passes/remove_nodes.h"

namespace fusetrain::passes {

using ir::NodeId;
using ir::ValueId;

MergeCastsReport merge_duplicate_casts(ir::Graph& graph, size_t backward_begin) {
  MergeCastsReport report;
  FT_CHECK(backward_begin <= graph.nodes().size(), "merge_duplicate_casts: backward begins at node ", backward_begin,
           " but the graph has ", graph.nodes().size(), " nodes");
  std::map<std::pair<ValueId, DType>, ValueId> first;  // (input, dtype) -> the first cast's output
  std::map<ValueId, ValueId> replace;                  // a duplicate's output -> the first's
  std::vector<bool> dead(graph.nodes().size(), false);
  for (NodeId n = 0; n < static_cast<NodeId>(backward_begin); ++n) {
    const ir::Node& cast = graph.node(n);
    if (cast.op != ir::OpKind::Cast || graph.is_output(cast.outputs[0])) continue;
    const ValueId out = cast.outputs[0];
    auto [it, inserted] = first.emplace(std::make_pair(cast.inputs[0], graph.value(out).dtype), out);
    if (inserted) continue;
    replace[out] = it->second;
    dead[static_cast<size_t>(n)] = true;
    report.casts += 1;
    report.bytes_saved += static_cast<size_t>(graph.value(out).shape.numel()) * dtype_size(graph.value(out).dtype);
  }
  if (report.casts > 0) replace_and_remove(graph, replace, dead);
  return report;
}

OutputCastsReport fold_output_casts(ir::Graph& graph) {
  OutputCastsReport report;
  const std::vector<std::vector<NodeId>> consumers = graph.consumers();
  std::map<ValueId, ValueId> replace;  // a removed cast's output -> the producer's, now bf16
  std::vector<bool> dead(graph.nodes().size(), false);
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
    replace[cast.outputs[0]] = y;
    dead[static_cast<size_t>(cast.id)] = true;
    report.casts += 1;
    report.bytes_saved += static_cast<size_t>(value.shape.numel()) * dtype_size(DType::f32);
  }
  if (report.casts > 0) replace_and_remove(graph, replace, dead);
  return report;
}

}  // namespace fusetrain::passes
