// Activation checkpointing on a hand-built graph: which nodes are cloned, where the
// clones go, and that the plan computes the same gradients with a smaller arena.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "fusetrain/fusetrain.h"
#include "fusetrain/passes/recompute.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using ir::OpKind;
using ir::ValueId;

// Three "layers" x -> tanh(x·Wᵢ) over an (R, C) activation, a summed loss.
struct Stack {
  ir::Graph g;
  std::vector<ValueId> boundaries;
  ValueId loss = ir::kNone;
  size_t backward_begin = 0;
};

std::unique_ptr<Stack> build_stack(int layers, int64_t R, int64_t C) {
  auto s = std::make_unique<Stack>();
  ir::GraphBuilder b(s->g);
  ValueId x = b.input("x", {R, C});
  x = b.scale(x, 1.0);
  s->boundaries.push_back(x);
  for (int l = 0; l < layers; ++l) {
    ValueId w = b.param("w" + std::to_string(l), {C, C});
    x = b.tanh(b.matmul(b.tanh(b.matmul(x, w)), w));
    s->boundaries.push_back(x);
  }
  s->loss = b.reduce_sum(x, {0, 1});
  s->g.mark_output(s->loss);
  s->backward_begin = s->g.nodes().size();
  autodiff::build_backward(s->g, s->loss, s->g.params());
  return s;
}

// sin(frequency · i) for i < n: an input for the stacks below.
std::vector<float> sine_input(int64_t n, double frequency) {
  std::vector<float> x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(frequency * static_cast<double>(i)));
  return x;
}

// Runs the stack's plan on input x with weights scale·cos(0.11·(k + i)); appends the gradients
// and the activation peak.
void run_stack(Stack& s, const std::vector<float>& x, float scale, std::vector<std::vector<float>>& grads,
               std::vector<size_t>& peaks) {
  runtime::ParameterStore params(s.g);
  for (size_t i = 0; i < params.slots().size(); ++i) {
    float* p = params.param(i).data_as<float>();
    for (int64_t k = 0; k < params.slots()[i].numel; ++k) p[k] = scale * std::cos(0.11f * static_cast<float>(k + i));
  }
  auto plan = compile::compile_plan(s.g, params, {});
  std::memcpy(plan->input("x").data(), x.data(), x.size() * sizeof(float));
  params.zero_grads();
  plan->run();
  grads.emplace_back(params.grads_data(), params.grads_data() + params.flat_numel());
  peaks.push_back(plan->memory_report().activation_peak_bytes);
}

TEST(Recompute, ClonesEachLayerBeforeItsBackward) {
  auto s = build_stack(3, 8, 16);
  const size_t nodes_before = s->g.nodes().size();
  passes::RecomputeReport report = passes::recompute_segments(s->g, s->boundaries);
  EXPECT_EQ(report.segments, 3);
  // Per layer m = x·W, t = tanh(m), tanh(t·W): backward reads the boundaries, W and t (for TanhBackward
  // and the second weight gradient), never m; t needs m, so the first MatMul and Tanh are cloned.
  EXPECT_EQ(report.nodes_cloned, 3 * 2);
  EXPECT_EQ(report.values_freed, 3);
  EXPECT_EQ(s->g.nodes().size(), nodes_before + 6);
  // Every value backward reads from inside a layer is now produced after forward ends (by a clone),
  // except the boundaries, which stay saved.
  const ir::Graph& g = s->g;
  const size_t forward_end = s->backward_begin;
  for (const ir::Node& n : g.nodes()) {
    if (static_cast<size_t>(n.id) < forward_end) continue;
    for (ValueId in : n.inputs) {
      const ir::Value& v = g.value(in);
      if (v.kind != ir::ValueKind::Activation) continue;
      if (static_cast<size_t>(v.producer) >= forward_end) continue;
      bool boundary = std::find(s->boundaries.begin(), s->boundaries.end(), in) != s->boundaries.end();
      EXPECT_TRUE(boundary || in == s->loss)
          << "backward node " << ir::op_name(n.op) << " still reads forward value " << g.describe(in);
    }
  }
}

