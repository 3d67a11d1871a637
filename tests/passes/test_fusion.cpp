// Fusion passes on hand-built graphs: the pattern before and after, and a plan
// computing the same values (bit for bit) from the rewritten graph.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "fusetrain/fusetrain.h"
#include "fusetrain/passes/fusion.h"
#include "fusetrain/passes/recompute.h"
#include "kernels/cpu/basic_kernels.h"

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

// Loss and every parameter gradient of `g` after autodiff, parameters set to a fixed pattern.
struct GraphRun {
  float loss = 0.0f;
  std::vector<float> grads;
};

// `joint` (optional) rewrites the graph once autodiff has added backward, as the joint passes do.
GraphRun run_graph(ir::Graph& g, ValueId loss, float amplitude, float frequency, int64_t step,
                   runtime::PlanOptions options = {}, const std::function<void(runtime::Plan&)>& feed = {},
                   const std::function<void(ir::Graph&)>& joint = {}) {
  autodiff::build_backward(g, loss, g.params());
  if (joint) joint(g);
  runtime::ParameterStore params(g);
  for (size_t i = 0; i < params.slots().size(); ++i) {
    float* p = params.param(i).data_as<float>();
    for (int64_t k = 0; k < params.slots()[i].numel; ++k)
      p[k] = amplitude * std::sin(frequency * static_cast<float>(k + 13 * static_cast<int64_t>(i)));
  }
  auto plan = compile::compile_plan(g, params, options);
  if (feed) feed(*plan);
  params.zero_grads();
  plan->set_step(step);
  plan->run();
  return {static_cast<float>(plan->output(loss).item()),
          std::vector<float>(params.grads_data(), params.grads_data() + params.flat_numel())};
}

void expect_bit_identical(const GraphRun& a, const GraphRun& b, const std::string& label) {
  EXPECT_EQ(a.loss, b.loss) << label;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << label;
  for (size_t i = 0; i < a.grads.size(); ++i) ASSERT_EQ(a.grads[i], b.grads[i]) << label << " gradient " << i;
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
      auto plan = compile::compile_plan(a->g, params, {});
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

// ViT's patch embedding after its convolution: (B, h, w, C) written channels-first, flattened and transposed back to
// tokens, then a projection, trained: one Reshape instead, the same loss and gradients bit for bit.
GraphRun run_patch_tokens(bool fold) {
  ir::Graph g;
  ir::GraphBuilder b(g, 3);
  const ValueId x = b.param("x", {2, 3, 4, 8});  // (B, h, w, C)
  const ValueId channels_first = b.transpose(b.tanh(x), {0, 3, 1, 2});
  const ValueId tokens = b.transpose(b.reshape(channels_first, {2, 8, 12}), {0, 2, 1});
  const ValueId y = b.linear(tokens, b.param("w", {5, 8}), ir::kNone);
  const ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  if (fold) {
    EXPECT_EQ(passes::fold_transpose_pairs(g).fused, 1);
    EXPECT_EQ(count(g, OpKind::Transpose), 0);
    EXPECT_EQ(g.value(tokens).shape, (Shape{2, 12, 8}));
  }
  return run_graph(g, loss, 0.5f, 0.41f, 0);
}

TEST(FoldTransposePairs, ChannelsFirstAndBackIsAReshapeWithTheSameResults) {
  expect_bit_identical(run_patch_tokens(false), run_patch_tokens(true), "patch tokens");
}

TEST(FoldTransposePairs, LeavesTransposesThatMoveElementsAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  const ValueId x = b.input("x", {2, 3, 4, 8});
  // Back to tokens but in (w, h) order: the two spatial axes swap.
  g.mark_output(b.transpose(b.reshape(b.transpose(x, {0, 3, 2, 1}), {2, 8, 12}), {0, 2, 1}));
  // The Reshape splits an axis.
  g.mark_output(b.transpose(b.reshape(b.transpose(x, {0, 3, 1, 2}), {2, 4, 2, 12}), {0, 3, 1, 2}));
  // The middle value is read elsewhere too.
  const ValueId shared = b.reshape(b.transpose(x, {0, 3, 1, 2}), {2, 8, 12});
  g.mark_output(b.transpose(shared, {0, 2, 1}));
  g.mark_output(shared);
  EXPECT_EQ(passes::fold_transpose_pairs(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Transpose), 6);
}

TEST(FuseDropoutAdd, EitherOrderFusesAndKeepsResultsBitForBit) {
  std::vector<GraphRun> runs;
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
    runs.push_back(run_graph(g, loss, 1.0f, 0.3f, 2));
  }
  expect_bit_identical(runs[0], runs[1], "dropout + add");
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
// fusion; `precision` is the matmul operands' dtype (casts before each Linear, as in models);
// `round_z` has GELU read the first Linear's output rounded to bf16, as bf16 models build it.
GraphRun run_mlp(bool fuse, const std::string& approximate, bool bias, DType precision, bool round_z = false,
                 bool reference = false) {
  ir::Graph g;
  ir::GraphBuilder b(g, 5);
  ValueId x = b.param("x", {3, 7, 24});
  ValueId w1 = b.param("w1", {40, 24}), b1 = bias ? b.param("b1", {40}) : ir::kNone;
  ValueId w2 = b.param("w2", {24, 40});
  auto operand = [&](ValueId v) { return precision == DType::f32 ? v : b.cast(v, precision); };
  ValueId z = b.linear(operand(x), operand(w1), b1);
  ValueId h = g.add(OpKind::Gelu, {round_z ? b.cast(z, DType::bf16) : z}, {{"approximate", approximate}});
  ValueId y = b.linear(operand(h), operand(w2), ir::kNone);
  ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  if (fuse) {
    passes::FusionReport report = passes::fuse_linear_gelu(g);
    EXPECT_EQ(report.fused, 1);
    EXPECT_EQ(report.nodes_removed, round_z ? 2 : 1);  // the Linear, and the cast of its output
    EXPECT_EQ(count(g, OpKind::Gelu), 0);
    EXPECT_EQ(count(g, OpKind::Linear), 1);
    EXPECT_EQ(count(g, OpKind::LinearGelu), 1);
    for (const ir::Node& n : g.nodes())
      if (n.op == OpKind::LinearGelu) EXPECT_EQ(g.value(n.outputs[1]).dtype, round_z ? DType::bf16 : DType::f32);
  }
  runtime::PlanOptions options;
  options.reference_kernels = reference;
  return run_graph(g, loss, 0.4f, 0.37f, 0, options);
}

TEST(FuseLinearGelu, FusesBiasAndGeluIntoTheLinearAndKeepsResultsBitForBit) {
  for (const char* approximate : {"none", "tanh"})
    for (bool bias : {true, false})
      for (DType precision : {DType::f32, DType::bf16})
        expect_bit_identical(run_mlp(false, approximate, bias, precision), run_mlp(true, approximate, bias, precision),
                             str(approximate, bias ? " bias " : " no-bias ", dtype_name(precision)));
}

TEST(FuseLinearGelu, KeepsZInBf16WhenGeluReadsItsBf16Cast) {
  for (const char* approximate : {"none", "tanh"})
    for (bool bias : {true, false}) {
      const std::string label = str(approximate, bias ? " bias" : " no-bias");
      GraphRun fused = run_mlp(true, approximate, bias, DType::bf16, true);
      expect_bit_identical(run_mlp(false, approximate, bias, DType::bf16, true), fused, label);
      // Against the reference kernels (double accumulation): equal to rounding.
      GraphRun reference = run_mlp(true, approximate, bias, DType::bf16, true, true);
      EXPECT_NEAR(reference.loss, fused.loss, 1e-3 * std::abs(reference.loss)) << label;
      double diff = 0.0, norm = 0.0;
      for (size_t i = 0; i < fused.grads.size(); ++i) {
        diff += std::pow(fused.grads[i] - reference.grads[i], 2);
        norm += std::pow(reference.grads[i], 2);
      }
      EXPECT_LE(std::sqrt(diff), 1e-2 * std::sqrt(norm)) << label;
    }
}

// An MLP whose Linears have biases and `precision` operands, with a GELU of form `gelu` between them, trained on
// `threads` threads; `joint` rewrites its joint graph. Its gradients (256 rows of 128 and of 96) span several blocks of
// the column sums' rows (cpu_basic::kColumnSumRows) and are large enough for two threads.
GraphRun run_gelu_mlp(DType precision, const std::string& gelu, int threads,
                      const std::function<void(ir::Graph&)>& joint) {
  ir::Graph g;
  ir::GraphBuilder b(g, 5);
  ValueId x = b.param("x", {4, 64, 96});
  ValueId w1 = b.param("w1", {128, 96}), b1 = b.param("b1", {128});
  ValueId w2 = b.param("w2", {96, 128}), b2 = b.param("b2", {96});
  auto operand = [&](ValueId v) { return precision == DType::f32 ? v : b.cast(v, precision); };
  ValueId h = g.add(OpKind::Gelu, {b.linear(operand(x), operand(w1), b1)}, {{"approximate", gelu}});
  ValueId y = b.linear(operand(h), operand(w2), b2);
  ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  runtime::PlanOptions options;
  options.num_threads = threads;
  return run_graph(g, loss, 0.4f, 0.37f, 0, options, {}, joint);
}

// run_gelu_mlp on two threads: autodiff casts each Linear's output gradient for its two GEMMs and sums it for the
// bias gradient; with `fuse`, fuse_cast_column_sum then makes each pair one CastColumnSum.
GraphRun run_bias_mlp(bool fuse, DType precision) {
  return run_gelu_mlp(precision, "none", 2, [&](ir::Graph& joint) {
    if (!fuse) return;
    const int casts = count(joint, OpKind::Cast), sums = count(joint, OpKind::ReduceSum);
    const int pairs = precision == DType::f32 ? 0 : 2;  // f32 operands: no gradient is cast
    EXPECT_EQ(passes::fuse_cast_column_sum(joint).fused, pairs);
    EXPECT_EQ(count(joint, OpKind::CastColumnSum), pairs);
    EXPECT_EQ(count(joint, OpKind::Cast), casts - pairs);
    EXPECT_EQ(count(joint, OpKind::ReduceSum), sums - pairs);
  });
}

// run_gelu_mlp with the pipeline's later passes on its joint graph (the GELU recomputed in backward when `recompute`,
// GELUs and projections writing bf16, CastColumnSum) and, with `fuse`, fuse_matmul_gelu_backward. ViT's and BERT's
// erf form under bf16, GPT-2's tanh form in f32.
GraphRun run_gelu_backward_mlp(bool fuse, DType precision, bool recompute, int threads) {
  return run_gelu_mlp(precision, precision == DType::bf16 ? "none" : "tanh", threads, [&](ir::Graph& joint) {
    if (recompute) EXPECT_EQ(passes::recompute_gelu_outputs(joint).gelus, 1);
    passes::fold_output_casts(joint);
    passes::fuse_cast_column_sum(joint);
    if (!fuse) return;
    const int gelus = count(joint, OpKind::Gelu), sums = count(joint, OpKind::CastColumnSum);
    EXPECT_EQ(passes::fuse_matmul_gelu_backward(joint).fused, 1);
    EXPECT_EQ(count(joint, OpKind::MatMulGeluBackward), 1);
    EXPECT_EQ(count(joint, OpKind::GeluBackward), 0);
    EXPECT_EQ(count(joint, OpKind::Gelu), gelus - (recompute ? 1 : 0));  // the forward's GELU stays
    EXPECT_EQ(count(joint, OpKind::CastColumnSum), sums - (precision == DType::bf16 ? 1 : 0));
  });
}

// Fused, every loss and gradient keeps its bits, the first bias gradient's included: the epilogue's column sums add
// in ReduceSum's blocks (cpu_basic::kColumnSumRows), whichever thread finishes which rows.
TEST(FuseMatMulGeluBackward, GeluBackwardInTheGemmEpilogueKeepsResultsBitForBit) {
  for (DType precision : {DType::bf16, DType::f32})
    for (bool recompute : {false, true})
      for (int threads : {1, 2}) {
        const std::string label = str(dtype_name(precision), recompute ? " recompute" : "", " threads=", threads);
        expect_bit_identical(run_gelu_backward_mlp(false, precision, recompute, threads),
                             run_gelu_backward_mlp(true, precision, recompute, threads), label);
      }
}

// A GeluBackward whose incoming gradient is no lone MatMul result stays: the product read again, or a product of two
// batched operands (no single GEMM to hold the epilogue).
TEST(FuseMatMulGeluBackward, LeavesProductsReadElsewhereAndBatchedProductsAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {4, 6, 8});
  ValueId a = b.input("a", {4, 6, 5}), w = b.input("w", {5, 8}), wb = b.input("wb", {4, 5, 8});
  ValueId shared = b.matmul(a, w, false, false);
  g.mark_output(g.add(OpKind::GeluBackward, {shared, x}));
  g.mark_output(shared);  // the product is read again
  g.mark_output(g.add(OpKind::GeluBackward, {b.matmul(a, wb, false, false), x}));  // batched b
  EXPECT_EQ(passes::fuse_matmul_gelu_backward(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::GeluBackward), 2);
  ValueId lone = b.matmul(a, w, false, false);
  g.mark_output(g.add(OpKind::GeluBackward, {lone, x}));
  EXPECT_EQ(passes::fuse_matmul_gelu_backward(g).fused, 1);
}

