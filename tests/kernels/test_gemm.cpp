// kernels/cpu/gemm against the plain-loop reference, on every code path this CPU has.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/kernels/benchmark.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/thread_balance.h"
#include "kernels/ref/gemm_ref.h"

namespace fusetrain::kernels {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr unsigned char kCanary = 0xA5;

uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return uint16_t(bits >> 16);
}

// Forces a code path through FUSETRAIN_GEMM for the lifetime of the object.
class ScopedPath {
 public:
  explicit ScopedPath(const std::string& path) {
    if (path == "default")
      unsetenv("FUSETRAIN_GEMM");
    else
      setenv("FUSETRAIN_GEMM", path.c_str(), 1);
  }
  ~ScopedPath() { unsetenv("FUSETRAIN_GEMM"); }
};

bool path_supported(const std::string& path) {
  if (path == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (path == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return true;
}

// A matrix of `rows` x `cols` with leading dimension ld; the padding columns hold NaN
// so any read outside the logical matrix poisons the result.
std::vector<float> random_matrix(int64_t rows, int64_t cols, int64_t ld, std::mt19937& rng, bool round_bf16) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> m(size_t(std::max<int64_t>(rows * ld, 1)), kNaN);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      float v = dist(rng);
      if (round_bf16) {
        uint32_t bits = uint32_t(f32_to_bf16(v)) << 16;
        std::memcpy(&v, &bits, sizeof v);
      }
      m[size_t(r * ld + c)] = v;
    }
  return m;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& m) {
  std::vector<uint16_t> out(m.size());
  for (size_t i = 0; i < m.size(); i++) out[i] = f32_to_bf16(m[i]);
  return out;
}

// Scratch of exactly `bytes` at an address 4 bytes past a 64-byte boundary, followed by a canary.
struct Scratch {
  std::vector<unsigned char> storage;
  size_t bytes;
  explicit Scratch(size_t n) : storage(n + 64 + 4 + 256, kCanary), bytes(n) {}
  void* data() {
    uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63);
    return reinterpret_cast<void*>(base + 4);
  }
  bool canary_intact() {
    auto* end = static_cast<unsigned char*>(data()) + bytes;
    for (int i = 0; i < 256; i++)
      if (end[i] != kCanary) return false;
    return true;
  }
};

// Compares the logical (M, N) part of C with the reference and checks padding was left alone.
void expect_close(const float* got, const float* want, const GemmShape& s, double tol) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < s.M; i++)
    for (int64_t j = 0; j < s.N; j++) {
      double g = got[i * s.ldc + j], w = want[i * s.ldc + j];
      ASSERT_FALSE(std::isnan(g)) << "C(" << i << ", " << j << ") is NaN";
      diff += (g - w) * (g - w);
      norm += w * w;
    }
  EXPECT_LE(std::sqrt(diff), tol * std::sqrt(norm) + 1e-30) << "relative error too large";
  for (int64_t i = 0; i < s.M; i++)
    for (int64_t j = s.N; j < s.ldc; j++)
      ASSERT_EQ(std::memcmp(&got[i * s.ldc + j], &want[i * s.ldc + j], sizeof(float)), 0)
          << "padding of C written at (" << i << ", " << j << ")";
}

struct Case {
  int64_t M, N, K;
  bool trans_a, trans_b;
  int64_t pad;  // added to every leading dimension
  float alpha, beta;
  bool nan_c;  // C starts as NaN (only meaningful with beta == 0)
  int threads;
};

GemmShape shape_of(const Case& c) {
  int64_t lda = (c.trans_a ? c.M : c.K) + c.pad, ldb = (c.trans_b ? c.K : c.N) + c.pad;
  return {c.M, c.N, c.K, c.trans_a, c.trans_b, std::max<int64_t>(lda, 1), std::max<int64_t>(ldb, 1), c.N + c.pad};
}

