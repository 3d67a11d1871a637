// kernels/cpu basic kernels against the plain-loop reference kernels, on every
// code path this CPU has (AVX-512 and the forced portable path), with 1 and 2
// threads, with and without accumulation. Movement ops, casts and dropout
// masks must match bit for bit; arithmetic within a tolerance relative to the
// reference's norm.
//
// Shape letters: B batch, T sequence, C channels, H heads, D head size, V vocabulary.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/cpu.h"
#include "fusetrain/core/half.h"
#include "fusetrain/ir/graph.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/vec_math.h"
#include "fusetrain/compile/lower.h"
#include "kernels/factories.h"
#include "kernels/rng.h"

namespace fusetrain::kernels {
namespace {

using ir::Attrs;
using ir::Graph;
using ir::OpKind;
using ir::ValueId;

constexpr int64_t kExact = -1;  // tolerance value meaning "bit for bit"

struct Path {
  const char* name;
  cpu_basic::CpuPath cap;
};

// Every code path this CPU can run: portable, AVX2 (on an AVX-512 CPU by capping the path) and AVX-512.
std::vector<Path> paths() {
  std::vector<Path> out{{"portable", cpu_basic::CpuPath::portable}};
  cpu_basic::cap_cpu_path(cpu_basic::CpuPath::avx2);
  if (cpu_basic::use_avx2()) out.push_back({"avx2", cpu_basic::CpuPath::avx2});
  cpu_basic::cap_cpu_path(cpu_basic::CpuPath::avx512);
  if (cpu_basic::use_avx512()) out.push_back({"avx512", cpu_basic::CpuPath::avx512});
  return out;
}

// Restores the default code path when a test ends, even on failure.
struct PathGuard {
  ~PathGuard() { cpu_basic::cap_cpu_path(cpu_basic::CpuPath::avx512); }
};

// ---- random tensors ---------------------------------------------------------------------

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng, double lo = -2.0, double hi = 2.0,
                     int64_t index_range = 1) {
  Tensor t = Tensor::zeros(shape, dtype);
  std::uniform_real_distribution<double> real(lo, hi);
  std::uniform_int_distribution<int64_t> index(0, std::max<int64_t>(index_range - 1, 0));
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (is_floating(dtype))
      t.set_item(i, real(rng));
    else if (dtype == DType::u8)
      t.set_item(i, static_cast<double>(index(rng) % 256));
    else
      t.set_item(i, static_cast<double>(index(rng)));
  }
  return t;
}

// Fills every byte of a float tensor with a NaN pattern (unwritten elements show).
void poison(Tensor& t) {
  if (t.dtype() == DType::f32) {
    float* p = static_cast<float*>(t.data());
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
  } else {
    std::memset(t.data(), 0xA5, t.nbytes());
  }
}

// ---- running one node ----------------------------------------------------------------------

std::vector<Tensor> run_node(Kernel& kernel, const Graph& g, const ir::Node& node, const std::vector<Tensor>& inputs,
                             const std::vector<Tensor>* initial, int threads, uint64_t rng_offset) {
  KernelArgs args;
  args.inputs = inputs;
  for (size_t i = 0; i < node.outputs.size(); ++i) {
    const ir::Value& v = g.value(node.outputs[i]);
    Tensor out = Tensor::zeros(v.shape, v.dtype);
    if (initial != nullptr)
      out.copy_from((*initial)[i]);
    else
      poison(out);
    args.outputs.push_back(out);
    args.accumulate.push_back(initial != nullptr ? 1 : 0);
  }
  AlignedPtr scratch = aligned_allocate(kernel.scratch_bytes(threads) + kAlignment);
  args.scratch = scratch.get();
  StepContext ctx;
  ctx.num_threads = threads;
  ctx.rng_offset = rng_offset;
  kernel.run(args, ctx);
  return args.outputs;
}

// Max |a - b| relative to max |b| (at least `floor`); NaN in either gives +inf
// unless both are NaN at the same place.
double relative_error(const Tensor& a, const Tensor& b, double floor = 1e-30) {
  double max_diff = 0.0, max_ref = floor;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.item(i), y = b.item(i);
    if (std::isnan(x) || std::isnan(y)) {
      if (std::isnan(x) && std::isnan(y)) continue;
      return std::numeric_limits<double>::infinity();
    }
    if (std::isinf(x) || std::isinf(y)) {
      if (x == y) continue;
      return std::numeric_limits<double>::infinity();
    }
    max_diff = std::max(max_diff, std::abs(x - y));
    max_ref = std::max(max_ref, std::abs(y));
  }
  return max_diff / max_ref;
}

struct CheckOptions {
  double tolerance = 1e-5;  // relative to the reference's max |value|; kExact: bit for bit
  uint64_t rng_offset = 0;
  bool expect_accumulates = false;
  double norm_floor = 1e-30;  // the norm errors are relative to is at least this
};

