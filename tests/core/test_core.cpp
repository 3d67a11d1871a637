// core: dtypes, shapes and broadcasting, bf16/f16 rounding, tensors, CPU features.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/half_paths.h"
#include "fusetrain/core/alloc.h"
#include "fusetrain/core/cpu.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/tensor.h"

namespace fusetrain::testing {
namespace {

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32, DType::u8})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_FALSE(parse_dtype("f64").has_value());
}

TEST(Shape, BroadcastAndErrors) {
  EXPECT_EQ(broadcast_shapes(Shape{3, 1}, Shape{1, 4}), (Shape{3, 4}));
  EXPECT_EQ(broadcast_shapes(Shape{4}, Shape{2, 3, 4}), (Shape{2, 3, 4}));
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ((Shape{2, 0, 3}).numel(), 0);
  try {
    broadcast_shapes(Shape{3, 2}, Shape{4});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(3, 2) and (4) do not broadcast"), std::string::npos) << e.what();
  }
  EXPECT_EQ(normalize_axis(-1, 3, "test"), 2);
  EXPECT_THROW(normalize_axis(3, 3, "test"), Error);
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3·2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
  // The bulk conversion (vectorised on AVX512-BF16) agrees with the scalar one.
  std::vector<float> in(1000);
  for (size_t i = 0; i < in.size(); ++i) in[i] = std::sin(static_cast<float>(i)) * std::pow(10.0f, (i % 9) - 4.0f);
  std::vector<uint16_t> out(in.size());
  float_to_bf16(out.data(), in.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], float_to_bf16(in[i])) << i;
}

TEST(F16, RoundTripsAndRounds) {
  for (float v : {0.0f, 1.0f, -2.0f, 65504.0f, 0.5f, 6.103515625e-05f, 5.960464477539063e-08f})
    EXPECT_EQ(f16_to_float(float_to_f16(v)), v) << v;
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);                      // overflow rounds to inf
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
}

// The bulk conversions (vectorised where the CPU allows) give the scalar ones' bits: every half and every bf16
// back to f32, and f32 values across normal, subnormal, overflow and NaN. Each is checked as dispatched on this
// CPU and, where the CPU has AVX2 + F16C, through the AVX2 variants too (an AVX-512 CPU dispatches past them).
struct BulkPath {
  const char* name;
  void (*f16_to_float)(float*, const uint16_t*, size_t);
  void (*float_to_f16)(uint16_t*, const float*, size_t);
  void (*bf16_to_float)(float*, const uint16_t*, size_t);
};

std::vector<BulkPath> bulk_paths() {
  std::vector<BulkPath> paths{{"dispatched", f16_to_float, float_to_f16, bf16_to_float}};
  if (cpu_features().avx2 && cpu_features().f16c)
    paths.push_back({"avx2", half_paths::f16_to_float_avx2, half_paths::float_to_f16_avx2,
                     half_paths::bf16_to_float_avx2});
  return paths;
}

TEST(F16, BulkConversionsMatchScalar) {
  std::vector<uint16_t> halves(65536);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<float> values;
  for (int e = -30; e <= 17; ++e)
    for (float m : {1.0f, 1.0004883f, 1.5f, 1.9990234f, 1.99951171875f})
      for (float sign : {1.0f, -1.0f}) values.push_back(sign * std::ldexp(m, e));
  values.push_back(std::nanf(""));
  values.push_back(std::numeric_limits<float>::infinity());
  for (const BulkPath& path : bulk_paths()) {
    SCOPED_TRACE(path.name);
    std::vector<float> floats(halves.size());
    path.f16_to_float(floats.data(), halves.data(), halves.size());
    for (size_t i = 0; i < halves.size(); ++i) {
      float want = f16_to_float(halves[i]);
      if (std::isnan(want))
        ASSERT_TRUE(std::isnan(floats[i])) << i;
      else
        ASSERT_EQ(floats[i], want) << i;
    }
    path.bf16_to_float(floats.data(), halves.data(), halves.size());
    for (size_t i = 0; i < halves.size(); ++i) {
      uint32_t got, want;
      const float expected = bf16_to_float(halves[i]);
      std::memcpy(&got, &floats[i], 4);
      std::memcpy(&want, &expected, 4);
      ASSERT_EQ(got, want) << i;  // bits: NaN payloads survive the widening too
    }
    std::vector<uint16_t> got(values.size());
    path.float_to_f16(got.data(), values.data(), values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(values[i]))
        EXPECT_TRUE(std::isnan(f16_to_float(got[i])));
      else
        EXPECT_EQ(got[i], float_to_f16(values[i])) << values[i];
    }
  }
}

