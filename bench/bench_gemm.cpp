// fusetrain GEMM vs oneDNN at a transformer Linear shape: M = B*T = 16*128, N = K = C = 768, 2 threads.
// Layouts: NN (x @ W), NT (x @ W^T, the Linear forward), TN (x^T @ dy, the weight gradient).
#include <benchmark/benchmark.h>
#include <dnnl.h>
#include <omp.h>

#include <cstring>
#include <dnnl.hpp>
#include <random>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace {

using fusetrain::kernels::GemmShape;

constexpr int64_t kM = 2048, kN = 768, kK = 768;
constexpr int kThreads = 2;

enum Layout { NN, NT, TN };

GemmShape shape_of(Layout layout) {
  bool ta = layout == TN, tb = layout == NT;
  return {kM, kN, kK, ta, tb, ta ? kM : kK, tb ? kK : kN, kN};
}

uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// A: (M, K) or (K, M), B: (K, N) or (N, K), C: (M, N), all filled once.
struct Operands {
  std::vector<float> a, b, c;
  std::vector<uint16_t> a16, b16;
  Operands() : a(kM * kK), b(kK * kN), c(kM * kN), a16(a.size()), b16(b.size()) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& v : a) v = dist(rng);
    for (float& v : b) v = dist(rng);
    for (size_t i = 0; i < a.size(); i++) a16[i] = f32_to_bf16(a[i]);
    for (size_t i = 0; i < b.size(); i++) b16[i] = f32_to_bf16(b[i]);
  }
};

Operands& operands() {
  static Operands ops;
  return ops;
}

void set_flops(benchmark::State& state) {
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * kM * kN * kK * double(state.iterations()), benchmark::Counter::kIsRate);
}

void bm_fusetrain_f32(benchmark::State& state, Layout layout) {
  Operands& ops = operands();
  GemmShape s = shape_of(layout);
  std::vector<char> scratch(fusetrain::kernels::gemm_f32_scratch_bytes(s, kThreads));
  for (auto _ : state)
    fusetrain::kernels::gemm_f32(s, 1.0f, ops.a.data(), ops.b.data(), 0.0f, ops.c.data(), scratch.data(), kThreads);
  set_flops(state);
}

void bm_fusetrain_bf16(benchmark::State& state, Layout layout) {
  Operands& ops = operands();
  GemmShape s = shape_of(layout);
  std::vector<char> scratch(fusetrain::kernels::gemm_bf16_scratch_bytes(s, kThreads));
  for (auto _ : state)
    fusetrain::kernels::gemm_bf16(s, 1.0f, ops.a16.data(), ops.b16.data(), 0.0f, ops.c.data(), scratch.data(),
                                  kThreads);
  set_flops(state);
}

void bm_onednn_sgemm(benchmark::State& state, Layout layout) {
  Operands& ops = operands();
  GemmShape s = shape_of(layout);
  omp_set_num_threads(kThreads);
  for (auto _ : state)
    dnnl_sgemm(s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N', s.M, s.N, s.K, 1.0f, ops.a.data(), s.lda, ops.b.data(),
               s.ldb, 0.0f, ops.c.data(), s.ldc);
  set_flops(state);
}

// oneDNN matmul primitive, bf16 src/weights and f32 dst; transposes expressed as strides.
void bm_onednn_matmul_bf16(benchmark::State& state, Layout layout) {
  using dnnl::memory;
  Operands& ops = operands();
  GemmShape s = shape_of(layout);
  omp_set_num_threads(kThreads);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  memory::desc a_md({kM, kK}, memory::data_type::bf16, s.trans_a ? memory::dims{1, kM} : memory::dims{kK, 1});
  memory::desc b_md({kK, kN}, memory::data_type::bf16, s.trans_b ? memory::dims{1, kK} : memory::dims{kN, 1});
  memory::desc c_md({kM, kN}, memory::data_type::f32, memory::dims{kN, 1});
  dnnl::matmul matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine));
  memory a(a_md, engine, ops.a16.data()), b(b_md, engine, ops.b16.data()), c(c_md, engine, ops.c.data());
  for (auto _ : state) {
    matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
  set_flops(state);
}

#define GEMM_BENCH(fn)                                                         \
  BENCHMARK_CAPTURE(fn, NN, NN)->UseRealTime()->Unit(benchmark::kMillisecond); \
  BENCHMARK_CAPTURE(fn, NT, NT)->UseRealTime()->Unit(benchmark::kMillisecond); \
  BENCHMARK_CAPTURE(fn, TN, TN)->UseRealTime()->Unit(benchmark::kMillisecond)

GEMM_BENCH(bm_fusetrain_f32);
GEMM_BENCH(bm_onednn_sgemm);
GEMM_BENCH(bm_fusetrain_bf16);
GEMM_BENCH(bm_onednn_matmul_bf16);

}  // namespace