TEST(Recompute, SameGradientsSmallerArena) {
  const int64_t R = 64, C = 32;
  const std::vector<float> x = sine_input(R * C, 0.37);
  std::vector<std::vector<float>> grads;
  std::vector<size_t> peaks;
  for (bool recompute : {false, true}) {
    auto s = build_stack(4, R, C);
    if (recompute) passes::recompute_segments(s->g, s->boundaries);
    run_stack(*s, x, 0.2f, grads, peaks);
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient element " << i;
  EXPECT_LT(peaks[1], peaks[0]) << "recompute must lower the activation peak";
}

TEST(Recompute, RejectsBoundariesOutOfOrder) {
  auto s = build_stack(2, 4, 8);
  std::vector<ValueId> reversed(s->boundaries.rbegin(), s->boundaries.rend());
  std::string msg = error_of([&] { passes::recompute_segments(s->g, reversed); });
  EXPECT_NE(msg.find("node order"), std::string::npos) << msg;
}

// Layers y = tanh(x·Wᵀ) with bf16 operands (x and W cast before each Linear), as models build them.
std::unique_ptr<Stack> build_bf16_stack(int layers, int64_t R, int64_t C) {
  auto s = std::make_unique<Stack>();
  ir::GraphBuilder b(s->g);
  ValueId x = b.input("x", {R, C});
  for (int l = 0; l < layers; ++l) {
    ValueId w = b.param("w" + std::to_string(l), {C, C});
    x = b.tanh(b.linear(b.cast(x, DType::bf16), b.cast(w, DType::bf16), ir::kNone));
  }
  s->loss = b.reduce_sum(x, {0, 1});
  s->g.mark_output(s->loss);
  s->backward_begin = s->g.nodes().size();
  autodiff::build_backward(s->g, s->loss, s->g.params());
  return s;
}

TEST(RecastWeights, BackwardReadsASecondCastPlacedBeforeItAndGradientsAreUnchanged) {
  const int64_t R = 8, C = 256;  // weights large next to activations, so their copies matter
  const std::vector<float> x = sine_input(R * C, 0.37);
  std::vector<std::vector<float>> grads;
  std::vector<size_t> peaks;
  for (bool recast : {false, true}) {
    auto s = build_bf16_stack(4, R, C);
    if (recast) {
      const size_t nodes_before = s->g.nodes().size();
      passes::RecastReport report = passes::recast_weights_for_backward(s->g);
      // Backward reads W only for dx = dy·W, which the first layer (x is an input) does not need.
      EXPECT_EQ(report.casts, 3);
      EXPECT_EQ(report.bytes_freed, size_t{3 * C * C * 2});
      EXPECT_EQ(s->g.nodes().size(), nodes_before + 3);
      // Backward reads no weight copy made in forward; each recast comes right before its first reader.
      const ir::Graph& g = s->g;
      for (const ir::Node& n : g.nodes()) {
        if (static_cast<size_t>(n.id) < s->backward_begin) continue;
        for (ValueId in : n.inputs) {
          const ir::Value& v = g.value(in);
          if (v.producer == ir::kNone || g.node(v.producer).op != OpKind::Cast) continue;
          if (g.value(g.node(v.producer).inputs[0]).kind != ir::ValueKind::Param) continue;
          EXPECT_GE(static_cast<size_t>(v.producer), s->backward_begin) << g.describe(in);
          EXPECT_LT(v.producer, n.id);
        }
        if (n.op == OpKind::Cast && n.name.find(":recast") != std::string::npos)
          EXPECT_NE(g.node(n.id + 1).op, OpKind::Cast) << "a recast goes right before the node that reads it";
      }
    }
    run_stack(*s, x, 0.05f, grads, peaks);
  }
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient element " << i;
  EXPECT_LT(peaks[1], peaks[0]) << "weight copies must no longer be live at the end of forward";
}

// Three bf16 projections of one input, each casting it itself, as the model builders write them.
std::unique_ptr<Stack> build_three_projections(int64_t R, int64_t C) {
  auto s = std::make_unique<Stack>();
  ir::GraphBuilder b(s->g);
  ValueId x = b.tanh(b.input("x", {R, C}));
  ValueId sum = ir::kNone;
  for (int i = 0; i < 3; ++i) {
    ValueId y = b.tanh(b.linear(b.cast(x, DType::bf16), b.cast(b.param(str("w", i), {C, C}), DType::bf16), ir::kNone));
    sum = sum == ir::kNone ? y : b.mul(sum, y);
  }
  s->loss = b.reduce_sum(sum, {0, 1});
  s->g.mark_output(s->loss);
  s->backward_begin = s->g.nodes().size();
  autodiff::build_backward(s->g, s->loss, s->g.params());
  return s;
}

TEST(MergeDuplicateCasts, OneCopyOfEachValueAndBitIdenticalGradients) {
  const int64_t R = 64, C = 32;
  const std::vector<float> x = sine_input(R * C, 0.53);
  std::vector<std::vector<float>> grads;
  std::vector<size_t> peaks;
  for (bool merge : {false, true}) {
    auto s = build_three_projections(R, C);
    if (merge) {
      passes::MergeCastsReport report = passes::merge_duplicate_casts(s->g);
      EXPECT_EQ(report.casts, 2);  // the input's second and third casts; the weights differ
      EXPECT_EQ(report.bytes_saved, size_t{2 * R * C * 2});
      ValueId input = ir::kNone;  // tanh(x), what the first cast reads
      int casts_of_input = 0;
      for (const ir::Node& n : s->g.nodes()) {
        if (n.op != OpKind::Cast) continue;
        if (input == ir::kNone) input = n.inputs[0];
        casts_of_input += n.inputs[0] == input;
      }
      EXPECT_EQ(casts_of_input, 1);
    }
    run_stack(*s, x, 0.1f, grads, peaks);
  }
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient element " << i;
  EXPECT_LT(peaks[1], peaks[0]) << "one bf16 copy of x kept for backward instead of three";
}

// Two MLP blocks x -> Linear -> GELU -> Linear as the model builders write them: `fused` has the first
// GELU folded into its Linear (LinearGelu, as fuse_linear_gelu leaves it), the second a plain Gelu;
// `bf16` casts the products' operands, and GELU reads its input rounded to bf16.
std::unique_ptr<Stack> build_mlps(int64_t R, int64_t C, bool bf16) {
  auto s = std::make_unique<Stack>();
  ir::GraphBuilder b(s->g);
  auto operand = [&](ValueId v) { return bf16 ? b.cast(v, DType::bf16) : v; };
  ValueId x = b.tanh(b.input("x", {R, C}));
  for (int layer = 0; layer < 2; ++layer) {
    ValueId w1 = b.param(str("w1_", layer), {4 * C, C}), w2 = b.param(str("w2_", layer), {C, 4 * C});
    ValueId h;
    if (layer == 0) {
      std::vector<ValueId> outs =
          s->g.add_node(OpKind::LinearGelu, {operand(x), operand(w1), b.param("b1", {4 * C})},
                        bf16 ? ir::Attrs{{"z_dtype", std::string("bf16")}} : ir::Attrs{});
      h = outs[0];
    } else {
      ValueId z = b.linear(operand(x), operand(w1), ir::kNone);
      h = b.gelu(bf16 ? b.cast(z, DType::bf16) : z, "tanh");
    }
    x = b.add(x, b.linear(operand(h), operand(w2), ir::kNone));
  }
  s->loss = b.reduce_sum(b.mul(x, x), {0, 1});
  s->g.mark_output(s->loss);
  s->backward_begin = s->g.nodes().size();
  autodiff::build_backward(s->g, s->loss, s->g.params());
  return s;
}

TEST(RecomputeGeluOutputs, BackwardRecomputesWhatTheNextProductKeptAndGradientsAreUnchanged) {
  const int64_t R = 48, C = 16;
  const std::vector<float> x = sine_input(R * C, 0.41);
  for (bool bf16 : {false, true}) {
    std::vector<std::vector<float>> grads;
    std::vector<size_t> peaks;
    for (bool recompute : {false, true}) {
      auto s = build_mlps(R, C, bf16);
      if (recompute) {
        const size_t nodes_before = s->g.nodes().size();
        passes::GeluRecomputeReport report = passes::recompute_gelu_outputs(s->g);
        EXPECT_EQ(report.gelus, 2) << "bf16 " << bf16;
        EXPECT_EQ(report.bytes_freed, size_t(2 * R * 4 * C * (bf16 ? 2 : 4))) << "bf16 " << bf16;
        EXPECT_EQ(s->g.nodes().size(), nodes_before + (bf16 ? 4 : 2));  // a Gelu (and its Cast) each
        // No backward node reads a forward GELU output or its cast: recomputing nodes go only into
        // backward, so forward keeps its node ids.
        const ir::Graph& g = s->g;
        const std::vector<std::vector<ir::NodeId>> consumers = g.consumers();
        for (ir::NodeId n = 0; n < static_cast<ir::NodeId>(s->backward_begin); ++n) {
          const ir::Node& node = g.node(n);
          if (node.op != OpKind::Gelu && node.op != OpKind::LinearGelu) continue;
          std::vector<ValueId> kept{node.outputs[0]};
          for (ir::NodeId c : consumers[static_cast<size_t>(node.outputs[0])])
            if (g.node(c).op == OpKind::Cast) kept.push_back(g.node(c).outputs[0]);
          for (ValueId v : kept)
            for (ir::NodeId c : consumers[static_cast<size_t>(v)])
              EXPECT_LT(static_cast<size_t>(c), s->backward_begin) << g.node(c).name << " reads " << g.describe(v);
        }
      }
      run_stack(*s, x, 0.2f, grads, peaks);
    }
    for (size_t i = 0; i < grads[0].size(); ++i)
      ASSERT_EQ(grads[0][i], grads[1][i]) << "bf16 " << bf16 << " gradient element " << i;
    EXPECT_LT(peaks[1], peaks[0]) << "bf16 " << bf16;
  }
}

// Two T5 feed-forward blocks x -> Linear -> ReLU -> Linear (with `bf16`, ReLU reads and writes the projection's result
// rounded to bf16, as the importer writes it): ReluBackward reads the ReLU's output, which the second projection's
// weight gradient keeps anyway, so the ReLU's input dies in forward; the gradients are bit-identical.
TEST(ReluBackwardFromOutput, ReadsTheKeptOutputAndGradientsAreUnchanged) {
  const int64_t R = 48, C = 16;
  const std::vector<float> x = sine_input(R * C, 0.37);
  for (bool bf16 : {false, true}) {
    std::vector<std::vector<float>> grads;
    std::vector<size_t> peaks;
    for (bool pass : {false, true}) {
      auto s = std::make_unique<Stack>();
      ir::GraphBuilder b(s->g);
      auto operand = [&](ValueId v) { return bf16 ? b.cast(v, DType::bf16) : v; };
      ValueId h = b.tanh(b.input("x", {R, C}));
      for (int layer = 0; layer < 2; ++layer) {
        ValueId w1 = b.param(str("wi_", layer), {4 * C, C}), w2 = b.param(str("wo_", layer), {C, 4 * C});
        ValueId y = b.relu(operand(b.linear(operand(h), operand(w1), ir::kNone)));
        h = b.add(h, b.linear(y, operand(w2), ir::kNone));
      }
      s->loss = b.reduce_sum(b.mul(h, h), {0, 1});
      s->g.mark_output(s->loss);
      s->backward_begin = s->g.nodes().size();
      autodiff::build_backward(s->g, s->loss, s->g.params());
      if (pass) {
        passes::ReluBackwardReport report = passes::relu_backward_from_output(s->g);
        EXPECT_EQ(report.relus, 2) << "bf16 " << bf16;
        EXPECT_EQ(report.bytes_freed, size_t(2 * R * 4 * C * (bf16 ? 2 : 4))) << "bf16 " << bf16;
        for (const ir::Node& n : s->g.nodes())
          if (n.op == OpKind::ReluBackward) {
            const ir::Node& producer = s->g.node(s->g.value(n.inputs[1]).producer);
            EXPECT_EQ(producer.op, OpKind::Relu) << n.name << " reads " << s->g.describe(n.inputs[1]);
          }
      }
      run_stack(*s, x, 0.2f, grads, peaks);
    }
    for (size_t i = 0; i < grads[0].size(); ++i)
      ASSERT_EQ(grads[0][i], grads[1][i]) << "bf16 " << bf16 << " gradient element " << i;
    EXPECT_LT(peaks[1], peaks[0]) << "bf16 " << bf16;
  }
}

int count_op(const ir::Graph& g, OpKind op) {
  return static_cast<int>(std::count_if(g.nodes().begin(), g.nodes().end(), [&](const ir::Node& n) { return n.op == op; }));
}

// After recompute_gelu_outputs, the bf16 MLPs cast four GELU results (two in forward, two
// recomputed in backward) and the second layer's projection z for its GELU: each GELU and that
// Linear then write bf16 themselves, with bit-identical gradients.
TEST(FoldOutputCasts, GelusAndProjectionsWriteBf16ThemselvesAndGradientsAreUnchanged) {
  const int64_t R = 48, C = 16;
  const std::vector<float> x = sine_input(R * C, 0.29);
  std::vector<std::vector<float>> grads;
  std::vector<size_t> peaks;
  for (bool fold : {false, true}) {
    auto s = build_mlps(R, C, true);
    passes::recompute_gelu_outputs(s->g);
    const int casts = count_op(s->g, OpKind::Cast);
    if (fold) {
      passes::OutputCastsReport report = passes::fold_output_casts(s->g);
      EXPECT_EQ(report.casts, 5);
      EXPECT_EQ(report.bytes_saved, size_t(5 * R * 4 * C * 4));  // each an (R, 4C) f32 result
      EXPECT_EQ(count_op(s->g, OpKind::Cast), casts - 5);
      int bf16_gelus = 0, bf16_projections = 0;
      for (const ir::Node& n : s->g.nodes()) {
        const bool bf16 = s->g.value(n.outputs[0]).dtype == DType::bf16;
        if (n.op == OpKind::Gelu || n.op == OpKind::LinearGelu) bf16_gelus += bf16;
        if (n.op == OpKind::Linear) bf16_projections += bf16;
      }
      EXPECT_EQ(bf16_gelus, 4);
      EXPECT_EQ(bf16_projections, 1);
    }
    run_stack(*s, x, 0.2f, grads, peaks);
  }
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "gradient element " << i;
  EXPECT_LE(peaks[1], peaks[0]);  // never more memory (here the peak lies elsewhere)
}

// Gives v one reader that wants it in bf16: a Cast to bf16, itself read through a Cast to f32 (a graph output's own
// cast is never folded, so the bf16 cast must not be the output).
void read_in_bf16(ir::Graph& g, ir::GraphBuilder& b, ValueId v) {
  g.mark_output(b.cast(b.cast(v, DType::bf16), DType::f32));
}

// A projection whose heads are split before the cast (Linear -> Reshape -> Cast, as imported attention projections
// read): the Linear writes bf16 and the Reshape carries it; a second Reshape read elsewhere too stops the fold.
TEST(FoldOutputCasts, ProjectionsCastAfterTheirHeadsSplitWriteBf16) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.cast(b.input("x", {2, 5, 8}), DType::bf16);
  ValueId w = b.cast(b.param("w", {8, 8}), DType::bf16);
  ValueId y = b.linear(x, w, b.param("bias", {8}));
  ValueId heads = b.reshape(y, {2, 5, 2, 4});
  auto read_bf16 = [&](ValueId v) { read_in_bf16(g, b, v); };
  read_bf16(heads);
  ValueId z = b.linear(x, w, ir::kNone);
  ValueId z_heads = b.reshape(z, {2, 5, 2, 4});
  read_bf16(b.reshape(z_heads, {10, 8}));
  g.mark_output(b.reduce_sum(z_heads, {0, 1, 2, 3}));  // z's heads are read in f32 too
  EXPECT_EQ(passes::fold_output_casts(g).casts, 1);
  EXPECT_EQ(g.value(y).dtype, DType::bf16);
  EXPECT_EQ(g.value(heads).dtype, DType::bf16);
  EXPECT_EQ(g.value(z).dtype, DType::f32);
  EXPECT_EQ(g.node(g.value(y).producer).attrs.get_string("out_dtype"), "bf16");
}

