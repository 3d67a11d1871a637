// Activation checkpointing as a graph rewrite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fusetrain/ir/graph.h"

namespace fusetrain::passes {

/// What recompute_segments changed.
struct RecomputeReport {
  int64_t segments = 0;       ///< segments whose activations backward now recomputes
  int64_t nodes_cloned = 0;   ///< forward nodes added to backward
  int64_t values_freed = 0;   ///< forward values backward no longer reads
};

/// Activation checkpointing (per transformer layer): trades one extra forward
/// per segment for not keeping the segment's activations alive until backward.
///
/// `boundaries` are values in node order (a layer's input, then each layer's
/// output); the forward nodes after boundary i−1's producer up to and including
/// boundary i's producer form segment i. Nodes at or after `backward_begin` are
/// backward. For each segment, the forward values that backward reads are
/// recomputed by clones of the forward nodes that produce them, placed just before
/// the first backward node that reads one of them, and backward is rewired to the
/// clones; the boundaries themselves stay saved. Clones keep their attributes, so
/// dropout (a counter-based stream keyed by seed and step) draws the same masks and
/// gradients are bit-identical to the graph without recompute.
RecomputeReport recompute_segments(ir::Graph& graph, const std::vector<ir::ValueId>& boundaries,
                                   size_t backward_begin);

}  // namespace fusetrain::passes