TEST(FuseCastColumnSum, CastsAndBiasSumsOfGradientsReadTheirInputOnceWithTheSameBits) {
  for (DType precision : {DType::bf16, DType::f16, DType::f32})
    expect_bit_identical(run_bias_mlp(false, precision), run_bias_mlp(true, precision), dtype_name(precision));
}

// x -> Reshape -> Reshape -> ReduceSum, the second Reshape's result read elsewhere too: the sum fuses with the cast,
// and both Reshapes stay (the second has another reader, so the first still feeds it). The same chain read by
// nothing else goes with its sum.
TEST(FuseCastColumnSum, KeepsReshapesThatAreReadElsewhere) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {4, 6, 8});
  g.mark_output(b.cast(b.cast(x, DType::bf16), DType::f32));
  ValueId rows = b.reshape(b.reshape(x, {24, 8}), {2, 12, 8});
  g.mark_output(b.reduce_sum(rows, {0, 1}));
  g.mark_output(b.reduce_sum(rows, {2}));  // another reader of the second Reshape
  ValueId doubled = b.scale(x, 2.0);
  g.mark_output(b.cast(b.cast(doubled, DType::bf16), DType::f32));
  g.mark_output(b.reduce_sum(b.reshape(b.reshape(doubled, {24, 8}), {2, 12, 8}), {0, 1}));
  EXPECT_EQ(passes::fuse_cast_column_sum(g).fused, 2);  // commits only if every kept Reshape's input is still made
  EXPECT_EQ(count(g, OpKind::CastColumnSum), 2);
  EXPECT_EQ(count(g, OpKind::Reshape), 2);
}

TEST(FuseCastColumnSum, LeavesOtherSumsAndCastsAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {4, 6, 8});
  ValueId half = b.cast(x, DType::bf16);
  ValueId kept = b.reduce_sum(x, {0, 1}, true);   // keeps the summed axes
  ValueId rows = b.reduce_sum(x, {1, 2});         // sums the last axis
  ValueId inner = b.reduce_sum(x, {1});           // leaves a leading axis
  ValueId narrow = b.reduce_sum(b.reshape(x, {24, 2, 4}), {0, 1});  // through a Reshape that changes the last axis
  ValueId w = b.input("w", {1, 8});  // one row: the kernels' views need two
  ValueId wide = b.cast(w, DType::bf16);
  ValueId wide_sum = b.reduce_sum(w, {0});
  for (ValueId v : {half, kept, rows, inner, narrow, wide, wide_sum}) g.mark_output(v);
  EXPECT_EQ(passes::fuse_cast_column_sum(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::CastColumnSum), 0);
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

