// fusetrain's convolution kernels by method (direct loops, im2col + the GEMM) against oneDNN 2.6's convolution
// primitives, f32, 2 threads, on the shapes of the workloads' convolutions: ConvNeXt-Tiny's depthwise 7×7 at its
// four stages (batch 8), Whisper-tiny's two front-end convolutions (batch 2, 3000 frames), Wav2Vec2-base's first
// two feature-extractor convolutions and its grouped positional convolution (batch 2, one second of 16 kHz audio).
// Each shape runs forward (y), backward data (dx) and backward weight (dw), fusetrain's with f32 and with bf16
// operands (what a bf16 run hands them; oneDNN's in f32); the counter is FLOP/s of the
// convolution as defined (2 · B · O · C/group · OH · OW · KH · KW, whichever method). Every tensor is in the
// engine's plain layout (NCHW / NCW, weights OIHW / GOIHW), oneDNN's included: the layouts the engine hands it.
//
//   build: cmake -DFUSETRAIN_BUILD_BENCH=ON ... && ninja -C build bench_conv
//   run:   build/bench_conv --benchmark_min_time=0.3s
#include <benchmark/benchmark.h>
#include <omp.h>

#include <dnnl.hpp>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include "fusetrain/compile/lower.h"
#include "fusetrain/fusetrain.h"
#include "fusetrain/kernels/device.h"
#include "kernels/cpu/dense_kernels.h"

namespace {

namespace ft = fusetrain;
using ft::ir::OpKind;

constexpr int kThreads = 2;

struct ConvShape {
  const char* name;
  std::vector<int64_t> x, w;  // (B, C, [H,] W), (O, C/group, [KH,] KW)
  std::vector<int64_t> strides, pads;
  int64_t group;
};

const std::vector<ConvShape>& shapes() {
  static const std::vector<ConvShape> s = {
      {"convnext_dw7_s1", {8, 96, 56, 56}, {96, 1, 7, 7}, {1, 1}, {3, 3, 3, 3}, 96},
      {"convnext_dw7_s2", {8, 192, 28, 28}, {192, 1, 7, 7}, {1, 1}, {3, 3, 3, 3}, 192},
      {"convnext_dw7_s3", {8, 384, 14, 14}, {384, 1, 7, 7}, {1, 1}, {3, 3, 3, 3}, 384},
      {"convnext_dw7_s4", {8, 768, 7, 7}, {768, 1, 7, 7}, {1, 1}, {3, 3, 3, 3}, 768},
      {"whisper_conv1", {2, 80, 3000}, {384, 80, 3}, {1}, {1, 1}, 1},
      {"whisper_conv2", {2, 384, 3000}, {384, 384, 3}, {2}, {1, 1}, 1},
      {"wav2vec2_conv0", {2, 1, 16000}, {512, 1, 10}, {5}, {0, 0}, 1},
      {"wav2vec2_conv1", {2, 512, 3199}, {512, 512, 3}, {2}, {0, 0}, 1},
      {"wav2vec2_posconv", {2, 768, 49}, {768, 48, 128}, {1}, {64, 64}, 16},
  };
  return s;
}

ft::ops::ConvParams params_of(const ConvShape& s) {
  ft::ops::ConvParams p;
  p.strides = s.strides;
  p.pads = s.pads;
  p.group = s.group;
  return p;
}

double flops(const ConvShape& s) {
  const ft::ops::ConvGeometry g = ft::ops::ConvGeometry::of(params_of(s), s.x, s.w);
  return 2.0 * double(g.B * g.O * g.channels_per_group() * g.OH * g.OW * g.KH * g.KW);
}

void fill(std::vector<float>& v, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& e : v) e = dist(rng);
}

void report(benchmark::State& state, const ConvShape& s) {
  state.counters["FLOPS"] = benchmark::Counter(flops(s) * double(state.iterations()), benchmark::Counter::kIsRate);
}

// ---- fusetrain: one Conv node and its two backward nodes, through the CPU device ----

void bm_fusetrain(benchmark::State& state, const ConvShape& s, OpKind op, ft::kernels::ConvMethod method,
                  ft::DType dtype) {
  ft::ir::Graph graph;
  ft::ir::GraphBuilder b(graph);
  const ft::ops::ConvGeometry geo = ft::ops::ConvGeometry::of(params_of(s), s.x, s.w);
  ft::ir::Attrs attrs;
  attrs.set("strides", s.strides).set("pads", s.pads).set("group", s.group);
  std::vector<ft::ir::ValueId> inputs;
  if (op == OpKind::Conv) {
    inputs = {b.input("x", ft::Shape(s.x), dtype), b.input("w", ft::Shape(s.w), dtype)};
  } else if (op == OpKind::ConvBackwardData) {
    inputs = {b.input("dy", ft::Shape(geo.output_dims()), dtype), b.input("w", ft::Shape(s.w), dtype)};
    attrs.set("shape", s.x);
  } else {
    inputs = {b.input("dy", ft::Shape(geo.output_dims()), dtype), b.input("x", ft::Shape(s.x), dtype)};
    attrs.set("shape", s.w);
  }
  graph.add(op, inputs, attrs);
  const ft::ir::Node& node = graph.node(0);
  ft::kernels::KernelArgs args;
  for (ft::ir::ValueId v : node.inputs) {
    args.inputs.push_back(ft::Tensor::zeros(graph.value(v).shape, dtype));
    std::vector<float> values(size_t(args.inputs.back().numel()));
    fill(values, 7 + unsigned(v));
    if (dtype == ft::DType::bf16)
      ft::float_to_bf16(args.inputs.back().data_as<uint16_t>(), values.data(), values.size());
    else
      std::copy(values.begin(), values.end(), args.inputs.back().data_as<float>());
  }
  args.outputs.push_back(ft::Tensor::zeros(graph.value(node.outputs[0]).shape, ft::DType::f32));
  args.accumulate.push_back(0);
  ft::kernels::set_conv_method(method);
  std::unique_ptr<ft::kernels::Kernel> kernel = ft::kernels::cpu_device().make_kernel(ft::compile::lower(graph, node));
  ft::kernels::set_conv_method(ft::kernels::ConvMethod::chosen);
  std::vector<char> scratch(kernel->scratch_bytes(kThreads) + 64);
  args.scratch = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) / 64 * 64);
  ft::kernels::StepContext ctx;
  ctx.num_threads = kThreads;
  for (auto _ : state) kernel->run(args, ctx);
  report(state, s);
}

