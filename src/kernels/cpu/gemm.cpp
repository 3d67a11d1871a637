// Blocked GEMM in the Goto/BLIS style.
//
// Legend: M, N, K problem dims; MR x NR register tile of C; KC depth of a packed
// block; NC width of a packed B block; kd packed depth (KC, or KC/2 for bf16 pairs).
//
// Per thread:  for jc (NC):  for pc (KC):  pack B (kc, nc) into NR-wide panels
//                  for ic (MR):  pack A (mr, kc) into one MR-tall panel (reused from L1)
//                      for jr (NR):  microkernel, B panels streamed from L2/L3
// Threads each own a rectangle of C (split along M and/or N), so they share
// nothing and never synchronise; each packs its own panels in its scratch slice.
// When the threads run at different speeds (another process on a core), C is cut
// into more rectangles, taken from a shared counter (kernels/cpu/thread_balance.h).
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/thread_balance.h"

#include "fusetrain/core/cpu.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/quant.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#define FT_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define FT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define FT_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define FT_INLINE inline __attribute__((always_inline))

namespace fusetrain::kernels {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

int thread_count() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

float to_f32(float x) { return x; }
float to_f32(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------
// Operands and packing
// ---------------------------------------------------------------------------

// A matrix seen as (x, k): element (x, k) is p[x * xs + k * ks]. For A, x = i;
// for B, x = j. Transposition is just a choice of strides; one of xs, ks is always 1.
template <typename T>
struct Operand {
  const T* p;
  int64_t xs, ks;
  const T* at(int64_t x, int64_t k) const { return p + x * xs + k * ks; }
};

// B as a 4-bit quantised weight W (quant::QuantMatrix): x along W's rows and k along its columns (x_is_row: the
// product x·Wᵀ), or the other way round (dy·W). Elements are dequantised as the panels are packed.
struct QuantOperand {
  const quant::QuantMatrix* w;
  int64_t x0, k0;
  bool x_is_row;
  float at(int64_t x, int64_t k) const { return x_is_row ? w->at(x0 + x, k0 + k) : w->at(k0 + k, x0 + x); }
};

// dst: (kc, R), dst[k * R + x] = src(x, k) for x < w, zero for w <= x < R.
template <int R, typename T>
void pack_panel(float* __restrict dst, const T* __restrict src, int64_t xs, int64_t ks, int w, int64_t kc) {
  if (xs == 1) {
    if constexpr (std::is_same_v<T, float>) {
      if (w == R) {  // whole panels: a fixed-size copy a row, inlined (GCC makes the loop a memmove call)
        for (int64_t k = 0; k < kc; k++) std::memcpy(dst + k * R, src + k * ks, R * sizeof(float));
        return;
      }
    }
    for (int64_t k = 0; k < kc; k++) {
      const T* s = src + k * ks;
      float* d = dst + k * R;
      for (int x = 0; x < w; x++) d[x] = to_f32(s[x]);
      for (int x = w; x < R; x++) d[x] = 0.0f;
    }
    return;
  }
  for (int x = 0; x < w; x++) {
    const T* s = src + x * xs;
    for (int64_t k = 0; k < kc; k++) dst[k * R + x] = to_f32(s[k]);
  }
  for (int x = w; x < R; x++)
    for (int64_t k = 0; k < kc; k++) dst[k * R + x] = 0.0f;
}

// ---------------------------------------------------------------------------
// Microkernels: c (mr, nr) = alpha * a_pack (kd, MR)^T * b_pack (kd, NR) + beta * c
// ---------------------------------------------------------------------------

// Scalar write-back of a (MR, NR) accumulator tile.
template <int MR, int NR>
void store_tile(const float (&acc)[MR][NR], float* c, int64_t ldc, int mr, int nr, float alpha, float beta) {
  for (int i = 0; i < mr; i++) {
    float* ci = c + i * ldc;
    for (int j = 0; j < nr; j++) {
      float v = alpha * acc[i][j];
      ci[j] = beta == 0.0f ? v : v + beta * ci[j];
    }
  }
}

// Plain-loop packing; the AVX-512 kernels replace it for operands contiguous along k.
struct GenericPacking {
  template <int R, typename Packed, typename T>
  static void pack(Packed* dst, const T* src, int64_t xs, int64_t ks, int w, int64_t kc) {
    pack_panel<R>(dst, src, xs, ks, w, kc);
  }
};

struct KernelF32Portable : GenericPacking {
  using Packed = float;
  static constexpr int MR = 4, NR = 8, KC = 256, NC = 1024, KSTEP = 1;

  static void micro(int64_t kd, const float* a, const float* b, float* c, int64_t ldc, int mr, int nr, float alpha,
                    float beta) {
    float acc[MR][NR] = {};
    for (int64_t k = 0; k < kd; k++, a += MR, b += NR)
      for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] += a[i] * b[j];
    store_tile(acc, c, ldc, mr, nr, alpha, beta);
  }
};

struct KernelF32Avx2 : GenericPacking {
  using Packed = float;
  static constexpr int MR = 6, NR = 16, KC = 256, NC = 768, KSTEP = 1;