// Two post-LN blocks (BERT: LayerNorm(dropout(h) + x), then LayerNorm(h + x)) and a pre-LN one
// (GPT-2: the sum is normalised and also carried on as the residual stream). `threads` > 1 with
// enough rows runs the kernels' parallel paths.
GraphRun run_residual_blocks(bool fuse, int threads) {
  ir::Graph g;
  ir::GraphBuilder b(g, 6);
  const int64_t C = 48;
  ValueId x = b.param("x", {5, 41, C});
  auto ln = [&](ValueId v, const char* name) {
    return b.layer_norm(v, b.param(str(name, ".gamma"), {C}), b.param(str(name, ".beta"), {C}), 1e-5);
  };
  auto branch = [&](ValueId v, const char* name) { return b.tanh(b.linear(v, b.param(name, {C, C}), ir::kNone)); };
  ValueId y = ln(b.add(b.dropout(branch(x, "w0"), 0.2), x), "ln0");  // DropoutAdd after fuse_dropout_add
  y = ln(b.add(branch(y, "w1"), y), "ln1");
  ValueId stream = b.add(y, branch(y, "w2"));
  ValueId out = b.add(stream, branch(ln(stream, "ln2"), "w3"));  // the sum is read again after its LayerNorm
  ValueId loss = b.reduce_sum(b.mul(out, out), {0, 1, 2});
  g.mark_output(loss);
  passes::fuse_dropout_add(g);
  if (fuse) {
    passes::FusionReport report = passes::fuse_add_layernorm(g);
    EXPECT_EQ(report.fused, 3);
    EXPECT_EQ(report.nodes_removed, 3);
    EXPECT_EQ(count(g, OpKind::AddLayerNorm), 3);
    EXPECT_EQ(count(g, OpKind::LayerNorm), 0);
    EXPECT_EQ(count(g, OpKind::DropoutAdd), 0);
    EXPECT_EQ(count(g, OpKind::Add), 1);  // the last residual add has no LayerNorm after it
  }
  runtime::PlanOptions options;
  options.num_threads = threads;
  return run_graph(g, loss, 0.5f, 0.21f, 3, options);
}

TEST(FuseAddLayerNorm, FusesPostAndPreNormResidualsAndKeepsResultsBitForBit) {
  for (int threads : {1, 2})
    expect_bit_identical(run_residual_blocks(false, threads), run_residual_blocks(true, threads),
                         str(threads, " threads"));
}

TEST(FuseAddLayerNorm, LeavesBroadcastsAndEarlierReadersAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {4, 8}), gamma = b.param("gamma", {8}), beta = b.param("beta", {8});
  g.mark_output(b.layer_norm(b.add(x, b.param("row", {1, 8})), gamma, beta, 1e-5));  // (4, 8) + (1, 8)
  ValueId sum = b.add(x, b.param("r", {4, 8}));
  g.mark_output(b.tanh(sum));  // read before the LayerNorm: the sum must exist there already
  g.mark_output(b.layer_norm(sum, gamma, beta, 1e-5));
  EXPECT_EQ(passes::fuse_add_layernorm(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::LayerNorm), 2);
  EXPECT_EQ(count(g, OpKind::AddLayerNorm), 0);
}

// A LayerNorm and an erf GELU written out of primitive ops, as exporters spell them, in the
// variants the passes accept: Pow or Mul for the square, Div by √2 or Mul by 1/√2, the GELU's
// three factors multiplied in each order.
struct DecomposedRun {
  GraphRun run;
  int layernorms = 0, gelus = 0;
};

DecomposedRun run_decomposed(bool fuse, int variant) {
  ir::Graph g;
  ir::GraphBuilder b(g, 2);
  const int64_t C = 24;
  ValueId x = b.param("x", {3, 5, C});
  ValueId gamma = b.param("gamma", {C}), beta = b.param("beta", {C});
  auto scalar = [&](double v) { return b.fill(Shape{}, v); };
  ValueId mean = b.reduce_mean(x, {-1}, true);
  ValueId d = b.sub(x, mean);
  ValueId squared = variant % 2 == 0 ? g.add(OpKind::Pow, {d}, {{"exponent", 2.0}}) : b.mul(d, d);
  ValueId std_dev = g.add(OpKind::Sqrt, {b.add(b.reduce_mean(squared, {2}, true), scalar(1e-5))});
  ValueId normed = variant < 2 ? b.add(b.mul(b.div(d, std_dev), gamma), beta)
                               : b.add(beta, b.mul(gamma, b.div(d, std_dev)));
  ValueId h = b.linear(normed, b.param("w", {C, C}), b.param("bias", {C}));
  ValueId erf = g.add(OpKind::Erf, {variant % 2 == 0 ? b.div(h, scalar(std::sqrt(2.0)))
                                                     : b.mul(scalar(1.0 / std::sqrt(2.0)), h)});
  ValueId cdf2 = b.add(scalar(1.0), erf);
  ValueId gelu = variant == 0   ? b.mul(b.mul(h, scalar(0.5)), cdf2)
                 : variant == 1 ? b.mul(b.mul(h, cdf2), scalar(0.5))
                                : b.mul(b.mul(cdf2, scalar(0.5)), h);
  ValueId loss = b.reduce_sum(b.mul(gelu, gelu), {0, 1, 2});
  g.mark_output(loss);
  DecomposedRun out;
  if (fuse) {
    out.layernorms = static_cast<int>(passes::fuse_decomposed_layernorm(g).fused);
    out.gelus = static_cast<int>(passes::fuse_erf_gelu(g).fused);
    EXPECT_EQ(count(g, OpKind::LayerNorm), 1);
    EXPECT_EQ(count(g, OpKind::Gelu), 1);
    for (OpKind gone : {OpKind::Pow, OpKind::Sqrt, OpKind::Erf, OpKind::ReduceMean, OpKind::Sub, OpKind::Div,
                        OpKind::Mul})
      EXPECT_EQ(count(g, gone), gone == OpKind::Mul ? 1 : 0) << ir::op_name(gone);  // the loss's own Mul stays
  }
  out.run = run_graph(g, loss, 0.6f, 0.43f, 0);
  return out;
}

TEST(FuseDecomposed, WrittenOutLayerNormAndErfGeluBecomeTheFusedOpsWithTheSameResults) {
  for (int variant = 0; variant < 3; ++variant) {
    DecomposedRun plain = run_decomposed(false, variant);
    DecomposedRun fused = run_decomposed(true, variant);
    EXPECT_EQ(fused.layernorms, 1) << "variant " << variant;
    EXPECT_EQ(fused.gelus, 1) << "variant " << variant;
    // Different arithmetic (one-pass statistics, fused GELU), so equal within rounding, not bit for bit.
    EXPECT_NEAR(plain.run.loss, fused.run.loss, 1e-5 * std::abs(plain.run.loss)) << "variant " << variant;
    ASSERT_EQ(plain.run.grads.size(), fused.run.grads.size());
    double max_grad = 0.0;
    for (float v : plain.run.grads) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
    for (size_t i = 0; i < plain.run.grads.size(); ++i)
      ASSERT_NEAR(plain.run.grads[i], fused.run.grads[i], 2e-5 * max_grad) << "variant " << variant << " gradient " << i;
  }
}

// Each variant of a written-out pattern, built by `run` without and with its pass: the pass fuses it once, and loss
// and every gradient agree within f32 rounding (the fused kernel forms its intermediates in another order): loss
// 1e-5 relative, gradients 2e-5 of the largest.
void expect_fused_alike(const std::function<GraphRun(bool, int, int*)>& run, int variants) {
  for (int variant = 0; variant < variants; ++variant) {
    int fused = 0;
    GraphRun plain = run(false, variant, nullptr);
    GraphRun with = run(true, variant, &fused);
    EXPECT_EQ(fused, 1) << "variant " << variant;
    EXPECT_NEAR(plain.loss, with.loss, 1e-5 * std::abs(plain.loss)) << "variant " << variant;
    ASSERT_EQ(plain.grads.size(), with.grads.size());
    double max_grad = 0.0;
    for (float v : plain.grads) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
    for (size_t i = 0; i < plain.grads.size(); ++i)
      ASSERT_NEAR(plain.grads[i], with.grads[i], 2e-5 * max_grad) << "variant " << variant << " gradient " << i;
  }
}

