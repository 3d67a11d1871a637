// Reverse-mode autodiff that emits ordinary IR.
#pragma once

#include <vector>

#include "fusetrain/ir/graph.h"

namespace fusetrain::autodiff {

/// The gradient values build_backward added to a graph.
struct Gradients {
  /// grads[i] is d loss / d params[i]; kNone when params[i] does not affect the loss.
  std::vector<ir::ValueId> grads;
  /// The seed d loss / d loss (a Fill of 1).
  ir::ValueId seed = ir::kNone;
};

/// True if `op` has a gradient rule (exactly the ops flagged kDifferentiable).
bool has_grad_rule(ir::OpKind op);

/// Appends the backward pass for `loss` with respect to `params` to `graph`:
/// one gradient rule per differentiable op (autodiff/grads), only along paths
/// from a parameter to the loss, summing contributions of values read by several
/// nodes. Gradients are f32 whatever the forward precision (low-precision
/// GEMMs in backward still accumulate in f32). Each returned gradient is produced by a node of its own and marked as
/// a graph output, so a plan can bind it to the flat gradient buffer.
/// Throws Error if the loss is not a scalar or a non-differentiable op lies on a
/// path from a parameter to the loss. `seed` (optional) is the value backward starts
/// from instead of a constant 1: a graph input holding the loss scale makes every
/// gradient come out multiplied by it (fp16 loss scaling).
Gradients build_backward(ir::Graph& graph, ir::ValueId loss, const std::vector<ir::ValueId>& params,
                         ir::ValueId seed = ir::kNone);

}  // namespace fusetrain::autodiff