std::string describe(const Case& c) {
  return "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
         (c.trans_a ? " TA" : "") + (c.trans_b ? " TB" : "") + " pad=" + std::to_string(c.pad) +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta) + (c.nan_c ? " nanC" : "") +
         " threads=" + std::to_string(c.threads);
}

void run_case(const Case& c, bool bf16) {
  SCOPED_TRACE(describe(c) + (bf16 ? " bf16" : " f32"));
  GemmShape s = shape_of(c);
  std::mt19937 rng(uint32_t(c.M * 1000003 + c.N * 1009 + c.K * 7 + c.trans_a * 2 + c.trans_b));
  auto A = random_matrix(c.trans_a ? c.K : c.M, c.trans_a ? c.M : c.K, s.lda, rng, bf16);
  auto B = random_matrix(c.trans_b ? c.N : c.K, c.trans_b ? c.K : c.N, s.ldb, rng, bf16);
  auto C0 = random_matrix(c.M, c.N, s.ldc, rng, false);
  for (int64_t i = 0; i < c.M; i++)
    for (int64_t j = c.N; j < s.ldc; j++) C0[size_t(i * s.ldc + j)] = 123.0f;  // padding sentinel
  if (c.nan_c)
    for (int64_t i = 0; i < c.M; i++)
      for (int64_t j = 0; j < c.N; j++) C0[size_t(i * s.ldc + j)] = kNaN;
  auto want = C0, got = C0;
  size_t bytes = bf16 ? gemm_bf16_scratch_bytes(s, c.threads) : gemm_f32_scratch_bytes(s, c.threads);
  Scratch scratch(bytes);
  if (bf16) {
    auto A16 = to_bf16(A), B16 = to_bf16(B);
    gemm_bf16_ref(s, c.alpha, A16.data(), B16.data(), c.beta, want.data());
    gemm_bf16(s, c.alpha, A16.data(), B16.data(), c.beta, got.data(), scratch.data(), c.threads);
  } else {
    gemm_f32_ref(s, c.alpha, A.data(), B.data(), c.beta, want.data());
    gemm_f32(s, c.alpha, A.data(), B.data(), c.beta, got.data(), scratch.data(), c.threads);
  }
  EXPECT_TRUE(scratch.canary_intact()) << "wrote past the reported scratch size";
  expect_close(got.data(), want.data(), s, bf16 ? 2e-5 : 1e-5);
}

class GemmPath : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!path_supported(GetParam())) GTEST_SKIP() << GetParam() << " not supported by this CPU";
  }
};

std::vector<Case> all_transposes(Case c) {
  std::vector<Case> out;
  for (int t = 0; t < 4; t++) {
    c.trans_a = t & 1;
    c.trans_b = t & 2;
    out.push_back(c);
  }
  return out;
}

TEST_P(GemmPath, SmallShapesAllTransposes) {
  ScopedPath path(GetParam());
  const int64_t sizes[] = {1, 3, 17, 129};
  for (bool bf16 : {false, true})
    for (int64_t M : sizes)
      for (int64_t N : sizes)
        for (int64_t K : sizes)
          for (const Case& c : all_transposes({M, N, K, false, false, 0, 1.0f, 0.0f, false, 1})) {
            run_case(c, bf16);
            if (HasFailure()) return;
          }
}

TEST_P(GemmPath, BlockEdgesAndThreads) {
  ScopedPath path(GetParam());
  // Shapes crossing the register tile, KC and NC block edges, run with several thread counts.
  const int64_t shapes[][3] = {{64, 64, 64},  {255, 255, 255}, {129, 255, 64}, {64, 17, 600}, {300, 1030, 33},
                               {2, 1100, 70}, {1, 255, 513},   {255, 3, 129},  {33, 40, 801}};
  for (bool bf16 : {false, true})
    for (auto& sh : shapes)
      for (int threads : {1, 2, 3})
        for (const Case& c : all_transposes({sh[0], sh[1], sh[2], false, false, 0, 1.0f, 0.0f, false, threads})) {
          run_case(c, bf16);
          if (HasFailure()) return;
        }
}

