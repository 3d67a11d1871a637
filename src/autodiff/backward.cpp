#include "fusetrain/autodiff/backward.h"

#include <array>

#include "autodiff/grad_context.h"
#include "fusetrain/core/error.h"

namespace fusetrain::autodiff {
namespace {

using ir::kNone;
using ir::NodeId;
using ir::OpKind;
using ir::ValueId;

using GradRule = void (*)(GradContext&);

template <OpKind K>
constexpr GradRule rule_for() {
  if constexpr ((ir::op_flags(K) & ir::kDifferentiable) != 0)
    return &grad_rule<K>;
  else
    return nullptr;
}

// One entry per op: its gradient rule, or null for ops without one. Referencing
// grad_rule<K> for every differentiable op makes a missing rule a link error.
constexpr std::array<GradRule, ir::kNumOps> kRules = {{
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) rule_for<OpKind::Name>(),
#include "fusetrain/ops/ops.def"
#undef FT_OP
}};

// Sums a list of gradient contributions with Add nodes.
ValueId sum_contributions(ir::GraphBuilder& b, const std::vector<ValueId>& parts) {
  if (parts.empty()) return kNone;
  ValueId total = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) total = b.add(total, parts[i]);
  return total;
}

}  // namespace

bool has_grad_rule(OpKind op) { return kRules[static_cast<size_t>(op)] != nullptr; }

ValueId GradContext::grad_output_or_zeros(size_t i) {
  if (output_grads_[i] != kNone) return output_grads_[i];
  const ir::Value& v = g.value(node_.outputs[i]);
  return b.fill(v.shape, 0.0, v.dtype);
}

ValueId GradContext::sum_to(ValueId grad, const Shape& shape) {
  if (g.value(grad).shape == shape) return grad;
  return g.add(OpKind::ReduceSumTo, {grad}, {{"shape", shape.dims()}});
}

