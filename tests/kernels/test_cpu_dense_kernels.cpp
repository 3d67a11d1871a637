// Tuned CPU MatMul, Linear, Attention and AttentionBackward (make_cpu_dense_kernel)
// against the reference kernels (make_ref_kernel) on random inputs, one-node graphs.
//
// Shape letters: B batch, H heads, T query length, S key length, D head size,
// M/N/K matmul extents, R rows of a Linear input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/cpu.h"
#include "fusetrain/core/half.h"
#include "fusetrain/ir/builder.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/gemm.h"
#include "fusetrain/compile/lower.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {
namespace {

using ir::OpKind;
using ir::ValueId;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
const int64_t kSizes[] = {1, 3, 17, 129};

// Forces the portable tile code for kernels created while it lives.
// Caps the kernels' path (to run the AVX2 path on a CPU that has AVX-512) until the end of the scope.
class ScopedPathCap {
 public:
  explicit ScopedPathCap(cpu_basic::CpuPath cap) { cpu_basic::cap_cpu_path(cap); }
  ~ScopedPathCap() { cpu_basic::cap_cpu_path(cpu_basic::CpuPath::avx512); }
};

class ScopedPortable {
 public:
  explicit ScopedPortable(bool portable) { cpu_basic::force_portable_path(portable); }
  ~ScopedPortable() { cpu_basic::force_portable_path(false); }
};

// Uniform [-1, 1) values; bf16 tensors get the nearest bf16.
Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::zeros(shape, dtype);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::bf16)
      static_cast<uint16_t*>(t.data())[i] = float_to_bf16(dist(rng));
    else
      static_cast<float*>(t.data())[i] = dist(rng);
  }
  return t;
}

// Runs `kernel` on `inputs`. Without `initial` the outputs start as NaN (a kernel must
// overwrite them); with it they start as copies of `initial` and the accumulate flags are set.
std::vector<Tensor> run_kernel(Kernel& kernel, const ir::Graph& g, const ir::Node& node,
                               const std::vector<Tensor>& inputs, int threads, uint64_t rng_offset = 0,
                               const std::vector<Tensor>* initial = nullptr) {
  KernelArgs args;
  args.inputs = inputs;
  for (size_t i = 0; i < node.outputs.size(); ++i) {
    const ir::Value& out = g.value(node.outputs[i]);
    Tensor t = initial ? (*initial)[i].clone() : Tensor::zeros(out.shape, out.dtype);
    if (!initial)
      for (int64_t e = 0; e < t.numel(); ++e) t.set_item(e, kNaN);
    args.outputs.push_back(t);
    args.accumulate.push_back(initial ? 1 : 0);
  }
  AlignedPtr scratch = aligned_allocate(std::max<size_t>(kernel.scratch_bytes(threads), 64));
  args.scratch = scratch.get();
  StepContext ctx;
  ctx.num_threads = threads;
  ctx.rng_offset = rng_offset;
  kernel.run(args, ctx);
  return args.outputs;
}

// Largest |a − b| divided by max(1, largest |b|); NaN anywhere gives infinity.
double scaled_max_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double worst = 0.0, scale = 1.0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    double x = a.item(i), y = b.item(i);
    if (std::isnan(x) || std::isnan(y)) return kInf;
    worst = std::max(worst, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  }
  return worst / scale;
}

// ‖a − b‖ / ‖b‖ (‖b‖ floored at 1e-30).
double relative_norm_error(const Tensor& a, const Tensor& b) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    double x = a.item(i), y = b.item(i);
    if (std::isnan(x) || std::isnan(y)) return kInf;
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// Random inputs for `node`, runs tuned and reference kernels, compares every output.
void expect_matches_reference(const ir::Graph& g, const ir::Node& node, int threads, double tolerance, bool accumulate,
                              std::mt19937& rng, const std::string& label, bool norm_wise = false) {
  std::vector<Tensor> inputs;
  for (ValueId v : node.inputs) inputs.push_back(random_tensor(g.value(v).shape, g.value(v).dtype, rng));
  std::vector<Tensor> initial;
  for (ValueId v : node.outputs) initial.push_back(random_tensor(g.value(v).shape, g.value(v).dtype, rng));
  std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, node));
  ASSERT_NE(tuned, nullptr) << label;
  EXPECT_TRUE(tuned->accumulates()) << label;  // MatMul and Linear handle the flag themselves
  std::unique_ptr<Kernel> reference = make_ref_kernel(compile::lower(g, node));
  std::vector<Tensor> got = run_kernel(*tuned, g, node, inputs, threads, 0, accumulate ? &initial : nullptr);
  std::vector<Tensor> want = run_kernel(*reference, g, node, inputs, 1, 0, accumulate ? &initial : nullptr);
  for (size_t i = 0; i < got.size(); ++i) {
    double error = norm_wise ? relative_norm_error(got[i], want[i]) : scaled_max_error(got[i], want[i]);
    EXPECT_LE(error, tolerance) << label << " output " << i;
  }
}

// ---------------------------------------------------------------------------
// MatMul and Linear
// ---------------------------------------------------------------------------

// a, b dims as stored (transposes already applied by the caller).
void check_matmul(std::vector<int64_t> a_dims, std::vector<int64_t> b_dims, bool trans_a, bool trans_b, DType dtype,
                  int threads, bool accumulate, std::mt19937& rng) {
  ir::Graph g;
  ir::GraphBuilder builder(g);
  ValueId a = builder.input("a", Shape(a_dims), dtype);
  ValueId b = builder.input("b", Shape(b_dims), dtype);
  builder.matmul(a, b, trans_a, trans_b);
  std::string label = "MatMul " + Shape(a_dims).to_string() + " x " + Shape(b_dims).to_string() +
                      " trans_a=" + std::to_string(trans_a) + " trans_b=" + std::to_string(trans_b) + " " +
                      dtype_name(dtype) + " threads=" + std::to_string(threads) + (accumulate ? " accumulate" : "");
  bool bf16 = dtype == DType::bf16;
  expect_matches_reference(g, g.nodes().back(), threads, bf16 ? 2e-3 : 2e-6, accumulate, rng, label, bf16);
}

// Stored dims of an (M, K) operand (or (K, M) when transposed), with leading batch dims.
std::vector<int64_t> stored(std::vector<int64_t> batch, int64_t rows, int64_t cols, bool transposed) {
  batch.push_back(transposed ? cols : rows);
  batch.push_back(transposed ? rows : cols);
  return batch;
}

TEST(CpuDenseKernels, MatMulEveryTransposeAndSize) {
  std::mt19937 rng(1);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t m : kSizes)
        for (int64_t n : kSizes)
          for (int64_t k : kSizes)
            check_matmul(stored({}, m, k, ta), stored({}, k, n, tb), ta, tb, DType::f32, m == 129 ? 2 : 1, false, rng);
}