TEST_P(GemmPath, AlphaBetaAndLeadingDimensions) {
  ScopedPath path(GetParam());
  struct AlphaBeta {
    float alpha, beta;
    bool nan_c;
  };
  const AlphaBeta variants[] = {
      {1.0f, 1.0f, false}, {0.5f, -2.0f, false}, {-1.5f, 0.0f, true}, {0.0f, 0.5f, false}, {0.0f, 0.0f, true}};
  const int64_t shapes[][3] = {{17, 33, 17}, {129, 64, 255}, {3, 129, 1}, {40, 70, 300}};
  for (bool bf16 : {false, true})
    for (auto& sh : shapes)
      for (const AlphaBeta& ab : variants)
        for (int64_t pad : {0, 7})
          for (const Case& c :
               all_transposes({sh[0], sh[1], sh[2], false, false, pad, ab.alpha, ab.beta, ab.nan_c, 2})) {
            run_case(c, bf16);
            if (HasFailure()) return;
          }
}

TEST_P(GemmPath, EmptyK) {
  ScopedPath path(GetParam());
  for (bool bf16 : {false, true}) {
    run_case({17, 33, 0, false, false, 3, 1.0f, 0.0f, true, 2}, bf16);
    run_case({17, 33, 0, true, true, 0, 1.0f, 0.5f, false, 2}, bf16);
    run_case({5, 3, 0, false, true, 0, 2.0f, 1.0f, false, 1}, bf16);
  }
}

// The epilogue sees every element of C exactly once, after its final value is in place, and
// is told where each block lies: it copies what it sees to that position of `seen`, and counts.
struct EpilogueProbe {
  std::vector<float>* seen;
  std::vector<int>* visits;
  int64_t ldc;
  static void apply(const void* context, float* c, int64_t ldc, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    const EpilogueProbe& p = *static_cast<const EpilogueProbe*>(context);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const size_t at = static_cast<size_t>((row + i) * p.ldc + col + j);
        (*p.seen)[at] = c[i * ldc + j];
        (*p.visits)[at] += 1;
      }
  }
};

// One NT product (x · wᵀ, as Linear runs it) of a case's random operands, f32 or bf16, with its scratch.
struct EpilogueCall {
  Case c;
  bool bf16;
  GemmShape s;
  std::vector<float> A, B;
  std::vector<uint16_t> A16, B16;
  Scratch scratch;

  EpilogueCall(const Case& c_in, bool bf16_in, unsigned seed)
      : c(c_in),
        bf16(bf16_in),
        s(shape_of(c_in)),
        scratch(bf16_in ? gemm_bf16_scratch_bytes(s, c_in.threads) : gemm_f32_scratch_bytes(s, c_in.threads)) {
    std::mt19937 rng(seed);
    A = random_matrix(c.M, c.K, s.lda, rng, bf16);
    B = random_matrix(c.N, c.K, s.ldb, rng, bf16);
    A16 = to_bf16(A);
    B16 = to_bf16(B);
  }
  // C = A · Bᵀ (C may be null: strips only), the epilogue on every finished strip.
  void run(float* C, const GemmEpilogue* epilogue) {
    if (bf16)
      gemm_bf16(s, 1.0f, A16.data(), B16.data(), 0.0f, C, scratch.data(), c.threads, epilogue);
    else
      gemm_f32(s, 1.0f, A.data(), B.data(), 0.0f, C, scratch.data(), c.threads, epilogue);
  }
  // The reference product, into `want`.
  void reference(float* want) const {
    if (bf16)
      gemm_bf16_ref(s, 1.0f, A16.data(), B16.data(), 0.0f, want);
    else
      gemm_f32_ref(s, 1.0f, A.data(), B.data(), 0.0f, want);
  }
};