TEST(Tensor, ViewsOwnershipAndCopies) {
  Tensor owned = Tensor::zeros({2, 3}, DType::f32);
  EXPECT_TRUE(owned.owns_memory());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(owned.data()) % kAlignment, 0u);
  owned.set_item(4, 2.5);
  Tensor view = Tensor::view(owned.data(), {6}, DType::f32);
  EXPECT_FALSE(view.owns_memory());
  EXPECT_EQ(view.item(4), 2.5);
  Tensor copy = owned.clone();
  owned.set_item(4, 0);
  EXPECT_EQ(copy.item(4), 2.5);
  EXPECT_THROW(owned.reshaped({4}), Error);
  EXPECT_THROW(owned.item(6), Error);
  EXPECT_THROW(owned.data_as<int64_t>(), Error);
}

// Resident pages of this process, in bytes (/proc/self/statm's second field).
size_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int read = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return read == 2 ? static_cast<size_t>(resident) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) : 0;
}

// Both ways aligned_allocate gets memory (aligned_alloc below 1 MiB, mmap from it on): 64-byte aligned, zero, writable
// to the last byte, and freed through the same stateless deleter (Tensor's shared_ptr uses it too).
TEST(AlignedAllocate, ZeroedAlignedOnBothSidesOfTheMapThreshold) {
  const size_t mib = size_t{1} << 20;
  for (size_t bytes : {size_t{1}, size_t{63}, size_t{64}, size_t{1000}, mib - 128, mib - 64, mib, mib + 1, 5 * mib + 3}) {
    AlignedPtr p = aligned_allocate(bytes);
    ASSERT_NE(p.get(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.get()) % kAlignment, 0u) << bytes;
    const unsigned char* c = static_cast<const unsigned char*>(p.get());
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; ++i) nonzero += c[i] != 0;
    EXPECT_EQ(nonzero, 0u) << bytes;
    std::memset(p.get(), 0xAB, bytes);
  }
  Tensor t = Tensor::zeros({3 * 1024 * 1024}, DType::f32);  // mapped, released by the shared_ptr's deleter
  t.set_item(t.numel() - 1, 1.0);
  EXPECT_EQ(t.item(0), 0.0);
}

// A mapped buffer costs no resident memory until it is written: what LoRA relies on when the gradients of weights
// it then freezes were laid out but never written.
TEST(AlignedAllocate, UnwrittenPagesOfALargeBufferAreNotResident) {
  const size_t bytes = size_t{256} << 20;
  const size_t before = resident_bytes();
  if (before == 0) GTEST_SKIP() << "no /proc/self/statm";
  AlignedPtr p = aligned_allocate(bytes);
  const size_t allocated = resident_bytes();
  EXPECT_LT(allocated, before + (size_t{32} << 20)) << "allocating 256 MiB made " << (allocated - before) << " bytes resident";
  std::memset(p.get(), 1, bytes);
  EXPECT_GT(resident_bytes(), before + (size_t{200} << 20)) << "writing it should make it resident";
}

// release_pages drops the whole pages inside a range (they read as zero and are no longer resident) and keeps the
// bytes of the partial pages at its ends: what enable_lora relies on to give back each f32 base weight once its bf16
// copy is written.
TEST(AlignedAllocate, ReleasedPagesReadZeroAndLeaveTheRestAlone) {
  const size_t bytes = size_t{128} << 20;
  AlignedPtr p = aligned_allocate(bytes);
  unsigned char* c = static_cast<unsigned char*>(p.get());
  std::memset(c, 7, bytes);
  const size_t written = resident_bytes();
  const size_t begin = 1000, length = (size_t{96} << 20) + 123;  // neither end on a page boundary
  release_pages(c + begin, length);
  if (written != 0)
    EXPECT_LT(resident_bytes() + (size_t{80} << 20), written) << "96 MiB released, still resident";
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t first = (reinterpret_cast<uintptr_t>(c + begin) + page - 1) / page * page - reinterpret_cast<uintptr_t>(c);
  const size_t last = (reinterpret_cast<uintptr_t>(c + begin + length)) / page * page - reinterpret_cast<uintptr_t>(c);
  size_t wrong = 0;
  for (size_t i = 0; i < bytes; i += 1 + (i % 61))  // a scattered sample, every page boundary region included below
    wrong += c[i] != ((i >= first && i < last) ? 0 : 7);
  for (size_t i : {size_t{0}, begin, first - 1, first, last - 1, last, begin + length, bytes - 1})
    wrong += c[i] != ((i >= first && i < last) ? 0 : 7);
  EXPECT_EQ(wrong, 0u);
  release_pages(c + 10, 20);  // no whole page inside: nothing changes
  EXPECT_EQ(c[10], 7);
  release_pages(nullptr, 100);
}

TEST(CpuFeatures, DescribesWhatItFound) {
  const CpuFeatures& f = cpu_features();
  std::string text = f.to_string();
  EXPECT_FALSE(text.empty());
  if (f.avx512_bf16) EXPECT_TRUE(f.avx512f);
  if (f.amx_bf16) EXPECT_TRUE(f.amx_tile);
  EXPECT_FALSE(cpu_model_name().empty());
}

}  // namespace
}  // namespace fusetrain::testing
