// The plain-loop reference kernels (kernels/ref) against hand-computed values on
// tiny inputs, plus finite-difference checks of the backward references, since
// every tuned kernel is tested against these.
//
// Shape letters: B batch, T query length, S key length, H heads, D head size,
// C channels, V vocabulary.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/ir/builder.h"
#include "fusetrain/compile/lower.h"
#include "kernels/factories.h"
#include "kernels/rng.h"

namespace fusetrain::kernels {
namespace {

using ir::Graph;
using ir::GraphBuilder;
using ir::OpKind;
using ir::ValueId;

constexpr double kPoison = 77.0;  // fresh outputs start here, so a kernel that skips a write is caught
constexpr unsigned char kCanary = 0xA5;

Tensor tensor(Shape shape, const std::vector<double>& values, DType dtype = DType::f32) {
  Tensor t = Tensor::zeros(std::move(shape), dtype);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, values[static_cast<size_t>(i)]);
  return t;
}

Tensor random_tensor(Shape shape, std::mt19937& rng, double low = -1.0, double high = 1.0) {
  std::uniform_real_distribution<double> dist(low, high);
  Tensor t = Tensor::zeros(std::move(shape), DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, dist(rng));
  return t;
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t.item(i));
  return out;
}

void expect_values(const Tensor& t, const std::vector<double>& want, double tol = 1e-6) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size()));
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_NEAR(t.item(i), want[static_cast<size_t>(i)], tol) << "element " << i;
}

// Runs the reference kernel of the last node of `g`. Outputs are fresh tensors
// filled with kPoison unless `outputs` is given (then `accumulate` applies).
// Checks that the kernel accumulates itself and stays inside its scratch.
std::vector<Tensor> run_ref(const Graph& g, const std::vector<Tensor>& inputs, uint64_t rng_offset = 0,
                            std::vector<Tensor> outputs = {}, std::vector<uint8_t> accumulate = {}) {
  const ir::Node& node = g.nodes().back();
  std::unique_ptr<Kernel> kernel = make_ref_kernel(compile::lower(g, node));
  EXPECT_TRUE(kernel->accumulates());
  KernelArgs args;
  args.inputs = inputs;
  if (outputs.empty())
    for (ValueId v : node.outputs) {
      Tensor t = Tensor::zeros(g.value(v).shape, g.value(v).dtype);
      for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, kPoison);
      outputs.push_back(t);
    }
  args.outputs = outputs;
  args.accumulate = accumulate.empty() ? std::vector<uint8_t>(outputs.size(), 0) : accumulate;
  const size_t scratch_bytes = kernel->scratch_bytes(1);
  AlignedPtr scratch = aligned_allocate(scratch_bytes + 64);
  std::memset(scratch.get(), kCanary, scratch_bytes + 64);
  args.scratch = scratch.get();
  StepContext ctx;
  ctx.rng_offset = rng_offset;
  kernel->run(args, ctx);
  const unsigned char* end = static_cast<const unsigned char*>(scratch.get()) + scratch_bytes;
  for (int i = 0; i < 64; ++i) EXPECT_EQ(end[i], kCanary) << "kernel wrote past its scratch_bytes()";
  return args.outputs;
}

// ---- MatMul, Linear ----------------------------------------------------------

TEST(RefKernels, MatMulEveryTransposeCombination) {
  // a (2, 3) · b (3, 2) = [[58, 64], [139, 154]]
  const std::vector<double> a = {1, 2, 3, 4, 5, 6}, a_t = {1, 4, 2, 5, 3, 6};
  const std::vector<double> b = {7, 8, 9, 10, 11, 12}, b_t = {7, 9, 11, 8, 10, 12};
  for (int trans_a = 0; trans_a < 2; ++trans_a)
    for (int trans_b = 0; trans_b < 2; ++trans_b) {
      Graph g;
      GraphBuilder gb(g);
      Shape a_shape = trans_a ? Shape{3, 2} : Shape{2, 3};
      Shape b_shape = trans_b ? Shape{2, 3} : Shape{3, 2};
      ValueId va = gb.input("a", a_shape), vb = gb.input("b", b_shape);
      gb.matmul(va, vb, trans_a, trans_b);
      auto out = run_ref(g, {tensor(a_shape, trans_a ? a_t : a), tensor(b_shape, trans_b ? b_t : b)});
      SCOPED_TRACE(testing::Message() << "trans_a=" << trans_a << " trans_b=" << trans_b);
      expect_values(out[0], {58, 64, 139, 154});
    }
}

TEST(RefKernels, MatMulBroadcastsTwoDimensionalOperandAndAccumulates) {
  // a (2, 1, 2) batched, b (2, 2) shared: batch 0 [1 2]·b, batch 1 [3 4]·b
  Graph g;
  GraphBuilder gb(g);
  gb.matmul(gb.input("a", {2, 1, 2}), gb.input("b", {2, 2}));
  Tensor a = tensor({2, 1, 2}, {1, 2, 3, 4});
  Tensor b = tensor({2, 2}, {1, 10, 100, 1000});
  Tensor c = tensor({2, 1, 2}, {1, 1, 1, 1});
  run_ref(g, {a, b}, 0, {c}, {1});
  expect_values(c, {1 + 201, 1 + 2010, 1 + 403, 1 + 4030});
}

TEST(RefKernels, MatMulBf16InputsWithBf16Output) {
  Graph g;
  ValueId a = g.add_input("a", {1, 2}, DType::bf16), b = g.add_input("b", {2, 1}, DType::bf16);
  g.add(OpKind::MatMul, {a, b}, {{"out_dtype", std::string("bf16")}});
  auto out = run_ref(g, {tensor({1, 2}, {1.5, -2}, DType::bf16), tensor({2, 1}, {4, 0.25}, DType::bf16)});
  EXPECT_EQ(out[0].dtype(), DType::bf16);
  expect_values(out[0], {5.5});
}