TEST_P(GemmPath, EpilogueVisitsEveryFinishedElementOnce) {
  ScopedPath path(GetParam());
  const int64_t shapes[][3] = {{255, 1030, 300}, {33, 17, 801}, {1, 40, 5}, {17, 33, 0}};
  for (bool bf16 : {false, true})
    for (auto& sh : shapes)
      for (int threads : {1, 2, 3}) {
        Case c{sh[0], sh[1], sh[2], false, true, 3, 1.0f, 0.0f, false, threads};
        SCOPED_TRACE(describe(c) + (bf16 ? " bf16" : " f32"));
        EpilogueCall call(c, bf16, 5);
        const GemmShape& s = call.s;
        std::vector<float> want(size_t(c.M * s.ldc), 0.0f), got = want, seen = want;
        std::vector<int> visits(want.size(), 0);
        EpilogueProbe probe{&seen, &visits, s.ldc};
        GemmEpilogue epilogue{&EpilogueProbe::apply, &probe};
        call.reference(want.data());
        call.run(got.data(), &epilogue);
        for (int64_t i = 0; i < c.M; ++i)
          for (int64_t j = 0; j < s.ldc; ++j) {
            const size_t at = size_t(i * s.ldc + j);
            ASSERT_EQ(visits[at], j < c.N ? 1 : 0) << "(" << i << ", " << j << ")";
            ASSERT_EQ(seen[at], got[at]) << "(" << i << ", " << j << ")";  // C's final value, at its place
          }
        expect_close(got.data(), want.data(), s, bf16 ? 2e-5 : 1e-5);
        if (HasFailure()) return;
      }
}

// Without C (K within one pass): the epilogue sees each element once, with the value the
// same call computes into C, and nothing else is written.
TEST_P(GemmPath, StripsWithoutCGiveTheEpilogueTheProduct) {
  ScopedPath path(GetParam());
  for (bool bf16 : {false, true}) {
    const int64_t max_k = gemm_strip_max_k(bf16);
    const int64_t shapes[][3] = {{255, 1030, max_k}, {33, 17, 7}, {1, 40, 5}, {100, 800, max_k / 2 + 1}};
    for (auto& sh : shapes)
      for (int threads : {1, 2, 3}) {
        Case c{sh[0], sh[1], sh[2], false, true, 3, 1.0f, 0.0f, false, threads};
        SCOPED_TRACE(describe(c) + (bf16 ? " bf16" : " f32"));
        EpilogueCall call(c, bf16, 7);
        const GemmShape& s = call.s;
        std::vector<float> with_c(size_t(c.M * s.ldc), 0.0f), seen = with_c, unused = with_c;
        std::vector<int> visits(with_c.size(), 0);
        EpilogueProbe probe{&seen, &visits, s.ldc}, into_unused{&unused, &visits, s.ldc};
        GemmEpilogue strips{&EpilogueProbe::apply, &probe}, full{&EpilogueProbe::apply, &into_unused};
        call.run(with_c.data(), &full);
        call.run(nullptr, &strips);
        for (int64_t i = 0; i < c.M; ++i)
          for (int64_t j = 0; j < s.ldc; ++j) {
            const size_t at = size_t(i * s.ldc + j);
            ASSERT_EQ(visits[at], j < c.N ? 2 : 0) << "(" << i << ", " << j << ")";
            ASSERT_EQ(seen[at], with_c[at]) << "(" << i << ", " << j << ")";  // bit for bit the product
          }
        if (HasFailure()) return;
      }
  }
}