// Runs the node with the reference and with the CPU kernel on every path,
// thread count and accumulate setting, and compares all outputs.
void check_node(const Graph& g, const ir::Node& node, const std::vector<Tensor>& inputs,
                const CheckOptions& options = {}) {
  PathGuard guard;
  std::mt19937 rng(1234);
  std::unique_ptr<Kernel> ref = make_ref_kernel(compile::lower(g, node));
  ASSERT_TRUE(ref != nullptr);
  std::vector<Tensor> initial;
  for (ValueId v : node.outputs) {
    const ir::Value& value = g.value(v);
    initial.push_back(random_tensor(value.shape, value.dtype, rng, -1.0, 1.0, 7));
  }
  for (const Path& path : paths()) {
    cpu_basic::cap_cpu_path(path.cap);
    std::unique_ptr<Kernel> cpu = make_cpu_basic_kernel(compile::lower(g, node));
    ASSERT_TRUE(cpu != nullptr) << ir::op_name(node.op) << " has no CPU kernel";
    if (options.expect_accumulates) {
      EXPECT_TRUE(cpu->accumulates()) << ir::op_name(node.op);
    }
    for (int threads : {1, 2}) {
      for (bool accumulate : {false, true}) {
        if (accumulate && !cpu->accumulates()) continue;
        SCOPED_TRACE(str(ir::op_name(node.op), " path=", path.name, " threads=", threads, " accumulate=", accumulate,
                         " inputs:", [&] {
                           std::string s;
                           for (ValueId v : node.inputs) s += " " + g.value(v).shape.to_string();
                           return s;
                         }()));
        const std::vector<Tensor>* init = accumulate ? &initial : nullptr;
        std::vector<Tensor> want = run_node(*ref, g, node, inputs, init, 1, options.rng_offset);
        std::vector<Tensor> got = run_node(*cpu, g, node, inputs, init, threads, options.rng_offset);
        for (size_t i = 0; i < want.size(); ++i) {
          if (options.tolerance == kExact) {
            EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), want[i].nbytes()), 0) << "output " << i;
          } else {
            EXPECT_LE(relative_error(got[i], want[i], options.norm_floor), options.tolerance) << "output " << i;
          }
        }
      }
    }
  }
}

// A graph with one input per (shape, dtype) and one node; returns the node.
const ir::Node& one_node(Graph& g, OpKind op, const std::vector<std::pair<Shape, DType>>& inputs, Attrs attrs = {}) {
  std::vector<ValueId> ids;
  for (size_t i = 0; i < inputs.size(); ++i)
    ids.push_back(g.add_input("in" + std::to_string(i), inputs[i].first, inputs[i].second));
  g.add_node(op, ids, std::move(attrs), "node");
  return g.nodes().back();
}

std::vector<Tensor> random_inputs(const Graph& g, const ir::Node& node, std::mt19937& rng, double lo = -2.0,
                                  double hi = 2.0, int64_t index_range = 1) {
  std::vector<Tensor> out;
  for (ValueId v : node.inputs)
    out.push_back(random_tensor(g.value(v).shape, g.value(v).dtype, rng, lo, hi, index_range));
  return out;
}

const std::vector<Shape> kShapes = {Shape{1},     Shape{3},       Shape{17},       Shape{129},
                                    Shape{3, 17}, Shape{17, 129}, Shape{129, 257}, Shape{2, 3, 17, 129}};

// ---- elementwise ------------------------------------------------------------------------------

// exp8 over n values, 8 at a time.
FT_AVX2 void exp8_all(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) cpu_basic::store8(y + i, n - i, cpu_basic::exp8(cpu_basic::load8(x + i, n - i)));
}

// exp8 (the AVX2 paths' exp) against double-precision libm: relative error below 2e-7 where e^x is a normal float,
// absolute below 2^-149 (one denormal step) under it, and the special values.
TEST(CpuBasicKernels, Exp8) {
  if (!cpu_features().avx2 || !cpu_features().fma) GTEST_SKIP() << "no AVX2 + FMA";
  std::vector<float> x;
  for (double v = -110.0; v <= 90.0; v += 0.0137) x.push_back(static_cast<float>(v));
  const float inf = std::numeric_limits<float>::infinity();
  x.insert(x.end(), {0.0f, -0.0f, 1e-30f, -1e-30f, 88.72f, -87.33f, inf, -inf, std::nanf("")});
  std::vector<float> y(x.size());
  exp8_all(x.data(), y.data(), static_cast<int64_t>(x.size()));
  double worst_relative = 0.0;
  for (size_t i = 0; i + 3 < x.size(); ++i) {
    const double want = std::exp(static_cast<double>(x[i]));
    if (want > std::numeric_limits<float>::max()) {
      EXPECT_EQ(y[i], inf) << x[i];
    } else if (want >= std::numeric_limits<float>::min()) {
      worst_relative = std::max(worst_relative, std::abs(y[i] - want) / want);
    } else {
      EXPECT_LE(std::abs(y[i] - want), std::ldexp(1.0, -149)) << x[i];
    }
  }
  EXPECT_LT(worst_relative, 2e-7);
  const size_t n = x.size();
  EXPECT_EQ(y[n - 3], inf);
  EXPECT_EQ(y[n - 2], 0.0f);
  EXPECT_TRUE(std::isnan(y[n - 1]));
}

TEST(CpuBasicKernels, Fill) {
  for (const Shape& shape : kShapes) {
    Graph g;
    g.add_node(OpKind::Fill, {}, {{"shape", shape.dims()}, {"value", 0.75}}, "fill");
    check_node(g, g.nodes().back(), {}, {kExact, 0, true});
  }
}