  FT_TARGET_AVX2 static void micro(int64_t kd, const float* a, const float* b, float* c, int64_t ldc, int mr, int nr,
                                   float alpha, float beta) {
    // Every loop over acc is unrolled: indexed only by constants, the 12 accumulators stay in registers (a rolled
    // loop here kept them on the stack, one store per FMA, which halved the kernel's speed on a Zen 1). alpha and
    // beta go to memory for the loop: in registers they leave 14 of the 15 the loop needs, and one accumulator spills.
    asm("" : "+m"(alpha), "+m"(beta));
    __m256 acc[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kd; k++, a += MR, b += NR) {
      __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
      for (int i = 0; i < MR; i++) {
        __m256 ai = _mm256_broadcast_ss(a + i);
        acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
      }
    }
    if (mr == MR && nr == NR) {
      __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
#pragma GCC unroll 6
      for (int i = 0; i < MR; i++) {
        float* ci = c + i * ldc;
        __m256 r0 = _mm256_mul_ps(va, acc[i][0]), r1 = _mm256_mul_ps(va, acc[i][1]);
        if (beta != 0.0f) {
          r0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(ci), r0);
          r1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(ci + 8), r1);
        }
        _mm256_storeu_ps(ci, r0);
        _mm256_storeu_ps(ci + 8, r1);
      }
      return;
    }
    float tile[MR][NR];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
      _mm256_storeu_ps(tile[i], acc[i][0]);
      _mm256_storeu_ps(tile[i] + 8, acc[i][1]);
    }
    store_tile(tile, c, ldc, mr, nr, alpha, beta);
  }
};

// In-register transpose of 16 rows of 16 32-bit lanes: four rounds of interleaving rows i and i + 8.
FT_TARGET_AVX512 FT_INLINE void transpose_16x16(__m512 (&v)[16]) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
#pragma GCC unroll 4
  for (int round = 0; round < 4; round++) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
      t[2 * i] = _mm512_permutex2var_ps(v[i], lo, v[i + 8]);
      t[2 * i + 1] = _mm512_permutex2var_ps(v[i], hi, v[i + 8]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) v[i] = t[i];
  }
}

// Packing of an operand contiguous along k (32-bit lanes: floats or bf16 pairs) by 16x16 transposes.
// dst: (kd, R), dst[k * R + x] = row x at `src + x * row_bytes`, lane k; rows w <= x < R are zero.
template <int R>
FT_TARGET_AVX512 void pack_transposed_avx512(void* dst, const void* src, int64_t row_bytes, int w, int64_t kd) {
  float* d = static_cast<float*>(dst);
  const char* s = static_cast<const char*>(src);
  for (int64_t k0 = 0; k0 < kd; k0 += 16) {
    int kn = int(std::min<int64_t>(16, kd - k0));
    __mmask16 load_mask = __mmask16((1u << kn) - 1);
    for (int g = 0; g < R; g += 16) {
      __m512 v[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; r++) {
        v[r] = _mm512_setzero_ps();
        if (g + r >= w) continue;
        const char* row = s + (g + r) * row_bytes + k0 * 4;
        _mm_prefetch(row + 128, _MM_HINT_T0);  // two lines ahead: 16 rows are more streams than hardware tracks
        v[r] = _mm512_maskz_loadu_ps(load_mask, row);
      }
      transpose_16x16(v);
      __mmask16 store_mask = __mmask16((1u << std::min(16, R - g)) - 1);
      for (int k = 0; k < kn; k++) _mm512_mask_storeu_ps(d + (k0 + k) * R + g, store_mask, v[k]);
    }
  }
}

// Packing of an fp32 operand contiguous along x: dst[k * R + x] = src[k * ks + x], zero for x >= w.
template <int R>
FT_TARGET_AVX512 void pack_rows_avx512(float* dst, const float* src, int64_t ks, int w, int64_t kc) {
  for (int64_t k = 0; k < kc; k++, dst += R) {
#pragma GCC unroll 2
    for (int g = 0; g < R; g += 16) {
      __mmask16 load_mask = __mmask16((1u << std::clamp(w - g, 0, 16)) - 1);
      __mmask16 store_mask = __mmask16((1u << std::min(16, R - g)) - 1);
      _mm512_mask_storeu_ps(dst + g, store_mask, _mm512_maskz_loadu_ps(load_mask, src + k * ks + g));
    }
  }
}

// bf16 packing of an operand contiguous along x: interleave rows k and k + 1 into 32-bit pairs.
// dst: (ceil(kc/2), R) words as in KernelBf16Avx512::pack; R <= 32.
template <int R>
FT_TARGET_AVX512 void pack_interleaved_avx512(uint32_t* dst, const uint16_t* src, int64_t ks, int w, int64_t kc) {
  static const uint16_t order[64] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                     8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
                                     16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_loadu_si512(order), hi = _mm512_loadu_si512(order + 32);
  __mmask32 row_mask = __mmask32((uint64_t(1) << w) - 1);
  __mmask16 lo_mask = __mmask16((1u << std::min(R, 16)) - 1), hi_mask = __mmask16((1u << std::max(R - 16, 0)) - 1);
  for (int64_t k = 0; k < kc; k += 2, dst += R) {
    __m512i r0 = _mm512_maskz_loadu_epi16(row_mask, src + k * ks);
    __m512i r1 = k + 1 < kc ? _mm512_maskz_loadu_epi16(row_mask, src + (k + 1) * ks) : _mm512_setzero_si512();
    _mm512_mask_storeu_epi32(dst, lo_mask, _mm512_permutex2var_epi16(r0, lo, r1));
    if (R > 16) _mm512_mask_storeu_epi32(dst + 16, hi_mask, _mm512_permutex2var_epi16(r0, hi, r1));
  }
}