// ---- oneDNN 2.6 ----

void bm_onednn(benchmark::State& state, const ConvShape& s, OpKind op) {
  using dnnl::memory;
  omp_set_num_threads(kThreads);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const ft::ops::ConvGeometry geo = ft::ops::ConvGeometry::of(params_of(s), s.x, s.w);
  const bool two_d = s.x.size() == 4;
  const memory::dims x_dims(s.x.begin(), s.x.end()), y_dims = geo.output_dims();
  memory::dims w_dims(s.w.begin(), s.w.end());
  if (s.group > 1) {  // (G, O/G, C/G, [KH,] KW)
    w_dims[0] = s.group;
    w_dims.insert(w_dims.begin() + 1, s.w[0] / s.group);
  }
  const auto act = two_d ? memory::format_tag::nchw : memory::format_tag::ncw;
  const auto wtag = s.group > 1 ? (two_d ? memory::format_tag::goihw : memory::format_tag::goiw)
                                : (two_d ? memory::format_tag::oihw : memory::format_tag::oiw);
  const memory::desc x_md(x_dims, memory::data_type::f32, act), y_md(y_dims, memory::data_type::f32, act),
      w_md(w_dims, memory::data_type::f32, wtag);
  const size_t n = s.strides.size();
  const memory::dims strides(s.strides.begin(), s.strides.end()), dilates(n, 0),
      pad_l(s.pads.begin(), s.pads.begin() + long(n)), pad_r(s.pads.begin() + long(n), s.pads.end());
  std::vector<float> xv(x_md.get_size() / 4), yv(y_md.get_size() / 4), wv(w_md.get_size() / 4);
  fill(xv, 1);
  fill(yv, 2);
  fill(wv, 3);
  memory x(x_md, engine, xv.data()), y(y_md, engine, yv.data()), w(w_md, engine, wv.data());
  const auto fwd_desc = dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                                        dnnl::algorithm::convolution_direct, x_md, w_md, y_md,
                                                        strides, dilates, pad_l, pad_r);
  const auto fwd_pd = dnnl::convolution_forward::primitive_desc(fwd_desc, engine);
  dnnl::primitive prim;
  std::unordered_map<int, memory> args;
  if (op == OpKind::Conv) {
    prim = dnnl::convolution_forward(fwd_pd);
    args = {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}};
  } else if (op == OpKind::ConvBackwardData) {
    const auto desc = dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, x_md, w_md, y_md,
                                                            strides, dilates, pad_l, pad_r);
    prim = dnnl::convolution_backward_data(dnnl::convolution_backward_data::primitive_desc(desc, engine, fwd_pd));
    args = {{DNNL_ARG_DIFF_DST, y}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DIFF_SRC, x}};
  } else {
    const auto desc = dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, x_md, w_md, y_md,
                                                               strides, dilates, pad_l, pad_r);
    prim = dnnl::convolution_backward_weights(
        dnnl::convolution_backward_weights::primitive_desc(desc, engine, fwd_pd));
    args = {{DNNL_ARG_SRC, x}, {DNNL_ARG_DIFF_DST, y}, {DNNL_ARG_DIFF_WEIGHTS, w}};
  }
  for (auto _ : state) {
    prim.execute(stream, args);
    stream.wait();
  }
  report(state, s);
}

const char* op_label(OpKind op) {
  return op == OpKind::Conv ? "forward" : op == OpKind::ConvBackwardData ? "data" : "weight";
}

int register_all() {
  for (const ConvShape& s : shapes())
    for (const OpKind op : {OpKind::Conv, OpKind::ConvBackwardData, OpKind::ConvBackwardWeight}) {
      const std::string base = std::string(s.name) + "/" + op_label(op) + "/";
      for (const auto& [method, label] : {std::pair{ft::kernels::ConvMethod::direct, "direct"},
                                          std::pair{ft::kernels::ConvMethod::im2col, "im2col"}})
        for (const ft::DType dtype : {ft::DType::f32, ft::DType::bf16})
          benchmark::RegisterBenchmark((base + label + (dtype == ft::DType::bf16 ? "_bf16" : "")).c_str(),
                                       bm_fusetrain, s, op, method, dtype)
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark((base + "onednn").c_str(), bm_onednn, s, op)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  return 0;
}

const int registered = register_all();

}  // namespace