TEST(RefKernels, LinearAddsBias) {
  // x (2, 2) · wᵀ with w (3, 2), bias (3)
  Graph g;
  GraphBuilder gb(g);
  gb.linear(gb.input("x", {2, 2}), gb.param("w", {3, 2}), gb.param("bias", {3}));
  auto out = run_ref(g, {tensor({2, 2}, {1, 2, 3, 4}), tensor({3, 2}, {1, 0, 0, 1, 1, 1}), tensor({3}, {0.5, 0, -1})});
  expect_values(out[0], {1.5, 2, 2, 3.5, 4, 6});
}

// ---- elementwise ----------------------------------------------------------------

TEST(RefKernels, AddBroadcastsColumnAgainstRow) {
  Graph g;
  GraphBuilder gb(g);
  gb.add(gb.input("a", {3, 1}), gb.input("b", {1, 4}));
  auto out = run_ref(g, {tensor({3, 1}, {1, 2, 3}), tensor({1, 4}, {10, 20, 30, 40})});
  EXPECT_EQ(out[0].shape(), (Shape{3, 4}));
  expect_values(out[0], {11, 21, 31, 41, 12, 22, 32, 42, 13, 23, 33, 43});
}

TEST(RefKernels, SubDivBroadcastLowerRankAndBf16) {
  Graph g;
  GraphBuilder gb(g);
  gb.sub(gb.input("a", {2, 2}), gb.input("b", {2}));
  expect_values(run_ref(g, {tensor({2, 2}, {5, 6, 7, 8}), tensor({2}, {1, 2})})[0], {4, 4, 6, 6});

  Graph h;
  GraphBuilder hb(h);
  hb.div(hb.input("a", {3}, DType::bf16), hb.input("b", {1}, DType::bf16));
  auto out = run_ref(h, {tensor({3}, {1, 2, 3}, DType::bf16), tensor({1}, {3}, DType::bf16)});
  EXPECT_EQ(out[0].dtype(), DType::bf16);
  // 1/3 rounded to bf16 (8 significant bits): 0x3EAB = 0.333984375
  expect_values(out[0], {0.333984375, 0.66796875, 1.0}, 0.0);
}

TEST(RefKernels, GeluBothFormulas) {
  const std::vector<double> x = {-1, 0, 1, 2};
  for (const char* approximate : {"none", "tanh"}) {
    Graph g;
    GraphBuilder gb(g);
    gb.gelu(gb.input("x", {4}), approximate);
    auto out = run_ref(g, {tensor({4}, x)});
    SCOPED_TRACE(approximate);
    if (std::string(approximate) == "none")
      expect_values(out[0], {-0.15865525393145707, 0.0, 0.8413447460685429, 1.9544997361036416});
    else
      expect_values(out[0], {-0.15880800939172324, 0.0, 0.8411919906082768, 1.954597694087775});
  }
}

TEST(RefKernels, GeluBackwardMatchesKnownDerivatives) {
  // erf form: gelu'(x) = Φ(x) + x·φ(x); gelu'(0) = 0.5, gelu'(1) = 0.841344746 + 0.241970725
  Graph g;
  ValueId dy = g.add_input("dy", {2}, DType::f32), x = g.add_input("x", {2}, DType::f32);
  g.add(OpKind::GeluBackward, {dy, x}, {{"approximate", std::string("none")}});
  expect_values(run_ref(g, {tensor({2}, {2, 1}), tensor({2}, {0, 1})})[0], {1.0, 1.0833154705876864});

  // tanh form against central differences of the forward formula
  auto gelu_tanh = [](double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))); };
  Graph h;
  ValueId hdy = h.add_input("dy", {3}, DType::f32), hx = h.add_input("x", {3}, DType::f32);
  h.add(OpKind::GeluBackward, {hdy, hx}, {{"approximate", std::string("tanh")}});
  auto out = run_ref(h, {tensor({3}, {1, 1, 1}), tensor({3}, {-1.5, 0.3, 2})});
  const double step = 1e-5;
  for (int i = 0; i < 3; ++i) {
    double v = std::vector<double>{-1.5, 0.3, 2}[static_cast<size_t>(i)];
    EXPECT_NEAR(out[0].item(i), (gelu_tanh(v + step) - gelu_tanh(v - step)) / (2 * step), 1e-6);
  }
}

TEST(RefKernels, TanhReluScaleAndTheirBackward) {
  {
    Graph g;
    GraphBuilder gb(g);
    gb.relu(gb.input("x", {3}));
    expect_values(run_ref(g, {tensor({3}, {-1, 0, 2})})[0], {0, 0, 2});
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.tanh(gb.input("x", {2}));
    expect_values(run_ref(g, {tensor({2}, {0, 1})})[0], {0, std::tanh(1.0)});
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.scale(gb.input("x", {2}), -2.5);
    expect_values(run_ref(g, {tensor({2}, {1, 4})})[0], {-2.5, -10});
  }
  {
    Graph g;
    ValueId dy = g.add_input("dy", {2}, DType::f32), y = g.add_input("y", {2}, DType::f32);
    g.add(OpKind::TanhBackward, {dy, y});
    expect_values(run_ref(g, {tensor({2}, {2, 3}), tensor({2}, {0.5, 0})})[0], {1.5, 3});
  }
  {
    Graph g;
    ValueId dy = g.add_input("dy", {3}, DType::f32), x = g.add_input("x", {3}, DType::f32);
    g.add(OpKind::ReluBackward, {dy, x});
    expect_values(run_ref(g, {tensor({3}, {5, 6, 7}), tensor({3}, {-1, 0, 1})})[0], {0, 0, 7});
  }
}

