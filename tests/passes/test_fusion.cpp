// Fusion passes on hand-built graphs: the pattern before and after, and a plan
// computing the same values (bit for bit) from the rewritten graph.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fusetrain/fusetrain.h"
#include "fusetrain/passes/fusion.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using ir::OpKind;
using ir::ValueId;

int count(const ir::Graph& g, OpKind op) {
  int n = 0;
  for (const ir::Node& node : g.nodes()) n += node.op == op;
  return n;
}

// Self-attention over x (B, T, C) as the model builders write it: projections,
// heads split by Reshape + Transpose, merged back by Transpose + Reshape.
struct AttentionGraph {
  ir::Graph g;
  ValueId loss = ir::kNone;
};

std::unique_ptr<AttentionGraph> build_attention(int64_t B, int64_t T, int64_t H, int64_t D, bool causal) {
  auto a = std::make_unique<AttentionGraph>();
  ir::GraphBuilder b(a->g, 3);
  const int64_t C = H * D;
  ValueId x = b.input("x", {B, T, C});
  auto heads = [&](const char* name) {
    ValueId w = b.param(name, {C, C});
    return b.transpose(b.reshape(b.linear(x, w, ir::kNone), {B, T, H, D}), {0, 2, 1, 3});
  };
  ValueId q = heads("wq"), k = heads("wk"), v = heads("wv");
  ValueId context = b.attention(q, k, v, ir::kNone, 1.0 / std::sqrt(static_cast<double>(D)), causal, 0.2);
  ValueId merged = b.reshape(b.transpose(context, {0, 2, 1, 3}), {B, T, C});
  a->loss = b.reduce_sum(b.mul(merged, merged), {0, 1, 2});
  a->g.mark_output(a->loss);
  return a;
}

TEST(FoldAttentionTransposes, RemovesTheFourTransposes) {
  auto a = build_attention(2, 5, 3, 4, false);
  EXPECT_EQ(count(a->g, OpKind::Transpose), 4);
  passes::FusionReport report = passes::fold_attention_transposes(a->g);
  EXPECT_EQ(report.fused, 1);
  EXPECT_EQ(report.nodes_removed, 4);
  EXPECT_EQ(count(a->g, OpKind::Transpose), 0);
  for (const ir::Node& n : a->g.nodes())
    if (n.op == OpKind::Attention) {
      EXPECT_EQ(n.attrs.get_int("seq_major", 0), 1);
      EXPECT_EQ(a->g.value(n.outputs[0]).shape, Shape({2, 5, 3, 4}));  // (B, T, H, D)
    }
  // Backward of the folded graph has no transposes either.
  autodiff::build_backward(a->g, a->loss, a->g.params());
  EXPECT_EQ(count(a->g, OpKind::Transpose), 0);
}

TEST(FoldAttentionTransposes, LeavesOtherUsesAlone) {
  // The context is read twice (by the merge and by the loss): folding would need a transpose
  // back, so the pass leaves this attention as it is.
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId q = b.transpose(b.input("q", {1, 4, 2, 3}), {0, 2, 1, 3});
  ValueId context = b.attention(q, q, q, ir::kNone, 0.5);
  ValueId merged = b.transpose(context, {0, 2, 1, 3});
  g.mark_output(merged);
  g.mark_output(context);
  EXPECT_EQ(passes::fold_attention_transposes(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Transpose), 2);
}

TEST(FoldAttentionTransposes, SameLossAndGradients) {
  for (bool causal : {false, true}) {
    std::vector<std::vector<float>> grads;
    std::vector<float> losses;
    for (bool fold : {false, true}) {
      auto a = build_attention(2, 9, 2, 8, causal);
      if (fold) passes::fold_attention_transposes(a->g);
      autodiff::build_backward(a->g, a->loss, a->g.params());
      runtime::ParameterStore params(a->g);
      for (size_t i = 0; i < params.slots().size(); ++i) {
        float* p = params.param(i).data_as<float>();
        for (int64_t k = 0; k < params.slots()[i].numel; ++k)
          p[k] = 0.3f * std::sin(0.7f * static_cast<float>(k + 5 * i));
      }
      auto plan = runtime::Plan::compile(a->g, params, {});
      Tensor x = plan->input("x");
      for (int64_t i = 0; i < x.numel(); ++i) x.set_item(i, std::cos(0.13 * static_cast<double>(i)));
      params.zero_grads();
      plan->set_step(4);
      plan->run();
      losses.push_back(static_cast<float>(plan->output(a->loss).item()));
      grads.emplace_back(params.grads_data(), params.grads_data() + params.flat_numel());
    }
    EXPECT_EQ(losses[0], losses[1]);
    for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient " << i;
  }
}