// Batched products against per-batch references, with either operand broadcast (stride 0).
template <typename T>
void run_batched(const Case& c, int64_t batch, bool broadcast_a, bool broadcast_b) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  SCOPED_TRACE(describe(c) + " batch=" + std::to_string(batch) + (broadcast_a ? " bcastA" : "") +
               (broadcast_b ? " bcastB" : "") + (bf16 ? " bf16" : " f32"));
  GemmShape s = shape_of(c);
  std::mt19937 rng(uint32_t(batch * 31 + c.M));
  int64_t size_a = (c.trans_a ? c.K : c.M) * s.lda, size_b = (c.trans_b ? c.N : c.K) * s.ldb, size_c = c.M * s.ldc;
  int64_t stride_a = broadcast_a ? 0 : size_a + 5, stride_b = broadcast_b ? 0 : size_b + 3, stride_c = size_c + 1;
  int64_t total_a = stride_a * (batch - 1) + size_a, total_b = stride_b * (batch - 1) + size_b;
  auto A = random_matrix(1, total_a, total_a, rng, bf16);
  auto B = random_matrix(1, total_b, total_b, rng, bf16);
  auto C0 = random_matrix(1, stride_c * batch, stride_c * batch, rng, false);
  if (c.nan_c)
    for (float& v : C0) v = kNaN;
  auto want = C0, got = C0;
  Scratch scratch(bf16 ? gemm_bf16_batched_scratch_bytes(s, batch, c.threads)
                       : gemm_f32_batched_scratch_bytes(s, batch, c.threads));
  if constexpr (bf16) {
    auto A16 = to_bf16(A), B16 = to_bf16(B);
    for (int64_t b = 0; b < batch; b++)
      gemm_bf16_ref(s, c.alpha, A16.data() + b * stride_a, B16.data() + b * stride_b, c.beta,
                    want.data() + b * stride_c);
    gemm_bf16_batched(s, batch, stride_a, stride_b, stride_c, c.alpha, A16.data(), B16.data(), c.beta, got.data(),
                      scratch.data(), c.threads);
  } else {
    for (int64_t b = 0; b < batch; b++)
      gemm_f32_ref(s, c.alpha, A.data() + b * stride_a, B.data() + b * stride_b, c.beta, want.data() + b * stride_c);
    gemm_f32_batched(s, batch, stride_a, stride_b, stride_c, c.alpha, A.data(), B.data(), c.beta, got.data(),
                     scratch.data(), c.threads);
  }
  EXPECT_TRUE(scratch.canary_intact()) << "wrote past the reported scratch size";
  for (int64_t b = 0; b < batch; b++)
    expect_close(got.data() + b * stride_c, want.data() + b * stride_c, s, bf16 ? 2e-5 : 1e-5);
}

TEST_P(GemmPath, Batched) {
  ScopedPath path(GetParam());
  for (int64_t batch : {1, 3, 8})
    for (int threads : {1, 2})
      for (const Case& c : all_transposes({33, 70, 129, false, false, 2, 0.7f, 0.0f, true, threads}))
        for (int bcast = 0; bcast < 3; bcast++) {
          run_batched<float>(c, batch, bcast == 1, bcast == 2);
          run_batched<uint16_t>(c, batch, bcast == 1, bcast == 2);
          if (HasFailure()) return;
        }
  Case accumulate{64, 64, 64, false, true, 0, 1.0f, 1.0f, false, 2};
  run_batched<float>(accumulate, 4, false, true);
  run_batched<uint16_t>(accumulate, 4, true, false);
}

// Fixes the parallel GEMMs' split for the lifetime of the object.
class ScopedSplit {
 public:
  explicit ScopedSplit(GemmSplit split) { set_gemm_split(split); }
  ~ScopedSplit() { set_gemm_split(GemmSplit::adaptive); }
};