TEST(CpuDenseKernels, MatMulBatchedAndBroadcast) {
  std::mt19937 rng(2);
  for (int threads : {1, 2})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (int64_t size : {3, 17, 129}) {
          int64_t m = size, n = 17, k = size == 3 ? 1 : 33;
          // both batched, a broadcast over b's batch, b broadcast over a's batch (folded when !ta)
          check_matmul(stored({2, 3}, m, k, ta), stored({2, 3}, k, n, tb), ta, tb, DType::f32, threads, false, rng);
          check_matmul(stored({}, m, k, ta), stored({2, 3}, k, n, tb), ta, tb, DType::f32, threads, false, rng);
          check_matmul(stored({2, 3}, m, k, ta), stored({}, k, n, tb), ta, tb, DType::f32, threads, false, rng);
        }
}

TEST(CpuDenseKernels, MatMulBf16) {
  std::mt19937 rng(3);
  for (int threads : {1, 2})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (int64_t size : kSizes) {
          check_matmul(stored({}, size, 129, ta), stored({}, 129, 17, tb), ta, tb, DType::bf16, threads, false, rng);
          check_matmul(stored({4}, 17, size, ta), stored({}, size, 3, tb), ta, tb, DType::bf16, threads, false, rng);
          check_matmul(stored({}, 3, size, ta), stored({4}, size, 129, tb), ta, tb, DType::bf16, threads, false, rng);
        }
}

TEST(CpuDenseKernels, MatMulAccumulates) {
  std::mt19937 rng(4);
  for (int threads : {1, 2})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        check_matmul(stored({}, 17, 129, ta), stored({}, 129, 3, tb), ta, tb, DType::f32, threads, true, rng);
        check_matmul(stored({2}, 129, 17, ta), stored({}, 17, 33, tb), ta, tb, DType::f32, threads, true, rng);
        check_matmul(stored({2}, 3, 17, ta), stored({2}, 17, 129, tb), ta, tb, DType::bf16, threads, true, rng);
      }
}

TEST(CpuDenseKernels, MatMulBf16ResultFallsBackToReference) {
  ir::Graph g;
  ir::GraphBuilder builder(g);
  ValueId a = builder.input("a", Shape{3, 4}, DType::bf16);
  ValueId b = builder.input("b", Shape{4, 5}, DType::bf16);
  g.add(OpKind::MatMul, {a, b}, {{"out_dtype", std::string("bf16")}});
  EXPECT_EQ(make_cpu_dense_kernel(compile::lower(g, g.nodes().back())), nullptr);
  builder.add(a, a);
  EXPECT_EQ(make_cpu_dense_kernel(compile::lower(g, g.nodes().back())), nullptr);
}

void check_linear(std::vector<int64_t> x_dims, int64_t n, bool bias, DType dtype, int threads, bool accumulate,
                  std::mt19937& rng) {
  ir::Graph g;
  ir::GraphBuilder builder(g);
  ValueId x = builder.input("x", Shape(x_dims), dtype);
  ValueId w = builder.input("w", Shape{n, x_dims.back()}, dtype);
  ValueId b = bias ? builder.input("bias", Shape{n}) : ir::kNone;
  builder.linear(x, w, b);
  std::string label = "Linear x" + Shape(x_dims).to_string() + " N=" + std::to_string(n) + " " + dtype_name(dtype) +
                      (bias ? " bias" : "") + (accumulate ? " accumulate" : "") + " threads=" + std::to_string(threads);
  bool bf16 = dtype == DType::bf16;
  expect_matches_reference(g, g.nodes().back(), threads, bf16 ? 2e-3 : 2e-6, accumulate, rng, label, bf16);
}

TEST(CpuDenseKernels, Linear) {
  std::mt19937 rng(5);
  for (int threads : {1, 2})
    for (bool bias : {false, true})
      for (bool accumulate : {false, true})
        for (DType dtype : {DType::f32, DType::bf16})
          for (int64_t size : kSizes) {
            check_linear({size, 17}, 129, bias, dtype, threads, accumulate, rng);
            check_linear({2, 3, 129}, size, bias, dtype, threads, accumulate, rng);
            check_linear({size}, 3, bias, dtype, threads, accumulate, rng);
          }
  // Large enough for the parallel bias pass.
  check_linear({300, 64}, 257, true, DType::f32, 2, false, rng);
  check_linear({300, 64}, 257, true, DType::f32, 2, true, rng);
}

// Every element of `rounded` (bf16) is the same element of `wide` (f32) rounded to nearest even.
void expect_rounded_to_bf16(const Tensor& wide, const Tensor& rounded) {
  ASSERT_EQ(wide.numel(), rounded.numel());
  const uint16_t* r = static_cast<const uint16_t*>(rounded.data());
  for (int64_t i = 0; i < wide.numel(); ++i) ASSERT_EQ(r[i], float_to_bf16(wide.data_as<float>()[i])) << "element " << i;
}

// A Linear writing bf16 (out_dtype, as fold_output_casts makes it) writes its f32 result rounded to nearest even, bit
// for bit: with and without bias, K within one pass of the GEMM (each strip rounded from the GEMM's own buffer) and
// beyond it (the product in scratch first), one and two threads.
TEST(CpuDenseKernels, LinearBf16OutputIsTheF32OutputRounded) {
  std::mt19937 rng(25);
  for (int threads : {1, 2})
    for (bool bias : {false, true})
      for (int64_t K : {int64_t{129}, gemm_strip_max_k(true) + 70}) {
        SCOPED_TRACE(str("threads=", threads, " bias=", bias, " K=", K));
        std::vector<Tensor> results[2];
        std::vector<Tensor> inputs = {random_tensor(Shape{3, 37, K}, DType::bf16, rng),
                                      random_tensor(Shape{70, K}, DType::bf16, rng)};
        if (bias) inputs.push_back(random_tensor(Shape{70}, DType::f32, rng));
        for (DType out : {DType::f32, DType::bf16}) {
          ir::Graph g;
          ir::GraphBuilder builder(g);
          std::vector<ValueId> in = {builder.input("x", inputs[0].shape(), DType::bf16),
                                     builder.input("w", inputs[1].shape(), DType::bf16)};
          if (bias) in.push_back(builder.input("b", Shape{70}));
          g.add_node(OpKind::Linear, in, {{"out_dtype", std::string(dtype_name(out))}});
          const ir::Node& node = g.nodes().back();
          std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, node));
          ASSERT_TRUE(tuned != nullptr);
          EXPECT_EQ(tuned->accumulates(), out == DType::f32);
          results[out == DType::bf16] = run_kernel(*tuned, g, node, inputs, threads);
        }
        expect_rounded_to_bf16(results[0][0], results[1][0]);
      }
}