TEST(CpuBasicKernels, BinaryBroadcast) {
  const std::vector<std::pair<Shape, Shape>> cases = {{Shape{1}, Shape{1}},
                                                      {Shape{3}, Shape{3}},
                                                      {Shape{17, 129}, Shape{129}},
                                                      {Shape{129, 257}, Shape{257}},
                                                      {Shape{129, 1}, Shape{1, 257}},
                                                      {Shape{3, 1, 17}, Shape{1, 129, 1}},
                                                      {Shape{1}, Shape{3, 17}},
                                                      {Shape{129, 257}, Shape{129, 257}},
                                                      {Shape{2, 3, 17, 129}, Shape{3, 1, 129}},
                                                      {Shape{}, Shape{17}}};
  std::mt19937 rng(1);
  for (OpKind op : {OpKind::Add, OpKind::Sub, OpKind::Mul, OpKind::Div}) {
    for (const auto& [a, b] : cases) {
      Graph g;
      const ir::Node& n = one_node(g, op, {{a, DType::f32}, {b, DType::f32}});
      std::vector<Tensor> in = random_inputs(g, n, rng, 0.5, 2.0);  // away from 0 for Div
      check_node(g, n, in, {1e-6, 0, true});
    }
  }
}

TEST(CpuBasicKernels, Scale) {
  std::mt19937 rng(2);
  for (const Shape& shape : kShapes) {
    Graph g;
    const ir::Node& n = one_node(g, OpKind::Scale, {{shape, DType::f32}}, {{"alpha", -0.37}});
    check_node(g, n, random_inputs(g, n, rng), {1e-6, 0, true});
  }
}

TEST(CpuBasicKernels, CopyAndCast) {
  std::mt19937 rng(3);
  for (const Shape& shape : kShapes) {
    for (DType t : {DType::f32, DType::bf16}) {
      Graph g;
      const ir::Node& n = one_node(g, OpKind::Copy, {{shape, t}});
      check_node(g, n, random_inputs(g, n, rng), {kExact, 0, true});
    }
    for (auto [from, to] :
         {std::pair{DType::f32, DType::bf16}, std::pair{DType::bf16, DType::f32}, std::pair{DType::f32, DType::f32}}) {
      Graph g;
      const ir::Node& n = one_node(g, OpKind::Cast, {{shape, from}}, {{"dtype", std::string(dtype_name(to))}});
      std::vector<Tensor> in = random_inputs(g, n, rng, -1e3, 1e3);
      if (from == DType::f32 && shape.numel() >= 4) {  // specials and rounding ties
        float* x = static_cast<float*>(in[0].data());
        x[0] = std::numeric_limits<float>::quiet_NaN();
        x[1] = -std::numeric_limits<float>::infinity();
        x[2] = bf16_to_float(0x3F81) + std::ldexp(1.0f, -8);  // exactly halfway: rounds to even
        x[3] = std::numeric_limits<float>::max();
      }
      check_node(g, n, in, {kExact});
    }
  }
}

// ---- activations ------------------------------------------------------------------------------

TEST(CpuBasicKernels, Activations) {
  std::mt19937 rng(4);
  for (const Shape& shape : kShapes) {
    for (const char* approximate : {"none", "tanh"}) {
      Graph g;
      const ir::Node& n = one_node(g, OpKind::Gelu, {{shape, DType::f32}}, {{"approximate", std::string(approximate)}});
      check_node(g, n, random_inputs(g, n, rng, -6.0, 6.0), {2e-6, 0, false, 1.0});
      Graph gb;
      const ir::Node& nb = one_node(gb, OpKind::GeluBackward, {{shape, DType::f32}, {shape, DType::f32}},
                                    {{"approximate", std::string(approximate)}});
      check_node(gb, nb, random_inputs(gb, nb, rng, -6.0, 6.0), {2e-6, 0, false, 1.0});
    }
    for (OpKind op : {OpKind::Tanh, OpKind::Relu}) {
      Graph g;
      const ir::Node& n = one_node(g, op, {{shape, DType::f32}});
      check_node(g, n, random_inputs(g, n, rng, -6.0, 6.0), {1e-6, 0, false, 1.0});
    }
    for (OpKind op : {OpKind::TanhBackward, OpKind::ReluBackward}) {
      Graph g;
      const ir::Node& n = one_node(g, op, {{shape, DType::f32}, {shape, DType::f32}});
      check_node(g, n, random_inputs(g, n, rng, -1.0, 1.0), {1e-6, 0, false, 1.0});
    }
    {  // ReLU of a bf16 projection's result (the importer's autocast rule): bf16 in and out, a bf16 x in backward
      Graph g;
      const ir::Node& n = one_node(g, OpKind::Relu, {{shape, DType::bf16}});
      check_node(g, n, random_inputs(g, n, rng, -6.0, 6.0), {kExact});
      Graph gb;
      const ir::Node& nb = one_node(gb, OpKind::ReluBackward, {{shape, DType::f32}, {shape, DType::bf16}});
      check_node(gb, nb, random_inputs(gb, nb, rng, -1.0, 1.0), {kExact});
    }
  }
}

// GELU (erf form) must agree with the double-precision formula to ~1e-6 everywhere.
TEST(CpuBasicKernels, GeluErfAccuracySweep) {
  const int64_t n = 200001;
  Graph g;
  const ir::Node& node = one_node(g, OpKind::Gelu, {{Shape{n}, DType::f32}}, {{"approximate", std::string("none")}});
  Tensor x = Tensor::zeros(Shape{n}, DType::f32);
  for (int64_t i = 0; i < n; ++i) x.set_item(i, -10.0 + 20.0 * static_cast<double>(i) / static_cast<double>(n - 1));
  PathGuard guard;
  for (const Path& path : paths()) {
    cpu_basic::cap_cpu_path(path.cap);
    std::unique_ptr<Kernel> k = make_cpu_basic_kernel(compile::lower(g, node));
    std::vector<Tensor> y = run_node(*k, g, node, {x}, nullptr, 2, 0);
    double worst = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      double v = x.item(i);
      double want = 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
      worst = std::max(worst, std::abs(y[0].item(i) - want));
    }
    EXPECT_LT(worst, 1.5e-6) << path.name;
  }
}