// A loaded machine's split (blocks from a shared counter) computes every element of C as one equal block per
// thread does: bit for bit, with the epilogue still visiting each finished element once.
TEST_P(GemmPath, SharedBlocksGiveTheEqualSplitsResultBitForBit) {
  ScopedPath path(GetParam());
  const int64_t shapes[][3] = {{255, 1030, 300}, {300, 1030, 33}, {33, 17, 801}, {2, 1100, 70}, {1000, 64, 257}};
  for (bool bf16 : {false, true})
    for (auto& sh : shapes)
      for (int threads : {2, 3}) {
        Case c{sh[0], sh[1], sh[2], false, true, 3, 1.0f, 0.0f, false, threads};
        SCOPED_TRACE(describe(c) + (bf16 ? " bf16" : " f32"));
        EpilogueCall call(c, bf16, 11);
        const GemmShape& s = call.s;
        std::vector<float> want(size_t(c.M * s.ldc), 0.0f), equal = want, shared = want, seen = want;
        std::vector<int> visits(want.size(), 0), ignored(want.size(), 0);
        EpilogueProbe probe{&seen, &visits, s.ldc}, unused{&want, &ignored, s.ldc};
        GemmEpilogue counted{&EpilogueProbe::apply, &probe}, plain{&EpilogueProbe::apply, &unused};
        {
          ScopedSplit split(GemmSplit::equal);
          call.run(equal.data(), &plain);
        }
        {
          ScopedSplit split(GemmSplit::shared);
          call.run(shared.data(), &counted);
        }
        ASSERT_EQ(std::memcmp(equal.data(), shared.data(), equal.size() * sizeof(float)), 0);
        for (int64_t i = 0; i < c.M; ++i)
          for (int64_t j = 0; j < s.ldc; ++j) {
            const size_t at = size_t(i * s.ldc + j);
            ASSERT_EQ(visits[at], j < c.N ? 1 : 0) << "(" << i << ", " << j << ")";
            ASSERT_EQ(seen[at], shared[at]) << "(" << i << ", " << j << ")";
          }
        call.reference(want.data());
        expect_close(shared.data(), want.data(), s, bf16 ? 2e-5 : 1e-5);
        if (HasFailure()) return;
      }
}

INSTANTIATE_TEST_SUITE_P(Paths, GemmPath, ::testing::Values("default", "avx512", "avx2", "portable"),
                         [](const auto& info) { return info.param; });

// The forced path must really change the code taken: vdpbf16ps adds each k pair before
// accumulating, the portable path adds products one k at a time, so some element differs.
TEST(ThreadBalance, TurnsContendedWhenRatesStayApartAndBalancedWhenTheyMeet) {
  ThreadBalance balance;
  const double seconds[3] = {1.0, 1.0, 1.0};
  const double even[3] = {100.0, 97.0, 0.0}, apart[3] = {100.0, 45.0, 0.0};  // thread 2 did no work: left out
  for (int i = 0; i < 20; ++i) balance.record(even, seconds, 3);
  EXPECT_FALSE(balance.contended());
  EXPECT_NEAR(balance.average_spread(), 0.03, 0.005);
  balance.record(apart, seconds, 2);  // one slow product does not flip it
  EXPECT_FALSE(balance.contended());
  for (int i = 0; i < 10; ++i) balance.record(apart, seconds, 2);
  EXPECT_TRUE(balance.contended());
  EXPECT_NEAR(balance.average_spread(), 0.55, 0.05);
  balance.record(even, seconds, 2);  // nor does one even product flip it back
  EXPECT_TRUE(balance.contended());
  for (int i = 0; i < 20; ++i) balance.record(even, seconds, 2);
  EXPECT_FALSE(balance.contended());
  const double none[2] = {0.0, 0.0}, stalled[2] = {100.0, 100.0}, zero_time[2] = {1.0, 0.0};
  balance.record(none, seconds, 2);  // nothing measured: nothing recorded
  balance.record(stalled, zero_time, 2);
  EXPECT_NEAR(balance.average_spread(), 0.03, 0.01);
}

TEST(GemmDispatch, PortableOverrideTakesEffect) {
  if (!__builtin_cpu_supports("avx512bf16")) GTEST_SKIP() << "needs AVX512_BF16 to compare against";
  GemmShape s{64, 64, 300, false, false, 300, 64, 64};
  std::mt19937 rng(7);
  auto A = to_bf16(random_matrix(64, 300, 300, rng, true)), B = to_bf16(random_matrix(300, 64, 64, rng, true));
  std::vector<float> fast(64 * 64), slow(64 * 64);
  Scratch scratch(gemm_bf16_scratch_bytes(s, 1));
  gemm_bf16(s, 1.0f, A.data(), B.data(), 0.0f, fast.data(), scratch.data(), 1);
  {
    ScopedPath path("portable");
    gemm_bf16(s, 1.0f, A.data(), B.data(), 0.0f, slow.data(), scratch.data(), 1);
  }
  EXPECT_NE(std::memcmp(fast.data(), slow.data(), fast.size() * sizeof(float)), 0);
}