// Write-back of a (ROWS, 32) tile held in zmm pairs; masked for nr < 32.
template <int ROWS>
FT_TARGET_AVX512 FT_INLINE void store_tile_avx512(__m512 (&acc)[ROWS][2], float* c, int64_t ldc, int nr, float alpha,
                                                  float beta) {
  __mmask16 m0 = nr >= 16 ? 0xFFFF : (1u << nr) - 1;
  __mmask16 m1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : (1u << (nr - 16)) - 1;
  __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
  for (int i = 0; i < ROWS; i++) {
    float* ci = c + i * ldc;
    __m512 r0 = _mm512_mul_ps(va, acc[i][0]), r1 = _mm512_mul_ps(va, acc[i][1]);
    if (beta != 0.0f) {
      r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, ci), r0);
      r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, ci + 16), r1);
    }
    _mm512_mask_storeu_ps(ci, m0, r0);
    _mm512_mask_storeu_ps(ci + 16, m1, r1);
  }
}

// Kernel::micro_rows<mr> for a runtime mr in [1, Kernel::MR].
template <class Kernel, int... Rows>
auto row_kernel_table(std::integer_sequence<int, Rows...>) {
  using Fn = decltype(&Kernel::template micro_rows<1>);
  static constexpr Fn table[] = {&Kernel::template micro_rows<Rows + 1>...};
  return table;
}

template <class Kernel>
auto row_kernel(int mr) {
  return row_kernel_table<Kernel>(std::make_integer_sequence<int, Kernel::MR>{})[mr - 1];
}

struct KernelF32Avx512 {
  using Packed = float;
  static constexpr int MR = 14, NR = 32, KC = 384, NC = 768, KSTEP = 1;

  template <int R, typename T>
  static void pack(float* dst, const T* src, int64_t xs, int64_t ks, int w, int64_t kc) {
    if constexpr (std::is_same_v<T, float>) {
      if (xs == 1) return pack_rows_avx512<R>(dst, src, ks, w, kc);
      if (ks == 1) return pack_transposed_avx512<R>(dst, src, xs * 4, w, kc);
    }
    pack_panel<R>(dst, src, xs, ks, w, kc);
  }

  // Tiles of mr < MR rows run a kernel with only mr accumulator rows (see row_kernel).
  //
  // Two software prefetches hide the memory the tile waits on: C's rows, requested before the k loop so they
  // arrive while it runs (C is written back once per KC block, from L3 or memory when the product is large), and
  // the B panel four k steps ahead (it streams from L2). Measured on an Ice Lake Xeon, 2 threads, the best of 6
  // alternated runs: 1024x1024x384 259.6 -> 277.5 GFLOP/s, 2048^3 244.7 -> 258.8, 6304x768x3072 257.1 -> 269.8.
  template <int ROWS>
  FT_TARGET_AVX512 static void micro_rows(int64_t kd, const float* a, const float* b, float* c, int64_t ldc, int nr,
                                          float alpha, float beta) {
#pragma GCC unroll 14
    for (int i = 0; i < ROWS; i++) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 16), _MM_HINT_T0);
    }
    __m512 acc[ROWS][2];
#pragma GCC unroll 14
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kd; k++, a += MR, b += NR) {
      _mm_prefetch(reinterpret_cast<const char*>(b + 4 * NR), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + 4 * NR + 16), _MM_HINT_T0);
      __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 14
      for (int i = 0; i < ROWS; i++) {
        __m512 ai = _mm512_set1_ps(a[i]);
        acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
      }
    }
    store_tile_avx512(acc, c, ldc, nr, alpha, beta);
  }

  static void micro(int64_t kd, const float* a, const float* b, float* c, int64_t ldc, int mr, int nr, float alpha,
                    float beta) {
    row_kernel<KernelF32Avx512>(mr)(kd, a, b, c, ldc, nr, alpha, beta);
  }
};

// Each 32-bit lane of a and b holds a bf16 pair along k; vdpbf16ps adds both products.
struct KernelBf16Avx512 {
  using Packed = uint32_t;
  static constexpr int MR = 14, NR = 32, KC = 768, NC = 768, KSTEP = 2;

  // Contiguous along x: interleave rows. Contiguous along k, a pair is one 32-bit word: transpose
  // words, then the odd last k alone. dst: (ceil(kc/2), R) words, dst[p * R + x] = src(x, 2p) | src(x, 2p + 1) << 16.
  template <int R>
  static void pack(uint32_t* dst, const uint16_t* src, int64_t xs, int64_t ks, int w, int64_t kc) {
    if (xs == 1) return pack_interleaved_avx512<R>(dst, src, ks, w, kc);
    int64_t kp = kc / 2;
    pack_transposed_avx512<R>(dst, src, xs * 2, w, kp);
    if (kc % 2)
      for (int x = 0; x < R; x++) dst[kp * R + x] = x < w ? src[x * xs + kc - 1] : 0;
  }

