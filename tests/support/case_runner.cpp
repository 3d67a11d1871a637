#include "support/case_runner.h"

#include "fusetrain/compile/lower.h"

#include <cmath>

namespace fusetrain::testing {

std::unique_ptr<CaseRun> prepare_case(const OpCase& c, int64_t n, bool reference_kernels, bool with_backward,
                                      int num_threads, uint64_t seed) {
  auto run = std::make_unique<CaseRun>();
  ir::GraphBuilder b(run->graph, seed);
  run->outputs = c.build(b, n);
  ir::ValueId loss = ir::kNone;
  for (size_t i = 0; i < run->outputs.size(); ++i) {
    ir::ValueId out = run->outputs[i];
    const ir::Value v = run->graph.value(out);  // a copy: the builder appends values
    ir::ValueId x = v.dtype == DType::f32 ? out : b.cast(out, DType::f32);
    ir::ValueId w = b.input("loss_weight_" + std::to_string(i), v.shape, DType::f32);
    std::vector<int64_t> axes;
    for (int64_t a = 0; a < v.shape.rank(); ++a) axes.push_back(a);
    ir::ValueId term = b.mul(x, w);
    if (!axes.empty()) term = b.reduce_sum(term, axes);
    loss = loss == ir::kNone ? term : b.add(loss, term);
  }
  run->loss = loss;
  run->graph.mark_output(loss);
  for (ir::ValueId o : run->outputs) run->graph.mark_output(o);
  run->params = run->graph.params();
  if (with_backward) run->grads = autodiff::build_backward(run->graph, loss, run->params);
  run->store = std::make_unique<runtime::ParameterStore>(run->graph);
  runtime::PlanOptions options;
  options.reference_kernels = reference_kernels;
  options.num_threads = num_threads;
  run->plan = compile::compile_plan(run->graph, *run->store, options);

  std::map<std::string, Fill> fills = c.fills;
  for (size_t i = 0; i < run->outputs.size(); ++i) fills["loss_weight_" + std::to_string(i)] = Fill{-1, 1};
  auto values = random_values(run->graph, fills, seed);
  for (const ir::Value& v : run->graph.values()) {
    if (v.kind == ir::ValueKind::Activation) continue;
    Tensor t = v.kind == ir::ValueKind::Param ? run->store->param(v.name) : run->plan->input(v.name);
    const std::vector<double>& data = values.at(v.name);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, data[static_cast<size_t>(i)]);
  }
  return run;
}

double CaseRun::run() {
  store->zero_grads();
  plan->set_step(0);
  plan->run();
  return plan->output(loss).item();
}

std::vector<double> CaseRun::output(size_t i) const {
  Tensor t = plan->output(outputs[i]);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t k = 0; k < t.numel(); ++k) out[static_cast<size_t>(k)] = t.item(k);
  return out;
}

std::vector<double> CaseRun::grad(size_t i) const {
  if (grads.grads.empty() || grads.grads[i] == ir::kNone) return {};
  Tensor t = store->grad(i);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t k = 0; k < t.numel(); ++k) out[static_cast<size_t>(k)] = t.item(k);
  return out;
}

double relative_error(const std::vector<double>& a, const std::vector<double>& b, double floor) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  if (a.size() != b.size()) return INFINITY;
  return std::sqrt(diff) / std::max(std::sqrt(norm), floor);
}

}  // namespace fusetrain::testing