// Llama's RMSNorm as exporters write it, on a value the residual also reads: the square as Pow or Mul, the division
// as Div(x, s) or x times Div(1, s) in either order, the weight on either side.
GraphRun run_decomposed_rmsnorm(bool fuse, int variant, int* fused) {
  ir::Graph g;
  ir::GraphBuilder b(g, 2);
  const int64_t C = 24;
  ValueId x = b.param("x", {3, 5, C});
  ValueId weight = b.param("weight", {C});
  auto scalar = [&](double v) { return b.fill(Shape{1}, v); };
  ValueId squared = variant == 1 ? b.mul(x, x) : g.add(OpKind::Pow, {x}, {{"exponent", 2.0}});
  ValueId s = g.add(OpKind::Sqrt, {b.add(b.reduce_mean(squared, {-1}, true), scalar(1e-6))});
  ValueId normed = variant == 0   ? b.mul(x, b.div(scalar(1.0), s))
                   : variant == 1 ? b.div(x, s)
                                  : b.mul(b.div(scalar(1.0), s), x);
  ValueId y = b.add(x, variant == 1 ? b.mul(weight, normed) : b.mul(normed, weight));
  ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  if (fuse) {
    *fused = static_cast<int>(passes::fuse_decomposed_rmsnorm(g).fused);
    EXPECT_EQ(count(g, OpKind::RMSNorm), 1);
    for (OpKind gone : {OpKind::Pow, OpKind::Sqrt, OpKind::ReduceMean, OpKind::Div})
      EXPECT_EQ(count(g, gone), 0) << ir::op_name(gone);
  }
  return run_graph(g, loss, 0.6f, 0.43f, 0);
}

TEST(FuseDecomposed, WrittenOutRMSNormBecomesRMSNormWithTheSameResults) {
  // The fused kernel forms 1/√ once per row: equal within rounding, not bit for bit.
  expect_fused_alike(run_decomposed_rmsnorm, 3);
}

TEST(FuseDecomposed, LeavesRMSNormLookalikesAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {4, 8});
  auto scalar = [&](double v) { return b.fill(Shape{1}, v); };
  // Mean over the first axis; a numerator other than the squared value; a reciprocal of 2, not 1.
  ValueId s0 = g.add(OpKind::Sqrt, {b.add(b.reduce_mean(b.mul(x, x), {0}, true), scalar(1e-6))});
  g.mark_output(b.mul(b.div(x, s0), b.param("w0", {8})));
  ValueId s1 = g.add(OpKind::Sqrt, {b.add(b.reduce_mean(b.mul(x, x), {-1}, true), scalar(1e-6))});
  g.mark_output(b.mul(b.div(b.param("z", {4, 8}), s1), b.param("w1", {8})));
  ValueId s2 = g.add(OpKind::Sqrt, {b.add(b.reduce_mean(b.mul(x, x), {-1}, true), scalar(1e-6))});
  g.mark_output(b.mul(b.mul(x, b.div(scalar(2.0), s2)), b.param("w2", {8})));
  EXPECT_EQ(passes::fuse_decomposed_rmsnorm(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Sqrt), 3);
}

// GPT-2's gelu_new as exporters write it, terms and factors in both orders: one Gelu (tanh form), the same values.
GraphRun run_tanh_gelu(bool fuse, int variant, int* fused) {
  ir::Graph g;
  ir::GraphBuilder b(g, 2);
  ValueId x = b.param("x", {3, 7});
  auto scalar = [&](double v) { return b.fill(Shape{1}, v); };
  ValueId cube = g.add(OpKind::Pow, {x}, {{"exponent", 3.0}});
  ValueId inner = variant == 0 ? b.add(x, b.mul(cube, scalar(0.044715))) : b.add(b.mul(scalar(0.044715), cube), x);
  ValueId t = g.add(OpKind::Tanh, {b.mul(inner, scalar(0.7978845608028654))});
  ValueId cdf2 = b.add(t, scalar(1.0));
  ValueId gelu = variant == 0 ? b.mul(b.mul(x, scalar(0.5)), cdf2) : b.mul(b.mul(cdf2, scalar(0.5)), x);
  ValueId loss = b.reduce_sum(b.mul(gelu, gelu), {0, 1});
  g.mark_output(loss);
  if (fuse) {
    *fused = static_cast<int>(passes::fuse_erf_gelu(g).fused);
    EXPECT_EQ(count(g, OpKind::Gelu), 1);
    EXPECT_EQ(count(g, OpKind::Tanh), 0);
    EXPECT_EQ(count(g, OpKind::Pow), 0);
  }
  return run_graph(g, loss, 0.6f, 0.43f, 0);
}

TEST(FuseDecomposed, WrittenOutTanhGeluBecomesGeluWithTheSameResults) {
  expect_fused_alike(run_tanh_gelu, 2);
}

TEST(FuseDecomposed, LeavesLookalikesAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {4, 8});
  auto scalar = [&](double v) { return b.fill(Shape{}, v); };
  // Variance over the first axis, not the last: not a LayerNorm.
  ValueId d = b.sub(x, b.reduce_mean(x, {-1}, true));
  ValueId s = g.add(OpKind::Sqrt, {b.add(b.reduce_mean(b.mul(d, d), {0}, true), scalar(1e-5))});
  g.mark_output(b.add(b.mul(b.div(d, s), b.param("gamma", {8})), b.param("beta", {8})));
  // A GELU with 0.6 instead of 0.5, and one whose erf is read elsewhere too.
  ValueId e = g.add(OpKind::Erf, {b.div(x, scalar(std::sqrt(2.0)))});
  g.mark_output(b.mul(b.mul(x, scalar(0.6)), b.add(e, scalar(1.0))));
  ValueId e2 = g.add(OpKind::Erf, {b.div(x, scalar(std::sqrt(2.0)))});
  g.mark_output(b.mul(b.mul(x, scalar(0.5)), b.add(e2, scalar(1.0))));
  g.mark_output(e2);
  EXPECT_EQ(passes::fuse_decomposed_layernorm(g).fused, 0);
  EXPECT_EQ(passes::fuse_erf_gelu(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Sqrt), 1);
  EXPECT_EQ(count(g, OpKind::Erf), 2);
}


// transformers' apply_rotary_pos_emb as ONNX graphs hold it, on heads transposed out of (B, T, H, D): cos and sin
// (1, 1, T, D) inputs with the products and the sum in one order (variant 0), or (B, 1, T, D) with every operand
// order swapped (variant 1). Variant 2 is fusetrain's own export: x (B, T, H, D) itself, its halves from one Split,
// cos and sin (1, T, 1, D). Variant 3 is partial rotary as Phi's graph holds it: the rotation of the first R = 4 of
// each transposed head's 8 elements, concatenated with the other 4.
GraphRun run_decomposed_rope(bool fuse, int variant, int* fused) {
  ir::Graph g;
  ir::GraphBuilder b(g, 2);
  const int64_t B = 2, T = 5, H = 3, W = 8, D = variant == 3 ? 4 : W;  // W the head size, D the rotated width
  const int64_t rows = variant == 1 ? B : 1;
  const Shape table = variant == 2 ? Shape{rows, T, 1, D} : Shape{rows, 1, T, D};
  ValueId u = b.param("u", {B, T, H, W});
  ValueId cos = b.input("cos", table);
  ValueId sin = b.input("sin", table);
  ValueId heads = variant == 2 ? u : b.transpose(u, {0, 2, 1, 3});
  ValueId x = variant == 3 ? b.slice(heads, 3, 0, D) : heads;
  ValueId rotated;
  if (variant == 2) {
    std::vector<ValueId> halves = b.split(x, 3, {D / 2, D / 2});
    rotated = b.concat({b.scale(halves[1], -1.0), halves[0]}, 3);
  } else {
    rotated = b.concat({b.scale(b.slice(x, 3, D / 2, D), -1.0), b.slice(x, 3, 0, D / 2)}, 3);
  }
  ValueId y = variant == 1 ? b.add(b.mul(sin, rotated), b.mul(cos, x)) : b.add(b.mul(x, cos), b.mul(rotated, sin));
  if (variant == 3) y = b.concat({y, b.slice(heads, 3, D, W)}, 3);
  // A weight after the rotation, so each position's gradient differs.
  ValueId loss = b.reduce_sum(b.mul(b.mul(y, y), b.param("w", {W})), {0, 1, 2, 3});
  g.mark_output(loss);
  if (fuse) {
    *fused = static_cast<int>(passes::fuse_decomposed_rope(g).fused);
    EXPECT_EQ(count(g, OpKind::RoPE), 1);
    for (OpKind gone : {OpKind::Slice, OpKind::Split, OpKind::Concat, OpKind::Scale})
      EXPECT_EQ(count(g, gone), 0) << ir::op_name(gone);
    EXPECT_EQ(count(g, OpKind::Transpose), variant == 2 ? 0 : 1);  // heads-major: now after the rotation
  }
  auto feed = [&](runtime::Plan& plan) {
    float* c = plan.input("cos").data_as<float>();
    float* s = plan.input("sin").data_as<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) {
          const double angle = static_cast<double>((t + r) * (1 + d % (D / 2))) * 0.3;
          c[(r * T + t) * D + d] = static_cast<float>(std::cos(angle));
          s[(r * T + t) * D + d] = static_cast<float>(std::sin(angle));
        }
  };
  return run_graph(g, loss, 0.8f, 0.29f, 0, {}, feed);
}