TEST(FoldOutputCasts, LeavesResultsReadElsewhereAndOtherOpsAlone) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {4, 8});
  auto read_bf16 = [&](ValueId v) { read_in_bf16(g, b, v); };
  ValueId read_twice = b.gelu(x, "none");  // cast, and read in f32 too
  g.mark_output(b.reduce_sum(b.cast(read_twice, DType::bf16), {0, 1}));
  g.mark_output(b.reduce_sum(read_twice, {0, 1}));
  read_bf16(b.tanh(x));  // not a GELU
  ValueId kept = b.gelu(b.scale(x, 2.0), "tanh");  // the f32 result leaves the graph
  g.mark_output(kept);
  read_bf16(kept);
  ValueId w = b.param("w", {8, 8});
  read_bf16(b.linear(x, w, ir::kNone));  // an f32 projection: its result stays f32
  ValueId twice = b.linear(b.cast(x, DType::bf16), b.cast(w, DType::bf16), ir::kNone);  // read in f32 too
  read_bf16(twice);
  g.mark_output(b.reduce_sum(twice, {0, 1}));
  ValueId lone = b.linear(b.cast(x, DType::bf16), b.cast(w, DType::bf16), ir::kNone);  // the control: folds
  read_bf16(lone);
  EXPECT_EQ(passes::fold_output_casts(g).casts, 1);
  EXPECT_EQ(g.value(lone).dtype, DType::bf16);
}

}  // namespace
}  // namespace fusetrain::testing
