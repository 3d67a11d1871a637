// fusetrain's LayerNorm, GELU and softmax kernels (forward and backward) against
// oneDNN 2.6 primitives on the same data, 2 threads, reporting bytes moved per
// second (every input read once, every output written once).
// Shapes: LayerNorm and GELU on (B·T, C) = (16·128, 768); softmax on attention
// scores (B·H·T, S) = (16·12·128, 128).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <dnnl.hpp>
#include <random>
#include <vector>

#include "fusetrain/fusetrain.h"
#include "fusetrain/compile/lower.h"
#include "fusetrain/kernels/device.h"

namespace {

namespace ft = fusetrain;
using ft::ir::OpKind;
using ft::ir::ValueId;

constexpr int kThreads = 2;
constexpr int64_t kRows = 16 * 128, kC = 768;
constexpr int64_t kSoftmaxRows = 16 * 12 * 128, kSoftmaxC = 128;

void fill_random(ft::Tensor& t, float low, float high, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(low, high);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
}

// A single node with owned input/output tensors and its tuned kernel.
struct OneNode {
  ft::ir::Graph graph;
  ft::kernels::KernelArgs args;
  std::unique_ptr<ft::kernels::Kernel> kernel;
  std::vector<char> scratch;

  void finish(ft::ir::NodeId id) {
    const ft::ir::Node& node = graph.node(id);
    for (ValueId v : node.inputs) {
      args.inputs.push_back(ft::Tensor::zeros(graph.value(v).shape, graph.value(v).dtype));
      if (graph.value(v).dtype == ft::DType::f32) fill_random(args.inputs.back(), -2, 2, 7 + v);
    }
    for (ValueId v : node.outputs) {
      args.outputs.push_back(ft::Tensor::zeros(graph.value(v).shape, graph.value(v).dtype));
      args.accumulate.push_back(0);
    }
    kernel = ft::kernels::cpu_device().make_kernel(ft::compile::lower(graph, node));
    scratch.resize(kernel->scratch_bytes(kThreads) + 64);
    args.scratch = scratch.data();
  }
  void run() {
    ft::kernels::StepContext ctx;
    ctx.num_threads = kThreads;
    kernel->run(args, ctx);
  }
  double bytes() const {
    double b = 0;
    for (const ft::Tensor& t : args.inputs) b += t.nbytes();
    for (const ft::Tensor& t : args.outputs) b += t.nbytes();
    return b;
  }
};

void report(benchmark::State& state, double bytes) {
  state.counters["bytes/s"] = benchmark::Counter(bytes * double(state.iterations()), benchmark::Counter::kIsRate);
}

// ---- fusetrain ----

void BM_fusetrain_layernorm_forward(benchmark::State& state) {
  OneNode n;
  ft::ir::GraphBuilder b(n.graph);
  b.layer_norm(b.input("x", {kRows, kC}), b.param("g", {kC}), b.param("b", {kC}));
  n.finish(0);
  for (auto _ : state) n.run();
  report(state, n.bytes());
}

void BM_fusetrain_layernorm_backward(benchmark::State& state) {
  OneNode n;
  ValueId dy = n.graph.add_input("dy", {kRows, kC}, ft::DType::f32);
  ValueId x = n.graph.add_input("x", {kRows, kC}, ft::DType::f32);
  ValueId g = n.graph.add_input("g", {kC}, ft::DType::f32);
  ValueId mean = n.graph.add_input("mean", {kRows}, ft::DType::f32);
  ValueId rstd = n.graph.add_input("rstd", {kRows}, ft::DType::f32);
  n.graph.add_node(OpKind::LayerNormBackward, {dy, x, g, mean, rstd});
  n.finish(0);
  for (auto _ : state) n.run();
  report(state, n.bytes());
}

void BM_fusetrain_gelu_forward(benchmark::State& state) {
  OneNode n;
  ft::ir::GraphBuilder b(n.graph);
  b.gelu(b.input("x", {kRows, 4 * kC}));
  n.finish(0);
  for (auto _ : state) n.run();
  report(state, n.bytes());
}

void BM_fusetrain_gelu_backward(benchmark::State& state) {
  OneNode n;
  ValueId dy = n.graph.add_input("dy", {kRows, 4 * kC}, ft::DType::f32);
  ValueId x = n.graph.add_input("x", {kRows, 4 * kC}, ft::DType::f32);
  n.graph.add(OpKind::GeluBackward, {dy, x}, {{"approximate", std::string("none")}});
  n.finish(0);
  for (auto _ : state) n.run();
  report(state, n.bytes());
}

void BM_fusetrain_softmax_forward(benchmark::State& state) {
  OneNode n;
  ft::ir::GraphBuilder b(n.graph);
  b.softmax(b.input("x", {kSoftmaxRows, kSoftmaxC}));
  n.finish(0);
  for (auto _ : state) n.run();
  report(state, n.bytes());
}

void BM_fusetrain_softmax_backward(benchmark::State& state) {
  OneNode n;
  ValueId dy = n.graph.add_input("dy", {kSoftmaxRows, kSoftmaxC}, ft::DType::f32);
  ValueId y = n.graph.add_input("y", {kSoftmaxRows, kSoftmaxC}, ft::DType::f32);
  n.graph.add(OpKind::SoftmaxBackward, {dy, y});
  n.finish(0);
  for (auto _ : state) n.run();
  report(state, n.bytes());
}

// ---- oneDNN ----

struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<std::vector<float>> buffers;
  dnnl::memory make(const dnnl::memory::desc& md) {
    buffers.emplace_back(md.get_size() / sizeof(float));
    std::mt19937 rng(buffers.size());
    std::uniform_real_distribution<float> dist(-2, 2);
    for (float& v : buffers.back()) v = dist(rng);
    return dnnl::memory(md, engine, buffers.back().data());
  }
};

