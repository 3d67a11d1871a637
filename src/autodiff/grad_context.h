// What a gradient rule sees: its node's inputs and outputs, the gradients that
// reached the outputs, and where to put the gradients of the inputs.
#pragma once

#include <vector>

#include "fusetrain/ir/builder.h"
#include "fusetrain/ir/graph.h"

namespace fusetrain::autodiff {

class GradContext {
 public:
  GradContext(ir::Graph& graph, const ir::Node& node, std::vector<ir::ValueId> output_grads,
              std::vector<bool> input_needs_grad)
      : b(graph),
        g(graph),
        node_(node),
        output_grads_(std::move(output_grads)),
        needs_grad_(std::move(input_needs_grad)),
        input_grads_(node.inputs.size(), ir::kNone) {}

  ir::GraphBuilder b;  ///< emits backward nodes
  ir::Graph& g;

  const ir::Node& node() const { return node_; }
  const ir::Attrs& attrs() const { return node_.attrs; }
  ir::ValueId input(size_t i) const { return node_.inputs[i]; }
  ir::ValueId output(size_t i) const { return node_.outputs[i]; }
  size_t num_inputs() const { return node_.inputs.size(); }
  size_t num_outputs() const { return node_.outputs.size(); }
  Shape input_shape(size_t i) const { return g.value(node_.inputs[i]).shape; }
  DType input_dtype(size_t i) const { return g.value(node_.inputs[i]).dtype; }
  /// Gradient that reached output i; kNone if none did.
  ir::ValueId grad_output(size_t i) const { return output_grads_[i]; }
  /// Gradient of output i, or zeros of its shape if none reached it.
  ir::ValueId grad_output_or_zeros(size_t i);
  /// True if input i lies on a path from a parameter to the loss.
  bool needs_grad(size_t i) const { return needs_grad_[i]; }
  /// Records the gradient of input i (ignored when input i needs none).
  void set_grad_input(size_t i, ir::ValueId grad) {
    if (needs_grad_[i]) input_grads_[i] = grad;
  }
  const std::vector<ir::ValueId>& input_grads() const { return input_grads_; }

  /// Sums `grad` down to `shape` (undoing broadcasting); returns grad if shapes match.
  ir::ValueId sum_to(ir::ValueId grad, const Shape& shape);

 private:
  ir::Node node_;  // a copy: adding nodes may move the graph's node storage
  std::vector<ir::ValueId> output_grads_;
  std::vector<bool> needs_grad_;
  std::vector<ir::ValueId> input_grads_;
};

/// The gradient rule of op K: a plain function that emits IR through ctx.
/// Each differentiable op in ops.def has a specialisation in autodiff/grads/;
/// a missing one is a link error.
template <ir::OpKind K>
void grad_rule(GradContext& ctx);

}  // namespace fusetrain::autodiff