  template <int ROWS>
  FT_TARGET_AVX512_BF16 static void micro_rows(int64_t kd, const uint32_t* a, const uint32_t* b, float* c, int64_t ldc,
                                               int nr, float alpha, float beta) {
    // C's rows, when the tile adds into them (a K block after the first): requested before the k loop, as in the
    // f32 kernel, so they arrive while it runs.
    if (beta != 0.0f) {
#pragma GCC unroll 14
      for (int i = 0; i < ROWS; i++) {
        _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 16), _MM_HINT_T0);
      }
    }
    __m512 acc[ROWS][2];
#pragma GCC unroll 14
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kd; k++, a += MR, b += NR) {
      __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 16);
#pragma GCC unroll 14
      for (int i = 0; i < ROWS; i++) {
        __m512bh ai = (__m512bh)_mm512_set1_epi32(int(a[i]));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
      }
    }
    store_tile_avx512(acc, c, ldc, nr, alpha, beta);
  }

  static void micro(int64_t kd, const uint32_t* a, const uint32_t* b, float* c, int64_t ldc, int mr, int nr,
                    float alpha, float beta) {
    row_kernel<KernelBf16Avx512>(mr)(kd, a, b, c, ldc, nr, alpha, beta);
  }
};

// ---------------------------------------------------------------------------
// Drivers
// ---------------------------------------------------------------------------

// Packs B's panel at (x, k), w wide and kc deep, as Kernel lays its packed B out.
template <class Kernel, int R, typename T>
void pack_b(typename Kernel::Packed* dst, const Operand<T>& b, int64_t x, int64_t k, int w, int64_t kc) {
  Kernel::template pack<R>(dst, b.at(x, k), b.xs, b.ks, w, kc);
}

// A quantised B, dequantised into the panel: f32 values (k, R), or for the bf16 kernel bf16 pairs along k.
template <class Kernel, int R>
void pack_b(typename Kernel::Packed* dst, const QuantOperand& b, int64_t x, int64_t k, int w, int64_t kc) {
  using Packed = typename Kernel::Packed;
  if constexpr (std::is_same_v<Packed, float>) {
    if (b.x_is_row) {
      for (int xi = 0; xi < w; xi++)
        for (int64_t kk = 0; kk < kc; kk++) dst[kk * R + xi] = b.at(x + xi, k + kk);
    } else {
      for (int64_t kk = 0; kk < kc; kk++)
        for (int xi = 0; xi < w; xi++) dst[kk * R + xi] = b.at(x + xi, k + kk);
    }
    for (int64_t kk = 0; kk < kc; kk++)
      for (int xi = w; xi < R; xi++) dst[kk * R + xi] = 0.0f;
  } else {
    const int64_t pairs = (kc + 1) / 2;
    for (int64_t p = 0; p < pairs; p++)
      for (int xi = 0; xi < R; xi++) {
        uint32_t lo = 0, hi = 0;
        if (xi < w) {
          lo = float_to_bf16(b.at(x + xi, k + 2 * p));
          if (2 * p + 1 < kc) hi = float_to_bf16(b.at(x + xi, k + 2 * p + 1));
        }
        dst[p * R + xi] = lo | hi << 16;
      }
  }
}

template <typename T>
Operand<T> b_at(const Operand<T>& b, int64_t x) {
  return {b.at(x, 0), b.xs, b.ks};
}
inline QuantOperand b_at(const QuantOperand& b, int64_t x) { return {b.w, b.x0 + x, b.k0, b.x_is_row}; }

template <class Kernel>
size_t kernel_thread_bytes(int64_t N, int64_t K) {
  int64_t kd = ceil_div(std::min<int64_t>(K, Kernel::KC), Kernel::KSTEP);
  int64_t b_elems = round_up(kd * round_up(std::min<int64_t>(N, Kernel::NC), Kernel::NR), 16);
  int64_t a_elems = round_up(kd * Kernel::MR, 16);
  return size_t(b_elems + a_elems) * sizeof(typename Kernel::Packed);
}

// Packed operands, then (for a call without C) one (MR, NC) f32 strip of C, 64-byte aligned.
template <class Kernel>
size_t kernel_thread_bytes_with_strip(int64_t N, int64_t K) {
  return size_t(round_up(int64_t(kernel_thread_bytes<Kernel>(N, K)), 64)) + size_t(Kernel::MR * Kernel::NC) * 4;
}

// Bytes of one thread's slice: the largest any path needs, so the size never depends on the path taken.
size_t thread_scratch_bytes(const GemmShape& s) {
  size_t bytes = std::max({kernel_thread_bytes_with_strip<KernelF32Portable>(s.N, s.K),
                           kernel_thread_bytes_with_strip<KernelF32Avx2>(s.N, s.K),
                           kernel_thread_bytes_with_strip<KernelF32Avx512>(s.N, s.K),
                           kernel_thread_bytes_with_strip<KernelBf16Avx512>(s.N, s.K)});
  return size_t(round_up(int64_t(bytes), 64));
}

