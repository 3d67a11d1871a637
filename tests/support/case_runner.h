// Compiles an OpCase into a plan with a weighted-sum loss, fills it with
// deterministic random data, and reads results back.
#pragma once

#include <memory>

#include "fusetrain/autodiff/backward.h"
#include "fusetrain/runtime/plan.h"
#include "support/op_cases.h"

namespace fusetrain::testing {

struct CaseRun {
  ir::Graph graph;
  std::vector<ir::ValueId> outputs;  ///< the case's outputs
  ir::ValueId loss = ir::kNone;      ///< Σ_i Σ outputs[i]·weights_i
  std::vector<ir::ValueId> params;
  autodiff::Gradients grads;
  std::unique_ptr<runtime::ParameterStore> store;
  std::unique_ptr<runtime::Plan> plan;

  /// Runs the plan once at dropout step 0 with zeroed gradients; returns the loss.
  double run();
  /// Output i as doubles.
  std::vector<double> output(size_t i) const;
  /// Gradient of parameter i as doubles (empty if it has none).
  std::vector<double> grad(size_t i) const;
};

/// Builds, compiles and fills the case at size n.
std::unique_ptr<CaseRun> prepare_case(const OpCase& c, int64_t n, bool reference_kernels, bool with_backward,
                                      int num_threads = 1, uint64_t seed = 7);

/// ‖a − b‖ / max(‖b‖, floor).
double relative_error(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-6);

}  // namespace fusetrain::testing
