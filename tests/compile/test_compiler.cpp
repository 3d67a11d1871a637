// The compiler on graphs that no model builder made: a hand-written network goes through the same
// pipeline and trains, as an imported graph will; the program cache; and the graph rewrite API the
// passes share.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "fusetrain/compile/compiler.h"
#include "fusetrain/fusetrain.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using ir::OpKind;
using ir::ValueId;

constexpr int64_t kRows = 32, kFeatures = 12, kHidden = 24, kClasses = 3;

// LayerNorm written out as exporters spell it: (x - mean) / sqrt(var + eps) * gamma + beta.
ValueId written_out_layer_norm(ir::GraphBuilder& b, ValueId x, ValueId gamma, ValueId beta) {
  ValueId centred = b.sub(x, b.reduce_mean(x, {-1}, true));
  ValueId variance = b.reduce_mean(b.mul(centred, centred), {-1}, true);
  ValueId norm = b.div(centred, b.graph().add(OpKind::Sqrt, {b.add(variance, b.fill(Shape{}, 1e-5))}));
  return b.add(b.mul(norm, gamma), beta);
}

// GELU written out: 0.5 · x · (1 + erf(x / √2)).
ValueId written_out_gelu(ir::GraphBuilder& b, ValueId x) {
  ValueId erf = b.graph().add(OpKind::Erf, {b.div(x, b.fill(Shape{}, std::sqrt(2.0)))});
  ValueId cdf = b.add(erf, b.fill(Shape{}, 1.0));
  return b.mul(b.mul(x, b.fill(Shape{}, 0.5)), cdf);
}

// A two-layer classifier: Linear, written-out LayerNorm and GELU, Linear, cross-entropy.
struct HandBuilt {
  ir::Graph graph;
  compile::GraphRoles roles;
  HandBuilt() {
    ir::GraphBuilder b(graph, 5);
    ValueId x = b.input("x", {kRows, kFeatures});
    ValueId labels = b.input("labels", {kRows}, DType::i64);
    ValueId h = b.linear(x, b.param("fc1.weight", {kHidden, kFeatures}), b.param("fc1.bias", {kHidden}));
    h = written_out_layer_norm(b, h, b.param("norm.weight", {kHidden}), b.param("norm.bias", {kHidden}));
    h = written_out_gelu(b, h);
    ValueId logits = b.linear(h, b.param("fc2.weight", {kClasses, kHidden}), b.param("fc2.bias", {kClasses}));
    roles.loss = b.softmax_cross_entropy(logits, labels);
    roles.outputs = {logits};
  }
};

// A fixed problem the network can learn: the class is which third of [-1, 1] the first feature's sign pattern falls in.
struct Data {
  std::vector<float> x = std::vector<float>(kRows * kFeatures);
  std::vector<int64_t> labels = std::vector<int64_t>(kRows);
  Data() {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (float& v : x) v = uniform(rng);
    for (int64_t r = 0; r < kRows; ++r) {
      const float f = x[static_cast<size_t>(r * kFeatures)];
      labels[static_cast<size_t>(r)] = f < -0.33f ? 0 : f < 0.33f ? 1 : 2;
    }
  }
};

void initialise(runtime::ParameterStore& params) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (size_t i = 0; i < params.slots().size(); ++i) {
    float* p = params.param(i).data_as<float>();
    const bool norm_weight = params.slots()[i].name == "norm.weight";
    for (int64_t k = 0; k < params.slots()[i].numel; ++k) p[k] = norm_weight ? 1.0f : normal(rng);
  }
}

compile::Program compile_training(const HandBuilt& net, runtime::ParameterStore& params, bool fusions) {
  compile::CompileOptions options;
  options.backward = true;
  options.fusions = fusions;
  options.plan.num_threads = 1;
  return compile::compile(net.graph, net.roles, params, options);
}