// LinearGelu with a bf16 z and y (no f32 output to hold the product): y is the f32-y run's result rounded and z the
// same, bit for bit, whether each strip comes from the GEMM's own buffer (K within one pass) or the product goes to
// scratch first (K beyond it).
TEST(CpuDenseKernels, LinearGeluBf16OutputsAreTheF32OutputRounded) {
  std::mt19937 rng(26);
  for (int threads : {1, 2})
    for (int64_t K : {int64_t{129}, gemm_strip_max_k(true) + 70}) {
      SCOPED_TRACE(str("threads=", threads, " K=", K));
      const std::vector<Tensor> inputs = {random_tensor(Shape{2, 37, K}, DType::bf16, rng),
                                          random_tensor(Shape{70, K}, DType::bf16, rng),
                                          random_tensor(Shape{70}, DType::f32, rng)};
      std::vector<Tensor> results[2];
      for (DType out : {DType::f32, DType::bf16}) {
        ir::Graph g;
        ir::GraphBuilder builder(g);
        const std::vector<ValueId> in = {builder.input("x", inputs[0].shape(), DType::bf16),
                                         builder.input("w", inputs[1].shape(), DType::bf16), builder.input("b", {70})};
        g.add_node(OpKind::LinearGelu, in, {{"z_dtype", std::string("bf16")}, {"out_dtype", std::string(dtype_name(out))}});
        const ir::Node& node = g.nodes().back();
        std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, node));
        ASSERT_TRUE(tuned != nullptr);
        results[out == DType::bf16] = run_kernel(*tuned, g, node, inputs, threads);
      }
      EXPECT_EQ(std::memcmp(results[0][1].data(), results[1][1].data(), results[0][1].nbytes()), 0) << "z";
      expect_rounded_to_bf16(results[0][0], results[1][0]);
    }
}

// MatMulGeluBackward against its reference: every output combination, both transposes of a 2-D product and a 3-D a,
// row counts that leave a short last strip (148 = 10·14 + 8 = 24·6 + 4), K within one pass and beyond it (the bf16
// dx's product then goes to scratch), the erf and tanh forms, one and two threads.
TEST(CpuDenseKernels, MatMulGeluBackwardMatchesTheReference) {
  std::mt19937 rng(31);
  struct Outputs {
    DType dx;
    bool column_sum, gelu;
    DType gelu_dtype;
  };
  const Outputs outputs[] = {{DType::f32, false, false, DType::f32},
                             {DType::bf16, true, true, DType::bf16},
                             {DType::bf16, true, false, DType::f32},
                             {DType::f32, true, true, DType::f32}};
  for (DType operands : {DType::f32, DType::bf16})
    for (int64_t K : {int64_t{33}, gemm_strip_max_k(operands == DType::bf16) + 70})
      for (bool ta : {false, true})
        for (const Outputs& o : outputs)
          for (int threads : {1, 2}) {
            const bool three_d = !ta && K == 33;
            const bool tanh = o.column_sum && !o.gelu;
            const DType x_dtype = operands;
            ir::Graph g;
            ir::GraphBuilder builder(g);
            const ValueId a = builder.input("a", three_d ? Shape{4, 37, K} : Shape(stored({}, 148, K, ta)), operands);
            const ValueId b = builder.input("b", {K, 70}, operands);
            const ValueId x = builder.input("x", {4, 37, 70}, x_dtype);
            g.add_node(OpKind::MatMulGeluBackward, {a, b, x},
                       {{"trans_a", int64_t{ta}},
                        {"approximate", std::string(tanh ? "tanh" : "none")},
                        {"out_dtype", std::string(dtype_name(o.dx))},
                        {"column_sum", int64_t{o.column_sum}},
                        {"gelu_out", int64_t{o.gelu}},
                        {"gelu_dtype", std::string(dtype_name(o.gelu_dtype))}});
            const std::string label = str(dtype_name(operands), " K=", K, " trans_a=", ta, " dx ", dtype_name(o.dx),
                                          " sums=", o.column_sum, " gelu=", o.gelu, " threads=", threads);
            // bf16 results may round the other way from a product that differs in its last f32 bits: norm-wise.
            const bool bf16 = operands == DType::bf16 || o.dx == DType::bf16;
            expect_matches_reference(g, g.nodes().back(), threads, bf16 ? 2e-3 : 2e-6, false, rng, label, bf16);
          }
}

// The column sums add into a bias gradient's buffer when the runtime asks (gradient accumulation); dx and gelu(x)
// are never accumulated, and a request to is refused rather than ignored.
TEST(CpuDenseKernels, MatMulGeluBackwardAddsItsColumnSumsIntoAGradient) {
  std::mt19937 rng(32);
  ir::Graph g;
  ir::GraphBuilder builder(g);
  const std::vector<ValueId> in = {builder.input("a", {148, 40}, DType::bf16), builder.input("b", {40, 70}, DType::bf16),
                                   builder.input("x", {148, 70}, DType::bf16)};
  g.add_node(OpKind::MatMulGeluBackward, in,
             {{"out_dtype", std::string("bf16")}, {"column_sum", int64_t{1}}, {"gelu_out", int64_t{1}},
              {"gelu_dtype", std::string("bf16")}});
  const ir::Node& node = g.nodes().back();
  std::vector<Tensor> inputs;
  for (ValueId v : node.inputs) inputs.push_back(random_tensor(g.value(v).shape, g.value(v).dtype, rng));
  std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, node));
  ASSERT_NE(tuned, nullptr);
  const std::vector<Tensor> fresh = run_kernel(*tuned, g, node, inputs, 2);
  KernelArgs args;
  args.inputs = inputs;
  for (ValueId v : node.outputs) args.outputs.push_back(Tensor::zeros(g.value(v).shape, g.value(v).dtype));
  for (int64_t j = 0; j < 70; ++j) args.outputs[1].set_item(j, 0.25 * static_cast<double>(j));
  args.accumulate = {0, 1, 0};
  AlignedPtr scratch = aligned_allocate(tuned->scratch_bytes(2));
  args.scratch = scratch.get();
  StepContext ctx;
  ctx.num_threads = 2;
  tuned->run(args, ctx);
  for (int64_t j = 0; j < 70; ++j)
    EXPECT_EQ(args.outputs[1].item(j),
              static_cast<float>(0.25 * static_cast<double>(j)) + static_cast<float>(fresh[1].item(j)))  // f32 sum
        << j;
  EXPECT_EQ(std::memcmp(args.outputs[0].data(), fresh[0].data(), fresh[0].nbytes()), 0);
  args.accumulate = {1, 0, 0};
  EXPECT_THROW(tuned->run(args, ctx), Error);
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

