// Activation checkpointing: clone each segment's forward into backward.
#include "fusetrain/passes/recompute.h"

#include <algorithm>
#include <map>

#include "fusetrain/core/error.h"

namespace fusetrain::passes {

using ir::kNone;
using ir::NodeId;
using ir::ValueId;

RecomputeReport recompute_segments(ir::Graph& graph, const std::vector<ValueId>& boundaries, size_t backward_begin) {
  RecomputeReport report;
  const size_t forward_nodes = backward_begin;
  FT_CHECK(forward_nodes <= graph.nodes().size(), "recompute: backward begins at node ", backward_begin,
           " but the graph has ", graph.nodes().size(), " nodes");
  std::vector<NodeId> producers;
  for (ValueId b : boundaries) {
    NodeId p = graph.value(b).producer;
    FT_CHECK(p != kNone && static_cast<size_t>(p) < forward_nodes, "recompute: boundary ", graph.describe(b),
             " is not produced by a forward node");
    FT_CHECK(producers.empty() || p > producers.back(), "recompute: boundaries must follow node order");
    producers.push_back(p);
  }

  // For each clone block, the backward node it goes before (blocks are appended in segment order).
  std::vector<std::pair<NodeId, std::vector<NodeId>>> blocks;
  for (size_t s = 1; s < producers.size(); ++s) {
    const NodeId first = producers[s - 1] + 1, last = producers[s];
    auto in_segment = [&](ValueId v) {
      NodeId p = graph.value(v).producer;
      return p != kNone && p >= first && p <= last;
    };
    // Forward values of this segment that backward reads, and where backward first reads one.
    std::vector<std::vector<NodeId>> consumers = graph.consumers();
    std::vector<ValueId> saved;
    NodeId first_reader = static_cast<NodeId>(graph.nodes().size());
    for (NodeId n = first; n <= last; ++n)
      for (ValueId out : graph.node(n).outputs) {
        if (out == boundaries[s] || graph.is_output(out)) continue;
        bool read_by_backward = false;
        for (NodeId c : consumers[static_cast<size_t>(out)])
          if (static_cast<size_t>(c) >= forward_nodes) {
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

    // Clone them in order; clones read clones where the original read the segment.
    std::map<ValueId, ValueId> clone_of;
    std::vector<NodeId> block;
    for (NodeId n = first; n <= last; ++n) {
      if (!needed[static_cast<size_t>(n - first)]) continue;
      const ir::Node original = graph.node(n);  // a copy: add_node may grow the node list
      std::vector<ValueId> inputs = original.inputs;
      for (ValueId& in : inputs)
        if (auto it = clone_of.find(in); it != clone_of.end()) in = it->second;
      std::vector<ValueId> outs = graph.add_node(original.op, inputs, original.attrs, original.name);
      for (size_t k = 0; k < outs.size(); ++k) clone_of[original.outputs[k]] = outs[k];
      block.push_back(static_cast<NodeId>(graph.nodes().size() - 1));
    }
    for (size_t n = forward_nodes; n < graph.nodes().size(); ++n) {
      if (std::find(block.begin(), block.end(), static_cast<NodeId>(n)) != block.end()) continue;
      for (ValueId& in : graph.node(static_cast<NodeId>(n)).inputs)
        if (auto it = clone_of.find(in); it != clone_of.end() && std::find(saved.begin(), saved.end(), in) != saved.end())
          in = it->second;
    }
    report.segments += 1;
    report.nodes_cloned += static_cast<int64_t>(block.size());
    report.values_freed += static_cast<int64_t>(saved.size());
    blocks.emplace_back(first_reader, std::move(block));
  }
  if (blocks.empty()) return report;

  // The schedule: the original nodes, each block just before its first reader.
  const size_t original_nodes = graph.nodes().size() - static_cast<size_t>(report.nodes_cloned);
  std::multimap<NodeId, const std::vector<NodeId>*> before;
  for (const auto& [reader, block] : blocks) before.emplace(reader, &block);
  std::vector<NodeId> order;
  order.reserve(graph.nodes().size());
  for (NodeId n = 0; n < static_cast<NodeId>(original_nodes); ++n) {
    auto [lo, hi] = before.equal_range(n);
    for (auto it = lo; it != hi; ++it) order.insert(order.end(), it->second->begin(), it->second->end());
    order.push_back(n);
  }
  graph.reorder_nodes(order);
  graph.verify();
  return report;
}

}  // namespace fusetrain::passes