double run_step(compile::Program& program, const Data& data, runtime::ParameterStore& params) {
  program.plan->upload_input("x", data.x.data());
  program.plan->upload_input("labels", data.labels.data());
  params.zero_grads();
  program.plan->run();
  return program.plan->output(program.roles.loss).item();
}

TEST(Compiler, HandBuiltGraphCompilesThroughThePipelineAndTrains) {
  HandBuilt net;
  Data data;
  runtime::ParameterStore params(net.graph);
  initialise(params);
  compile::Program program = compile_training(net, params, /*fusions=*/true);

  // The pipeline recognised the written-out ops, as it will in an imported graph.
  const std::vector<std::string>& applied = program.log.applied;
  auto ran = [&](const std::string& pass) {
    for (const std::string& line : applied)
      if (line.rfind(pass + ":", 0) == 0) return true;
    return false;
  };
  EXPECT_TRUE(ran("fuse_decomposed_layernorm"));
  EXPECT_TRUE(ran("fuse_erf_gelu"));
  EXPECT_EQ(program.log.ops_after.count("Erf"), 0u);
  EXPECT_EQ(program.log.ops_after.at("LayerNorm"), 1);

  // Every parameter got a gradient bound to the store, made by a backward node or by the fused LM head, which
  // forms its weight's gradient in forward.
  const ir::Graph& g = program.plan->graph();
  std::set<std::string> with_gradient;
  for (const ir::Value& v : g.values())
    if (v.gradient_of != ir::kNone) {
      with_gradient.insert(g.value(v.gradient_of).name);
      const ir::Node& producer = g.node(v.producer);
      EXPECT_TRUE(producer.phase == ir::Phase::Backward || producer.op == OpKind::LinearCrossEntropy)
          << g.describe(v.id);
    }
  EXPECT_EQ(with_gradient.size(), params.slots().size());

  // It trains: AdamW on the fixed batch takes the loss well below where it started.
  optim::AdamW adamw(params, optim::AdamWConfig{.lr = 0.02, .weight_decay = 0.0});
  adamw.set_num_threads(1);
  const double first = run_step(program, data, params);
  EXPECT_NEAR(first, std::log(3.0), 1.0) << "an untrained 3-class classifier starts near log 3";
  double last = first;
  for (int step = 0; step < 60; ++step) {
    adamw.clip_and_step(1.0);
    last = run_step(program, data, params);
    ASSERT_TRUE(std::isfinite(last)) << "step " << step;
  }
  EXPECT_LT(last, 0.3 * first) << "first loss " << first;
}

// The fused program computes the function of the graph as written: the same loss and gradients as the
// program compiled without passes, to float rounding (the fused LayerNorm and GELU round differently).
TEST(Compiler, PassesKeepTheHandBuiltGraphsLossAndGradients) {
  HandBuilt net;
  Data data;
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  for (bool fusions : {false, true}) {
    runtime::ParameterStore params(net.graph);
    initialise(params);
    compile::Program program = compile_training(net, params, fusions);
    losses.push_back(run_step(program, data, params));
    grads.emplace_back(params.grads_data(), params.grads_data() + params.flat_numel());
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-5 * std::abs(losses[0]));
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_NEAR(grads[0][i], grads[1][i], 1e-4) << "element " << i;
}

TEST(Compiler, TrainingProgramNeedsALoss) {
  HandBuilt net;
  runtime::ParameterStore params(net.graph);
  compile::GraphRoles roles = net.roles;
  roles.loss = ir::kNone;
  compile::CompileOptions options;
  options.backward = true;
  EXPECT_NE(error_of([&] { compile::compile(net.graph, roles, params, options); }).find("needs a loss"),
            std::string::npos);
}

TEST(Compiler, PipelineNamesEveryPassOnce) {
  std::set<std::string> names;
  for (const compile::Pass& pass : compile::pipeline()) {
    EXPECT_TRUE(names.insert(pass.name).second) << pass.name;
    EXPECT_NE(pass.applies, nullptr);
    EXPECT_NE(pass.run, nullptr);
  }
  // Stages run in order: Forward rows, then Joint, then Final.
  int last_stage = 0;
  for (const compile::Pass& pass : compile::pipeline()) {
    EXPECT_GE(static_cast<int>(pass.stage), last_stage) << pass.name;
    last_stage = static_cast<int>(pass.stage);
  }
}