struct AttentionCase {
  int64_t B = 2, H = 2, T = 3, S = 3, D = 8;
  int64_t K = 0;  // key/value heads (grouped-query attention); 0: H
  bool mask = false;
  bool causal = false;
  int64_t window = 0;  // sliding window (causal only); 0: none
  double dropout = 0.0;
  int threads = 1;
  bool dead_row = false;   // batch 0's mask is −inf everywhere: no query there sees a key
  bool seq_major = false;  // q, k, v, out (B, T|S, H, D) instead of (B, H, T|S, D)
  bool head_mask = false;  // the mask is a key bias per head (B, H, S), as ALiBi's, rather than (B, S)
  double softcap = 0.0;    // scores softcap·tanh(scores / softcap) before the mask (Gemma 2); 0: none
  int64_t packed = 0;      // > 0 (causal, T = S): examples of 1 to `packed` tokens packed in each row (key_begin)
  DType dtype = DType::f32;  // of q, k, v (bf16: mixed precision)
  int score_bias = 0;  // a differentiated score bias: 0 none, 1 (1, H, T, S) broadcast over the batch, 2 (B, H, T, S)

  std::string label() const {
    return "Attention B=" + std::to_string(B) + " H=" + std::to_string(H) + " T=" + std::to_string(T) +
           " S=" + std::to_string(S) + " D=" + std::to_string(D) + (mask ? " mask" : "") + (causal ? " causal" : "") +
           " window=" + std::to_string(window) + " dropout=" + std::to_string(dropout) + " threads=" + std::to_string(threads) +
           (dead_row ? " dead-row" : "") + (seq_major ? " seq-major" : "") + (head_mask ? " head-mask" : "") +
           " K=" + std::to_string(kv_heads()) + " softcap=" + std::to_string(softcap) +
           " packed=" + std::to_string(packed) + " score_bias=" + std::to_string(score_bias) + " " + dtype_name(dtype);
  }
  Shape bias_shape() const { return Shape{score_bias == 2 ? B : 1, H, T, S}; }
  Shape mask_shape() const { return head_mask ? Shape{B, H, S} : Shape{B, S}; }
  int64_t kv_heads() const { return K > 0 ? K : H; }
  Shape q_shape() const { return seq_major ? Shape{B, T, H, D} : Shape{B, H, T, D}; }
  Shape kv_shape() const { return seq_major ? Shape{B, S, kv_heads(), D} : Shape{B, kv_heads(), S, D}; }
  ir::Attrs attrs() const {
    return {{"scale", 1.0 / std::sqrt(static_cast<double>(D))}, {"causal", int64_t{causal}}, {"dropout_p", dropout},
            {"seed", int64_t{11}}, {"seq_major", int64_t{seq_major}}, {"window", window}, {"softcap", softcap},
            {"score_bias", int64_t{score_bias > 0}}};
  }
};

// q, k, v uniform in [-2, 2) (sharper softmax than [-1, 1)); mask 0 or −3 per key,
// −inf for batch 0 when dead_row.
std::vector<Tensor> attention_inputs(const AttentionCase& c, std::mt19937& rng) {
  std::vector<Tensor> in;
  for (Shape s : {c.q_shape(), c.kv_shape(), c.kv_shape()}) {
    Tensor t = random_tensor(s, c.dtype, rng);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, 2.0 * t.item(i));  // exact in bf16 too
    in.push_back(t);
  }
  if (c.score_bias) {
    // In [-2, 2), a fifth of it the lowest float: T5's relative bias with its mask folded in. Never on a query's
    // diagonal key (s = t + S − T): a row whose visible scores were all the lowest float would be a tie in f32
    // (the scores vanish beside it) but not in the reference's doubles.
    Tensor bias = random_tensor(c.bias_shape(), DType::f32, rng);
    std::bernoulli_distribution hidden(0.2);
    for (int64_t i = 0; i < bias.numel(); ++i) {
      const int64_t t = i / c.S % c.T, s = i % c.S;
      const bool hide = hidden(rng) && s != t + c.S - c.T;
      bias.set_item(i, hide ? double(std::numeric_limits<float>::lowest()) : 2.0 * bias.item(i));
    }
    in.push_back(bias);
  }
  if (c.mask) {
    Tensor m = Tensor::zeros(c.mask_shape(), DType::f32);
    std::bernoulli_distribution masked(0.3);
    for (int64_t i = 0; i < m.numel(); ++i) m.set_item(i, masked(rng) ? -3.0 : 0.0);
    if (c.head_mask)  // ALiBi's form: slope_h · key position, slope 2^-(h + 1), on top of the padding
      for (int64_t i = 0; i < m.numel(); ++i)
        m.set_item(i, m.item(i) + std::ldexp(1.0, -int((i / c.S) % c.H) - 1) * double(i % c.S));
    if (c.dead_row)
      for (int64_t s = 0; s < c.S; ++s) m.set_item(s, -kInf);
    in.push_back(m);
  }
  if (c.packed > 0) {  // key_begin (B, T): each row cut into examples of random lengths in [1, packed]
    Tensor begin = Tensor::zeros(Shape{c.B, c.T}, DType::i64);
    std::uniform_int_distribution<int64_t> length(1, c.packed);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t start = 0; start < c.T;) {
        const int64_t end = std::min(c.T, start + length(rng));
        for (int64_t t = start; t < end; ++t) begin.data_as<int64_t>()[b * c.T + t] = start;
        start = end;
      }
    in.push_back(begin);
  }
  return in;
}

