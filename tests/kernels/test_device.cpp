// The kernel boundary without graphs: kernels built from hand-written KernelCalls on both CPU
// devices, device memory and host-side helpers, and the one AVX-512 Philox against the scalar one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/core/cpu.h"
#include "fusetrain/core/error.h"
#include "fusetrain/kernels/device.h"
#include "kernels/cpu/basic_kernels.h"
#include "kernels/cpu/philox_avx2.h"
#include "kernels/cpu/philox_avx512.h"
#include "kernels/rng.h"
#include "support/test_util.h"

namespace fusetrain::kernels {
namespace {

using fusetrain::testing::error_of;

// SoftmaxCrossEntropy over logits (2, 3) with targets {2, -100}: one counted row.
KernelCall cross_entropy_call() {
  KernelCall call;
  call.op = OpKind::SoftmaxCrossEntropy;
  call.op_params = ops::CrossEntropyParams{};  // ignore_index -100
  call.inputs = {{Shape{2, 3}, DType::f32}, {Shape{2}, DType::i64}};
  call.outputs = {{Shape{}, DType::f32}, {Shape{2}, DType::f32}};
  call.name = "loss";
  return call;
}

TEST(Device, KernelFromAHandWrittenCallRuns) {
  for (const Device* device : {&cpu_device(), &reference_device()}) {
    std::unique_ptr<Kernel> kernel = device->make_kernel(cross_entropy_call());
    Tensor logits = Tensor::zeros(Shape{2, 3}, DType::f32), targets = Tensor::zeros(Shape{2}, DType::i64);
    Tensor loss = Tensor::zeros(Shape{}, DType::f32), lse = Tensor::zeros(Shape{2}, DType::f32);
    const float values[6] = {1.0f, 2.0f, 3.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < 6; ++i) logits.data_as<float>()[i] = values[i];
    targets.data_as<int64_t>()[0] = 2;
    targets.data_as<int64_t>()[1] = -100;
    KernelArgs args;
    args.inputs = {logits, targets};
    args.outputs = {loss, lse};
    args.accumulate = {0, 0};
    DeviceBuffer scratch = device->allocate(kernel->scratch_bytes(1) + 1);
    args.scratch = scratch.get();
    StepContext ctx;
    kernel->run(args, ctx);
    const double expected_lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
    EXPECT_NEAR(loss.data_as<float>()[0], expected_lse - 3.0, 1e-6) << device->name();
    EXPECT_NEAR(lse.data_as<float>()[0], expected_lse, 1e-6) << device->name();
  }
}

TEST(Device, WrongParamsOrDtypesAreNamed) {
  KernelCall call = cross_entropy_call();
  call.op_params = ops::MatMulParams{};
  const std::string wrong = error_of([&] { reference_device().make_kernel(call); });
  EXPECT_NE(wrong.find("SoftmaxCrossEntropy \"loss\""), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("CrossEntropyParams"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("MatMulParams"), std::string::npos) << wrong;
}

TEST(Device, MemoryIsAlignedAndZeroed) {
  for (const Device* device : {&cpu_device(), &reference_device()}) {
    DeviceBuffer buffer = device->allocate(1000);
    ASSERT_NE(buffer.get(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.get()) % 64, 0u);
    const unsigned char* bytes = static_cast<const unsigned char*>(buffer.get());
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(bytes[i], 0);
    std::memset(buffer.get(), 7, 1000);
    StepContext ctx;
    device->zero(buffer.get(), 1000, ctx);
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(bytes[i], 0);
  }
  EXPECT_EQ(&device_for(Backend::Reference), &reference_device());
  EXPECT_EQ(&device_for(Backend::Optimized), &cpu_device());
}

TEST(Device, AddIntoAddsSeriallyAndInParallel) {
  for (int64_t n : {int64_t{100}, int64_t{100000}}) {
    std::vector<float> dest(static_cast<size_t>(n)), src(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      dest[static_cast<size_t>(i)] = 0.5f * static_cast<float>(i);
      src[static_cast<size_t>(i)] = 0.25f;
    }
    StepContext ctx;
    ctx.num_threads = 4;
    cpu_device().add_into(dest.data(), src.data(), n, ctx);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(dest[static_cast<size_t>(i)], 0.5f * static_cast<float>(i) + 0.25f);
  }
}

// The vector Philox of `Lanes` counters: each lane's four words, the words in stream order, and their uniforms.
template <int Lanes>
using VectorPhilox = void (*)(const uint32_t lo[Lanes], const uint32_t hi[Lanes], uint64_t offset, uint64_t seed,
                              uint32_t words[4][Lanes], uint32_t ordered[4 * Lanes], float uniforms[4 * Lanes]);

FT_AVX512 void philox16(const uint32_t lo[16], const uint32_t hi[16], uint64_t offset, uint64_t seed,
                        uint32_t words[4][16], uint32_t ordered[64], float uniforms[64]) {
  const cpu_basic::Philox16 r = cpu_basic::philox4x32_16(_mm512_loadu_si512(lo), _mm512_loadu_si512(hi), offset, seed);
  for (int w = 0; w < 4; ++w) _mm512_storeu_si512(words[w], r.w[w]);
  __m512i order[4];
  cpu_basic::philox_element_order(r, order);
  for (int q = 0; q < 4; ++q) {
    _mm512_storeu_si512(ordered + 16 * q, order[q]);
    _mm512_storeu_ps(uniforms + 16 * q, cpu_basic::to_uniform16(order[q]));
  }
}

FT_AVX2 void philox8(const uint32_t lo[8], const uint32_t hi[8], uint64_t offset, uint64_t seed, uint32_t words[4][8],
                     uint32_t ordered[32], float uniforms[32]) {
  const cpu_basic::Philox8 r = cpu_basic::philox4x32_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)),
                                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)),
                                                       offset, seed);
  for (int w = 0; w < 4; ++w) _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[w]), r.w[w]);
  __m256i order[4];
  cpu_basic::philox_element_order(r, order);
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ordered + 8 * q), order[q]);
    _mm256_storeu_ps(uniforms + 8 * q, cpu_basic::to_uniform8(order[q]));
  }
}