// ---- softmax, layernorm -------------------------------------------------------------------------

const std::vector<Shape> kRowShapes = {Shape{1, 1},     Shape{3, 17},      Shape{17, 129},
                                       Shape{129, 129}, Shape{2, 3, 1000}, Shape{5, 4099}};

TEST(CpuBasicKernels, Softmax) {
  std::mt19937 rng(5);
  for (const Shape& shape : kRowShapes) {
    Graph g;
    const ir::Node& n = one_node(g, OpKind::Softmax, {{shape, DType::f32}});
    check_node(g, n, random_inputs(g, n, rng, -8.0, 8.0), {1e-5});
    Graph gb;
    const ir::Node& nb = one_node(gb, OpKind::SoftmaxBackward, {{shape, DType::f32}, {shape, DType::f32}});
    check_node(gb, nb, random_inputs(gb, nb, rng, 0.0, 1.0), {1e-5});
  }
}

TEST(CpuBasicKernels, LayerNorm) {
  std::mt19937 rng(6);
  for (const Shape& shape : kRowShapes) {
    const Shape C{shape[-1]};
    const Shape rows(std::vector<int64_t>(shape.dims().begin(), shape.dims().end() - 1));
    Graph g;
    const ir::Node& n =
        one_node(g, OpKind::LayerNorm, {{shape, DType::f32}, {C, DType::f32}, {C, DType::f32}}, {{"eps", 1e-5}});
    std::vector<Tensor> in = random_inputs(g, n, rng);
    // A large common offset: one-pass statistics must not cancel.
    for (int64_t i = 0; i < in[0].numel(); ++i) in[0].set_item(i, in[0].item(i) + 300.0);
    check_node(g, n, in, {2e-5});

    Graph gb;
    const ir::Node& nb =
        one_node(gb, OpKind::LayerNormBackward,
                 {{shape, DType::f32}, {shape, DType::f32}, {C, DType::f32}, {rows, DType::f32}, {rows, DType::f32}});
    std::vector<Tensor> inb = random_inputs(gb, nb, rng);
    for (int64_t i = 0; i < inb[4].numel(); ++i) inb[4].set_item(i, 0.5 + std::abs(inb[4].item(i)));  // rstd > 0
    check_node(gb, nb, inb, {1e-5, 0, true});
  }
}

TEST(CpuBasicKernels, RMSNorm) {
  std::mt19937 rng(16);
  for (const Shape& shape : kRowShapes) {
    const Shape C{shape[-1]};
    const Shape rows(std::vector<int64_t>(shape.dims().begin(), shape.dims().end() - 1));
    Graph g;
    const ir::Node& n = one_node(g, OpKind::RMSNorm, {{shape, DType::f32}, {C, DType::f32}}, {{"eps", 1e-6}});
    check_node(g, n, random_inputs(g, n, rng), {2e-6});

    Graph gb;
    const ir::Node& nb = one_node(
        gb, OpKind::RMSNormBackward,
        {{shape, DType::f32}, {shape, DType::f32}, {C, DType::f32}, {rows, DType::f32}});
    std::vector<Tensor> inb = random_inputs(gb, nb, rng);
    for (int64_t i = 0; i < inb[3].numel(); ++i) inb[3].set_item(i, 0.5 + std::abs(inb[3].item(i)));  // rstd > 0
    // Column sums of dweight over up to 4,099 rows in f32 against the reference's double sums.
    check_node(gb, nb, inb, {1e-5, 0, true});
  }
}

TEST(CpuBasicKernels, RoPE) {
  std::mt19937 rng(17);
  // (B, T, H, D): head sizes with a half below, at and above one vector, and not a multiple of 16; tables as wide
  // as the head, or (partial rotary) a quarter or half of it, or all but two elements.
  for (const Shape& shape : {Shape{1, 1, 1, 2}, Shape{2, 3, 2, 10}, Shape{2, 5, 3, 64}, Shape{1, 9, 2, 96},
                             Shape{3, 7, 4, 130}})
  for (int64_t R : {shape[3], shape[3] / 4 * 2, shape[3] / 2 / 2 * 2, shape[3] - 2}) {
    if (R <= 0) continue;
    const Shape table{shape[0], shape[1], R};
    for (int64_t inverse : {0, 1}) {
      SCOPED_TRACE(testing::Message() << shape.to_string() << " R=" << R << " inverse=" << inverse);
      Graph g;
      const ir::Node& n = one_node(g, OpKind::RoPE, {{shape, DType::f32}, {table, DType::f32}, {table, DType::f32}},
                                   {{"inverse", inverse}});
      check_node(g, n, random_inputs(g, n, rng), {1e-6, 0, true});
    }
  }
}