char* thread_scratch(void* scratch, size_t slice_bytes, int t) {
  uintptr_t base = (reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63);
  return reinterpret_cast<char*>(base) + size_t(t) * slice_bytes;
}

// C (M, N) = alpha * a (M, K) * b (K, N) + beta * C on one thread; requires K > 0. This C is
// the block of the whole product at (row0, col0), which is what the epilogue is told. Without C
// (null; K within one KC block, beta 0) each strip goes to an (MR, NC) buffer in `work` and the
// epilogue alone consumes it.
template <class Kernel, typename T, typename BOperand>
void gemm_serial(int64_t M, int64_t N, int64_t K, float alpha, Operand<T> a, BOperand b, float beta, float* C,
                 int64_t ldc, char* work, const GemmEpilogue* epilogue = nullptr, int64_t row0 = 0, int64_t col0 = 0) {
  using Packed = typename Kernel::Packed;
  constexpr int MR = Kernel::MR, NR = Kernel::NR;
  int64_t kd_max = ceil_div(std::min<int64_t>(K, Kernel::KC), Kernel::KSTEP);
  Packed* b_pack = reinterpret_cast<Packed*>(work);  // (nc / NR) panels of (kd, NR)
  Packed* a_pack = b_pack + round_up(kd_max * round_up(std::min<int64_t>(N, Kernel::NC), NR), 16);  // (kd, MR)
  float* strip = C ? nullptr : reinterpret_cast<float*>(work + round_up(int64_t(kernel_thread_bytes<Kernel>(N, K)), 64));
  for (int64_t jc = 0; jc < N; jc += Kernel::NC) {
    int64_t nc = std::min<int64_t>(Kernel::NC, N - jc);
    for (int64_t pc = 0; pc < K; pc += Kernel::KC) {
      int64_t kc = std::min<int64_t>(Kernel::KC, K - pc);
      int64_t kd = ceil_div(kc, Kernel::KSTEP);
      for (int64_t jr = 0; jr < nc; jr += NR)
        pack_b<Kernel, NR>(b_pack + jr * kd, b, jc + jr, pc, int(std::min<int64_t>(NR, nc - jr)), kc);
      float beta_k = pc == 0 ? beta : 1.0f;
      for (int64_t ic = 0; ic < M; ic += MR) {
        int mr = int(std::min<int64_t>(MR, M - ic));
        Kernel::template pack<MR>(a_pack, a.at(ic, pc), a.xs, a.ks, mr, kc);
        float* c = strip ? strip : C + ic * ldc + jc;
        const int64_t ld = strip ? Kernel::NC : ldc;
        for (int64_t jr = 0; jr < nc; jr += NR)
          Kernel::micro(kd, a_pack, b_pack + jr * kd, c + jr, ld, mr, int(std::min<int64_t>(NR, nc - jr)), alpha,
                        beta_k);
        if (epilogue && pc + kc >= K)  // this strip of C is final and still in cache
          epilogue->apply(epilogue->context, c, ld, row0 + ic, col0 + jc, mr, nc);
      }
    }
  }
}

// Splits M into tm and N into tn ranges (tm * tn = threads), minimising the
// largest per-thread tile (rounded to MR x NR) plus the cost of packing it.
void choose_grid(int64_t M, int64_t N, int MR, int NR, int threads, int* tm, int* tn) {
  double best = 0.0;
  for (int m = 1; m <= threads; m++) {
    if (threads % m) continue;
    int n = threads / m;
    double um = double(ceil_div(ceil_div(M, MR), m) * MR), un = double(ceil_div(ceil_div(N, NR), n) * NR);
    double cost = um * un + 16.0 * (um + un);
    if (m == 1 || cost < best) best = cost, *tm = m, *tn = n;
  }
}

// [begin, end) of part `index` when `units` of size `unit` are split into `parts`, clamped to `total`.
void split_range(int64_t total, int64_t unit, int parts, int index, int64_t* begin, int64_t* end) {
  int64_t units = ceil_div(total, unit);
  *begin = std::min(total, units * index / parts * unit);
  *end = std::min(total, units * (index + 1) / parts * unit);
}

// The process's parallel GEMMs share one measure of their threads' balance, and the split a test may fix.
ThreadBalance& thread_balance() {
  static ThreadBalance balance;
  return balance;
}
std::atomic<GemmSplit> forced_split{GemmSplit::adaptive};

// Blocks of C per thread when the threads are not balanced. Each block packs its own panels of A and B, so more
// blocks pack more; on W3 with one competing process, 2 per thread gave a median step of 1.79-1.89 s, 4 per thread
// 1.94 s (2-core Zen 2).
constexpr int kBlocksPerThread = 2;
constexpr int kMaxMeasuredThreads = 64;  // a larger team always runs in equal blocks