// `Lanes` consecutive counters through the vector Philox against the scalar philox4x32 and uniform_at.
template <int Lanes>
void expect_vector_philox_is_scalar(VectorPhilox<Lanes> vector_philox) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint64_t seed = trial % 3 == 0 ? static_cast<uint64_t>(trial) : rng();
    const uint64_t offset = trial % 5 == 0 ? 0 : rng();
    // Consecutive blocks from a random start, some crossing a 2^32 boundary of the low word.
    const uint64_t first = trial % 7 == 0 ? 0xFFFFFFF8ull + rng() % 16 : rng() >> 3;  // 4·first fits in 64 bits
    uint32_t lo[Lanes], hi[Lanes], words[4][Lanes], ordered[4 * Lanes];
    float uniforms[4 * Lanes];
    for (int l = 0; l < Lanes; ++l) {
      lo[l] = static_cast<uint32_t>(first + l);
      hi[l] = static_cast<uint32_t>((first + l) >> 32);
    }
    vector_philox(lo, hi, offset, seed, words, ordered, uniforms);
    for (int l = 0; l < Lanes; ++l) {
      const Philox4 s = philox4x32(lo[l], hi[l], static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                                   static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
      for (int w = 0; w < 4; ++w) {
        ASSERT_EQ(words[w][l], s.v[w]) << "trial " << trial << " lane " << l << " word " << w;
        ASSERT_EQ(ordered[4 * l + w], s.v[w]) << "trial " << trial << " element " << 4 * l + w;
        ASSERT_EQ(uniforms[4 * l + w], uniform_at(seed, offset, 4 * (first + l) + w)) << "trial " << trial;
      }
    }
  }
}

TEST(Philox, VectorEqualsScalarBitForBit) {
  if (!cpu_basic::use_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  expect_vector_philox_is_scalar<16>(philox16);
}

TEST(Philox, Avx2VectorEqualsScalarBitForBit) {
  if (!cpu_features().avx2 || !cpu_features().fma) GTEST_SKIP() << "no AVX2 + FMA on this CPU";
  expect_vector_philox_is_scalar<8>(philox8);
}

}  // namespace
}  // namespace fusetrain::kernels