TEST(RefKernels, FillOverwritesOrAddsTheValue) {
  Graph g;
  GraphBuilder gb(g);
  gb.fill({2, 2}, 1.25, DType::bf16);
  expect_values(run_ref(g, {})[0], {1.25, 1.25, 1.25, 1.25}, 0.0);
  Tensor existing = tensor({2, 2}, {1, 2, 3, 4}, DType::bf16);
  run_ref(g, {}, 0, {existing}, {1});
  expect_values(existing, {2.25, 3.25, 4.25, 5.25}, 0.0);
}

TEST(RefKernels, CastRoundsToNearestEvenForBf16) {
  // bf16 keeps 8 significant bits: 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷ and
  // rounds to the even 1.0; 1 + 3·2⁻⁸ lies halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶ and
  // rounds to the even 1 + 2⁻⁶.
  Graph g;
  GraphBuilder gb(g);
  gb.cast(gb.input("x", {3}), DType::bf16);
  auto out = run_ref(g, {tensor({3}, {1 + std::ldexp(1.0, -8), 1 + 3 * std::ldexp(1.0, -8), -2.0})});
  const uint16_t* bits = out[0].data_as<uint16_t>();
  EXPECT_EQ(bits[0], 0x3F80);
  EXPECT_EQ(bits[1], 0x3F82);
  EXPECT_EQ(bits[2], 0xC000);
}

TEST(RefKernels, CastBetweenIntegersAndFloats) {
  {
    Graph g;
    GraphBuilder gb(g);
    gb.cast(gb.input("x", {4}), DType::i32);
    auto out = run_ref(g, {tensor({4}, {2.9, -2.9, 1e20, 0.0})});
    EXPECT_EQ(values(out[0]), (std::vector<double>{2, -2, 2147483647.0, 0}));  // truncate, saturate
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.cast(gb.input("x", {2}, DType::i64), DType::f16);
    expect_values(run_ref(g, {tensor({2}, {3, -2049}, DType::i64)})[0], {3, -2048}, 0.0);  // f16: 11 bits
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.cast(gb.input("x", {2}, DType::i32), DType::i64);
    Tensor existing = tensor({2}, {10, 20}, DType::i64);
    run_ref(g, {tensor({2}, {-1, 5}, DType::i32)}, 0, {existing}, {1});
    EXPECT_EQ(values(existing), (std::vector<double>{9, 25}));
  }
}

TEST(RefKernels, DropoutZeroIsIdentityAndHalfKeepsAboutHalfScaledByTwo) {
  {
    Graph g;
    g.add(OpKind::Dropout, {g.add_input("x", {5}, DType::f32)}, {{"p", 0.0}, {"seed", int64_t{3}}});
    expect_values(run_ref(g, {tensor({5}, {1, -2, 3, -4, 5})}, 17)[0], {1, -2, 3, -4, 5}, 0.0);
  }
  const int64_t n = 4000;
  Graph g;
  g.add(OpKind::Dropout, {g.add_input("x", {n}, DType::f32)}, {{"p", 0.5}, {"seed", int64_t{7}}});
  Tensor x = Tensor::zeros({n}, DType::f32);
  for (int64_t i = 0; i < n; ++i) x.set_item(i, 1.5);
  auto out = run_ref(g, {x}, 42);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = dropout_keep(7, 42, static_cast<uint64_t>(i), 0.5f);
    EXPECT_EQ(out[0].item(i), keep ? 3.0 : 0.0) << "element " << i;
    kept += keep;
  }
  EXPECT_GT(kept, n * 45 / 100);
  EXPECT_LT(kept, n * 55 / 100);
  // Another step offset draws another mask.
  auto other = run_ref(g, {x}, 43);
  EXPECT_NE(values(other[0]), values(out[0]));
}

// ---- softmax, layer norm -----------------------------------------------------------

TEST(RefKernels, SoftmaxOfOneTwoThree) {
  Graph g;
  GraphBuilder gb(g);
  gb.softmax(gb.input("x", {2, 3}));
  auto out = run_ref(g, {tensor({2, 3}, {1, 2, 3, 1001, 1002, 1003})});
  const std::vector<double> p = {0.09003057317038046, 0.24472847105479767, 0.6652409557748219};
  expect_values(out[0], {p[0], p[1], p[2], p[0], p[1], p[2]});
}

TEST(RefKernels, SoftmaxBackward) {
  // dx = y·(dy − Σ dy·y): y = (0.25, 0.75), dy = (1, 3): Σ = 2.5, dx = (−0.375, 0.375)
  Graph g;
  ValueId dy = g.add_input("dy", {2}, DType::f32), y = g.add_input("y", {2}, DType::f32);
  g.add(OpKind::SoftmaxBackward, {dy, y});
  expect_values(run_ref(g, {tensor({2}, {1, 3}), tensor({2}, {0.25, 0.75})})[0], {-0.375, 0.375});
}