TEST(FuseDecomposed, WrittenOutRotaryEmbeddingBecomesRoPEWithTheSameResults) {
  // The kernel sums each rotated pair in double, the written-out graph in f32.
  expect_fused_alike(run_decomposed_rope, 4);
}

TEST(FuseDecomposed, LeavesRotaryLookalikesAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  const int64_t B = 2, T = 4, H = 2, D = 6;
  ValueId u = b.param("u", {B, T, H, D});
  ValueId cos = b.input("cos", {1, 1, T, D});
  ValueId sin = b.input("sin", {1, 1, T, D});
  ValueId x = b.transpose(u, {0, 2, 1, 3});
  auto rope = [&](ValueId x, ValueId cos, ValueId sin, double sign, bool swap_halves) {
    ValueId x1 = b.slice(x, 3, 0, D / 2), x2 = b.slice(x, 3, D / 2, D);
    ValueId rotated = swap_halves ? b.concat({x1, b.scale(x2, sign)}, 3) : b.concat({b.scale(x2, sign), x1}, 3);
    return b.add(b.mul(x, cos), b.mul(rotated, sin));
  };
  // −2 instead of −1; the halves in the other order; sin a trained parameter (it would need a gradient); heads not
  // transposed out of (B, T, H, D).
  g.mark_output(rope(x, cos, sin, -2.0, false));
  g.mark_output(rope(x, cos, sin, -1.0, true));
  g.mark_output(rope(x, cos, b.param("sin_w", {1, 1, T, D}), -1.0, false));
  g.mark_output(rope(b.param("x", {B, H, T, D}), cos, sin, -1.0, false));
  EXPECT_EQ(passes::fuse_decomposed_rope(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Concat), 4);
}

// Llama's MLP product silu(gate) · up with σ as the ONNX importer writes Sigmoid, (1 + tanh(gate / 2)) / 2: the
// halvings as Scale (variant 0) or as Mul by 0.5 and Div by 2 (variant 1), the products in both orders.
GraphRun run_decomposed_swiglu(bool fuse, int variant, int* fused) {
  ir::Graph g;
  ir::GraphBuilder b(g, 2);
  ValueId gate = b.param("gate", {3, 5, 12});
  ValueId up = b.param("up", {3, 5, 12});
  auto scalar = [&](double v) { return b.fill(Shape{1}, v); };
  ValueId t = g.add(OpKind::Tanh, {variant == 0 ? b.scale(gate, 0.5) : b.div(gate, scalar(2.0))});
  ValueId sigmoid = variant == 0 ? b.scale(b.add(t, scalar(1.0)), 0.5) : b.mul(scalar(0.5), b.add(scalar(1.0), t));
  ValueId y = variant == 0 ? b.mul(up, b.mul(gate, sigmoid)) : b.mul(b.mul(sigmoid, gate), up);
  ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  if (fuse) {
    *fused = static_cast<int>(passes::fuse_decomposed_swiglu(g).fused);
    EXPECT_EQ(count(g, OpKind::SwiGLU), 1);
    EXPECT_EQ(count(g, OpKind::Tanh), 0);
    EXPECT_EQ(count(g, OpKind::Mul), 1);  // the loss's square alone
  }
  return run_graph(g, loss, 0.9f, 0.37f, 0);
}

TEST(FuseDecomposed, WrittenOutSwiGLUBecomesSwiGLUWithTheSameResults) {
  // The fused kernel forms σ from exp, the written-out graph from tanh.
  expect_fused_alike(run_decomposed_swiglu, 2);
}

TEST(FuseDecomposed, LeavesSwiGLULookalikesAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId gate = b.param("gate", {4, 8});
  ValueId up = b.param("up", {4, 8});
  auto scalar = [&](double v) { return b.fill(Shape{1}, v); };
  auto sigmoid_of = [&](ValueId x) {
    return b.scale(b.add(g.add(OpKind::Tanh, {b.scale(x, 0.5)}), scalar(1.0)), 0.5);
  };
  // σ(gate) times something other than gate; σ read elsewhere too; σ(gate)·gate not multiplied by anything; up
  // broadcast from another shape; a quarter instead of a half.
  g.mark_output(b.mul(b.mul(up, sigmoid_of(gate)), up));
  ValueId shared = sigmoid_of(gate);
  g.mark_output(b.mul(b.mul(gate, shared), up));
  g.mark_output(shared);
  g.mark_output(b.mul(gate, sigmoid_of(gate)));
  g.mark_output(b.mul(b.mul(gate, sigmoid_of(gate)), b.param("row", {8})));
  g.mark_output(b.mul(b.mul(gate, b.scale(b.add(g.add(OpKind::Tanh, {b.scale(gate, 0.25)}), scalar(1.0)), 0.5)), up));
  EXPECT_EQ(passes::fuse_decomposed_swiglu(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::Tanh), 5);
}

// A language-model head: h = tanh(x·w1ᵀ), logits = h·wvᵀ (+ bias) over V = 301 classes, and the
// cross-entropy against targets of which `ignored` (a fraction) are -100. Operands in `precision`
// (casts before the head, as bf16 models build it). Returns the loss and every gradient.
GraphRun run_lm_head(bool fuse, DType precision, bool bias, double ignored, int64_t chunk_rows, int threads) {
  ir::Graph g;
  ir::GraphBuilder b(g, 3);
  const int64_t B = 3, T = 37, C = 24, V = 301;
  ValueId h = b.tanh(b.linear(b.param("x", {B, T, C}), b.param("w1", {C, C}), ir::kNone));
  auto operand = [&](ValueId v) { return precision == DType::f32 ? v : b.cast(v, precision); };
  ValueId logits =
      b.linear(operand(h), operand(b.param("wv", {V, C})), bias ? b.param("bias", {V}) : ir::kNone);
  ValueId loss = b.softmax_cross_entropy(logits, b.input("targets", {B, T}, DType::i64));
  g.mark_output(loss);
  if (fuse) {
    passes::FusionReport report = passes::fuse_linear_cross_entropy(g, chunk_rows);
    EXPECT_EQ(report.fused, 1);
    EXPECT_EQ(report.nodes_removed, 1);
    EXPECT_EQ(count(g, OpKind::SoftmaxCrossEntropy), 0);
    EXPECT_EQ(count(g, OpKind::LinearCrossEntropy), 1);
    EXPECT_EQ(count(g, OpKind::Linear), 1);  // the first one
  }
  runtime::PlanOptions options;
  options.num_threads = threads;
  return run_graph(g, loss, 0.5f, 0.29f, 0, options, [&](runtime::Plan& plan) {
    int64_t* t = plan.input("targets").data_as<int64_t>();
    for (int64_t i = 0; i < B * T; ++i) {
      const bool skip = static_cast<double>((i * 37) % 100) < ignored * 100.0;
      t[i] = skip ? -100 : (i * 7919) % V;
    }
  });
}