TEST(ProgramCache, CompilesOncePerKey) {
  HandBuilt net;
  runtime::ParameterStore params(net.graph);
  compile::ProgramCache cache;
  EXPECT_EQ(cache.find({kRows, 1}), nullptr);
  compile::Program& a = cache.insert({kRows, 1}, compile_training(net, params, true));
  compile::Program& b = cache.insert({kRows, 0}, compile_training(net, params, false));
  EXPECT_EQ(cache.find({kRows, 1}), &a);
  EXPECT_EQ(cache.find({kRows, 0}), &b);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_NE(error_of([&] { cache.insert({kRows, 1}, compile_training(net, params, true)); }).find("already"),
            std::string::npos);
}

// ---- the rewrite API -------------------------------------------------------------------------

TEST(GraphRewrite, InsertBeforeKeepsIdsUntilCommitThenPlacesNodes) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {4});
  ValueId y = b.tanh(x);       // node 0
  ValueId z = b.relu(y);       // node 1
  g.mark_output(z);
  const ir::Node& relu = g.node(1);
  std::vector<ValueId> inserted = g.insert_before(1, OpKind::Scale, {y}, {{"alpha", 2.0}}, "double");
  EXPECT_EQ(g.nodes().size(), 3u);
  EXPECT_EQ(relu.op, OpKind::Relu) << "a reference survives the insertion";
  EXPECT_EQ(g.replace_uses_if(y, inserted[0], [](const ir::Node& n) { return n.op == OpKind::Relu; }), 1);
  EXPECT_TRUE(g.has_pending_edits());
  EXPECT_NE(error_of([&] { g.verify(); }).find("commit"), std::string::npos);
  g.commit();
  ASSERT_EQ(g.nodes().size(), 3u);
  EXPECT_EQ(g.node(0).op, OpKind::Tanh);
  EXPECT_EQ(g.node(1).name, "double");
  EXPECT_EQ(g.node(2).op, OpKind::Relu);
  EXPECT_EQ(g.node(2).inputs[0], inserted[0]);
}

TEST(GraphRewrite, ReplaceRemoveAndSetOp) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {2, 3});
  ValueId a = b.tanh(x);
  ValueId c = b.tanh(x);  // a duplicate of a
  ValueId out = b.add(a, c);
  g.mark_output(c);
  g.replace_all_uses(c, a);
  EXPECT_EQ(g.node(2).inputs[1], a);
  EXPECT_EQ(g.outputs()[0], a) << "graph outputs follow too";
  g.remove_node(1);
  EXPECT_EQ(g.commit(), 1);
  EXPECT_EQ(g.nodes().size(), 2u);
  // set_op keeps the outputs (and so the readers); the new op must produce the same shapes.
  g.set_op(1, OpKind::Mul, {a, a}, {});
  EXPECT_EQ(g.node(1).op, OpKind::Mul);
  EXPECT_EQ(g.node(1).outputs[0], out);
  EXPECT_NE(error_of([&] { g.set_op(1, OpKind::ReduceSum, {a}, {{"axes", std::vector<int64_t>{0}}}); })
                .find("would turn output"),
            std::string::npos);
  EXPECT_NE(error_of([&] { g.replace_all_uses(a, b.reduce_sum(a, {0})); }).find("differ"), std::string::npos);
}

TEST(GraphRewrite, RemovingANodeStillReadFailsAtCommit) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  ValueId x = b.input("x", {2});
  g.mark_output(b.relu(b.tanh(x)));
  g.remove_node(0);
  EXPECT_NE(error_of([&] { g.commit(); }).find("before it is defined"), std::string::npos);
}

}  // namespace
}  // namespace fusetrain::testing
