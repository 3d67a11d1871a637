// The IR: op table, shape inference errors, verifier, dump.
#include <gtest/gtest.h>

#include "fusetrain/fusetrain.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using ir::OpKind;

TEST(OpTable, NamesRoundTrip) {
  for (int k = 0; k < ir::kNumOps; ++k) {
    OpKind op = static_cast<OpKind>(k);
    EXPECT_EQ(ir::parse_op(ir::op_name(op)), op);
    EXPECT_EQ(ir::op_info(op).flags, ir::op_flags(op));
  }
  EXPECT_FALSE(ir::parse_op("NoSuchOp").has_value());
}

TEST(ShapeInference, MatMulMismatchNamesOpAndShapes) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto x = b.input("x", {3, 5});
  auto w = b.param("w", {4, 2});
  std::string msg = error_of([&] { b.matmul(x, w); });
  EXPECT_NE(msg.find("MatMul"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(3, 5)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(4, 2)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("inner dimensions differ: 5 vs 4"), std::string::npos) << msg;
}

TEST(ShapeInference, BroadcastMismatch) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  std::string msg = error_of([&] { b.add(b.param("a", {3, 4}), b.param("b", {5})); });
  EXPECT_NE(msg.find("Add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("do not broadcast"), std::string::npos) << msg;
}

TEST(ShapeInference, WrongDtypes) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto ids = b.input("ids", {4}, DType::i64);
  std::string msg = error_of([&] { b.gelu(ids); });
  EXPECT_NE(msg.find("Gelu"), std::string::npos) << msg;
  EXPECT_NE(msg.find("must be f32 or bf16, found i64"), std::string::npos) << msg;
  auto w = b.param("w", {10, 3});
  msg = error_of([&] { b.embedding(w, b.input("float_ids", {4})); });
  EXPECT_NE(msg.find("ids must be i64 or i32, found f32"), std::string::npos) << msg;
  msg = error_of([&] { b.softmax_cross_entropy(b.param("logits", {4, 3}), b.input("t", {5}, DType::i64)); });
  EXPECT_NE(msg.find("targets should be (4)"), std::string::npos) << msg;
}

TEST(ShapeInference, ArityAndAttributes) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto x = b.param("x", {2, 6});
  EXPECT_NE(error_of([&] { g.add(OpKind::Add, {x}); }).find("takes 2 inputs, found 1"), std::string::npos);
  EXPECT_NE(error_of([&] { b.reshape(x, {5, -1}); }).find("cannot infer -1"), std::string::npos);
  EXPECT_NE(error_of([&] { b.transpose(x, {0, 0}); }).find("not a permutation"), std::string::npos);
  EXPECT_NE(error_of([&] { b.dropout(x, 1.5); }).find("p must be in [0, 1)"), std::string::npos);
  EXPECT_NE(error_of([&] { b.split(x, 1, {2, 2}); }).find("sizes add up to 4"), std::string::npos);
  EXPECT_NE(error_of([&] {
              g.add(OpKind::Gelu, {x}, {{"approximate", std::string("fast")}});
            }).find("approximate must be"),
            std::string::npos);
  auto q = b.param("q", {1, 2, 4, 8});
  EXPECT_NE(error_of([&] { b.attention(q, q, q, ir::kNone, 1.0, false, 0.0, DType::f32, 2); })
                .find("a sliding window (window 2) needs causal attention"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              g.add_node(OpKind::Attention, {q, q, q}, {{"scale", 1.0}, {"causal", int64_t{1}}, {"window", int64_t{-1}}});
            }).find("window should be >= 0 (0: no sliding window), found -1"),
            std::string::npos);
}

TEST(Verifier, DetectsCycle) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto x = b.param("x", {4});
  auto y = b.relu(x);
  auto z = b.tanh(y);
  g.mark_output(z);
  g.verify();
  g.node(0).inputs[0] = z;  // relu now reads tanh's output: a cycle
  std::string msg = error_of([&] { g.verify(); });
  EXPECT_NE(msg.find("before it is defined"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Relu"), std::string::npos) << msg;
}

TEST(Verifier, DetectsShapeTampering) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto y = b.relu(b.param("x", {4}));
  g.value(y).shape = Shape{5};
  EXPECT_NE(error_of([&] { g.verify(); }).find("but the op produces f32(4)"), std::string::npos);
}

TEST(Autodiff, LossMustBeScalar) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto y = b.relu(b.param("x", {4}));
  std::string msg = error_of([&] { autodiff::build_backward(g, y, g.params()); });
  EXPECT_NE(msg.find("must be a floating-point scalar, found shape (4)"), std::string::npos) << msg;
}

TEST(Autodiff, UnusedParameterHasNoGradient) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto x = b.param("x", {4});
  b.param("unused", {2});
  auto loss = b.reduce_sum(b.mul(x, x), {0});
  autodiff::Gradients grads = autodiff::build_backward(g, loss, g.params());
  EXPECT_NE(grads.grads[0], ir::kNone);
  EXPECT_EQ(grads.grads[1], ir::kNone);
  g.verify();
}

TEST(Dump, ListsInputsParamsAndNodes) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto x = b.input("x", {2, 3});
  auto w = b.param("w", {4, 3});
  g.mark_output(b.linear(x, w));
  std::string text = g.dump();
  EXPECT_NE(text.find("input %0:f32(2, 3) \"x\""), std::string::npos) << text;
  EXPECT_NE(text.find("param %1:f32(4, 3) \"w\""), std::string::npos) << text;
  EXPECT_NE(text.find("= Linear(%0, %1)"), std::string::npos) << text;
}

TEST(Plan, BadInputNamesAndParameterMismatch) {
  ir::Graph g;
  ir::GraphBuilder b(g);
  auto y = b.relu(b.param("x", {4}));
  g.mark_output(y);
  runtime::ParameterStore params(g);
  auto plan = compile::compile_plan(g, params);
  EXPECT_NE(error_of([&] { plan->input("nope"); }).find("no input named \"nope\""), std::string::npos);
  runtime::ParameterStore other(std::vector<std::pair<std::string, Shape>>{{"x", {5}}});
  EXPECT_NE(error_of([&] { compile::compile_plan(g, other); }).find("parameter \"x\""), std::string::npos);
}

}  // namespace
}  // namespace fusetrain::testing