// Forward and backward of one case, tuned against reference. The backward nodes read
// the reference forward's out and lse, as they would after a reference forward pass.
// `tolerance` bounds the scaled error of out, lse (half of it) and the gradients (twice it).
void check_attention(const AttentionCase& c, std::mt19937& rng, double tolerance = 1e-5) {
  const std::string label = c.label();
  const uint64_t rng_offset = 7;
  ir::Graph g;
  ir::GraphBuilder builder(g, 11);
  ValueId q = builder.input("q", c.q_shape(), c.dtype);
  ValueId k = builder.input("k", c.kv_shape(), c.dtype);
  ValueId v = builder.input("v", c.kv_shape(), c.dtype);
  ValueId bias = c.score_bias ? builder.input("bias", c.bias_shape()) : ir::kNone;
  ValueId mask = c.mask ? builder.input("mask", c.mask_shape()) : ir::kNone;
  ValueId key_begin = c.packed > 0 ? builder.input("key_begin", Shape{c.B, c.T}, DType::i64) : ir::kNone;
  std::vector<ValueId> forward_inputs{q, k, v};
  if (c.score_bias) forward_inputs.push_back(bias);
  if (c.mask) forward_inputs.push_back(mask);
  if (c.packed > 0) forward_inputs.push_back(key_begin);
  g.add_node(OpKind::Attention, forward_inputs, c.attrs());
  const ir::Node forward = g.nodes().back();
  ValueId dout = builder.input("dout", c.q_shape());
  ValueId out = builder.input("out", c.q_shape());
  ValueId lse = builder.input("lse", Shape{c.B, c.H, c.T});
  std::vector<ValueId> backward_inputs{dout, q, k, v, out, lse};
  if (c.score_bias) backward_inputs.push_back(bias);
  if (c.mask) backward_inputs.push_back(mask);
  if (c.packed > 0) backward_inputs.push_back(key_begin);
  g.add_node(OpKind::AttentionBackward, backward_inputs, forward.attrs);
  const ir::Node backward = g.nodes().back();

  std::vector<Tensor> inputs = attention_inputs(c, rng);
  std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, forward));
  ASSERT_NE(tuned, nullptr) << label;
  std::unique_ptr<Kernel> reference = make_ref_kernel(compile::lower(g, forward));
  std::vector<Tensor> got = run_kernel(*tuned, g, forward, inputs, c.threads, rng_offset);
  std::vector<Tensor> want = run_kernel(*reference, g, forward, inputs, 1, rng_offset);
  EXPECT_LE(scaled_max_error(got[0], want[0]), tolerance) << label << " out";
  EXPECT_LE(scaled_max_error(got[1], want[1]), tolerance / 2) << label << " lse";
  if (c.dead_row) {
    for (int64_t i = 0; i < c.H * c.T * c.D; ++i) ASSERT_EQ(got[0].item(i), 0.0) << label;
    for (int64_t i = 0; i < c.H * c.T; ++i) ASSERT_EQ(got[1].item(i), 0.0) << label;
  }

  std::vector<Tensor> backward_in{
      random_tensor(c.q_shape(), DType::f32, rng), inputs[0], inputs[1], inputs[2], want[0], want[1]};
  for (size_t i = 3; i < inputs.size(); ++i) backward_in.push_back(inputs[i]);  // the bias, mask, key_begin
  std::unique_ptr<Kernel> tuned_backward = make_cpu_dense_kernel(compile::lower(g, backward));
  ASSERT_NE(tuned_backward, nullptr) << label;
  EXPECT_FALSE(tuned_backward->accumulates());
  std::unique_ptr<Kernel> reference_backward = make_ref_kernel(compile::lower(g, backward));
  std::vector<Tensor> grads = run_kernel(*tuned_backward, g, backward, backward_in, c.threads, rng_offset);
  std::vector<Tensor> want_grads = run_kernel(*reference_backward, g, backward, backward_in, 1, rng_offset);
  const char* names[] = {" dq", " dk", " dv", " dbias"};
  ASSERT_EQ(grads.size(), c.score_bias ? 4u : 3u) << label;
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_LE(scaled_max_error(grads[i], want_grads[i]), 2 * tolerance) << label << names[i];
}

// T, S in {1, 3, 17, 129}, D in {8, 64}, with and without mask, causal where T <= S,
// dropout 0 and 0.1, on the given thread count.
void check_attention_grid(int threads, std::mt19937& rng) {
  for (int64_t T : kSizes)
    for (int64_t S : kSizes)
      for (int64_t D : {8, 64})
        for (bool mask : {false, true})
          for (bool causal : {false, true})
            for (double dropout : {0.0, 0.1}) {
              if (causal && T > S) continue;
              AttentionCase c;
              c.T = T, c.S = S, c.D = D, c.mask = mask, c.causal = causal, c.dropout = dropout, c.threads = threads;
              check_attention(c, rng);
            }
}

// A key bias per head (B, H, S), ALiBi's form, in every layout: direct and seq-major, grouped key/value heads,
// causal or not, on one and two threads.
TEST(CpuDenseKernels, AttentionPerHeadKeyBias) {
  std::mt19937 rng(17);
  for (int threads : {1, 2})
    for (bool seq_major : {false, true})
      for (int64_t K : {0, 2})
        for (bool causal : {false, true})
          for (int64_t T : {3, 17, 129}) {
            AttentionCase c;
            c.H = 4, c.K = K, c.T = T, c.S = T, c.D = 24, c.mask = true, c.head_mask = true, c.causal = causal;
            c.seq_major = seq_major, c.threads = threads;
            check_attention(c, rng);
          }
}

// A differentiated score bias (T5's relative positions, the mask folded in as the lowest float), broadcast over the
// batch or not, with a padding mask, in every layout: direct and seq-major, grouped key/value heads, causal or not,
// queries fewer than keys (cross-attention), dropout, one and two threads, f32 and bf16 operands.
TEST(CpuDenseKernels, AttentionScoreBias) {
  std::mt19937 rng(23);
  for (int threads : {1, 2})
    for (bool seq_major : {false, true})
      for (int64_t K : {0, 2})
        for (bool causal : {false, true})
          for (int64_t T : {3, 17, 129})
            for (int score_bias : {1, 2}) {
              AttentionCase c;
              c.H = 4, c.K = K, c.T = T, c.S = causal ? T : T + 40, c.D = 24, c.causal = causal;
              c.seq_major = seq_major, c.threads = threads, c.score_bias = score_bias, c.mask = T != 17;
              c.dropout = T == 17 ? 0.1 : 0.0;
              check_attention(c, rng);
            }
  // bf16 operands: with AVX512-BF16 the tiles' bf16 products round P, dS and dO (AttentionBf16Operands' bound).
  const bool pairs = cpu_basic::use_avx512() && cpu_features().avx512_bf16;
  for (int64_t T : {17, 129}) {
    AttentionCase c;
    c.H = 4, c.T = T, c.S = T, c.D = 64, c.score_bias = 2, c.mask = true, c.dtype = DType::bf16, c.threads = 2;
    check_attention(c, rng, pairs ? 1e-2 : 1e-5);
  }
}

// Logit soft-capping (Gemma 2) with a cap of 1.5, where tanh bends every score (q, k in [-2, 2), D 24: scores up to
// about 4): the AVX-512, AVX2 and portable tile ops, direct and seq-major with grouped heads, causal with and
// without a sliding window, dropout, one and two threads.
TEST(CpuDenseKernels, AttentionSoftCap) {
  std::mt19937 rng(19);
  for (int path = 0; path < 3; ++path) {
    ScopedPathCap cap(path == 1 ? cpu_basic::CpuPath::avx2 : cpu_basic::CpuPath::avx512);
    ScopedPortable portable(path == 2);
    for (int threads : {1, 2})
      for (bool seq_major : {false, true})
        for (int64_t window : {int64_t{0}, int64_t{5}})
          for (double dropout : {0.0, 0.1}) {
            AttentionCase c;
            c.H = 4, c.K = seq_major ? 2 : 0, c.T = 37, c.S = 37, c.D = 24, c.mask = true, c.causal = true;
            c.window = window, c.dropout = dropout, c.seq_major = seq_major, c.threads = threads, c.softcap = 1.5;
            SCOPED_TRACE(path == 0 ? "avx512" : path == 1 ? "avx2" : "portable");
            check_attention(c, rng);
          }
  }
}

TEST(CpuDenseKernels, AttentionOneThread) {
  std::mt19937 rng(6);
  check_attention_grid(1, rng);
}

TEST(CpuDenseKernels, AttentionTwoThreads) {
  std::mt19937 rng(7);
  check_attention_grid(2, rng);
}

