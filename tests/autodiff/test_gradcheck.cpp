// Finite-difference gradient checks, generated from the op table: every op
// flagged kDifferentiable in ops.def must have a gradient rule and at least one
// case in support/op_cases.cpp, and every case's analytic gradients must match
// central differences.
#include <gtest/gtest.h>

#include <set>

#include "fusetrain/autodiff/backward.h"
#include "support/case_runner.h"

namespace fusetrain::testing {
namespace {

TEST(GradientCoverage, EveryDifferentiableOpHasARuleAndACheck) {
  std::set<ir::OpKind> covered;
  for (const OpCase& c : op_cases()) covered.insert(c.op);
  for (int k = 0; k < ir::kNumOps; ++k) {
    ir::OpKind op = static_cast<ir::OpKind>(k);
    bool differentiable = ir::op_info(op).has(ir::kDifferentiable);
    EXPECT_EQ(autodiff::has_grad_rule(op), differentiable) << ir::op_name(op);
    if (differentiable) EXPECT_TRUE(covered.count(op)) << ir::op_name(op) << " has no gradient check case";
  }
}

class GradCheck : public ::testing::TestWithParam<size_t> {};

TEST_P(GradCheck, MatchesFiniteDifferences) {
  const OpCase& c = op_cases()[GetParam()];
  for (int64_t n : {int64_t{1}, int64_t{3}}) {
    if (n > c.max_gradcheck_n) continue;
    auto run = prepare_case(c, n, /*reference_kernels=*/c.gradcheck_reference_kernels, /*with_backward=*/true);
    run->run();
    std::vector<std::vector<double>> analytic_grads;
    for (size_t p = 0; p < run->params.size(); ++p) analytic_grads.push_back(run->grad(p));
    for (size_t p = 0; p < run->params.size(); ++p) {
      std::vector<double> analytic = analytic_grads[p];
      Tensor param = run->store->param(p);
      std::vector<double> numeric(static_cast<size_t>(param.numel()));
      for (int64_t i = 0; i < param.numel(); ++i) {
        double original = param.item(i);
        param.set_item(i, original + c.eps);
        double up = run->run();
        param.set_item(i, original - c.eps);
        double down = run->run();
        param.set_item(i, original);
        numeric[static_cast<size_t>(i)] = (up - down) / (2 * c.eps);
      }
      if (analytic.empty()) analytic.assign(numeric.size(), 0.0);
      if (c.expected_from_numeric) c.expected_from_numeric(p, numeric);
      double err = relative_error(analytic, numeric, 1e-3);
      EXPECT_LT(err, c.tolerance) << c.name << " n=" << n << " parameter " << run->store->slots()[p].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCases, GradCheck, ::testing::Range<size_t>(0, op_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) { return op_cases()[info.param].name; });

}  // namespace
}  // namespace fusetrain::testing
