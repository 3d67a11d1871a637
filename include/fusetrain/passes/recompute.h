// Passes on the training graph after autodiff: activation checkpointing, and where the casts of
// mixed precision happen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fusetrain/ir/graph.h"

namespace fusetrain::passes {

/// What recompute_segments changed.
struct RecomputeReport {
  int64_t segments = 0;      ///< segments whose activations backward now recomputes
  int64_t nodes_cloned = 0;  ///< forward nodes added to backward
  int64_t values_freed = 0;  ///< forward values backward no longer reads
};

/// Activation checkpointing (per transformer layer): trades one extra forward
/// per segment for not keeping the segment's activations alive until backward.
///
/// `boundaries` are values in node order (a layer's input, then each layer's
/// output); the forward nodes after boundary i−1's producer up to and including
/// boundary i's producer form segment i. For each segment, the forward values that backward reads are
/// recomputed by clones of the forward nodes that produce them, placed just before
/// the first backward node that reads one of them, and backward is rewired to the
/// clones; the boundaries themselves stay saved. Clones keep their attributes, so
/// dropout (a counter-based stream keyed by seed and step) draws the same masks and
/// gradients are bit-identical to the graph without recompute.
RecomputeReport recompute_segments(ir::Graph& graph, const std::vector<ir::ValueId>& boundaries);

/// What recast_weights_for_backward changed.
struct RecastReport {
  int64_t casts = 0;       ///< weight casts given a second cast for backward
  size_t bytes_freed = 0;  ///< weight copies no longer kept from forward to backward
};

/// Mixed precision keeps a bf16 (or f16) copy of every weight for the matmuls; backward
/// reads it again (dx = dy·w); a LoRA model's bf16 base weights are read by f32 plans through an f32 copy, the
/// same way. Instead of keeping forward's copy alive until then, through
/// the end of forward where activation memory peaks, a Cast of a parameter that backward
/// reads is cloned just before its first backward reader, and backward reads the clone.
/// Costs a second cast of each weight per step; results are bit-identical (a cast is exact
/// and deterministic).
RecastReport recast_weights_for_backward(ir::Graph& graph);

/// What merge_duplicate_casts changed.
struct MergeCastsReport {
  int64_t casts = 0;       ///< casts removed because an earlier one made the same copy
  size_t bytes_saved = 0;  ///< their outputs, each a buffer that was also kept for backward
};

/// Models cast a value for each product that reads it (a layer's input, once for each of the query,
/// key and value projections). Forward casts of the same value to the same dtype are merged into the
/// first, so one copy is made and saved for backward instead of three. Runs after autodiff, on the
/// forward nodes, so gradients are bit-identical.
MergeCastsReport merge_duplicate_casts(ir::Graph& graph);

/// What recompute_gelu_outputs changed.
struct GeluRecomputeReport {
  int64_t gelus = 0;       ///< GELU outputs backward now recomputes
  size_t bytes_freed = 0;  ///< the values no longer kept from forward to backward
};

/// GELU's backward keeps its input z; the product after it keeps GELU's output y (or y's bf16
/// cast) for its weight gradient: two (rows, intermediate) activations per MLP. For each Gelu or
/// LinearGelu whose z backward reads anyway, the y (or its cast) that backward reads is computed
/// again from z just before its first backward reader, so forward's copy dies in forward. Costs
/// one GELU (and cast) per MLP per step; results are bit-identical (the same kernels on the same z).
GeluRecomputeReport recompute_gelu_outputs(ir::Graph& graph);

/// What relu_backward_from_output changed.
struct ReluBackwardReport {
  int64_t relus = 0;       ///< ReluBackward nodes that read the ReLU's output instead of its input
  size_t bytes_freed = 0;  ///< ReLU inputs no longer kept from forward to backward
};

/// ReluBackward(dy, z) keeps the ReLU's input z while the product after the ReLU keeps its output y for its weight
/// gradient (T5's feed-forward): two (rows, intermediate) activations per MLP. Where backward reads y anyway,
/// ReluBackward reads y instead (y > 0 exactly where z > 0), so z dies in forward. No extra work; results are
/// bit-identical.
ReluBackwardReport relu_backward_from_output(ir::Graph& graph);

/// What fold_output_casts changed.
struct OutputCastsReport {
  int64_t casts = 0;       ///< casts removed: their producer now writes bf16 itself
  size_t bytes_saved = 0;  ///< the f32 results no longer written
};

/// A bf16 model casts GELU's result to bf16 for the product after it, and a bf16 projection's result for the
/// attention or product that reads it. Where a Gelu's, a LinearGelu's or a bf16 Linear's f32 output is read only
/// by a Cast to bf16 (a Linear's directly or through Reshapes, as its heads are split), the op rounds its result to
/// bf16 itself (out_dtype; the Linear in its GEMM epilogue, the Reshapes then carrying bf16) and the Cast goes: no
/// f32 copy is written and read back. The rounding is the Cast kernel's, so results are bit-identical. Runs on the
/// whole graph after autodiff and the passes that clone GELUs into backward, so recomputed GELUs fold too.
OutputCastsReport fold_output_casts(ir::Graph& graph);

}  // namespace fusetrain::passes