template <class Kernel, typename T, typename BOperand>
void gemm_threads_on(const GemmShape& s, float alpha, Operand<T> a, BOperand b, float beta, float* C, void* scratch,
                     int threads, const GemmEpilogue* epilogue) {
  size_t slice = thread_scratch_bytes(s);
  if (threads <= 1) {
    gemm_serial<Kernel>(s.M, s.N, s.K, alpha, a, b, beta, C, s.ldc, thread_scratch(scratch, slice, 0), epilogue);
    return;
  }
  ThreadBalance& balance = thread_balance();
  const bool measured = threads <= kMaxMeasuredThreads;
  const GemmSplit split = forced_split.load(std::memory_order_relaxed);
  const bool shared = split == GemmSplit::shared || (split == GemmSplit::adaptive && measured && balance.contended());
  const int parts = threads * (shared ? kBlocksPerThread : 1);
  // Rows are split in units of whole tiles, and of whole blocks where the epilogue asks for them.
  const int64_t row_unit = epilogue ? std::lcm<int64_t>(Kernel::MR, std::max<int64_t>(epilogue->row_align, 1))
                                    : int64_t{Kernel::MR};
  int tm = 1, tn = 1;
  choose_grid(s.M, s.N, int(row_unit), Kernel::NR, parts, &tm, &tn);
  double work[kMaxMeasuredThreads] = {}, seconds[kMaxMeasuredThreads] = {};
  std::atomic<int> next{0};
  int team = 1;
#pragma omp parallel num_threads(threads)
  {
    const int t = thread_id(), nt = thread_count();
    if (t == 0) team = nt;
    char* work_t = thread_scratch(scratch, slice, t);
    const auto start = std::chrono::steady_clock::now();
    double done = 0.0;
    // Equal blocks go to their own thread (each thread keeps the rows it wrote last time in its cache); shared
    // blocks to whichever thread asks next.
    auto first = [&] { return shared ? next.fetch_add(1, std::memory_order_relaxed) : t; };
    auto after = [&](int c) { return shared ? next.fetch_add(1, std::memory_order_relaxed) : c + nt; };
    for (int c = first(); c < parts; c = after(c)) {
      int64_t m0, m1, n0, n1;
      split_range(s.M, row_unit, tm, c / tn, &m0, &m1);
      split_range(s.N, Kernel::NR, tn, c % tn, &n0, &n1);
      if (m0 >= m1 || n0 >= n1) continue;
      Operand<T> a_t{a.at(m0, 0), a.xs, a.ks};
      gemm_serial<Kernel>(m1 - m0, n1 - n0, s.K, alpha, a_t, b_at(b, n0), beta, C ? C + m0 * s.ldc + n0 : nullptr,
                          s.ldc, work_t, epilogue, m0, n0);
      done += double(m1 - m0) * double(n1 - n0);
    }
    if (measured) {
      work[t] = done;
      seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  if (measured) balance.record(work, seconds, team);
}

template <class Kernel, typename T>
void gemm_threads(const GemmShape& s, float alpha, const T* A, const T* B, float beta, float* C, void* scratch,
                  int threads, const GemmEpilogue* epilogue) {
  Operand<T> a{A, s.trans_a ? 1 : s.lda, s.trans_a ? s.lda : 1};
  Operand<T> b{B, s.trans_b ? s.ldb : 1, s.trans_b ? 1 : s.ldb};
  gemm_threads_on<Kernel>(s, alpha, a, b, beta, C, scratch, threads, epilogue);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

enum class Isa { portable, avx2, avx512, avx512_bf16 };

// From the engine's own CPUID reading (cpu_features), as every kernel's path: the compiler runtime's
// __builtin_cpu_supports is not filled in by every toolchain (zig's, which builds the wheel, reports nothing).
Isa detect_isa() {
  const CpuFeatures& f = cpu_features();
  bool avx2 = f.avx2 && f.fma;
  bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  if (avx512 && f.avx512_bf16) return Isa::avx512_bf16;
  if (avx512) return Isa::avx512;
  return avx2 ? Isa::avx2 : Isa::portable;
}

// Best ISA of this CPU, capped by FUSETRAIN_GEMM (portable | avx2 | avx512); read on every call.
Isa select_isa() {
  static const Isa best = detect_isa();
  const char* forced = std::getenv("FUSETRAIN_GEMM");
  Isa cap = Isa::avx512_bf16;
  if (forced && std::strcmp(forced, "portable") == 0) cap = Isa::portable;
  if (forced && std::strcmp(forced, "avx2") == 0) cap = Isa::avx2;
  if (forced && std::strcmp(forced, "avx512") == 0) cap = Isa::avx512;
  return std::min(best, cap);
}

// C = beta * C, the whole result when K == 0 or alpha == 0.
void scale_c(const GemmShape& s, float beta, float* C) {
  for (int64_t i = 0; i < s.M; i++) {
    float* c = C + i * s.ldc;
    for (int64_t j = 0; j < s.N; j++) c[j] = beta == 0.0f ? 0.0f : beta * c[j];
  }
}

template <typename T>
void gemm_any(Isa isa, const GemmShape& s, float alpha, const T* A, const T* B, float beta, float* C, void* scratch,
              int threads, const GemmEpilogue* epilogue = nullptr) {
  if (s.M <= 0 || s.N <= 0) return;
  if (s.K <= 0 || alpha == 0.0f) {
    scale_c(s, beta, C);
    if (epilogue) epilogue->apply(epilogue->context, C, s.ldc, 0, 0, s.M, s.N);
    return;
  }
  if (2.0 * double(s.M) * double(s.N) * double(s.K) < 2e5) threads = 1;  // a parallel region costs more
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (isa == Isa::avx512_bf16)
      return gemm_threads<KernelBf16Avx512>(s, alpha, A, B, beta, C, scratch, threads, epilogue);
  }
  // Without vdpbf16ps, bf16 operands are widened to fp32 while packing.
  if (isa >= Isa::avx512) {
    gemm_threads<KernelF32Avx512>(s, alpha, A, B, beta, C, scratch, threads, epilogue);
  } else if (isa == Isa::avx2) {
    gemm_threads<KernelF32Avx2>(s, alpha, A, B, beta, C, scratch, threads, epilogue);
  } else {
    gemm_threads<KernelF32Portable>(s, alpha, A, B, beta, C, scratch, threads, epilogue);
  }
}

// Whole batches per thread when they divide evenly or are plentiful, else all threads on each batch.
template <typename T>
void gemm_batched_any(const GemmShape& s, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                      float alpha, const T* A, const T* B, float beta, float* C, void* scratch, int threads) {
  Isa isa = select_isa();
  if (threads <= 1 || (batch % threads != 0 && batch < 4 * threads)) {
    for (int64_t b = 0; b < batch; b++)
      gemm_any(isa, s, alpha, A + b * stride_a, B + b * stride_b, beta, C + b * stride_c, scratch, threads);
    return;
  }
  size_t slice = thread_scratch_bytes(s);
#pragma omp parallel num_threads(threads)
  {
    int64_t b0, b1;
    split_range(batch, 1, thread_count(), thread_id(), &b0, &b1);
    void* work = thread_scratch(scratch, slice, thread_id());
    for (int64_t b = b0; b < b1; b++)
      gemm_any(isa, s, alpha, A + b * stride_a, B + b * stride_b, beta, C + b * stride_c, work, 1);
  }
}

template <typename T>
void gemm_quant4(const GemmShape& s, const T* A, const quant::QuantMatrix& W, float* C, void* scratch, int threads,
                 const GemmEpilogue* epilogue) {
  if (s.M <= 0 || s.N <= 0) return;
  if (s.K <= 0) {
    scale_c(s, 0.0f, C);
    if (epilogue) epilogue->apply(epilogue->context, C, s.ldc, 0, 0, s.M, s.N);
    return;
  }
  if (2.0 * double(s.M) * double(s.N) * double(s.K) < 2e5) threads = 1;
  const Isa isa = select_isa();
  Operand<T> a{A, s.trans_a ? 1 : s.lda, s.trans_a ? s.lda : 1};
  const QuantOperand b{&W, 0, 0, s.trans_b};
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (isa == Isa::avx512_bf16 && W.bf16)
      return gemm_threads_on<KernelBf16Avx512>(s, 1.0f, a, b, 0.0f, C, scratch, threads, epilogue);
  }
  if (isa >= Isa::avx512)
    gemm_threads_on<KernelF32Avx512>(s, 1.0f, a, b, 0.0f, C, scratch, threads, epilogue);
  else if (isa == Isa::avx2)
    gemm_threads_on<KernelF32Avx2>(s, 1.0f, a, b, 0.0f, C, scratch, threads, epilogue);
  else
    gemm_threads_on<KernelF32Portable>(s, 1.0f, a, b, 0.0f, C, scratch, threads, epilogue);
}

}  // namespace