// The grid a forced path runs: T in {1, 17, 129}, S in {3, 129}, D 64, masked, causal or not, dropout 0 and 0.1.
void check_attention_path_grid(int threads, std::mt19937& rng) {
  for (int64_t T : {1, 17, 129})
    for (int64_t S : {3, 129})
      for (bool causal : {false, true})
        for (double dropout : {0.0, 0.1}) {
          if (causal && T > S) continue;
          AttentionCase c;
          c.T = T, c.S = S, c.D = 64, c.mask = true, c.causal = causal, c.dropout = dropout, c.threads = threads;
          check_attention(c, rng);
        }
}

TEST(CpuDenseKernels, AttentionPortablePath) {
  ScopedPortable portable(true);
  std::mt19937 rng(8);
  check_attention_path_grid(2, rng);
}

// Fewer (b, h) pairs than threads: backward splits keys and sums private dq partials.
TEST(CpuDenseKernels, AttentionFewHeadsManyThreads) {
  std::mt19937 rng(9);
  for (int threads : {2, 3, 4})
    for (bool causal : {false, true})
      for (double dropout : {0.0, 0.1}) {
        AttentionCase c;
        c.B = 1, c.H = 1, c.T = 129, c.S = 200, c.D = 64, c.causal = causal, c.dropout = dropout;
        c.threads = threads;
        check_attention(c, rng);
      }
}

TEST(CpuDenseKernels, AttentionOddHeadSizes) {
  std::mt19937 rng(12);
  for (int64_t D : {1, 5, 80, 128})
    for (bool portable : {false, true}) {
      ScopedPortable path(portable);
      AttentionCase c;
      c.T = 33, c.S = 70, c.D = D, c.mask = true, c.causal = true, c.dropout = 0.1, c.threads = 2;
      check_attention(c, rng);
    }
}

TEST(CpuDenseKernels, AttentionRowWithoutKeys) {
  std::mt19937 rng(10);
  for (int threads : {1, 2})
    for (bool causal : {false, true}) {
      AttentionCase c;
      c.T = 17, c.S = 70, c.D = 8, c.mask = true, c.dead_row = true, c.causal = causal, c.threads = threads;
      check_attention(c, rng);
    }
}

// Projections' own layout, (B, T, H, D): tuned against reference over the cases that
// exercise different code paths (partial tiles, masks, causal, dropout, split keys).
TEST(CpuDenseKernels, AttentionSeqMajor) {
  std::mt19937 rng(13);
  for (int threads : {1, 2})
    for (int64_t T : {1, 17, 129})
      for (bool causal : {false, true})
        for (double dropout : {0.0, 0.1}) {
          AttentionCase c;
          c.seq_major = true, c.B = 2, c.H = 3, c.T = T, c.S = causal ? T + 5 : 70, c.D = 8, c.mask = true;
          c.causal = causal, c.dropout = dropout, c.threads = threads;
          check_attention(c, rng);
        }
  AttentionCase few;  // one (b, h) on three threads: a single task
  few.seq_major = true, few.B = 1, few.H = 1, few.T = 129, few.S = 200, few.D = 64, few.dropout = 0.1, few.threads = 3;
  check_attention(few, rng);
  // Nine heads of one batch element, gathered and scattered group by group: 5 + 4 heads on
  // two threads (both kept busy); on one thread, backward's packing budget makes it 7 + 2.
  for (int threads : {1, 2}) {
    AttentionCase groups;
    groups.seq_major = true, groups.B = 1, groups.H = 9, groups.T = 129, groups.S = 129, groups.D = 64;
    groups.mask = true, groups.causal = true, groups.dropout = 0.1, groups.threads = threads;
    check_attention(groups, rng);
  }
}

// Grouped-query attention: K key/value heads each serving H / K query heads, in both layouts, on one
// and two threads, where the head groups split differently (whole key/value groups per task).
TEST(CpuDenseKernels, AttentionGroupedQuery) {
  std::mt19937 rng(15);
  for (bool seq_major : {false, true})
    for (int threads : {1, 2})
      for (auto [H, K] : {std::pair<int64_t, int64_t>{6, 2}, {4, 1}, {12, 4}})
        for (bool causal : {false, true}) {
          AttentionCase c;
          c.seq_major = seq_major, c.B = 2, c.H = H, c.K = K, c.T = 37, c.S = causal ? 37 : 70, c.D = 24;
          c.mask = true, c.causal = causal, c.dropout = causal ? 0.1 : 0.0, c.threads = threads;
          check_attention(c, rng);
        }
  // A group budget that splits the query heads: T = S = 600, D = 64, 12 query heads on 3 key/value heads.
  AttentionCase big;
  big.seq_major = true, big.B = 1, big.H = 12, big.K = 3, big.T = 600, big.S = 600, big.D = 64, big.causal = true;
  big.threads = 2;
  check_attention(big, rng);
}

// Sliding windows: tiles the window's edge crosses, query blocks starting past key 0, key blocks whose
// query loop ends early; windows of 1 (each query sees itself), shorter and longer than a tile, and T < S
// (the query rows are the last of the keys'), in both layouts, with grouped-query heads, a key mask and dropout.
TEST(CpuDenseKernels, AttentionSlidingWindow) {
  std::mt19937 rng(16);
  for (bool portable : {false, true}) {
    ScopedPortable path(portable);
    for (int threads : {1, 2})
      for (auto [T, S] : {std::pair<int64_t, int64_t>{150, 150}, {70, 200}, {5, 5}})
        for (int64_t window : {1, 7, 64, 90}) {
          if (window >= S) continue;
          AttentionCase c;
          c.B = 2, c.H = 4, c.K = window == 7 ? 2 : 0, c.T = T, c.S = S, c.D = 16, c.causal = true;
          c.window = window, c.mask = true, c.dropout = window == 64 ? 0.1 : 0.0, c.threads = threads;
          c.seq_major = window == 90;
          check_attention(c, rng);
        }
  }
  // One (b, h) on two threads: backward splits the key blocks into chunks with private dq partials.
  AttentionCase few;
  few.B = 1, few.H = 1, few.T = 300, few.S = 300, few.D = 8, few.causal = true, few.window = 100, few.threads = 2;
  check_attention(few, rng);
}