TEST(FuseDropoutAdd, EitherOrderFusesAndKeepsResultsBitForBit) {
  std::vector<std::vector<float>> grads;
  std::vector<float> losses;
  for (bool fuse : {false, true}) {
    ir::Graph g;
    ir::GraphBuilder b(g, 8);
    ValueId x = b.param("x", {3, 37}), r = b.param("r", {3, 37});
    ValueId h = b.add(b.dropout(x, 0.25), r);         // dropout on the left
    ValueId y = b.add(h, b.dropout(b.tanh(h), 0.1));  // and on the right
    ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1});
    g.mark_output(loss);
    if (fuse) {
      passes::FusionReport report = passes::fuse_dropout_add(g);
      EXPECT_EQ(report.fused, 2);
      EXPECT_EQ(count(g, OpKind::Dropout), 0);
      EXPECT_EQ(count(g, OpKind::DropoutAdd), 2);
      EXPECT_EQ(count(g, OpKind::Add), 0);
    }
    autodiff::build_backward(g, loss, g.params());
    runtime::ParameterStore params(g);
    for (size_t i = 0; i < params.slots().size(); ++i) {
      float* p = params.param(i).data_as<float>();
      for (int64_t k = 0; k < params.slots()[i].numel; ++k) p[k] = std::sin(0.3f * static_cast<float>(k + 11 * i));
    }
    auto plan = runtime::Plan::compile(g, params, {});
    params.zero_grads();
    plan->set_step(2);
    plan->run();
    losses.push_back(static_cast<float>(plan->output(loss).item()));
    grads.emplace_back(params.grads_data(), params.grads_data() + params.flat_numel());
  }
  EXPECT_EQ(losses[0], losses[1]);
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient " << i;
}

TEST(FuseDropoutAdd, LeavesDropoutsWithOtherReadersAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {4, 8});
  ValueId dropped = b.dropout(x, 0.5);
  ValueId sum = b.add(dropped, x);
  g.mark_output(b.mul(sum, dropped));                                    // the dropped values are read again
  ValueId broadcast = b.add(b.dropout(b.param("row", {1, 8}), 0.5), x);  // (1, 8) + (4, 8): no
  g.mark_output(broadcast);
  EXPECT_EQ(passes::fuse_dropout_add(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Dropout), 2);
}

// Loss and every gradient of an MLP block, Linear -> GELU -> Linear, with and without the
// fusion; `precision` is the matmul operands' dtype (casts before each Linear, as in models).
struct MlpRun {
  float loss = 0.0f;
  std::vector<float> grads;
  int fused = 0;
};

MlpRun run_mlp(bool fuse, const std::string& approximate, bool bias, DType precision) {
  ir::Graph g;
  ir::GraphBuilder b(g, 5);
  ValueId x = b.param("x", {3, 7, 24});
  ValueId w1 = b.param("w1", {40, 24}), b1 = bias ? b.param("b1", {40}) : ir::kNone;
  ValueId w2 = b.param("w2", {24, 40});
  auto operand = [&](ValueId v) { return precision == DType::f32 ? v : b.cast(v, precision); };
  ValueId h = g.add(OpKind::Gelu, {b.linear(operand(x), operand(w1), b1)}, {{"approximate", approximate}});
  ValueId y = b.linear(operand(h), operand(w2), ir::kNone);
  ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  MlpRun run;
  if (fuse) {
    passes::FusionReport report = passes::fuse_linear_gelu(g);
    run.fused = static_cast<int>(report.fused);
    EXPECT_EQ(report.nodes_removed, 1);
    EXPECT_EQ(count(g, OpKind::Gelu), 0);
    EXPECT_EQ(count(g, OpKind::Linear), 1);
    EXPECT_EQ(count(g, OpKind::LinearGelu), 1);
  }
  autodiff::build_backward(g, loss, g.params());
  runtime::ParameterStore params(g);
  for (size_t i = 0; i < params.slots().size(); ++i) {
    float* p = params.param(i).data_as<float>();
    for (int64_t k = 0; k < params.slots()[i].numel; ++k)
      p[k] = 0.4f * std::sin(0.37f * static_cast<float>(k + 13 * i));
  }
  auto plan = runtime::Plan::compile(g, params, {});
  params.zero_grads();
  plan->run();
  run.loss = static_cast<float>(plan->output(loss).item());
  run.grads.assign(params.grads_data(), params.grads_data() + params.flat_numel());
  return run;
}

TEST(FuseLinearGelu, FusesBiasAndGeluIntoTheLinearAndKeepsResultsBitForBit) {
  for (const char* approximate : {"none", "tanh"})
    for (bool bias : {true, false})
      for (DType precision : {DType::f32, DType::bf16}) {
        const std::string label = str(approximate, bias ? " bias " : " no-bias ", dtype_name(precision));
        MlpRun plain = run_mlp(false, approximate, bias, precision);
        MlpRun fused = run_mlp(true, approximate, bias, precision);
        EXPECT_EQ(fused.fused, 1) << label;
        EXPECT_EQ(plain.loss, fused.loss) << label;
        ASSERT_EQ(plain.grads.size(), fused.grads.size());
        for (size_t i = 0; i < plain.grads.size(); ++i)
          ASSERT_EQ(plain.grads[i], fused.grads[i]) << label << " gradient " << i;
      }
}

TEST(FuseLinearGelu, LeavesLinearsWhoseOutputIsReadElsewhereAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {4, 8});
  ValueId z = b.linear(x, b.param("w", {8, 8}), b.param("bias", {8}));
  ValueId h = g.add(OpKind::Gelu, {z});
  g.mark_output(b.add(h, z));  // z is read again
  ValueId out = b.linear(x, b.param("w2", {8, 8}), ir::kNone);
  g.mark_output(out);
  g.mark_output(g.add(OpKind::Gelu, {out}));  // the Linear's output is a graph output
  EXPECT_EQ(passes::fuse_linear_gelu(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Gelu), 2);
  EXPECT_EQ(count(g, OpKind::LinearGelu), 0);
}

}  // namespace
}  // namespace fusetrain::testing