TEST(CpuBasicKernels, SwiGLU) {
  std::mt19937 rng(18);
  for (const Shape& shape : kShapes) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      // f32: a few ulps of exp and the divide; bf16: silu(gate) and the result each rounded (2^-8 relative each).
      const double tolerance = dtype == DType::f32 ? 2e-6 : 8e-3;
      Graph g;
      const ir::Node& n = one_node(g, OpKind::SwiGLU, {{shape, dtype}, {shape, dtype}});
      check_node(g, n, random_inputs(g, n, rng, -8.0, 8.0), {tolerance, 0, true, 1.0});
      Graph gb;
      const ir::Node& nb = one_node(gb, OpKind::SwiGLUBackward, {{shape, DType::f32}, {shape, dtype}, {shape, dtype}});
      // Exact to f32 rounding: with bf16 operands dup reads silu(gate) rounded to bf16 as the reference does (a
      // kernel that did not round it would be 2^-9 relative off).
      check_node(gb, nb, random_inputs(gb, nb, rng, -8.0, 8.0), {2e-6, 0, true, 1.0});
    }
  }
}

// ---- embedding ---------------------------------------------------------------------------------

TEST(CpuBasicKernels, Embedding) {
  std::mt19937 rng(7);
  for (int64_t V : {1, 5, 129}) {
    for (int64_t C : {1, 17, 129}) {
      for (DType ids_t : {DType::i64, DType::i32}) {
        for (DType wt : {DType::f32, DType::bf16}) {
          Graph g;
          const ir::Node& n = one_node(g, OpKind::Embedding, {{Shape{V, C}, wt}, {Shape{3, 17}, ids_t}});
          check_node(g, n, random_inputs(g, n, rng, -2.0, 2.0, V), {kExact});
        }
        Graph gb;
        const ir::Node& nb = one_node(gb, OpKind::EmbeddingBackward,
                                      {{Shape{3, 17, C}, DType::f32}, {Shape{3, 17}, ids_t}}, {{"num_embeddings", V}});
        check_node(gb, nb, random_inputs(gb, nb, rng, -2.0, 2.0, V), {1e-6, 0, true});
      }
    }
  }
  // Enough rows and columns for two threads.
  Graph gb;
  const ir::Node& nb =
      one_node(gb, OpKind::EmbeddingBackward, {{Shape{4, 129, 257}, DType::f32}, {Shape{4, 129}, DType::i64}},
               {{"num_embeddings", int64_t{17}}});
  check_node(gb, nb, random_inputs(gb, nb, rng, -2.0, 2.0, 17), {1e-6, 0, true});
}

TEST(CpuBasicKernels, EmbeddingRejectsOutOfRangeIds) {
  PathGuard guard;
  for (OpKind op : {OpKind::Embedding, OpKind::EmbeddingBackward}) {
    Graph g;
    const ir::Node& n = op == OpKind::Embedding ? one_node(g, op, {{Shape{5, 3}, DType::f32}, {Shape{4}, DType::i64}})
                                                : one_node(g, op, {{Shape{4, 3}, DType::f32}, {Shape{4}, DType::i64}},
                                                           {{"num_embeddings", int64_t{5}}});
    std::unique_ptr<Kernel> k = make_cpu_basic_kernel(compile::lower(g, n));
    ASSERT_TRUE(k != nullptr);
    Tensor first = Tensor::zeros(op == OpKind::Embedding ? Shape{5, 3} : Shape{4, 3}, DType::f32);
    Tensor ids = Tensor::zeros(Shape{4}, DType::i64);
    ids.set_item(2, 7);
    std::string message;
    try {
      run_node(*k, g, n, {first, ids}, nullptr, 2, 0);
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("id 7"), std::string::npos) << message;
    EXPECT_NE(message.find("[0, 5)"), std::string::npos) << message;
  }
}

// ---- dropout -----------------------------------------------------------------------------------

TEST(CpuBasicKernels, DropoutMatchesRngBitForBit) {
  std::mt19937 rng(8);
  for (const Shape& shape : {Shape{1}, Shape{3}, Shape{17}, Shape{129}, Shape{67, 129}, Shape{129, 257}}) {
    for (double p : {0.0, 0.1, 0.5}) {
      Graph g;
      const ir::Node& n = one_node(g, OpKind::Dropout, {{shape, DType::f32}}, {{"p", p}, {"seed", int64_t{12345}}});
      std::vector<Tensor> in = random_inputs(g, n, rng, 0.5, 2.0);  // never 0: a zero output means dropped
      check_node(g, n, in, {1e-6, 987654321ull});
      // The mask itself, against rng.h.
      PathGuard guard;
      for (const Path& path : paths()) {
        cpu_basic::cap_cpu_path(path.cap);
        std::unique_ptr<Kernel> k = make_cpu_basic_kernel(compile::lower(g, n));
        std::vector<Tensor> y = run_node(*k, g, n, in, nullptr, 2, 987654321ull);
        int64_t mismatches = 0;
        for (int64_t i = 0; i < shape.numel(); ++i) {
          bool keep = dropout_keep(12345, 987654321ull, static_cast<uint64_t>(i), static_cast<float>(p));
          mismatches += keep != (y[0].item(i) != 0.0);
        }
        EXPECT_EQ(mismatches, 0) << path.name << " p=" << p << " shape " << shape.to_string();
      }
    }
  }
}

// ---- movement ----------------------------------------------------------------------------------