TEST(RefKernels, LayerNormOfOneRow) {
  // x = (1, 2, 3, 4): mean 2.5, biased variance 1.25
  Graph g;
  GraphBuilder gb(g);
  gb.layer_norm(gb.input("x", {1, 4}), gb.param("gamma", {4}), gb.param("beta", {4}), 0.01);
  auto out = run_ref(g, {tensor({1, 4}, {1, 2, 3, 4}), tensor({4}, {1, 1, 2, 1}), tensor({4}, {0, 0, 0, 10})});
  const double rstd = 1.0 / std::sqrt(1.25 + 0.01);
  expect_values(out[0], {-1.5 * rstd, -0.5 * rstd, 2 * 0.5 * rstd, 1.5 * rstd + 10});
  expect_values(out[1], {2.5});
  expect_values(out[2], {rstd});
}

// Central-difference gradient of Σ cotangent·output[0] of the last node of `g`
// with respect to every element of input `which`.
std::vector<double> numeric_gradient(const Graph& g, std::vector<Tensor> inputs, size_t which, const Tensor& cotangent,
                                     uint64_t rng_offset = 0, double step = 1e-2) {
  auto objective = [&](const std::vector<Tensor>& in) {
    Tensor out = run_ref(g, in, rng_offset)[0];
    double sum = 0.0;
    for (int64_t i = 0; i < out.numel(); ++i) sum += out.item(i) * cotangent.item(i);
    return sum;
  };
  inputs[which] = inputs[which].clone();
  std::vector<double> grad;
  for (int64_t i = 0; i < inputs[which].numel(); ++i) {
    const double x = inputs[which].item(i);
    inputs[which].set_item(i, x + step);
    const double plus = objective(inputs);
    inputs[which].set_item(i, x - step);
    const double minus = objective(inputs);
    inputs[which].set_item(i, x);
    grad.push_back((plus - minus) / (2 * step));
  }
  return grad;
}

TEST(RefKernels, LayerNormBackwardMatchesFiniteDifferences) {
  std::mt19937 rng(1);
  Graph g;
  GraphBuilder gb(g);
  gb.layer_norm(gb.input("x", {3, 5}), gb.param("gamma", {5}), gb.param("beta", {5}), 1e-5);
  std::vector<Tensor> in = {random_tensor({3, 5}, rng), random_tensor({5}, rng, 0.5, 1.5), random_tensor({5}, rng)};
  Tensor dy = random_tensor({3, 5}, rng);
  auto fwd = run_ref(g, in);

  Graph b;
  b.add_node(OpKind::LayerNormBackward, {b.add_input("dy", {3, 5}, DType::f32), b.add_input("x", {3, 5}, DType::f32),
                                         b.add_input("gamma", {5}, DType::f32), b.add_input("mean", {3}, DType::f32),
                                         b.add_input("rstd", {3}, DType::f32)});
  // dx aliases dy in place (kInPlace): run with the output bound to dy's memory.
  Tensor dy_copy = dy.clone();
  Tensor dgamma = Tensor::zeros({5}, DType::f32), dbeta = Tensor::zeros({5}, DType::f32);
  run_ref(b, {dy_copy, in[0], in[1], fwd[1], fwd[2]}, 0, {dy_copy, dgamma, dbeta});
  const char* names[] = {"dx", "dgamma", "dbeta"};
  const Tensor got[] = {dy_copy, dgamma, dbeta};
  for (size_t k = 0; k < 3; ++k) {
    SCOPED_TRACE(names[k]);
    std::vector<double> want = numeric_gradient(g, in, k, dy);
    expect_values(got[k], want, 2e-3);
  }
}

TEST(RefKernels, RMSNormScalesEachRowByItsRootMeanSquare) {
  Graph g;
  GraphBuilder gb(g);
  gb.rms_norm(gb.input("x", {2, 4}), gb.param("weight", {4}), 1e-6);
  auto out = run_ref(g, {tensor({2, 4}, {1, 2, 3, 4, 0, 0, 0, 5}), tensor({4}, {1, 1, 1, 2})});
  const double r0 = 1.0 / std::sqrt((1 + 4 + 9 + 16) / 4.0 + 1e-6), r1 = 1.0 / std::sqrt(25 / 4.0 + 1e-6);
  expect_values(out[0], {1 * r0, 2 * r0, 3 * r0, 8 * r0, 0, 0, 0, 10 * r1}, 1e-6);
  expect_values(out[1], {r0, r1}, 1e-6);
}

TEST(RefKernels, RMSNormBackwardMatchesFiniteDifferences) {
  std::mt19937 rng(2);
  Graph g;
  GraphBuilder gb(g);
  gb.rms_norm(gb.input("x", {3, 5}), gb.param("weight", {5}), 1e-6);
  std::vector<Tensor> in = {random_tensor({3, 5}, rng), random_tensor({5}, rng, 0.5, 1.5)};
  Tensor dy = random_tensor({3, 5}, rng);
  auto fwd = run_ref(g, in);

  Graph b;
  b.add_node(OpKind::RMSNormBackward, {b.add_input("dy", {3, 5}, DType::f32), b.add_input("x", {3, 5}, DType::f32),
                                       b.add_input("weight", {5}, DType::f32), b.add_input("rstd", {3}, DType::f32)});
  // dx aliases dy in place (kInPlace): run with the output bound to dy's memory.
  Tensor dy_copy = dy.clone();
  Tensor dweight = Tensor::zeros({5}, DType::f32);
  run_ref(b, {dy_copy, in[0], in[1], fwd[1]}, 0, {dy_copy, dweight});
  const char* names[] = {"dx", "dweight"};
  const Tensor got[] = {dy_copy, dweight};
  for (size_t k = 0; k < 2; ++k) {
    SCOPED_TRACE(names[k]);
    expect_values(got[k], numeric_gradient(g, in, k, dy), 2e-3);
  }
}