size_t gemm_quant4_scratch_bytes(const GemmShape& shape, int num_threads) {
  return thread_scratch_bytes(shape) * size_t(std::max(num_threads, 1)) + 64;
}

void gemm_quant4_f32(const GemmShape& shape, const float* A, const quant::QuantMatrix& W, float* C, void* scratch,
                     int num_threads, const GemmEpilogue* epilogue) {
  gemm_quant4(shape, A, W, C, scratch, num_threads, epilogue);
}

void gemm_quant4_bf16(const GemmShape& shape, const uint16_t* A, const quant::QuantMatrix& W, float* C, void* scratch,
                      int num_threads, const GemmEpilogue* epilogue) {
  gemm_quant4(shape, A, W, C, scratch, num_threads, epilogue);
}

void set_gemm_split(GemmSplit split) { forced_split.store(split, std::memory_order_relaxed); }

size_t gemm_f32_scratch_bytes(const GemmShape& shape, int num_threads) {
  return size_t(std::max(num_threads, 1)) * thread_scratch_bytes(shape) + 64;
}

size_t gemm_bf16_scratch_bytes(const GemmShape& shape, int num_threads) {
  return gemm_f32_scratch_bytes(shape, num_threads);
}

size_t gemm_f32_batched_scratch_bytes(const GemmShape& shape, int64_t, int num_threads) {
  return gemm_f32_scratch_bytes(shape, num_threads);
}