// Packed sequences (key_begin): examples from 1 token to longer than a tile, boundaries inside tiles and on their
// edges, with a key mask, sliding windows, dropout, grouped-query heads, both layouts, the AVX-512 (or AVX2) and
// portable tile ops, one and two threads; and one (b, h) on two threads (backward's key-block chunks).
TEST(CpuDenseKernels, AttentionPackedSequences) {
  std::mt19937 rng(23);
  for (bool portable : {false, true}) {
    ScopedPortable path(portable);
    for (int threads : {1, 2})
      for (int64_t packed : {1, 5, 40, 150})
        for (bool seq_major : {false, true}) {
          AttentionCase c;
          c.B = 2, c.H = 4, c.K = seq_major ? 2 : 0, c.T = 200, c.S = 200, c.D = 16, c.causal = true;
          c.packed = packed, c.seq_major = seq_major, c.threads = threads, c.mask = packed == 40;
          c.window = packed == 150 ? 30 : 0, c.dropout = packed == 5 ? 0.1 : 0.0;
          check_attention(c, rng);
        }
  }
  AttentionCase few;
  few.B = 1, few.H = 1, few.T = 300, few.S = 300, few.D = 8, few.causal = true, few.packed = 120, few.threads = 2;
  check_attention(few, rng);
}

// A key_begin that decreases along a row, or points past its query, is refused by both kernels, naming it.
TEST(CpuDenseKernels, AttentionRefusesBadKeyBegin) {
  std::mt19937 rng(24);
  AttentionCase c;
  c.B = 1, c.H = 1, c.T = 4, c.S = 4, c.causal = true, c.packed = 2;
  ir::Graph g;
  ir::GraphBuilder builder(g, 11);
  builder.attention(builder.input("q", c.q_shape()), builder.input("k", c.kv_shape()), builder.input("v", c.kv_shape()),
                    ir::kNone, 0.5, true, 0.0, DType::f32, 0, 0.0, builder.input("key_begin", Shape{1, 4}, DType::i64));
  const ir::Node node = g.nodes().back();
  std::vector<Tensor> inputs = attention_inputs(c, rng);
  for (auto [values, message] : {std::pair<std::vector<int64_t>, std::string>{{0, 0, 2, 1}, "must not decrease"},
                                 {{0, 2, 2, 2}, "key_begin[0, 1] is 2; expected a key in [0, 1]"}}) {
    std::copy(values.begin(), values.end(), inputs[3].data_as<int64_t>());
    for (bool reference : {false, true}) {
      std::unique_ptr<Kernel> kernel =
          reference ? make_ref_kernel(compile::lower(g, node)) : make_cpu_dense_kernel(compile::lower(g, node));
      try {
        run_kernel(*kernel, g, node, inputs, 1);
        ADD_FAILURE() << "key_begin " << values[1] << values[2] << values[3] << " was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      }
    }
  }
}

// The AVX2 tile ops, which CPUs without AVX-512 take (capped to them here, so a CPU with AVX-512 runs them too):
// partial tiles in every dimension (head sizes 5, 24, 64, 80), key masks, causal, dropout, a row with no key,
// sliding windows, grouped-query heads, both layouts, one and two threads.
TEST(CpuDenseKernels, AttentionAvx2Path) {
  if (!cpu_features().avx2 || !cpu_features().fma) GTEST_SKIP() << "no AVX2 + FMA";
  ScopedPathCap cap(cpu_basic::CpuPath::avx2);
  std::mt19937 rng(17);
  for (int threads : {1, 2}) check_attention_path_grid(threads, rng);
  for (int64_t D : {5, 80}) {
    AttentionCase c;
    c.T = 33, c.S = 70, c.D = D, c.mask = true, c.causal = true, c.dropout = 0.1, c.threads = 2;
    check_attention(c, rng);
  }
  AttentionCase dead;
  dead.T = 17, dead.S = 70, dead.D = 8, dead.mask = true, dead.dead_row = true, dead.threads = 2;
  check_attention(dead, rng);
  AttentionCase biased;
  biased.T = 33, biased.S = 70, biased.D = 24, biased.score_bias = 1, biased.mask = true, biased.threads = 2;
  check_attention(biased, rng);
  for (bool seq_major : {false, true}) {
    AttentionCase c;
    c.seq_major = seq_major, c.B = 2, c.H = 6, c.K = 2, c.T = 150, c.S = 150, c.D = 24, c.mask = true;
    c.causal = true, c.window = seq_major ? 0 : 40, c.threads = 2;
    check_attention(c, rng);
  }
}

// bf16 q, k, v (mixed precision). With AVX512-BF16 the tiles multiply bf16 pairs, rounding the probabilities, dS
// and the f32 dO to bf16 (2^-9 relative each) where the reference keeps them f32: the results may differ by those
// roundings summed over up to S keys or T queries, within 1e-2 of the largest value on outputs and 2e-2 on gradients
// (measured: at most 5.3e-3), while a misplaced pair would be off by O(1); and they must differ from the f32 tiles'
// 1e-6 (the bf16 products ran). Without AVX512-BF16 the tiles widen q, k, v exactly and the f32 bound holds. Odd
// head sizes pad a pair; partial tiles, masks, causal, dropout, windows, grouped-query heads, both layouts, one and
// two threads.
TEST(CpuDenseKernels, AttentionBf16Operands) {
  const bool pairs = cpu_basic::use_avx512() && cpu_features().avx512_bf16;
  const double tolerance = pairs ? 1e-2 : 1e-5;
  std::mt19937 rng(23);
  for (int threads : {1, 2})
    for (int64_t D : {5, 8, 64, 80})
      for (int64_t T : {1, 17, 129})
        for (bool seq_major : {false, true}) {
          AttentionCase c;
          c.dtype = DType::bf16, c.T = T, c.S = T == 1 ? 70 : T, c.D = D, c.mask = D != 64, c.causal = T > 1;
          c.dropout = D == 8 ? 0.1 : 0.0, c.seq_major = seq_major, c.threads = threads;
          c.window = D == 80 && !seq_major && c.causal ? 40 : 0;
          c.H = 4, c.K = D == 5 ? 2 : 4;
          check_attention(c, rng, tolerance);
        }
  // The bf16 products must be in use where the CPU has them: their rounding shows against the reference.
  AttentionCase c;
  c.dtype = DType::bf16, c.T = 129, c.S = 129, c.D = 64, c.causal = true, c.threads = 2;
  ir::Graph g;
  ir::GraphBuilder builder(g, 11);
  const ValueId q = builder.input("q", c.q_shape(), c.dtype), k = builder.input("k", c.kv_shape(), c.dtype),
                v = builder.input("v", c.kv_shape(), c.dtype);
  g.add_node(OpKind::Attention, {q, k, v}, c.attrs());
  const ir::Node& node = g.nodes().back();
  const std::vector<Tensor> inputs = attention_inputs(c, rng);
  std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, node));
  std::unique_ptr<Kernel> reference = make_ref_kernel(compile::lower(g, node));
  const double largest =
      scaled_max_error(run_kernel(*tuned, g, node, inputs, 2, 7)[0], run_kernel(*reference, g, node, inputs, 1, 7)[0]);
  if (pairs)
    EXPECT_GT(largest, 1e-5) << "bf16 tiles: the probabilities' rounding to bf16 is not visible";
  else
    EXPECT_LE(largest, 1e-5);
}

