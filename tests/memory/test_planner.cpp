#include <gtest/gtest.h>

#include "fusetrain/fusetrain.h"
#include "support/models.h"

namespace fusetrain::testing {
namespace {

using memory::BufferRequest;

TEST(ArenaPlanner, ReusesMemoryOfDeadBuffers) {
  std::vector<BufferRequest> requests{{1000, 0, 1, "a"}, {1000, 2, 3, "b"}, {500, 1, 2, "c"}};
  memory::ArenaPlan plan = memory::plan_arena(requests);
  memory::check_arena(requests, plan);
  EXPECT_EQ(plan.offsets[0], plan.offsets[1]);  // a and b never live together
  EXPECT_LT(plan.arena_bytes, memory::naive_bytes(requests));
}

TEST(ArenaPlanner, OffsetsAreAligned) {
  std::vector<BufferRequest> requests{{3, 0, 5, "a"}, {7, 0, 5, "b"}, {130, 2, 2, "c"}};
  memory::ArenaPlan plan = memory::plan_arena(requests, 64);
  for (size_t off : plan.offsets) EXPECT_EQ(off % 64, 0u);
  memory::check_arena(requests, plan);
}

TEST(ArenaChecker, RejectsOverlappingLiveBuffers) {
  std::vector<BufferRequest> requests{{256, 0, 3, "first"}, {256, 2, 4, "second"}};
  memory::ArenaPlan bad;
  bad.offsets = {0, 128};
  bad.arena_bytes = 384;
  try {
    memory::check_arena(requests, bad);
    FAIL() << "overlap not detected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("first"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("second"), std::string::npos);
  }
  bad.offsets = {0, 256};
  bad.arena_bytes = 512;
  EXPECT_NO_THROW(memory::check_arena(requests, bad));
  bad.offsets = {0, 100};  // misaligned
  bad.arena_bytes = 1024;
  EXPECT_THROW(memory::check_arena(requests, bad), Error);
}

void expect_sound_and_smaller(ir::Graph& graph, ir::ValueId loss) {
  graph.mark_output(loss);
  autodiff::build_backward(graph, loss, graph.params());
  runtime::ParameterStore params(graph);
  auto plan = compile::compile_plan(graph, params);
  memory::check_arena(plan->buffers(), plan->arena_plan());
  const memory::MemoryReport& report = plan->memory_report();
  EXPECT_LT(report.activation_peak_bytes, report.activation_naive_bytes) << report.to_string();
  EXPECT_GT(report.num_in_place, 0u) << report.to_string();
  EXPECT_EQ(report.parameter_bytes, static_cast<size_t>(params.flat_numel()) * 4);
}

TEST(PlanMemory, MlpForwardBackwardIsSoundAndPacked) {
  ir::Graph graph;
  ir::GraphBuilder b(graph);
  expect_sound_and_smaller(graph, build_mlp(b, 128, 8, 64, 4));
}

TEST(PlanMemory, TransformerForwardBackwardIsSoundAndPacked) {
  ir::Graph graph;
  ir::GraphBuilder b(graph);
  expect_sound_and_smaller(graph, build_tiny_transformer(b, TinyTransformer{}));
}

// A language-model head's gradient overwrites its logits (SoftmaxCrossEntropyBackward may
// reuse input 1) when nothing else keeps them: one vocabulary-sized buffer instead of two,
// and the same gradients as when the logits are pinned as an output.
TEST(PlanMemory, CrossEntropyGradientOverwritesDeadLogits) {
  const int64_t N = 48, C = 16, V = 500;
  std::vector<size_t> peaks;
  std::vector<std::vector<float>> grads;
  for (bool pin_logits : {true, false}) {
    ir::Graph graph;
    ir::GraphBuilder b(graph);
    ir::ValueId x = b.param("x", {N, C});
    ir::ValueId logits = b.linear(x, b.param("w", {V, C}));
    ir::ValueId targets = b.input("targets", {N}, DType::i64);
    ir::ValueId loss = b.softmax_cross_entropy(logits, targets);
    graph.mark_output(loss);
    if (pin_logits) graph.mark_output(logits);
    autodiff::build_backward(graph, loss, graph.params());
    runtime::ParameterStore params(graph);
    for (size_t i = 0; i < params.slots().size(); ++i) {
      float* p = params.param(i).data_as<float>();
      for (int64_t k = 0; k < params.slots()[i].numel; ++k) p[k] = 0.1f * std::sin(0.37f * static_cast<float>(k + i));
    }
    auto plan = compile::compile_plan(graph, params);
    int64_t* t = plan->input("targets").data_as<int64_t>();
    for (int64_t r = 0; r < N; ++r) t[r] = r % 7 == 0 ? -100 : (r * 37) % V;
    params.zero_grads();
    plan->run();
    peaks.push_back(plan->memory_report().activation_peak_bytes);
    grads.emplace_back(params.grads_data(), params.grads_data() + params.flat_numel());
  }
  EXPECT_LE(peaks[1] + static_cast<size_t>(N * V) * sizeof(float), peaks[0]);
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient " << i;
}

}  // namespace
}  // namespace fusetrain::testing
