// Plan behaviour: dropout reproducibility, gradient accumulation, input binding.
#include <gtest/gtest.h>

#include <cstring>

#include "fusetrain/fusetrain.h"

namespace fusetrain::testing {
namespace {

using ir::ValueId;

struct DropoutNet {
  ir::Graph graph;
  ValueId loss, out;
  runtime::ParameterStore* params = nullptr;
  DropoutNet() {
    ir::GraphBuilder b(graph, 11);
    ValueId x = b.param("x", {64, 32});
    out = b.dropout(b.gelu(x), 0.5);
    loss = b.reduce_sum(b.mul(out, out), {0, 1});
    graph.mark_output(loss);
    graph.mark_output(out);
    autodiff::build_backward(graph, loss, graph.params());
  }
};

std::vector<float> snapshot(const Tensor& t) {
  const float* p = t.data_as<float>();
  return std::vector<float>(p, p + t.numel());
}

TEST(Plan, DropoutMasksFollowTheStepCounter) {
  DropoutNet net;
  runtime::ParameterStore params(net.graph);
  for (int64_t i = 0; i < params.flat_numel(); ++i) params.params_data()[i] = 1.0f + 0.01f * (i % 7);
  auto plan = compile::compile_plan(net.graph, params);
  plan->run();  // step 0
  std::vector<float> first = snapshot(plan->output(net.out));
  plan->run();  // step 1: a different mask
  std::vector<float> second = snapshot(plan->output(net.out));
  EXPECT_NE(first, second);
  plan->set_step(0);  // resuming at step 0 reproduces step 0 exactly
  plan->run();
  EXPECT_EQ(first, snapshot(plan->output(net.out)));
  int64_t zeros = 0;
  for (float v : first) zeros += v == 0.0f;
  EXPECT_GT(zeros, 64 * 32 / 4);
  EXPECT_LT(zeros, 64 * 32 * 3 / 4);
}

TEST(Plan, GradientsAccumulateAcrossRuns) {
  DropoutNet net;
  runtime::ParameterStore params(net.graph);
  for (int64_t i = 0; i < params.flat_numel(); ++i) params.params_data()[i] = 0.5f;
  auto plan = compile::compile_plan(net.graph, params);
  params.zero_grads();
  plan->set_step(3);
  plan->run();
  std::vector<float> once = snapshot(params.grad(0));
  plan->set_step(3);
  plan->run();  // no zero_grads: the same gradient is added again
  std::vector<float> twice = snapshot(params.grad(0));
  for (size_t i = 0; i < once.size(); ++i) ASSERT_FLOAT_EQ(twice[i], 2 * once[i]);
}

TEST(Plan, BindInputReadsCallerMemory) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {4});
  ValueId y = b.scale(x, 2.0);
  g.mark_output(y);
  runtime::ParameterStore params(g, kernels::cpu_device());  // zero copy from host memory: a CPU device's feature
  auto plan = compile::compile_plan(g, params);
  float mine[4] = {1, 2, 3, 4};
  plan->bind_input("x", mine);
  plan->run();
  EXPECT_FLOAT_EQ(plan->output(y).item(3), 8.0f);
  mine[3] = 10;
  plan->run();
  EXPECT_FLOAT_EQ(plan->output(y).item(3), 20.0f);
  plan->bind_input("x", nullptr);  // back to the plan's own buffer (zeros)
  plan->run();
  EXPECT_FLOAT_EQ(plan->output(y).item(3), 0.0f);
}

TEST(Plan, ReferenceAndTunedKernelsAgreeOnATrainingStep) {
  DropoutNet net;
  std::vector<std::vector<float>> grads;
  for (bool reference : {true, false}) {
    runtime::ParameterStore params(net.graph);
    for (int64_t i = 0; i < params.flat_numel(); ++i)
      params.params_data()[i] = 0.1f * static_cast<float>(i % 13) - 0.6f;
    runtime::PlanOptions options;
    options.reference_kernels = reference;
    auto plan = compile::compile_plan(net.graph, params, options);
    plan->run();
    grads.push_back(snapshot(params.grad(0)));
  }
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_NEAR(grads[0][i], grads[1][i], 1e-5);
}

}  // namespace
}  // namespace fusetrain::testing