TEST(CpuBasicKernels, ReshapeCopiesOrAliases) {
  std::mt19937 rng(9);
  Graph g;
  const ir::Node& n =
      one_node(g, OpKind::Reshape, {{Shape{17, 129}, DType::f32}}, {{"shape", std::vector<int64_t>{129, -1}}});
  std::vector<Tensor> in = random_inputs(g, n, rng);
  check_node(g, n, in, {kExact});
  std::unique_ptr<Kernel> k = make_cpu_basic_kernel(compile::lower(g, n));
  KernelArgs args;
  args.inputs = {in[0]};
  args.outputs = {in[0].reshaped(Shape{129, 17})};
  args.accumulate = {0};
  Tensor before = in[0].clone();
  k->run(args, StepContext{});
  EXPECT_EQ(std::memcmp(before.data(), in[0].data(), before.nbytes()), 0);
}

TEST(CpuBasicKernels, Transpose) {
  struct Case {
    Shape shape;
    std::vector<int64_t> perm;
  };
  const std::vector<Case> cases = {
      {Shape{17}, {0}},
      {Shape{3, 17}, {1, 0}},
      {Shape{129, 257}, {1, 0}},
      {Shape{2, 17, 3, 129}, {0, 2, 1, 3}},  // (B, T, H, D) -> (B, H, T, D)
      {Shape{2, 129, 4, 33}, {0, 2, 1, 3}},
      {Shape{3, 17, 129}, {0, 2, 1}},      // swap the last two
      {Shape{2, 3, 17, 5}, {3, 1, 0, 2}},  // general
      {Shape{1, 17, 1, 3}, {3, 2, 0, 1}},  // extent-1 axes
      {Shape{4, 3, 2, 5, 3}, {4, 0, 3, 1, 2}},
      {Shape{2, 3, 4, 5, 6}, {0, 1, 2, 3, 4}},
  };
  std::mt19937 rng(10);
  for (const Case& c : cases) {
    for (DType t : {DType::f32, DType::bf16, DType::i64, DType::u8}) {
      Graph g;
      const ir::Node& n = one_node(g, OpKind::Transpose, {{c.shape, t}}, {{"perm", c.perm}});
      check_node(g, n, random_inputs(g, n, rng, -2.0, 2.0, 1000), {kExact});
    }
  }
}

TEST(CpuBasicKernels, SplitConcatSlice) {
  std::mt19937 rng(11);
  const Shape shape{3, 17, 129};
  for (int64_t axis : {0, 1, 2, -1}) {
    const int64_t a = axis < 0 ? axis + 3 : axis;
    const int64_t extent = shape[a];
    for (DType t : {DType::f32, DType::bf16}) {
      std::vector<int64_t> sizes = extent == 3 ? std::vector<int64_t>{1, 0, 2} : std::vector<int64_t>{1, extent - 4, 3};
      Graph gs;
      const ir::Node& split = one_node(gs, OpKind::Split, {{shape, t}}, {{"axis", axis}, {"sizes", sizes}});
      check_node(gs, split, random_inputs(gs, split, rng), {kExact});

      Graph gc;
      std::vector<std::pair<Shape, DType>> pieces;
      for (int64_t s : sizes) {
        Shape piece = shape;
        piece[a] = s;
        pieces.push_back({piece, t});
      }
      const ir::Node& concat = one_node(gc, OpKind::Concat, pieces, {{"axis", axis}});
      check_node(gc, concat, random_inputs(gc, concat, rng), {kExact});

      const int64_t start = 1, end = extent;
      Graph gl;
      const ir::Node& slice =
          one_node(gl, OpKind::Slice, {{shape, t}}, {{"axis", axis}, {"start", start}, {"end", end}});
      check_node(gl, slice, random_inputs(gl, slice, rng), {kExact});

      Shape part = shape;
      part[a] = end - start;
      Graph gb;
      const ir::Node& back = one_node(gb, OpKind::SliceBackward, {{part, t}},
                                      {{"shape", shape.dims()}, {"axis", axis}, {"start", start}, {"end", end}});
      check_node(gb, back, random_inputs(gb, back, rng), {kExact});
    }
  }
  // Big enough for two threads.
  Graph gl;
  const ir::Node& slice = one_node(gl, OpKind::Slice, {{Shape{129, 257}, DType::f32}},
                                   {{"axis", int64_t{1}}, {"start", int64_t{3}}, {"end", int64_t{250}}});
  check_node(gl, slice, random_inputs(gl, slice, rng), {kExact});
}

TEST(CpuBasicKernels, ExpandTo) {
  std::mt19937 rng(12);
  const std::vector<std::pair<Shape, Shape>> cases = {
      {Shape{17, 1}, Shape{3, 17, 129}},        {Shape{129}, Shape{3, 129}}, {Shape{1}, Shape{17, 3}},
      {Shape{3, 1, 129}, Shape{2, 3, 17, 129}}, {Shape{}, Shape{129, 257}},  {Shape{1, 257}, Shape{129, 257}}};
  for (const auto& [from, to] : cases) {
    for (DType t : {DType::f32, DType::bf16}) {
      Graph g;
      const ir::Node& n = one_node(g, OpKind::ExpandTo, {{from, t}}, {{"shape", to.dims()}});
      check_node(g, n, random_inputs(g, n, rng), {kExact});
    }
  }
}

// ---- reductions -------------------------------------------------------------------------------