// f16 operands: exactly the f32 GEMM of the converted operands, including leading
// dimensions, transposes, accumulation and batches with a broadcast operand.
TEST(GemmF16, EqualsF32GemmOfConvertedOperands) {
  std::mt19937 rng(21);
  for (bool trans_a : {false, true})
    for (bool trans_b : {false, true})
      for (int threads : {1, 2}) {
        const int64_t M = 37, N = 70, K = 129, batch = 3;
        GemmShape s{M, N, K, trans_a, trans_b, (trans_a ? M : K) + 3, (trans_b ? K : N) + 1, N + 2};
        const int64_t size_a = (trans_a ? K : M) * s.lda, size_b = (trans_b ? N : K) * s.ldb;
        const int64_t stride_a = size_a + 5, stride_c = M * s.ldc;
        auto A = random_matrix(1, stride_a * batch, stride_a * batch, rng, false);
        auto B = random_matrix(1, size_b, size_b, rng, false);
        std::vector<uint16_t> A16(A.size()), B16(B.size());
        float_to_f16(A16.data(), A.data(), A.size());
        float_to_f16(B16.data(), B.data(), B.size());
        f16_to_float(A.data(), A16.data(), A.size());  // the values the f16 GEMM sees
        f16_to_float(B.data(), B16.data(), B.size());
        auto C0 = random_matrix(1, stride_c * batch, stride_c * batch, rng, false);
        auto want = C0, got = C0;
        Scratch f32_scratch(gemm_f32_batched_scratch_bytes(s, batch, threads));
        Scratch f16_scratch(gemm_f16_batched_scratch_bytes(s, batch, stride_a, 0, threads));
        gemm_f32_batched(s, batch, stride_a, 0, stride_c, 0.5f, A.data(), B.data(), 1.0f, want.data(),
                         f32_scratch.data(), threads);
        gemm_f16_batched(s, batch, stride_a, 0, stride_c, 0.5f, A16.data(), B16.data(), 1.0f, got.data(),
                         f16_scratch.data(), threads);
        EXPECT_TRUE(f16_scratch.canary_intact()) << "wrote past the reported scratch size";
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
            << "trans_a " << trans_a << " trans_b " << trans_b << " threads " << threads;
        std::vector<float> one_want(M * s.ldc, 0.0f), one_got(M * s.ldc, 0.0f);
        Scratch one_f32(gemm_f32_scratch_bytes(s, threads)), one_f16(gemm_f16_scratch_bytes(s, threads));
        gemm_f32(s, 1.0f, A.data(), B.data(), 0.0f, one_want.data(), one_f32.data(), threads);
        gemm_f16(s, 1.0f, A16.data(), B16.data(), 0.0f, one_got.data(), one_f16.data(), threads);
        EXPECT_TRUE(one_f16.canary_intact());
        ASSERT_EQ(std::memcmp(one_want.data(), one_got.data(), one_want.size() * sizeof(float)), 0);
      }
}

TEST(GemmBenchmark, MeasuresPositiveThroughputAndRejectsBadShapes) {
  EXPECT_GT(measure_matmul_gflops(64, 48, 32, /*bf16=*/false, 1, 1), 0.0);
  EXPECT_GT(measure_matmul_gflops(64, 48, 32, /*bf16=*/true, 1, 1), 0.0);
  try {
    measure_matmul_gflops(0, 8, 8, false, 1);
    FAIL() << "no error for M = 0";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "measure_matmul_gflops: dimensions must be positive, got 0 x 8 x 8");
  }
}

}  // namespace
}  // namespace fusetrain::kernels