TEST(FuseLinearCrossEntropy, SameLossAndGradientsWithoutStoringLogits) {
  for (DType precision : {DType::f32, DType::bf16})
    for (bool bias : {true, false})
      for (double ignored : {0.0, 0.85, 1.0})
        for (int64_t chunk : {int64_t{0}, int64_t{16}})
          for (int threads : {1, 2}) {
            const std::string label = str(dtype_name(precision), bias ? " bias" : " no-bias", " ignored ", ignored,
                                          " chunk ", chunk, " threads ", threads);
            GraphRun plain = run_lm_head(false, precision, bias, ignored, chunk, threads);
            GraphRun fused = run_lm_head(true, precision, bias, ignored, chunk, threads);
            // Each row's logits, lse and d(logits) are the unfused kernels' own, so the loss and the
            // gradients below the head (x, w1) agree bit for bit; the head's weight and bias sum the
            // same terms over rows in another grouping (chunks of counted rows), so to rounding.
            EXPECT_EQ(plain.loss, fused.loss) << label;
            ASSERT_EQ(plain.grads.size(), fused.grads.size());
            double max_grad = 0.0;
            for (float v : plain.grads) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
            const size_t below_head = 3 * 37 * 24 + 24 * 24;  // x, then w1: the first parameters declared
            for (size_t i = 0; i < plain.grads.size(); ++i) {
              if (i < below_head)
                ASSERT_EQ(plain.grads[i], fused.grads[i]) << label << " gradient " << i;
              else
                ASSERT_NEAR(plain.grads[i], fused.grads[i], 1e-6 * max_grad) << label << " gradient " << i;
            }
            if (ignored == 1.0) EXPECT_EQ(fused.loss, 0.0f) << label;
          }
}

// A frozen head (LoRA's base weight, cast to bf16 as a bf16 model does): the fused op forms no dw or dbias.
TEST(FuseLinearCrossEntropy, FrozenHeadGetsNoWeightGradient) {
  for (bool frozen : {false, true}) {
    ir::Graph g;
    ir::GraphBuilder b(g);
    ValueId x = b.param("x", {4, 8});
    ValueId w = b.param("w", {5, 8});
    if (frozen) g.freeze(w, DType::f32);
    ValueId logits = b.linear(b.cast(x, DType::bf16), b.cast(w, DType::bf16), ir::kNone);
    g.mark_output(b.softmax_cross_entropy(logits, b.input("targets", {4}, DType::i64)));
    ASSERT_EQ(passes::fuse_linear_cross_entropy(g).fused, 1);
    for (const ir::Node& n : g.nodes())
      if (n.op == OpKind::LinearCrossEntropy) {
        EXPECT_EQ(n.outputs.size(), frozen ? 2u : 4u);
        EXPECT_EQ(n.attrs.get_int("weight_grad", 1), frozen ? 0 : 1);
      }
  }
}

// TRL's token statistics (TokenStats: summed entropy, top-1 hits, counted rows) of an LM head, unfused (its own
// op over stored logits, checked against the logits here in double) and fused into LinearCrossEntropy (from each
// chunk's logits): the same counts, the entropy sum to f32 rounding; f32 and bf16 operands, ignored rows, ties at the
// top (a first maximum counts, a later one does not), one and two threads.
TEST(FuseLinearCrossEntropy, TokenStatisticsComeFromTheFusedHead) {
  for (int path = 0; path < 3; ++path)  // the AVX-512, AVX2 and portable row statistics (as far as the CPU has them)
  for (DType precision : {DType::f32, DType::bf16})
    for (int threads : {1, 2}) {
      kernels::cpu_basic::cap_cpu_path(path == 1 ? kernels::cpu_basic::CpuPath::avx2 : kernels::cpu_basic::CpuPath::avx512);
      kernels::cpu_basic::force_portable_path(path == 2);
      const int64_t B = 2, T = 29, C = 16, V = 203;
      std::vector<float> stats[2];
      std::vector<int64_t> targets_of_rows(static_cast<size_t>(B * T));
      for (bool fuse : {false, true}) {
        ir::Graph g;
        ir::GraphBuilder b(g, 3);
        ValueId h = b.tanh(b.param("x", {B, T, C}));
        auto operand = [&](ValueId v) { return precision == DType::f32 ? v : b.cast(v, precision); };
        ValueId logits = b.linear(operand(h), operand(b.param("wv", {V, C})), ir::kNone);
        ValueId targets = b.input("targets", {B, T}, DType::i64);
        ValueId loss = b.softmax_cross_entropy(logits, targets);
        ValueId sums = b.token_stats(logits, targets);
        g.mark_output(loss);
        g.mark_output(sums);
        if (!fuse) g.mark_output(logits);
        if (fuse) {
          ASSERT_EQ(passes::fuse_linear_cross_entropy(g).fused, 1);
          EXPECT_EQ(count(g, OpKind::TokenStats), 0);
        }
        autodiff::build_backward(g, loss, g.params());
        runtime::ParameterStore params(g);
        for (size_t i = 0; i < params.slots().size(); ++i) {
          float* p = params.param(i).data_as<float>();
          // Rows of wv repeat every 50 words: logit ties, so the first maximum decides a hit.
          for (int64_t k = 0; k < params.slots()[i].numel; ++k)
            p[k] = std::sin(0.37f * static_cast<float>((i == 1 ? k % (50 * C) : k) + 13 * int64_t(i)));
        }
        runtime::PlanOptions options;
        options.num_threads = threads;
        auto plan = compile::compile_plan(g, params, options);
        int64_t* t = plan->input("targets").data_as<int64_t>();
        if (!fuse) {
          // Targets: every fifth row ignored; then, from the logits of a first run, rows on their first maximum
          // (hits), on a later equal one (word + 50: not hits) and elsewhere.
          for (int64_t i = 0; i < B * T; ++i) targets_of_rows[size_t(i)] = i % 5 == 0 ? -100 : (i * 7919) % V;
          std::copy(targets_of_rows.begin(), targets_of_rows.end(), t);
          plan->run();
          const float* z = plan->output(logits).data_as<float>();
          for (int64_t r = 0; r < B * T; ++r) {
            if (r % 5 == 0 || r % 3 == 0) continue;
            const int64_t first_max = std::max_element(z + r * V, z + (r + 1) * V) - (z + r * V);
            targets_of_rows[size_t(r)] = r % 3 == 1 || first_max + 50 >= V ? first_max : first_max + 50;
          }
        }
        std::copy(targets_of_rows.begin(), targets_of_rows.end(), t);
        plan->run();
        const Tensor out = plan->output(sums);
        stats[fuse] = {out.data_as<float>()[0], out.data_as<float>()[1], out.data_as<float>()[2]};
        if (fuse) continue;
        // The same sums from the stored logits, in double.
        const Tensor z = plan->output(logits);
        double entropy = 0.0, hits = 0.0, rows = 0.0;
        for (int64_t r = 0; r < B * T; ++r) {
          if (t[r] == -100) continue;
          const float* row = z.data_as<float>() + r * V;
          double max = row[0], sum = 0.0, weighted = 0.0;
          int64_t first_max = 0;
          for (int64_t v = 1; v < V; ++v)
            if (row[v] > max) max = row[v], first_max = v;
          for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max), weighted += std::exp(row[v] - max) * row[v];
          entropy += max + std::log(sum) - weighted / sum;
          hits += first_max == t[r] ? 1.0 : 0.0;
          rows += 1.0;
        }
        EXPECT_NEAR(stats[0][0], entropy, 1e-5 * entropy);
        EXPECT_EQ(stats[0][1], hits);
        EXPECT_EQ(stats[0][2], rows);
        EXPECT_GT(hits, 0.0);
        EXPECT_LT(hits, rows);
      }
      kernels::cpu_basic::cap_cpu_path(kernels::cpu_basic::CpuPath::avx512);
      kernels::cpu_basic::force_portable_path(false);
      const std::string label = str("path ", path, " ", dtype_name(precision), " threads ", threads);
      EXPECT_NEAR(stats[1][0], stats[0][0], 1e-5 * stats[0][0]) << label;
      EXPECT_EQ(stats[1][1], stats[0][1]) << label;
      EXPECT_EQ(stats[1][2], stats[0][2]) << label;
    }
}