TEST(CpuBasicKernels, ReduceSumAndMean) {
  std::mt19937 rng(13);
  struct Case {
    Shape shape;
    std::vector<int64_t> axes;
  };
  const std::vector<Case> cases = {{Shape{1}, {0}},           {Shape{129}, {0}},
                                   {Shape{3, 17}, {1}},       {Shape{3, 17}, {0}},
                                   {Shape{129, 257}, {0}},    {Shape{129, 257}, {1}},
                                   {Shape{129, 257}, {0, 1}}, {Shape{3, 17, 129}, {1}},
                                   {Shape{3, 17, 129}, {-1}}, {Shape{2, 3, 17, 129}, {0, 1, 2}},
                                   {Shape{3, 1, 17}, {1}},    {Shape{17, 4099}, {0}},
                                   {Shape{5, 40000}, {1}},    {Shape{3, 17}, {}}};
  for (const Case& c : cases) {
    for (OpKind op : {OpKind::ReduceSum, OpKind::ReduceMean}) {
      for (int64_t keepdims : {0, 1}) {
        Graph g;
        const ir::Node& n = one_node(g, op, {{c.shape, DType::f32}}, {{"axes", c.axes}, {"keepdims", keepdims}});
        check_node(g, n, random_inputs(g, n, rng), {1e-5, 0, true});
      }
    }
  }
  // Reduced axes on both sides of a kept one (the generic walk).
  for (const Case& c : std::vector<Case>{{Shape{3, 17, 5}, {0, 2}},
                                         {Shape{3, 4, 17, 5, 129}, {0, 2, 4}},
                                         {Shape{2, 3, 4, 5}, {1, 3}},
                                         {Shape{129, 3, 129}, {0, 2}}}) {
    Graph g;
    const ir::Node& n = one_node(g, OpKind::ReduceMean, {{c.shape, DType::f32}}, {{"axes", c.axes}});
    check_node(g, n, random_inputs(g, n, rng), {1e-5, 0, true});
  }
}

TEST(CpuBasicKernels, ReduceSumTo) {
  std::mt19937 rng(14);
  const std::vector<std::pair<Shape, Shape>> cases = {{Shape{3, 17, 129}, Shape{17, 1}},
                                                      {Shape{3, 17, 129}, Shape{129}},
                                                      {Shape{3, 17, 129}, Shape{1, 1, 1}},
                                                      {Shape{3, 17, 129}, Shape{3, 1, 129}},
                                                      {Shape{129, 257}, Shape{257}},
                                                      {Shape{129, 257}, Shape{129, 1}},
                                                      {Shape{17}, Shape{17}},
                                                      {Shape{2, 3, 17, 129}, Shape{1, 129}}};
  for (const auto& [from, to] : cases) {
    Graph g;
    const ir::Node& n = one_node(g, OpKind::ReduceSumTo, {{from, DType::f32}}, {{"shape", to.dims()}});
    check_node(g, n, random_inputs(g, n, rng), {1e-5, 0, true});
  }
}

// CastColumnSum against the reference, and against the Cast and ReduceSum kernels it replaces: the same bits on
// every path and thread count (fuse_cast_column_sum keeps a model's gradients bit for bit). Shapes: rows not a
// multiple of the row runs or the threads, widths not a multiple of 16 or 64, a wide output (over 64K columns,
// whose sums ReduceSum splits by columns), and f16.
TEST(CpuBasicKernels, CastColumnSum) {
  PathGuard guard;
  std::mt19937 rng(16);
  const std::vector<std::pair<Shape, DType>> cases = {
      {Shape{3, 17, 129}, DType::bf16}, {Shape{129, 257}, DType::bf16},    {Shape{2, 3, 37, 768}, DType::bf16},
      {Shape{2, 65537}, DType::bf16},   {Shape{33, 3072}, DType::f16},     {Shape{2, 2}, DType::bf16}};
  for (const auto& [shape, to] : cases) {
    Graph g;
    const ir::Node& n = one_node(g, OpKind::CastColumnSum, {{shape, DType::f32}}, {{"dtype", dtype_name(to)}});
    const std::vector<Tensor> in = random_inputs(g, n, rng);
    check_node(g, n, in, {1e-5, 0, true});

    Graph gc, gs;
    const ir::Node& cast = one_node(gc, OpKind::Cast, {{shape, DType::f32}}, {{"dtype", dtype_name(to)}});
    std::vector<int64_t> leading;
    for (int64_t a = 0; a + 1 < shape.rank(); ++a) leading.push_back(a);
    const ir::Node& sum = one_node(gs, OpKind::ReduceSum, {{shape, DType::f32}}, {{"axes", leading}});
    for (const Path& path : paths()) {
      cpu_basic::cap_cpu_path(path.cap);
      std::unique_ptr<Kernel> fused = make_cpu_basic_kernel(compile::lower(g, n));
      std::unique_ptr<Kernel> cast_k = make_cpu_basic_kernel(compile::lower(gc, cast));
      std::unique_ptr<Kernel> sum_k = make_cpu_basic_kernel(compile::lower(gs, sum));
      ASSERT_TRUE(fused && cast_k && sum_k);
      for (int threads : {1, 2}) {
        SCOPED_TRACE(str("path=", path.name, " threads=", threads, " x ", shape.to_string()));
        const std::vector<Tensor> got = run_node(*fused, g, n, in, nullptr, threads, 0);
        const Tensor want_cast = run_node(*cast_k, gc, cast, in, nullptr, threads, 0)[0];
        const Tensor want_sum = run_node(*sum_k, gs, sum, in, nullptr, threads, 0)[0];
        EXPECT_EQ(std::memcmp(got[0].data(), want_cast.data(), want_cast.nbytes()), 0) << "the cast";
        EXPECT_EQ(std::memcmp(got[1].data(), want_sum.data(), want_sum.nbytes()), 0) << "the sums";
        // As training runs it: the cast written, the sums added into a bias's gradient buffer.
        const Tensor start = random_tensor(Shape{shape[-1]}, DType::f32, rng);
        const std::vector<Tensor> sum_start = {start};
        const Tensor want_added = run_node(*sum_k, gs, sum, in, &sum_start, threads, 0)[0];
        KernelArgs args;
        args.inputs = in;
        args.outputs = {Tensor::zeros(shape, to), start.clone()};
        args.accumulate = {0, 1};
        AlignedPtr scratch = aligned_allocate(fused->scratch_bytes(threads) + kAlignment);
        args.scratch = scratch.get();
        StepContext ctx;
        ctx.num_threads = threads;
        fused->run(args, ctx);
        EXPECT_EQ(std::memcmp(args.outputs[0].data(), want_cast.data(), want_cast.nbytes()), 0) << "the cast, sums added";
        EXPECT_EQ(std::memcmp(args.outputs[1].data(), want_added.data(), want_added.nbytes()), 0) << "the sums added";
      }
    }
  }
}

