// What graph passes share: dropping the nodes a rewrite made dead, and placing appended nodes
// earlier in the schedule.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "fusetrain/ir/graph.h"

namespace fusetrain::passes {

/// Removes the nodes marked in `dead` (indexed by node id), keeps the others in
/// order, re-verifies the graph and returns how many were removed.
inline int64_t remove_nodes(ir::Graph& g, const std::vector<bool>& dead) {
  std::vector<ir::NodeId> order;
  for (ir::NodeId id = 0; id < static_cast<ir::NodeId>(g.nodes().size()); ++id)
    if (!dead[static_cast<size_t>(id)]) order.push_back(id);
  const int64_t removed = static_cast<int64_t>(g.nodes().size() - order.size());
  g.reorder_nodes(order);
  g.verify();
  return removed;
}

/// Drops the nodes marked in `dead` after pointing every read of a key of `replace` at its value
/// (the output of a removed node at what takes its place); returns how many nodes were removed.
inline int64_t replace_and_remove(ir::Graph& g, const std::map<ir::ValueId, ir::ValueId>& replace,
                                  const std::vector<bool>& dead) {
  for (ir::NodeId n = 0; n < static_cast<ir::NodeId>(g.nodes().size()); ++n)
    for (ir::ValueId& in : g.node(n).inputs)
      if (auto r = replace.find(in); r != replace.end()) in = r->second;
  return remove_nodes(g, dead);
}

/// Reorders the graph so that every node appended after the first `original_nodes` runs just
/// before the original node it is keyed to in `before` (several for one key: in insertion
/// order), then re-verifies it.
inline void place_before(ir::Graph& g, ir::NodeId original_nodes, const std::multimap<ir::NodeId, ir::NodeId>& before) {
  std::vector<ir::NodeId> order;
  order.reserve(g.nodes().size());
  for (ir::NodeId n = 0; n < original_nodes; ++n) {
    auto [lo, hi] = before.equal_range(n);
    for (auto it = lo; it != hi; ++it) order.push_back(it->second);
    order.push_back(n);
  }
  g.reorder_nodes(order);
  g.verify();
}

}  // namespace fusetrain::passes