// A bf16 out (out_dtype) is the f32 out rounded to nearest even, bit for bit, and lse is unchanged: both layouts,
// head sizes that are and are not whole vectors (the copies in and out of the heads' scratch take different routes),
// one and two threads.
TEST(CpuDenseKernels, AttentionBf16OutputIsTheF32OutputRounded) {
  std::mt19937 rng(24);
  for (int threads : {1, 2})
    for (int64_t D : {24, 64})
      for (bool seq_major : {false, true}) {
        AttentionCase c;
        c.dtype = DType::bf16, c.B = 2, c.H = 3, c.T = 37, c.S = 37, c.D = D, c.mask = true, c.causal = true;
        c.seq_major = seq_major, c.threads = threads;
        SCOPED_TRACE(c.label());
        const std::vector<Tensor> inputs = attention_inputs(c, rng);
        std::vector<Tensor> results[2];
        for (DType out : {DType::f32, DType::bf16}) {
          ir::Graph g;
          ir::GraphBuilder builder(g);
          const ValueId q = builder.input("q", c.q_shape(), c.dtype), k = builder.input("k", c.kv_shape(), c.dtype),
                        v = builder.input("v", c.kv_shape(), c.dtype), mask = builder.input("mask", c.mask_shape());
          ir::Attrs attrs = c.attrs();
          attrs.set("out_dtype", std::string(dtype_name(out)));
          g.add_node(OpKind::Attention, {q, k, v, mask}, attrs);
          const ir::Node& node = g.nodes().back();
          std::unique_ptr<Kernel> tuned = make_cpu_dense_kernel(compile::lower(g, node));
          ASSERT_TRUE(tuned != nullptr);
          results[out == DType::bf16] = run_kernel(*tuned, g, node, inputs, threads, 7);
        }
        expect_rounded_to_bf16(results[0][0], results[1][0]);
        EXPECT_EQ(std::memcmp(results[0][1].data(), results[1][1].data(), results[0][1].nbytes()), 0) << "lse";
      }
}

// (B, H, T, D) <-> (B, T, H, D).
Tensor swap_axes_1_2(const Tensor& x) {
  const Shape& s = x.shape();
  Tensor y = Tensor::zeros(Shape{s[0], s[2], s[1], s[3]}, DType::f32);
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t b = 0; b < s[1]; ++b)
      for (int64_t c = 0; c < s[2]; ++c)
        for (int64_t d = 0; d < s[3]; ++d)
          y.set_item(((a * s[2] + c) * s[1] + b) * s[3] + d, x.item(((a * s[1] + b) * s[2] + c) * s[3] + d));
  return y;
}

// The layouts differ only in addresses: seq-major results are the transposed head-major
// ones bit for bit (dropout masks included), forward and backward.
TEST(CpuDenseKernels, AttentionSeqMajorIsTransposedHeadMajor) {
  std::mt19937 rng(14);
  for (int threads : {1, 2}) {
    AttentionCase heads;
    heads.B = 2, heads.H = 3, heads.T = 40, heads.S = 40, heads.D = 16, heads.mask = true, heads.causal = true;
    heads.dropout = 0.1, heads.threads = threads;
    AttentionCase seq = heads;
    seq.seq_major = true;
    std::vector<Tensor> in = attention_inputs(heads, rng);
    Tensor dout = random_tensor(heads.q_shape(), DType::f32, rng);
    std::vector<Tensor> results[2];
    for (const AttentionCase* c : {&heads, &seq}) {
      const bool transpose = c->seq_major;
      auto layout = [&](const Tensor& t) { return transpose ? swap_axes_1_2(t) : t; };
      ir::Graph g;
      ir::GraphBuilder builder(g);
      ValueId q = builder.input("q", c->q_shape()), k = builder.input("k", c->kv_shape());
      ValueId v = builder.input("v", c->kv_shape()), mask = builder.input("mask", Shape{c->B, c->S});
      g.add_node(OpKind::Attention, {q, k, v, mask}, c->attrs());
      const ir::Node forward = g.nodes().back();
      std::unique_ptr<Kernel> fwd = make_cpu_dense_kernel(compile::lower(g, forward));
      std::vector<Tensor> out = run_kernel(*fwd, g, forward, {layout(in[0]), layout(in[1]), layout(in[2]), in[3]},
                                           threads, 5);
      g.add_node(OpKind::AttentionBackward,
                 {builder.input("dout", c->q_shape()), q, k, v, builder.input("out", c->q_shape()),
                  builder.input("lse", Shape{c->B, c->H, c->T}), mask},
                 c->attrs());
      const ir::Node backward = g.nodes().back();
      std::unique_ptr<Kernel> bwd = make_cpu_dense_kernel(compile::lower(g, backward));
      std::vector<Tensor> grads = run_kernel(
          *bwd, g, backward, {layout(dout), layout(in[0]), layout(in[1]), layout(in[2]), out[0], out[1], in[3]},
          threads, 5);
      for (Tensor* t : {&out[0], &grads[0], &grads[1], &grads[2]}) *t = layout(*t);  // back to (B, H, T, D)
      results[transpose] = {out[0], out[1], grads[0], grads[1], grads[2]};
    }
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    for (int r = 0; r < 5; ++r)
      for (int64_t i = 0; i < results[0][r].numel(); ++i)
        ASSERT_EQ(results[0][r].item(i), results[1][r].item(i)) << names[r] << " element " << i << " threads " << threads;
  }
}

TEST(CpuDenseKernels, AttentionBackwardIsDeterministic) {
  std::mt19937 rng(11);
  ir::Graph g;
  ir::GraphBuilder builder(g);
  const Shape q_shape{1, 1, 100, 16}, kv_shape{1, 1, 300, 16};
  std::vector<ValueId> in{builder.input("dout", q_shape), builder.input("q", q_shape),
                          builder.input("k", kv_shape),   builder.input("v", kv_shape),
                          builder.input("out", q_shape),  builder.input("lse", Shape{1, 1, 100})};
  g.add_node(OpKind::AttentionBackward, in, {{"scale", 0.25}, {"causal", int64_t{0}}, {"dropout_p", 0.0}});
  const ir::Node& node = g.nodes().back();
  std::vector<Tensor> inputs;
  for (ValueId v : node.inputs) inputs.push_back(random_tensor(g.value(v).shape, DType::f32, rng));
  std::unique_ptr<Kernel> kernel = make_cpu_dense_kernel(compile::lower(g, node));
  std::vector<Tensor> first = run_kernel(*kernel, g, node, inputs, 4);
  for (int repeat = 0; repeat < 3; ++repeat) {
    std::vector<Tensor> again = run_kernel(*kernel, g, node, inputs, 4);
    for (size_t i = 0; i < first.size(); ++i)
      ASSERT_EQ(std::memcmp(first[i].data(), again[i].data(), first[i].nbytes()), 0) << "output " << i;
  }
}

}  // namespace
}  // namespace fusetrain::kernels
