// What fusion passes share: dropping the nodes a rewrite made dead.
#pragma once

#include <cstdint>
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

}  // namespace fusetrain::passes