// ---- loss ---------------------------------------------------------------------------------------

TEST(CpuBasicKernels, SoftmaxCrossEntropy) {
  std::mt19937 rng(15);
  const std::vector<Shape> shapes = {Shape{1, 1}, Shape{3, 17}, Shape{17, 129}, Shape{2, 3, 1000}, Shape{33, 4099}};
  for (const Shape& shape : shapes) {
    for (DType targets_t : {DType::i64, DType::i32}) {
      for (bool all_ignored : {false, true}) {
        const Shape rows(std::vector<int64_t>(shape.dims().begin(), shape.dims().end() - 1));
        Graph g;
        const ir::Node& n = one_node(g, OpKind::SoftmaxCrossEntropy, {{shape, DType::f32}, {rows, targets_t}},
                                     {{"ignore_index", int64_t{-1}}});
        std::vector<Tensor> in = random_inputs(g, n, rng, -6.0, 6.0, shape[-1]);
        for (int64_t r = 0; r < in[1].numel(); ++r)
          if (all_ignored || r % 3 == 1) in[1].set_item(r, -1);
        check_node(g, n, in, {1e-5});

        Graph gb;
        const ir::Node& nb =
            one_node(gb, OpKind::SoftmaxCrossEntropyBackward,
                     {{Shape{}, DType::f32}, {shape, DType::f32}, {rows, targets_t}, {rows, DType::f32}},
                     {{"ignore_index", int64_t{-1}}});
        // lse from the reference forward, so softmax is normalised.
        std::unique_ptr<Kernel> ref = make_ref_kernel(compile::lower(g, n));
        std::vector<Tensor> fwd = run_node(*ref, g, n, in, nullptr, 1, 0);
        Tensor dloss = Tensor::zeros(Shape{}, DType::f32);
        dloss.set_item(0, 1.7);
        check_node(gb, nb, {dloss, in[0], in[1], fwd[1]}, {1e-5});
      }
    }
  }
}

TEST(CpuBasicKernels, SoftmaxCrossEntropyRejectsBadTargets) {
  Graph g;
  const ir::Node& n = one_node(g, OpKind::SoftmaxCrossEntropy, {{Shape{2, 5}, DType::f32}, {Shape{2}, DType::i64}});
  std::unique_ptr<Kernel> k = make_cpu_basic_kernel(compile::lower(g, n));
  ASSERT_TRUE(k != nullptr);
  Tensor logits = Tensor::zeros(Shape{2, 5}, DType::f32);
  Tensor targets = Tensor::zeros(Shape{2}, DType::i64);
  targets.set_item(1, 5);
  EXPECT_THROW(run_node(*k, g, n, {logits, targets}, nullptr, 1, 0), Error);
}

// The loss reduction does not depend on the thread count beyond float rounding.
TEST(CpuBasicKernels, CrossEntropyLossIsStableAcrossThreads) {
  std::mt19937 rng(16);
  Graph g;
  const ir::Node& n =
      one_node(g, OpKind::SoftmaxCrossEntropy, {{Shape{64, 1000}, DType::f32}, {Shape{64}, DType::i64}});
  std::vector<Tensor> in = random_inputs(g, n, rng, -6.0, 6.0, 1000);
  std::unique_ptr<Kernel> k = make_cpu_basic_kernel(compile::lower(g, n));
  std::vector<Tensor> one = run_node(*k, g, n, in, nullptr, 1, 0);
  std::vector<Tensor> two = run_node(*k, g, n, in, nullptr, 2, 0);
  EXPECT_NEAR(one[0].item(0), two[0].item(0), 1e-6 * std::abs(one[0].item(0)));
  EXPECT_EQ(std::memcmp(one[1].data(), two[1].data(), one[1].nbytes()), 0);
}

// The dense ops belong to make_cpu_dense_kernel.
TEST(CpuBasicKernels, DenseOpsAreNotHere) {
  Graph g;
  const ir::Node& n = one_node(g, OpKind::MatMul, {{Shape{3, 4}, DType::f32}, {Shape{4, 5}, DType::f32}});
  EXPECT_EQ(make_cpu_basic_kernel(compile::lower(g, n)), nullptr);
}

}  // namespace
}  // namespace fusetrain::kernels