dnnl::memory::desc matrix(int64_t rows, int64_t cols) {
  return dnnl::memory::desc({rows, cols}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab);
}
dnnl::memory::desc vector1d(int64_t n) {
  return dnnl::memory::desc({n}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::a);
}

void BM_onednn_layernorm_forward(benchmark::State& state) {
  omp_set_num_threads(kThreads);
  using namespace dnnl;
  Dnnl d;
  auto md = matrix(kRows, kC);
  auto pd = layer_normalization_forward::primitive_desc(
      layer_normalization_forward::desc(prop_kind::forward_training, md, 1e-5f, normalization_flags::use_scale_shift),
      d.engine);
  auto src = d.make(md), dst = d.make(md), ss = d.make(pd.weights_desc()), mean = d.make(pd.mean_desc()),
       var = d.make(pd.variance_desc());
  layer_normalization_forward prim(pd);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src},
                                       {DNNL_ARG_DST, dst},
                                       {DNNL_ARG_SCALE_SHIFT, ss},
                                       {DNNL_ARG_MEAN, mean},
                                       {DNNL_ARG_VARIANCE, var}};
  for (auto _ : state) prim.execute(d.stream, args);
  d.stream.wait();
  report(state, 2.0 * kRows * kC * 4 + 2.0 * kRows * 4 + 2.0 * kC * 4);
}

void BM_onednn_layernorm_backward(benchmark::State& state) {
  omp_set_num_threads(kThreads);
  using namespace dnnl;
  Dnnl d;
  auto md = matrix(kRows, kC);
  auto fwd = layer_normalization_forward::primitive_desc(
      layer_normalization_forward::desc(prop_kind::forward_training, md, 1e-5f, normalization_flags::use_scale_shift),
      d.engine);
  auto pd = layer_normalization_backward::primitive_desc(
      layer_normalization_backward::desc(prop_kind::backward, md, md, 1e-5f, normalization_flags::use_scale_shift),
      d.engine, fwd);
  auto src = d.make(md), diff_dst = d.make(md), diff_src = d.make(md), ss = d.make(pd.weights_desc()),
       diff_ss = d.make(pd.diff_weights_desc()), mean = d.make(pd.mean_desc()), var = d.make(pd.variance_desc());
  for (float& v : d.buffers.back()) v = std::abs(v) + 0.1f;  // variance > 0
  layer_normalization_backward prim(pd);
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, src},        {DNNL_ARG_DIFF_DST, diff_dst},        {DNNL_ARG_DIFF_SRC, diff_src},
      {DNNL_ARG_SCALE_SHIFT, ss}, {DNNL_ARG_DIFF_SCALE_SHIFT, diff_ss}, {DNNL_ARG_MEAN, mean},
      {DNNL_ARG_VARIANCE, var}};
  for (auto _ : state) prim.execute(d.stream, args);
  d.stream.wait();
  report(state, 3.0 * kRows * kC * 4 + 2.0 * kRows * 4 + 3.0 * kC * 4);
}