TEST(FuseLinearCrossEntropy, LeavesLogitsThatAreReadElsewhereAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {4, 8});
  ValueId targets = b.input("targets", {4}, DType::i64);
  ValueId read = b.linear(x, b.param("w", {5, 8}), ir::kNone);  // the logits are an output too
  g.mark_output(read);
  g.mark_output(b.softmax_cross_entropy(read, targets));
  ValueId half = b.linear(b.cast(x, DType::f16), b.cast(b.param("w2", {5, 8}), DType::f16), ir::kNone);
  g.mark_output(b.softmax_cross_entropy(half, targets));  // f16 operands: not fused
  ValueId scaled = b.scale(b.linear(x, b.param("w3", {5, 8}), ir::kNone), 2.0);
  g.mark_output(b.softmax_cross_entropy(scaled, targets));  // not a Linear's output
  EXPECT_EQ(passes::fuse_linear_cross_entropy(g).fused, 0);
  EXPECT_EQ(count(g, OpKind::SoftmaxCrossEntropy), 3);
}

// A post-norm encoder layer as the model builders write it (dropout on the attention
// probabilities and both residual branches), read by a first-token classifier.
struct LayerGraph {
  ir::Graph g;
  ValueId loss = ir::kNone;
  int64_t T = 0;
};

std::unique_ptr<LayerGraph> build_first_token_layer(bool causal, bool read_all_rows) {
  auto l = std::make_unique<LayerGraph>();
  ir::GraphBuilder b(l->g, 9);
  const int64_t B = 3, T = 11, H = 2, D = 8, C = H * D;
  l->T = T;
  ValueId x = b.param("x", {B, T, C});
  auto dense = [&](ValueId v, const std::string& name, int64_t out, int64_t in) {
    return b.linear(v, b.param(name + ".w", {out, in}), b.param(name + ".b", {out}));
  };
  auto ln = [&](ValueId v, const std::string& name) {
    return b.layer_norm(v, b.param(name + ".gamma", {C}), b.param(name + ".beta", {C}), 1e-5);
  };
  auto heads = [&](const char* name) {
    return b.transpose(b.reshape(dense(x, name, C, C), {B, T, H, D}), {0, 2, 1, 3});
  };
  ValueId q = heads("q"), k = heads("k"), v = heads("v");
  ValueId context = b.attention(q, k, v, ir::kNone, 1.0 / std::sqrt(static_cast<double>(D)), causal, 0.2);
  ValueId attn = dense(b.reshape(b.transpose(context, {0, 2, 1, 3}), {B, T, C}), "o", C, C);
  ValueId y = ln(b.add(b.dropout(attn, 0.2), x), "ln1");
  ValueId h = dense(b.gelu(dense(y, "up", 4 * C, C)), "down", C, 4 * C);
  y = ln(b.add(b.dropout(h, 0.2), y), "ln2");
  ValueId pooled = b.tanh(dense(b.reshape(b.slice(y, 1, 0, 1), {B, C}), "pool", C, C));
  l->loss = b.reduce_sum(b.mul(pooled, pooled), {0, 1});
  if (read_all_rows) l->loss = b.add(l->loss, b.reduce_sum(y, {0, 1, 2}));
  l->g.mark_output(l->loss);
  return l;
}

const ir::Node* find_op(const ir::Graph& g, OpKind op) {
  for (const ir::Node& n : g.nodes())
    if (n.op == op) return &n;
  return nullptr;
}

// Pruned and unpruned, through the passes that follow in a model plan (folded attention
// transposes, fused dropout + add + LayerNorm) or without them, on 1 and 2 threads.
TEST(PruneSlicedRows, FirstTokenClassifierRunsTheLayerOnOneRowWithTheSameMasks) {
  for (bool fold : {false, true})
    for (bool fuse : {false, true})
      for (int threads : {1, 2}) {
        const std::string label = str(fold ? "folded" : "transposes", fuse ? " fused" : "", " threads ", threads);
        GraphRun runs[2];
        for (bool prune : {false, true}) {
          auto l = build_first_token_layer(false, false);
          ir::Graph& g = l->g;
          if (fold) passes::fold_attention_transposes(g);
          if (prune) {
            passes::FusionReport report = passes::prune_sliced_rows(g);
            EXPECT_GT(report.fused, 10) << label;
            EXPECT_EQ(count(g, OpKind::Slice), 1) << label;  // of x, read by q and the residual
            const ir::Node* attention = find_op(g, OpKind::Attention);
            ASSERT_NE(attention, nullptr);
            const Shape& qs = g.value(attention->inputs[0]).shape;
            const Shape& ks = g.value(attention->inputs[1]).shape;
            EXPECT_EQ(fold ? qs[1] : qs[2], 1) << label;  // one query row
            EXPECT_EQ(fold ? ks[1] : ks[2], l->T) << label;  // every key
            EXPECT_EQ(attention->attrs.get_int("rng_rows"), l->T) << label;
            int full_rows = 0, dropouts_mapped = 0;
            for (const ir::Node& n : g.nodes()) {
              if (n.op == OpKind::Linear) full_rows += g.value(n.inputs[0]).shape[1] == l->T;
              if (n.op == OpKind::Dropout) dropouts_mapped += n.attrs.get_int("index_block", 0) == 16;
            }
            EXPECT_EQ(full_rows, 2) << label;  // the key and value projections
            EXPECT_EQ(dropouts_mapped, 2) << label;
          }
          if (fuse) {
            passes::fuse_dropout_add(g);
            EXPECT_EQ(passes::fuse_add_layernorm(g).fused, 2) << label;
          }
          runtime::PlanOptions options;
          options.num_threads = threads;
          runs[prune] = run_graph(g, l->loss, 0.6f, 0.37f, 5, options);
        }
        // Each kept row is computed by the same kernels from the same masks; products over
        // fewer rows may group sums differently, so agreement is to rounding. Masks drawn
        // afresh for the pruned rows would move the loss by far more.
        EXPECT_NEAR(runs[0].loss, runs[1].loss, 1e-5 * std::abs(runs[0].loss)) << label;
        ASSERT_EQ(runs[0].grads.size(), runs[1].grads.size());
        double max_grad = 0.0;
        for (float v : runs[0].grads) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
        for (size_t i = 0; i < runs[0].grads.size(); ++i)
          ASSERT_NEAR(runs[0].grads[i], runs[1].grads[i], 1e-5 * max_grad) << label << " gradient " << i;
      }
}

TEST(PruneSlicedRows, StopsWhereRowsAreReadInFullOrDependOnOtherRows) {
  // Every row of the layer's output is also summed into the loss: nothing to prune.
  auto all = build_first_token_layer(false, true);
  EXPECT_EQ(passes::prune_sliced_rows(all->g).fused, 0);
  // Causal attention: the query rows are not pruned (the pass stops at the attention).
  auto causal = build_first_token_layer(true, false);
  EXPECT_GT(passes::prune_sliced_rows(causal->g).fused, 0);
  const ir::Node* attention = find_op(causal->g, OpKind::Attention);
  ASSERT_NE(attention, nullptr);
  EXPECT_EQ(causal->g.value(attention->outputs[0]).shape[2], causal->T);
  // A Slice that keeps every row, and one across a LayerNorm's normalised axis, stay where they are.
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.param("x", {2, 3, 4});
  ValueId n = b.layer_norm(x, b.param("gamma", {4}), b.param("beta", {4}), 1e-5);
  g.mark_output(b.reduce_sum(b.slice(n, 2, 0, 2), {0, 1, 2}));
  g.mark_output(b.reduce_sum(b.slice(b.tanh(x), 1, 0, 3), {0, 1, 2}));
  EXPECT_EQ(passes::prune_sliced_rows(g).fused, 0);
}

// After round_activation_inputs, the graph as imported trains as the one written with autocast's roundings, bit for
// bit: one step on x filled with sin(step·i).
void expect_rounded_as_written(ir::Graph& imported, ValueId imported_loss, ir::Graph& written, ValueId written_loss,
                               float step, const char* what) {
  passes::round_activation_inputs(imported);
  auto feed = [step](runtime::Plan& plan) {
    Tensor x = plan.input("x");
    float* data = x.data_as<float>();
    for (int64_t i = 0; i < x.numel(); ++i) data[i] = std::sin(step * static_cast<float>(i));
  };
  expect_bit_identical(run_graph(imported, imported_loss, 0.4f, 0.7f, 1, {}, feed),
                       run_graph(written, written_loss, 0.4f, 0.7f, 1, {}, feed), what);
}