size_t gemm_bf16_batched_scratch_bytes(const GemmShape& shape, int64_t, int num_threads) {
  return gemm_f32_scratch_bytes(shape, num_threads);
}

int64_t gemm_strip_max_k(bool bf16_operands) {
  switch (select_isa()) {
    case Isa::avx512_bf16:
      return bf16_operands ? KernelBf16Avx512::KC : KernelF32Avx512::KC;
    case Isa::avx512:
      return KernelF32Avx512::KC;
    case Isa::avx2:
      return KernelF32Avx2::KC;
    default:
      return KernelF32Portable::KC;
  }
}

void gemm_f32(const GemmShape& shape, float alpha, const float* A, const float* B, float beta, float* C, void* scratch,
              int num_threads, const GemmEpilogue* epilogue) {
  gemm_any(select_isa(), shape, alpha, A, B, beta, C, scratch, num_threads, epilogue);
}

void gemm_bf16(const GemmShape& shape, float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C,
               void* scratch, int num_threads, const GemmEpilogue* epilogue) {
  gemm_any(select_isa(), shape, alpha, A, B, beta, C, scratch, num_threads, epilogue);
}

void gemm_f32_batched(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                      float alpha, const float* A, const float* B, float beta, float* C, void* scratch,
                      int num_threads) {
  gemm_batched_any(shape, batch, stride_a, stride_b, stride_c, alpha, A, B, beta, C, scratch, num_threads);
}

void gemm_bf16_batched(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                       float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C, void* scratch,
                       int num_threads) {
  gemm_batched_any(shape, batch, stride_a, stride_b, stride_c, alpha, A, B, beta, C, scratch, num_threads);
}

// ---- f16 operands: converted to f32 in scratch, then the f32 GEMM --------------------------

namespace {

// Elements spanned by one stored operand: rows of `ld` elements, the last one `cols` long.
int64_t operand_extent(int64_t rows, int64_t cols, int64_t ld) { return rows == 0 ? 0 : (rows - 1) * ld + cols; }
int64_t extent_a(const GemmShape& s) {
  return s.trans_a ? operand_extent(s.K, s.M, s.lda) : operand_extent(s.M, s.K, s.lda);
}
int64_t extent_b(const GemmShape& s) {
  return s.trans_b ? operand_extent(s.N, s.K, s.ldb) : operand_extent(s.K, s.N, s.ldb);
}
int64_t batched_extent(int64_t one, int64_t batch, int64_t stride) {
  return batch > 0 ? one + (batch - 1) * stride : 0;
}
size_t floats_bytes(int64_t n) { return static_cast<size_t>((n + 15) / 16 * 16) * sizeof(float); }

void convert_f16(float* dst, const uint16_t* src, int64_t n, int num_threads) {
  constexpr int64_t kChunk = 1 << 15;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (num_threads <= 1 || chunks == 1) {
    f16_to_float(dst, src, static_cast<size_t>(n));
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    f16_to_float(dst + c * kChunk, src + c * kChunk, static_cast<size_t>(std::min(kChunk, n - c * kChunk)));
}

}  // namespace

size_t gemm_f16_scratch_bytes(const GemmShape& shape, int num_threads) {
  return floats_bytes(extent_a(shape)) + floats_bytes(extent_b(shape)) + gemm_f32_scratch_bytes(shape, num_threads);
}

void gemm_f16(const GemmShape& shape, float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C,
              void* scratch, int num_threads, const GemmEpilogue* epilogue) {
  const int64_t na = extent_a(shape), nb = extent_b(shape);
  float* a = static_cast<float*>(scratch);
  float* b = reinterpret_cast<float*>(reinterpret_cast<char*>(a) + floats_bytes(na));
  void* rest = reinterpret_cast<char*>(b) + floats_bytes(nb);
  convert_f16(a, A, na, num_threads);
  convert_f16(b, B, nb, num_threads);
  gemm_f32(shape, alpha, a, b, beta, C, rest, num_threads, epilogue);
}

size_t gemm_f16_batched_scratch_bytes(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b,
                                      int num_threads) {
  return floats_bytes(batched_extent(extent_a(shape), batch, stride_a)) +
         floats_bytes(batched_extent(extent_b(shape), batch, stride_b)) +
         gemm_f32_batched_scratch_bytes(shape, batch, num_threads);
}

void gemm_f16_batched(const GemmShape& shape, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                      float alpha, const uint16_t* A, const uint16_t* B, float beta, float* C, void* scratch,
                      int num_threads) {
  const int64_t na = batched_extent(extent_a(shape), batch, stride_a);
  const int64_t nb = batched_extent(extent_b(shape), batch, stride_b);
  float* a = static_cast<float*>(scratch);
  float* b = reinterpret_cast<float*>(reinterpret_cast<char*>(a) + floats_bytes(na));
  void* rest = reinterpret_cast<char*>(b) + floats_bytes(nb);
  convert_f16(a, A, na, num_threads);
  convert_f16(b, B, nb, num_threads);
  gemm_f32_batched(shape, batch, stride_a, stride_b, stride_c, alpha, a, b, beta, C, rest, num_threads);
}

}  // namespace fusetrain::kernels
