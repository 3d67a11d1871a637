// Activation checkpointing: clone each segment's forward into backward.
#include "fusetrain/passes/recompute.h"

#include <algorithm>
#include <map>

#include "fusetrain/core/error.h"
#include "passes/names.h"

namespace fusetrain::passes {

RecomputeReport recompute_segments(ir::Graph& graph, const std::vector<ValueId>& boundaries) {
  RecomputeReport report;
  auto is_backward = [&](NodeId n) { return graph.node(n).phase == ir::Phase::Backward; };
  std::vector<NodeId> producers;
  for (ValueId b : boundaries) {
    NodeId p = graph.value(b).producer;
    FT_CHECK(p != kNone && !is_backward(p), "recompute: boundary ", graph.describe(b),
             " is not produced by a forward node");
    FT_CHECK(producers.empty() || p > producers.back(), "recompute: boundaries must follow node order");
    producers.push_back(p);
  }

  const NodeId original_nodes = static_cast<NodeId>(graph.nodes().size());
  for (size_t s = 1; s < producers.size(); ++s) {
    const NodeId first = producers[s - 1] + 1, last = producers[s];
    auto in_segment = [&](ValueId v) {
      NodeId p = graph.value(v).producer;
      return p != kNone && p >= first && p <= last;
    };
    // Forward values of this segment that backward reads, and where backward first reads one.
    std::vector<std::vector<NodeId>> consumers = graph.consumers();
    std::vector<ValueId> saved;
    NodeId first_reader = original_nodes;
    for (NodeId n = first; n <= last; ++n)
      for (ValueId out : graph.node(n).outputs) {
        if (out == boundaries[s] || graph.is_output(out)) continue;
        bool read_by_backward = false;
        for (NodeId c : consumers[static_cast<size_t>(out)])
          if (is_backward(c)) {
            read_by_backward = true;
            first_reader = std::min(first_reader, c);
          }
        if (read_by_backward) saved.push_back(out);
      }
    if (saved.empty()) continue;

    // The segment nodes those values need, found backwards from them.
    std::vector<bool> needed(static_cast<size_t>(last - first + 1), false);
    for (ValueId v : saved) needed[static_cast<size_t>(graph.value(v).producer - first)] = true;
    for (NodeId n = last; n >= first; --n) {
      if (!needed[static_cast<size_t>(n - first)]) continue;
      for (ValueId in : graph.node(n).inputs)
        if (in_segment(in)) needed[static_cast<size_t>(graph.value(in).producer - first)] = true;
    }

    // Clone them in order, just before the first backward reader; clones read clones where the
    // original read the segment, and backward reads the clones instead of the saved values.
    std::map<ValueId, ValueId> clone_of;
    int64_t cloned = 0;
    for (NodeId n = first; n <= last; ++n) {
      if (!needed[static_cast<size_t>(n - first)]) continue;
      const ir::Node& original = graph.node(n);
      std::vector<ValueId> inputs = original.inputs;
      for (ValueId& in : inputs)
        if (auto it = clone_of.find(in); it != clone_of.end()) in = it->second;
      std::vector<ValueId> outs = graph.insert_before(first_reader, original.op, inputs, original.attrs, original.name);
      for (size_t k = 0; k < outs.size(); ++k) clone_of[original.outputs[k]] = outs[k];
      ++cloned;
    }
    for (ValueId v : saved)
      graph.replace_uses_if(v, clone_of.at(v), [&](const ir::Node& reader) {
        return reader.phase == ir::Phase::Backward && reader.id < original_nodes;
      });
    report.segments += 1;
    report.nodes_cloned += cloned;
    report.values_freed += static_cast<int64_t>(saved.size());
  }
  graph.commit();
  return report;
}

}  // namespace fusetrain::passes