Gradients build_backward(ir::Graph& graph, ValueId loss, const std::vector<ValueId>& params, ValueId seed) {
  const ir::Value& loss_value = graph.value(loss);
  FT_CHECK(loss_value.shape.numel() == 1 && is_floating(loss_value.dtype), "build_backward: the loss ",
           graph.describe(loss), " must be a floating-point scalar, found shape ", loss_value.shape.to_string());
  for (ValueId p : params)
    FT_CHECK(graph.value(p).kind == ir::ValueKind::Param, "build_backward: ", graph.describe(p), " is not a parameter");

  const size_t num_values = graph.values().size();
  const NodeId num_forward_nodes = static_cast<NodeId>(graph.nodes().size());

  // Forward sweep: which values depend on a parameter.
  std::vector<bool> from_param(num_values, false);
  for (ValueId p : params) from_param[static_cast<size_t>(p)] = true;
  for (const ir::Node& n : graph.nodes()) {
    bool any = false;
    for (ValueId v : n.inputs) any = any || from_param[static_cast<size_t>(v)];
    for (ValueId v : n.outputs) from_param[static_cast<size_t>(v)] = any;
  }
  // Backward sweep: which values the loss depends on.
  std::vector<bool> to_loss(num_values, false);
  to_loss[static_cast<size_t>(loss)] = true;
  for (NodeId id = num_forward_nodes - 1; id >= 0; --id) {
    const ir::Node& n = graph.node(id);
    bool any = false;
    for (ValueId v : n.outputs) any = any || to_loss[static_cast<size_t>(v)];
    if (any)
      for (ValueId v : n.inputs) to_loss[static_cast<size_t>(v)] = true;
  }
  auto on_path = [&](ValueId v) { return from_param[static_cast<size_t>(v)] && to_loss[static_cast<size_t>(v)]; };

  // Every node emitted from here on is backward; the graph's phase is restored however this returns.
  struct PhaseScope {
    ir::Graph& g;
    ir::Phase saved;
    ~PhaseScope() { g.set_phase(saved); }
  } scope{graph, graph.phase()};
  graph.set_phase(ir::Phase::Backward);
  ir::GraphBuilder b(graph);
  std::vector<std::vector<ValueId>> contributions(num_values);
  Gradients result;
  if (seed != ir::kNone) {
    FT_CHECK(graph.value(seed).shape == loss_value.shape && graph.value(seed).dtype == loss_value.dtype,
             "build_backward: the seed ", graph.describe(seed), " does not match the loss ", graph.describe(loss));
    result.seed = seed;
  } else {
    result.seed = b.fill(loss_value.shape, 1.0, loss_value.dtype);
  }
  contributions[static_cast<size_t>(loss)].push_back(result.seed);

  for (NodeId id = num_forward_nodes - 1; id >= 0; --id) {
    const ir::Node& node = graph.node(id);
    std::vector<bool> needs(node.inputs.size());
    bool any_input = false;
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      needs[i] = on_path(node.inputs[i]);
      any_input = any_input || needs[i];
    }
    std::vector<ValueId> output_grads(node.outputs.size(), kNone);
    bool any_output = false;
    for (size_t i = 0; i < node.outputs.size(); ++i) {
      output_grads[i] = sum_contributions(b, contributions[static_cast<size_t>(node.outputs[i])]);
      any_output = any_output || output_grads[i] != kNone;
    }
    if (!any_input || !any_output) continue;
    GradRule rule = kRules[static_cast<size_t>(node.op)];
    FT_CHECK(rule != nullptr, "build_backward: node ", node.name, " (", ir::op_name(node.op),
             ") lies between a parameter and the loss but has no gradient rule");
    GradContext ctx(graph, node, std::move(output_grads), needs);
    rule(ctx);
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      ValueId grad = ctx.input_grads()[i];
      if (!needs[i]) continue;
      FT_CHECK(grad != kNone, "gradient rule of ", ir::op_name(node.op), " gave no gradient for input ", i, " of node ",
               node.name);
      const ir::Value& in = graph.value(node.inputs[i]);
      const ir::Value& gv = graph.value(grad);
      FT_CHECK(gv.shape == in.shape, "gradient rule of ", ir::op_name(node.op), " gave a gradient of shape ",
               gv.shape.to_string(), " for input ", i, " of shape ", in.shape.to_string(), " (node ", node.name, ")");
      FT_CHECK(gv.dtype == DType::f32, "gradient rule of ", ir::op_name(node.op), " gave a ", dtype_name(gv.dtype),
               " gradient for input ", i, " of node ", node.name, "; gradients are f32");
      contributions[static_cast<size_t>(node.inputs[i])].push_back(grad);
    }
  }

  // Each parameter gradient gets a producer of its own, so the plan can write it
  // straight into the gradient buffer (accumulating across micro-batches).
  std::vector<bool> taken(graph.values().size() + params.size() * 2, false);
  for (ValueId p : params) {
    ValueId grad = sum_contributions(b, contributions[static_cast<size_t>(p)]);
    if (grad != kNone) {
      const ir::Value& gv = graph.value(grad);
      // A forward node's output is an activation, except the gradients LinearCrossEntropy forms itself: those go
      // straight into the gradient buffer too (no (V, K) copy of an LM head's gradient alive across the step).
      const bool forward = gv.producer != kNone && graph.node(gv.producer).phase == ir::Phase::Forward &&
                           graph.node(gv.producer).op != OpKind::LinearCrossEntropy;
      bool shared = gv.producer == kNone || forward || taken[static_cast<size_t>(grad)] || graph.is_output(grad);
      if (!shared)
        for (const ir::Node& n : graph.nodes())
          for (ValueId v : n.inputs) shared = shared || v == grad;
      if (shared) grad = graph.add(OpKind::Copy, {grad});
      if (static_cast<size_t>(grad) >= taken.size()) taken.resize(static_cast<size_t>(grad) + 1, false);
      taken[static_cast<size_t>(grad)] = true;
      graph.value(grad).name = "grad:" + graph.value(p).name;
      graph.value(grad).gradient_of = p;
      graph.mark_output(grad);
    }
    result.grads.push_back(grad);
  }
  return result;
}

}  // namespace fusetrain::autodiff
