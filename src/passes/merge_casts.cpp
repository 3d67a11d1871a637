// Identical casts in forward merged into one, and casts of GELU and bf16 projection results folded into their
// producer (see recompute.h).
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
    // The cast reads the result itself, or through Reshapes (a projection's heads split) that nothing else reads.
    auto sole_reader = [&](ValueId v) {
      return !graph.is_output(v) && consumers[static_cast<size_t>(v)].size() == 1 && graph.value(v).dtype == DType::f32;
    };
    std::vector<ValueId> chain;  // the cast's input, then each Reshape's input back to the result
    ValueId y = cast.inputs[0];
    if (!sole_reader(y)) continue;
    chain.push_back(y);
    while (graph.value(y).producer != ir::kNone && graph.node(graph.value(y).producer).op == ir::OpKind::Reshape &&
           sole_reader(graph.node(graph.value(y).producer).inputs[0])) {
      y = graph.node(graph.value(y).producer).inputs[0];
      chain.push_back(y);
    }
    const ir::Value& value = graph.value(y);
    if (value.producer == ir::kNone) continue;
    ir::Node& producer = graph.node(value.producer);
    const bool gelu = producer.op == ir::OpKind::Gelu || (producer.op == ir::OpKind::LinearGelu && value.output_index == 0);
    // A bf16 projection's result, not a parameter's gradient (those stay f32 and may accumulate).
    const bool projection = producer.op == ir::OpKind::Linear && graph.value(producer.inputs[0]).dtype == DType::bf16 &&
                            value.gradient_of == kNone;
    if (!gelu && !projection) continue;
    if (gelu && chain.size() > 1) continue;  // a GELU's result is cast where it is
    producer.attrs.set("out_dtype", std::string("bf16"));
    for (ValueId v : chain) graph.value(v).dtype = DType::bf16;
    graph.replace_all_uses(cast.outputs[0], chain.front());
    graph.remove_node(cast.id);
    report.casts += 1;
    report.bytes_saved += static_cast<size_t>(value.shape.numel()) * dtype_size(DType::f32);
  }
  graph.commit();
  return report;
}

}  // namespace fusetrain::passes
