// measure_matmul_gflops: times the GEMM the kernels use, on operands it allocates.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/kernels/benchmark.h"
#include "kernels/cpu/gemm.h"

namespace fusetrain::kernels {

namespace {

// The best GFLOP/s of an (M, N, K) product `call` computes: the best of `repeats` timings of three calls, after one
// warm-up call.
template <typename Call>
double best_gflops(const Call& call, int64_t M, int64_t N, int64_t K, int repeats) {
  call();
  double best = 0;
  constexpr int kCalls = 3;
  for (int r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) call();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) * kCalls /
                              seconds / 1e9);
  }
  return best;
}

}  // namespace

double measure_matmul_gflops(int64_t M, int64_t N, int64_t K, bool bf16, int num_threads, int repeats) {
  FT_CHECK(M > 0 && N > 0 && K > 0, "measure_matmul_gflops: dimensions must be positive, got ", M, " x ", N, " x ",
           K);
  FT_CHECK(repeats > 0, "measure_matmul_gflops: repeats must be positive, got ", repeats);
  const int threads = num_threads > 0 ? num_threads : omp_get_num_procs();
  const GemmShape shape{M, N, K, false, false, K, N, N};
  // a: (M, K), b: (K, N), c: (M, N)
  std::vector<float> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N)), c(static_cast<size_t>(M * N));
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& x : a) x = uniform(rng);
  for (float& x : b) x = uniform(rng);
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  for (size_t i = 0; i < a.size(); ++i) a16[i] = float_to_bf16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = float_to_bf16(b[i]);
  std::vector<unsigned char> scratch(bf16 ? gemm_bf16_scratch_bytes(shape, threads)
                                          : gemm_f32_scratch_bytes(shape, threads));
  auto call = [&] {
    if (bf16)
      gemm_bf16(shape, 1.0f, a16.data(), b16.data(), 0.0f, c.data(), scratch.data(), threads);
    else
      gemm_f32(shape, 1.0f, a.data(), b.data(), 0.0f, c.data(), scratch.data(), threads);
  };
  return best_gflops(call, M, N, K, repeats);
}

double measure_weight_matmul_gflops(int64_t M, int64_t N, int64_t K, bool trans_b, bool nf4, int num_threads,
                                    int repeats) {
  FT_CHECK(M > 0 && N > 0 && K > 0 && N * K % 64 == 0, "measure_weight_matmul_gflops: dimensions must be positive ",
           "with N x K a multiple of 64, got ", M, " x ", N, " x ", K);
  FT_CHECK(repeats > 0, "measure_weight_matmul_gflops: repeats must be positive, got ", repeats);
  const int threads = num_threads > 0 ? num_threads : omp_get_num_procs();
  const GemmShape shape{M, N, K, false, trans_b, K, trans_b ? K : N, N};
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<uint16_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N));
  for (uint16_t& x : a) x = float_to_bf16(uniform(rng));
  for (uint16_t& x : b) x = float_to_bf16(uniform(rng));
  std::vector<uint8_t> codes(static_cast<size_t>(N * K / 2));
  for (uint8_t& x : codes) x = static_cast<uint8_t>(rng() & 0xFF);
  std::vector<float> absmax(static_cast<size_t>(N * K / 64)), code(16);
  for (float& x : absmax) x = 0.5f + uniform(rng) * 0.25f;
  for (float& x : code) x = uniform(rng);
  const quant::QuantMatrix w{codes.data(), absmax.data(), code.data(), trans_b ? N : K, trans_b ? K : N, 6, true};
  std::vector<float> c(static_cast<size_t>(M * N));
  std::vector<unsigned char> scratch(nf4 ? gemm_quant4_scratch_bytes(shape, threads)
                                         : gemm_bf16_scratch_bytes(shape, threads));
  auto call = [&] {
    if (nf4)
      gemm_quant4_bf16(shape, a.data(), w, c.data(), scratch.data(), threads);
    else
      gemm_bf16(shape, 1.0f, a.data(), b.data(), 0.0f, c.data(), scratch.data(), threads);
  };
  return best_gflops(call, M, N, K, repeats);
}

}  // namespace fusetrain::kernels