void eltwise_gelu(benchmark::State& state, bool backward) {
  omp_set_num_threads(kThreads);
  using namespace dnnl;
  Dnnl d;
  auto md = matrix(kRows, 4 * kC);
  auto fwd = eltwise_forward::primitive_desc(
      eltwise_forward::desc(prop_kind::forward_training, algorithm::eltwise_gelu_erf, md, 0.f, 0.f), d.engine);
  auto src = d.make(md), dst = d.make(md), diff = d.make(md), diff_src = d.make(md);
  if (!backward) {
    eltwise_forward prim(fwd);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}};
    for (auto _ : state) prim.execute(d.stream, args);
    report(state, 2.0 * kRows * 4 * kC * 4);
  } else {
    auto pd = eltwise_backward::primitive_desc(eltwise_backward::desc(algorithm::eltwise_gelu_erf, md, md, 0.f, 0.f),
                                               d.engine, fwd);
    eltwise_backward prim(pd);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff}, {DNNL_ARG_DIFF_SRC, diff_src}};
    for (auto _ : state) prim.execute(d.stream, args);
    report(state, 3.0 * kRows * 4 * kC * 4);
  }
  d.stream.wait();
}
void BM_onednn_gelu_forward(benchmark::State& state) { eltwise_gelu(state, false); }
void BM_onednn_gelu_backward(benchmark::State& state) { eltwise_gelu(state, true); }

void softmax(benchmark::State& state, bool backward) {
  omp_set_num_threads(kThreads);
  using namespace dnnl;
  Dnnl d;
  auto md = matrix(kSoftmaxRows, kSoftmaxC);
  auto fwd = softmax_forward::primitive_desc(softmax_forward::desc(prop_kind::forward_training, md, 1), d.engine);
  auto src = d.make(md), dst = d.make(md), diff = d.make(md), diff_src = d.make(md);
  if (!backward) {
    softmax_forward prim(fwd);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}};
    for (auto _ : state) prim.execute(d.stream, args);
    report(state, 2.0 * kSoftmaxRows * kSoftmaxC * 4);
  } else {
    auto pd = softmax_backward::primitive_desc(softmax_backward::desc(md, md, 1), d.engine, fwd);
    softmax_backward prim(pd);
    std::unordered_map<int, memory> args{{DNNL_ARG_DST, dst}, {DNNL_ARG_DIFF_DST, diff}, {DNNL_ARG_DIFF_SRC, diff_src}};
    for (auto _ : state) prim.execute(d.stream, args);
    report(state, 3.0 * kSoftmaxRows * kSoftmaxC * 4);
  }
  d.stream.wait();
}
void BM_onednn_softmax_forward(benchmark::State& state) { softmax(state, false); }
void BM_onednn_softmax_backward(benchmark::State& state) { softmax(state, true); }

}  // namespace

BENCHMARK(BM_fusetrain_layernorm_forward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_onednn_layernorm_forward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fusetrain_layernorm_backward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_onednn_layernorm_backward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fusetrain_gelu_forward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_onednn_gelu_forward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fusetrain_gelu_backward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_onednn_gelu_backward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fusetrain_softmax_forward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_onednn_softmax_forward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fusetrain_softmax_backward)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_onednn_softmax_backward)->UseRealTime()->Unit(benchmark::kMicrosecond);
