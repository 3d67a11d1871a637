// Storage planning: which bytes of one arena every activation, scratch buffer and gradient
// temporary of a schedule lives in. Liveness comes from the schedule; the only op property read is
// whether an output may take over an input's memory (the op table's in-place and alias flags).
#pragma once

#include <cstddef>
#include <vector>

#include "fusetrain/ir/graph.h"
#include "fusetrain/memory/planner.h"

namespace fusetrain::memory {

/// One scheduled node, as the storage planner sees it.
struct ScheduledNode {
  const ir::Node* node = nullptr;
  size_t scratch_bytes = 0;  ///< arena memory its kernel needs while it runs
  bool accumulates = false;  ///< its kernel adds into gradient outputs itself (else: a temporary, added after)
};

/// Where everything lives.
struct StoragePlan {
  /// Per value id: its buffer (index into `buffers`), or -1 when it lives elsewhere: inputs, parameters, and the
  /// gradients bound to the parameter store.
  std::vector<int> buffer_of;
  /// Per scheduled node: its scratch buffer, or -1.
  std::vector<int> scratch_of;
  /// Per scheduled node, per gradient output in order: the temporary its kernel writes before the result is
  /// added into the gradient, or -1 where the kernel accumulates itself.
  std::vector<std::vector<int>> temporaries_of;
  std::vector<BufferRequest> buffers;
  ArenaPlan arena;          ///< offsets of `buffers`, checked by check_arena
  size_t naive_bytes = 0;   ///< every activation and scratch buffer in its own bytes
  size_t num_in_place = 0;  ///< outputs that reuse their input's memory
};

/// True for the values a plan binds to the parameter store's gradient buffer: a graph output that is a
/// parameter's gradient.
bool is_bound_gradient(const ir::Graph& graph, ir::ValueId value);

/// Plans the storage of `schedule` (nodes of `graph` in execution order). An output shares its input's
/// buffer when the op is an alias (Reshape), or when `in_place` holds, the op allows it and the input dies at
/// this node (same size and dtype, not a graph output, not read again at another slot of a non-elementwise op).
/// Graph outputs live to the end. The arena is planned best-fit and checked.
StoragePlan plan_storage(const ir::Graph& graph, const std::vector<ScheduledNode>& schedule, bool in_place);

}  // namespace fusetrain::memory