// A two-projection MLP on x (4, 6, 8), GELU(x·w1ᵀ + b1)·w2ᵀ, every projection's operands cast to bf16 as bf16
// mixed precision builds them; with `rounded`, the GELU's input cast to bf16 too (as the built families write it),
// else left f32 (as an imported graph holds it).
ValueId bf16_mlp(ir::Graph& g, bool rounded) {
  ir::GraphBuilder b(g, 5);
  auto bf16 = [&](ValueId v) { return b.cast(v, DType::bf16); };
  const ValueId x = bf16(b.input("x", {4, 6, 8}));
  const ValueId z = b.linear(x, bf16(b.param("w1", {12, 8})), b.param("b1", {12}));
  const ValueId y = b.linear(bf16(b.gelu(rounded ? bf16(z) : z)), bf16(b.param("w2", {8, 12})));
  const ValueId loss = b.reduce_sum(b.mul(y, y), {0, 1, 2});
  g.mark_output(loss);
  return loss;
}

TEST(RoundActivationInputs, GeluReadsABf16ProjectionRoundedAsTheBuiltFamiliesDo) {
  ir::Graph rewritten;
  bf16_mlp(rewritten, false);
  EXPECT_EQ(passes::round_activation_inputs(rewritten).fused, 1);
  for (const ir::Node& n : rewritten.nodes())
    if (n.op == OpKind::Gelu) EXPECT_EQ(rewritten.value(n.inputs[0]).dtype, DType::bf16);

  // Rewritten, the graph as imported trains as the one written with the cast, bit for bit (without the pass the
  // two differ: the GELU's input is rounded in one only).
  ir::Graph imported, built;
  const ValueId imported_loss = bf16_mlp(imported, false), built_loss = bf16_mlp(built, true);
  expect_rounded_as_written(imported, imported_loss, built, built_loss, 0.37f, "gelu");

  // In f32 (projections without bf16 operands) nothing changes.
  ir::Graph f32;
  ir::GraphBuilder b(f32, 5);
  b.gelu(b.linear(b.input("x", {4, 8}), b.param("w", {12, 8})));
  EXPECT_EQ(passes::round_activation_inputs(f32).fused, 0);
}

// Llama's MLP under bf16 as imported (SwiGLU on the f32 results, its result cast for down_proj and also read in f32
// by the loss) or as written with the roundings autocast makes (gate and up rounded, SwiGLU writing bf16).
ValueId bf16_swiglu_mlp(ir::Graph& g, bool rounded) {
  ir::GraphBuilder b(g, 5);
  auto bf16 = [&](ValueId v) { return b.cast(v, DType::bf16); };
  const ValueId x = bf16(b.input("x", {4, 6, 8}));
  const ValueId gate = b.linear(x, bf16(b.param("wg", {12, 8}))), up = b.linear(x, bf16(b.param("wu", {12, 8})));
  const ValueId h = rounded ? b.swiglu(bf16(gate), bf16(up)) : b.swiglu(gate, up);
  const ValueId y = b.linear(rounded ? h : bf16(h), bf16(b.param("wd", {8, 12})));
  const ValueId h32 = rounded ? b.cast(h, DType::f32) : h;
  const ValueId loss = b.add(b.reduce_sum(b.mul(y, y), {0, 1, 2}), b.reduce_sum(b.mul(h32, h32), {0, 1, 2}));
  g.mark_output(loss);
  return loss;
}

TEST(RoundActivationInputs, SwiGLUReadsAndWritesBf16AsAutocastDoes) {
  ir::Graph rewritten;
  bf16_swiglu_mlp(rewritten, false);
  EXPECT_EQ(passes::round_activation_inputs(rewritten).fused, 1);
  const std::vector<std::vector<ir::NodeId>> consumers = rewritten.consumers();
  int widened = 0;
  for (const ir::Node& n : rewritten.nodes()) {
    if (n.op != OpKind::SwiGLU) continue;
    EXPECT_EQ(rewritten.value(n.inputs[0]).dtype, DType::bf16);
    EXPECT_EQ(rewritten.value(n.inputs[1]).dtype, DType::bf16);
    EXPECT_EQ(rewritten.value(n.outputs[0]).dtype, DType::bf16);
    for (const ir::NodeId r : consumers[static_cast<size_t>(n.outputs[0])]) {
      const ir::Node& reader = rewritten.node(r);
      // down_proj reads it directly; the loss through one Cast to f32; no Cast to bf16 is left.
      if (reader.op == OpKind::Cast) {
        EXPECT_EQ(rewritten.value(reader.outputs[0]).dtype, DType::f32);
        widened += 1;
      } else {
        EXPECT_EQ(reader.op, OpKind::Linear);
      }
    }
  }
  EXPECT_EQ(widened, 1);

  // Rewritten, the graph as imported trains as the one written with the casts, bit for bit.
  ir::Graph imported, built;
  const ValueId imported_loss = bf16_swiglu_mlp(imported, false), built_loss = bf16_swiglu_mlp(built, true);
  expect_rounded_as_written(imported, imported_loss, built, built_loss, 0.37f, "swiglu");

  // One input from an f32 product: left alone.
  ir::Graph mixed;
  ir::GraphBuilder b(mixed, 5);
  const ValueId x = b.input("x", {4, 8});
  b.swiglu(b.linear(b.cast(x, DType::bf16), b.cast(b.param("wg", {12, 8}), DType::bf16)),
           b.linear(x, b.param("wu", {12, 8})));
  EXPECT_EQ(passes::round_activation_inputs(mixed).fused, 0);
}

// Attention on bf16 q, k, v as imported (f32 output, the heads merged, then cast for the output projection, and also
// read in f32 by the loss) or as written with autocast's bf16 output.
ValueId bf16_attention_block(ir::Graph& g, bool written_bf16) {
  ir::GraphBuilder b(g, 5);
  auto bf16 = [&](ValueId v) { return b.cast(v, DType::bf16); };
  const ValueId x = b.input("x", {2, 5, 3, 4});  // (B, H, T, D)
  const ValueId q = bf16(b.mul(x, b.param("wq", {4}))), k = bf16(b.mul(x, b.param("wk", {4})));
  const ValueId v = bf16(b.mul(x, b.param("wv", {4})));
  const ValueId y = b.attention(q, k, v, ir::kNone, 0.5, false, 0.0, written_bf16 ? DType::bf16 : DType::f32);
  const ValueId merged = b.reshape(b.transpose(y, {0, 2, 1, 3}), {2, 3, 20});
  const ValueId out = b.linear(written_bf16 ? merged : bf16(merged), bf16(b.param("wo", {6, 20})));
  const ValueId merged32 = written_bf16 ? b.cast(merged, DType::f32) : merged;
  const ValueId loss =
      b.add(b.reduce_sum(b.mul(out, out), {0, 1, 2}), b.reduce_sum(b.mul(merged32, merged32), {0, 1, 2}));
  g.mark_output(loss);
  return loss;
}

TEST(RoundActivationInputs, AttentionOnBf16OperandsWritesBf16ThroughTheHeadsMerge) {
  ir::Graph rewritten;
  bf16_attention_block(rewritten, false);
  EXPECT_EQ(passes::round_activation_inputs(rewritten).fused, 1);
  int bf16_casts = 0, widening = 0;
  for (const ir::Node& n : rewritten.nodes()) {
    if (n.op == OpKind::Attention) EXPECT_EQ(rewritten.value(n.outputs[0]).dtype, DType::bf16);
    if (n.op == OpKind::Reshape || n.op == OpKind::Transpose)
      EXPECT_EQ(rewritten.value(n.outputs[0]).dtype, DType::bf16) << ir::op_name(n.op);
    if (n.op == OpKind::Cast && rewritten.value(n.inputs[0]).producer != ir::kNone &&
        rewritten.node(rewritten.value(n.inputs[0]).producer).op == OpKind::Reshape)
      (rewritten.value(n.outputs[0]).dtype == DType::bf16 ? bf16_casts : widening) += 1;
  }
  EXPECT_EQ(bf16_casts, 0);  // the output projection's Cast went
  EXPECT_EQ(widening, 1);    // the f32 reader reads through one
  ir::Graph imported, written;
  const ValueId imported_loss = bf16_attention_block(imported, false);
  const ValueId written_loss = bf16_attention_block(written, true);
  expect_rounded_as_written(imported, imported_loss, written, written_loss, 0.41f, "attention");
}

}  // namespace
}  // namespace fusetrain::testing