TEST(RefKernels, RoPERotatesTheHalvesAsLlamaDoes) {
  // transformers' apply_rotary_pos_emb: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1), with cos and sin
  // the two halves' frequencies repeated.
  Graph g;
  GraphBuilder gb(g);
  gb.rope(gb.input("x", {1, 1, 1, 4}), gb.input("cos", {1, 1, 4}), gb.input("sin", {1, 1, 4}));
  const double a = 0.5, b = 0.25;
  auto out = run_ref(g, {tensor({1, 1, 1, 4}, {1, 2, 3, 4}),
                         tensor({1, 1, 4}, {std::cos(a), std::cos(b), std::cos(a), std::cos(b)}),
                         tensor({1, 1, 4}, {std::sin(a), std::sin(b), std::sin(a), std::sin(b)})});
  expect_values(out[0], {1 * std::cos(a) - 3 * std::sin(a), 2 * std::cos(b) - 4 * std::sin(b),
                         3 * std::cos(a) + 1 * std::sin(a), 4 * std::cos(b) + 2 * std::sin(b)},
                1e-6);
}

// ---- embedding ---------------------------------------------------------------

TEST(RefKernels, EmbeddingGatherAndScatterAddWithRepeatedId) {
  Graph g;
  GraphBuilder gb(g);
  gb.embedding(gb.param("weight", {3, 2}), gb.input("ids", {2, 2}, DType::i32));
  Tensor weight = tensor({3, 2}, {0, 1, 10, 11, 20, 21});
  Tensor ids = tensor({2, 2}, {2, 0, 2, 1}, DType::i32);
  expect_values(run_ref(g, {weight, ids})[0], {20, 21, 0, 1, 20, 21, 10, 11});

  Graph b;
  ValueId dy = b.add_input("dy", {2, 2, 2}, DType::f32), vid = b.add_input("ids", {2, 2}, DType::i32);
  b.add(OpKind::EmbeddingBackward, {dy, vid}, {{"num_embeddings", int64_t{4}}});
  Tensor grad = tensor({2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  // id 2 appears twice: rows (1,2) + (5,6); id 3 never: zeros
  expect_values(run_ref(b, {grad, ids})[0], {3, 4, 7, 8, 6, 8, 0, 0});
  Tensor existing = tensor({4, 2}, {1, 1, 1, 1, 1, 1, 1, 1});
  run_ref(b, {grad, ids}, 0, {existing}, {1});
  expect_values(existing, {4, 5, 8, 9, 7, 9, 1, 1});
}

TEST(RefKernels, EmbeddingIdOutOfRangeThrows) {
  Graph g;
  GraphBuilder gb(g);
  gb.embedding(gb.param("weight", {3, 2}), gb.input("ids", {2}, DType::i64));
  Tensor weight = tensor({3, 2}, {0, 1, 2, 3, 4, 5});
  try {
    run_ref(g, {weight, tensor({2}, {1, 3}, DType::i64)});
    FAIL() << "expected fusetrain::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("Embedding"), std::string::npos) << msg;
    EXPECT_NE(msg.find(g.nodes().back().name), std::string::npos) << msg;
    EXPECT_NE(msg.find("id 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 3)"), std::string::npos) << msg;
  }
  EXPECT_THROW(run_ref(g, {weight, tensor({2}, {-1, 0}, DType::i64)}), Error);
}

// ---- cross-entropy --------------------------------------------------------------

TEST(RefKernels, CrossEntropySkipsIgnoredRow) {
  Graph g;
  GraphBuilder gb(g);
  gb.softmax_cross_entropy(gb.input("logits", {3, 3}), gb.input("targets", {3}, DType::i64));
  Tensor logits = tensor({3, 3}, {1, 2, 3, 0, 0, 0, 1, 0, 0});
  Tensor targets = tensor({3}, {2, -100, 0}, DType::i64);
  auto out = run_ref(g, {logits, targets});
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  const double lse2 = std::log(std::exp(1.0) + 2.0);
  expect_values(out[0], {((lse0 - 3) + (lse2 - 1)) / 2});
  expect_values(out[1], {lse0, std::log(3.0), lse2});

  Graph b;
  ValueId dloss = b.add_input("dloss", {}, DType::f32), vl = b.add_input("logits", {3, 3}, DType::f32);
  ValueId vt = b.add_input("targets", {3}, DType::i64), vlse = b.add_input("lse", {3}, DType::f32);
  b.add(OpKind::SoftmaxCrossEntropyBackward, {dloss, vl, vt, vlse}, {{"ignore_index", int64_t{-100}}});
  auto d = run_ref(b, {tensor({}, {2.0}), logits, targets, out[1]});
  const double e0 = std::exp(1 - lse0), e1 = std::exp(2 - lse0), e2 = std::exp(3 - lse0);
  const double f0 = std::exp(1 - lse2), f1 = std::exp(0 - lse2);
  // dloss·(softmax − onehot)/count with count 2
  expect_values(d[0], {e0, e1, e2 - 1, 0, 0, 0, f0 - 1, f1, f1});

  // Loss gradient against central differences of the forward kernel.
  std::vector<double> want = numeric_gradient(g, {logits, targets}, 0, tensor({}, {2.0}));
  expect_values(d[0], want, 1e-3);
}

TEST(RefKernels, CrossEntropyTargetOutOfRangeThrows) {
  Graph g;
  GraphBuilder gb(g);
  gb.softmax_cross_entropy(gb.input("logits", {2, 3}), gb.input("targets", {2}, DType::i32));
  EXPECT_THROW(run_ref(g, {tensor({2, 3}, {0, 0, 0, 0, 0, 0}), tensor({2}, {0, 3}, DType::i32)}), Error);
}

TEST(RefKernels, CrossEntropyWithEveryRowIgnoredIsZero) {
  Graph g;
  GraphBuilder gb(g);
  gb.softmax_cross_entropy(gb.input("logits", {1, 2}), gb.input("targets", {1}, DType::i64), 5);
  expect_values(run_ref(g, {tensor({1, 2}, {0, 1}), tensor({1}, {5}, DType::i64)})[0], {0});
}

// ---- attention -----------------------------------------------------------------

TEST(RefKernels, AttentionWithOneKeyReturnsValue) {
  Graph g;
  GraphBuilder gb(g);
  gb.attention(gb.input("q", {1, 2, 1, 3}), gb.input("k", {1, 2, 1, 3}), gb.input("v", {1, 2, 1, 3}), ir::kNone, 0.5);
  Tensor q = tensor({1, 2, 1, 3}, {1, 2, 3, 0, 1, 0});
  Tensor k = tensor({1, 2, 1, 3}, {1, 1, 1, 2, 2, 2});
  Tensor v = tensor({1, 2, 1, 3}, {4, 5, 6, -1, -2, -3});
  auto out = run_ref(g, {q, k, v});
  expect_values(out[0], {4, 5, 6, -1, -2, -3});
  expect_values(out[1], {0.5 * 6, 0.5 * 2});  // lse = scale·q·k for a single key
}

TEST(RefKernels, CausalAttentionFirstQuerySeesOnlyFirstKey) {
  Graph g;
  GraphBuilder gb(g);
  gb.attention(gb.input("q", {1, 1, 2, 1}), gb.input("k", {1, 1, 2, 1}), gb.input("v", {1, 1, 2, 1}), ir::kNone, 1.0,
               true);
  Tensor q = tensor({1, 1, 2, 1}, {1, 1}), k = tensor({1, 1, 2, 1}, {0, 1}), v = tensor({1, 1, 2, 1}, {10, 20});
  auto out = run_ref(g, {q, k, v});
  const double p1 = std::exp(1.0) / (1 + std::exp(1.0));
  expect_values(out[0], {10, 10 * (1 - p1) + 20 * p1}, 1e-5);
  expect_values(out[1], {0, std::log(1 + std::exp(1.0))});
}

TEST(RefKernels, CausalAttentionAlignsQueriesToTheLastKeys) {
  // T = 1, S = 3: the single query sees every key (s <= t + S - T = 2).
  Graph g;
  GraphBuilder gb(g);
  gb.attention(gb.input("q", {1, 1, 1, 1}), gb.input("k", {1, 1, 3, 1}), gb.input("v", {1, 1, 3, 1}), ir::kNone, 1.0,
               true);
  auto out = run_ref(g, {tensor({1, 1, 1, 1}, {0}), tensor({1, 1, 3, 1}, {1, 2, 3}), tensor({1, 1, 3, 1}, {3, 6, 9})});
  expect_values(out[0], {6}, 1e-5);
  expect_values(out[1], {std::log(3.0)}, 1e-6);
}

TEST(RefKernels, AttentionMaskHidesKeys) {
  const double inf = std::numeric_limits<double>::infinity();
  Graph g;
  GraphBuilder gb(g);
  gb.attention(gb.input("q", {2, 1, 1, 1}), gb.input("k", {2, 1, 2, 1}), gb.input("v", {2, 1, 2, 1}),
               gb.input("mask", {2, 2}), 1.0);
  auto out = run_ref(g, {tensor({2, 1, 1, 1}, {1, 1}), tensor({2, 1, 2, 1}, {5, 0, 0, 0}),
                         tensor({2, 1, 2, 1}, {1, 2, 3, 4}), tensor({2, 2}, {0, -inf, -inf, -inf})});
  // batch 0 sees key 0 only; batch 1 sees no key: output 0, lse stored as 0
  expect_values(out[0], {1, 0});
  expect_values(out[1], {5, 0});
}

TEST(RefKernels, AttentionDropoutUsesTheDocumentedElementIndex) {
  // B = 1, H = 2, T = 2, S = 3, D = 1; q = 0 so every allowed probability is 1/3.
  const double p = 0.5;
  Graph g;
  GraphBuilder gb(g, 9);
  gb.attention(gb.input("q", {1, 2, 2, 1}), gb.input("k", {1, 2, 3, 1}), gb.input("v", {1, 2, 3, 1}), ir::kNone, 1.0,
               false, p);
  const uint64_t seed = static_cast<uint64_t>(g.nodes().back().attrs.get_int("seed"));
  std::mt19937 rng(2);
  Tensor v = tensor({1, 2, 3, 1}, {1, 10, 100, 1000, 10000, 100000});
  auto out = run_ref(g, {Tensor::zeros({1, 2, 2, 1}, DType::f32), random_tensor({1, 2, 3, 1}, rng), v}, 5);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t t = 0; t < 2; ++t) {
      double want = 0.0;
      for (int64_t s = 0; s < 3; ++s)
        if (dropout_keep(seed, 5, static_cast<uint64_t>((h * 2 + t) * 3 + s), static_cast<float>(p)))
          want += (1.0 / 3.0) / (1 - p) * v.item(h * 3 + s);
      EXPECT_NEAR(out[0].item(h * 2 + t), want, 1e-6 * std::max(1.0, std::abs(want))) << "h=" << h << " t=" << t;
    }
}

// An AttentionBackward node with the forward's attributes in `b`: inputs dout, q, k, v, out (B, H, T|S, D), lse
// (B, H, T), then `extras` (name, shape), all f32, in order.
void add_attention_backward(Graph& b, int64_t B, int64_t H, int64_t T, int64_t S, int64_t D,
                            const std::vector<std::pair<std::string, Shape>>& extras, const ir::Attrs& attrs) {
  std::vector<ValueId> ids;
  ids.push_back(b.add_input("dout", {B, H, T, D}, DType::f32));
  ids.push_back(b.add_input("q", {B, H, T, D}, DType::f32));
  ids.push_back(b.add_input("k", {B, H, S, D}, DType::f32));
  ids.push_back(b.add_input("v", {B, H, S, D}, DType::f32));
  ids.push_back(b.add_input("out", {B, H, T, D}, DType::f32));
  ids.push_back(b.add_input("lse", {B, H, T}, DType::f32));
  for (const auto& [name, shape] : extras) ids.push_back(b.add_input(name, shape, DType::f32));
  b.add_node(OpKind::AttentionBackward, ids, attrs);
}

TEST(RefKernels, AttentionBackwardMatchesFiniteDifferences) {
  // With causal masking, an additive mask, (B, S) or a key bias per head (B, H, S) as ALiBi's, dropout (the
  // dropout mask is a fixed function of (seed, step, index), so the output is differentiable), and Gemma 2's
  // logit soft-capping (a cap of 0.8, which bends the scores: 0.7·q·k reaches about 2 here).
  std::mt19937 rng(3);
  const int64_t B = 2, H = 2, T = 3, S = 4, D = 3;
  for (double softcap : {0.0, 0.8})
  for (const Shape& mask_shape : {Shape{B, S}, Shape{B, H, S}})
  for (double p : {0.0, 0.3}) {
    SCOPED_TRACE(testing::Message() << "dropout_p=" << p << " mask " << mask_shape.to_string() << " softcap="
                                    << softcap);
    Graph g;
    GraphBuilder gb(g, 4);
    gb.attention(gb.input("q", {B, H, T, D}), gb.input("k", {B, H, S, D}), gb.input("v", {B, H, S, D}),
                 gb.input("mask", mask_shape), 0.7, true, p, DType::f32, 0, softcap);
    const ir::Attrs attrs = g.nodes().back().attrs;
    std::vector<Tensor> in = {random_tensor({B, H, T, D}, rng), random_tensor({B, H, S, D}, rng),
                              random_tensor({B, H, S, D}, rng), random_tensor(mask_shape, rng)};
    Tensor dout = random_tensor({B, H, T, D}, rng);
    auto fwd = run_ref(g, in, 11);

    Graph b;
    add_attention_backward(b, B, H, T, S, D, {{"mask", mask_shape}}, attrs);
    auto grads = run_ref(b, {dout, in[0], in[1], in[2], fwd[0], fwd[1], in[3]}, 11);
    const char* names[] = {"dq", "dk", "dv"};
    for (size_t k = 0; k < 3; ++k) {
      SCOPED_TRACE(names[k]);
      expect_values(grads[k], numeric_gradient(g, in, k, dout, 11), 2e-3);
    }
    // Accumulation adds onto existing gradients.
    Tensor dq = tensor({B, H, T, D}, std::vector<double>(static_cast<size_t>(B * H * T * D), 1.0));
    Tensor dk = Tensor::zeros({B, H, S, D}, DType::f32), dv = Tensor::zeros({B, H, S, D}, DType::f32);
    run_ref(b, {dout, in[0], in[1], in[2], fwd[0], fwd[1], in[3]}, 11, {dq, dk, dv}, {1, 0, 0});
    for (int64_t i = 0; i < dq.numel(); ++i) EXPECT_NEAR(dq.item(i), grads[0].item(i) + 1.0, 1e-6);
  }
}

TEST(RefKernels, AttentionScoreBiasBackwardMatchesFiniteDifferences) {
  // A score bias (T5's relative positions) of (B, H, T, S) or broadcast over the batch (1, H, T, S), with a key
  // mask, causal or not, and dropout: dq, dk, dv and the bias's gradient dS (B, H, T, S), summed over the batch
  // for the broadcast bias, against central differences.
  std::mt19937 rng(5);
  const int64_t B = 2, H = 2, T = 3, S = 4, D = 3;
  for (int64_t bias_batch : {B, int64_t{1}})
  for (bool causal : {false, true})
  for (double p : {0.0, 0.3}) {
    SCOPED_TRACE(testing::Message() << "bias batch " << bias_batch << " causal " << causal << " dropout_p=" << p);
    const Shape bias_shape{bias_batch, H, T, S};
    Graph g;
    GraphBuilder gb(g, 4);
    gb.attention(gb.input("q", {B, H, T, D}), gb.input("k", {B, H, S, D}), gb.input("v", {B, H, S, D}),
                 gb.input("mask", {B, S}), 0.7, causal, p, DType::f32, 0, 0.0, ir::kNone,
                 gb.input("bias", bias_shape));
    const ir::Attrs attrs = g.nodes().back().attrs;
    ASSERT_EQ(attrs.get_int("score_bias", 0), 1);
    std::vector<Tensor> in = {random_tensor({B, H, T, D}, rng), random_tensor({B, H, S, D}, rng),
                              random_tensor({B, H, S, D}, rng), random_tensor(bias_shape, rng),
                              random_tensor({B, S}, rng)};
    Tensor dout = random_tensor({B, H, T, D}, rng);
    auto fwd = run_ref(g, in, 11);

    Graph b;
    add_attention_backward(b, B, H, T, S, D, {{"bias", bias_shape}, {"mask", Shape{B, S}}}, attrs);
    auto grads = run_ref(b, {dout, in[0], in[1], in[2], fwd[0], fwd[1], in[3], in[4]}, 11);
    ASSERT_EQ(grads.size(), 4u);
    ASSERT_EQ(grads[3].shape(), Shape({B, H, T, S}));
    const char* names[] = {"dq", "dk", "dv", "dbias"};
    for (size_t k = 0; k < 3; ++k) {
      SCOPED_TRACE(names[k]);
      expect_values(grads[k], numeric_gradient(g, in, k, dout, 11), 2e-3);
    }
    SCOPED_TRACE(names[3]);
    std::vector<double> dbias(static_cast<size_t>(bias_shape.numel()), 0.0);
    for (int64_t i = 0; i < grads[3].numel(); ++i) dbias[size_t(i % bias_shape.numel())] += grads[3].item(i);
    const std::vector<double> want = numeric_gradient(g, in, 3, dout, 11);
    ASSERT_EQ(want.size(), dbias.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(dbias[i], want[i], 2e-3 * std::max(1.0, std::abs(want[i])));
    if (causal)  // keys after a query's own get no gradient
      for (int64_t t = 0; t < T; ++t)
        for (int64_t s = t + S - T + 1; s < S; ++s) EXPECT_EQ(grads[3].item(t * S + s), 0.0);
  }
}

// ---- data movement and reductions ------------------------------------------------

TEST(RefKernels, TransposeSplitConcatSlice) {
  Tensor x = tensor({2, 3}, {0, 1, 2, 3, 4, 5});
  {
    Graph g;
    GraphBuilder gb(g);
    gb.transpose(gb.input("x", {2, 3}), {1, 0});
    expect_values(run_ref(g, {x})[0], {0, 3, 1, 4, 2, 5});
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.split(gb.input("x", {2, 3}), 1, {1, 2});
    auto out = run_ref(g, {x});
    expect_values(out[0], {0, 3});
    expect_values(out[1], {1, 2, 4, 5});
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.concat({gb.input("a", {2, 1}, DType::bf16), gb.input("b", {2, 2}, DType::bf16)}, -1);
    auto out = run_ref(g, {tensor({2, 1}, {9, 8}, DType::bf16), tensor({2, 2}, {1, 2, 3, 4}, DType::bf16)});
    expect_values(out[0], {9, 1, 2, 8, 3, 4}, 0.0);
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.slice(gb.input("x", {2, 3}), 1, 1, 3);
    expect_values(run_ref(g, {x})[0], {1, 2, 4, 5});
  }
  {
    Graph g;
    g.add(OpKind::SliceBackward, {g.add_input("dy", {2, 2}, DType::f32)},
          {{"shape", std::vector<int64_t>{2, 3}}, {"axis", int64_t{1}}, {"start", int64_t{1}}, {"end", int64_t{3}}});
    expect_values(run_ref(g, {tensor({2, 2}, {1, 2, 4, 5})})[0], {0, 1, 2, 0, 4, 5});
  }
}

TEST(RefKernels, ReshapeCopiesUnlessAliased) {
  Graph g;
  GraphBuilder gb(g);
  gb.reshape(gb.input("x", {2, 3}, DType::i64), {3, -1});
  Tensor x = tensor({2, 3}, {0, 1, 2, 3, 4, 5}, DType::i64);
  expect_values(run_ref(g, {x})[0], {0, 1, 2, 3, 4, 5}, 0.0);
  Tensor alias = x.reshaped({3, 2});
  run_ref(g, {x}, 0, {alias});
  expect_values(alias, {0, 1, 2, 3, 4, 5}, 0.0);
}

TEST(RefKernels, ReductionsAndBroadcasts) {
  Tensor x = tensor({2, 3}, {1, 2, 3, 4, 5, 6});
  {
    Graph g;
    GraphBuilder gb(g);
    gb.reduce_sum(gb.input("x", {2, 3}), {0});
    expect_values(run_ref(g, {x})[0], {5, 7, 9});
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.reduce_mean(gb.input("x", {2, 3}), {-1}, true);
    auto out = run_ref(g, {x});
    EXPECT_EQ(out[0].shape(), (Shape{2, 1}));
    expect_values(out[0], {2, 5});
  }
  {
    Graph g;
    GraphBuilder gb(g);
    gb.reduce_sum(gb.input("x", {2, 3}), {0, 1});
    expect_values(run_ref(g, {x})[0], {21});
  }
  {
    Graph g;
    g.add(OpKind::ReduceSumTo, {g.add_input("x", {2, 3}, DType::f32)}, {{"shape", std::vector<int64_t>{3}}});
    expect_values(run_ref(g, {x})[0], {5, 7, 9});
  }
  {
    Graph g;
    g.add(OpKind::ReduceSumTo, {g.add_input("x", {2, 3}, DType::f32)}, {{"shape", std::vector<int64_t>{2, 1}}});
    expect_values(run_ref(g, {x})[0], {6, 15});
  }
  {
    Graph g;
    g.add(OpKind::ExpandTo, {g.add_input("x", {2, 1}, DType::f32)}, {{"shape", std::vector<int64_t>{3, 2, 2}}});
    expect_values(run_ref(g, {tensor({2, 1}, {7, 8})})[0], {7, 7, 8, 8, 7, 7, 8, 8, 7, 7, 8, 8});
  }
  {
    Graph g;
    g.add(OpKind::Copy, {g.add_input("x", {2}, DType::f16)});
    Tensor existing = tensor({2}, {1, 1}, DType::f16);
    run_ref(g, {tensor({2}, {0.5, -3}, DType::f16)}, 0, {existing}, {1});
    expect_values(existing, {1.5, -2}, 0.0);
  }
}

}  // namespace
}  // namespace fusetrain::kernels
