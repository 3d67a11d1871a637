// Philox4x32-10 of kernels/rng.h on 16 counters at once, the one vector copy every tuned
// kernel that draws dropout masks uses (dropout.cpp, attention.cpp, layernorm.cpp through
// dropout_range_fn). tests/kernels/test_cpu_basic_kernels.cpp checks it against the scalar
// philox4x32 bit for bit. Callers carry FT_AVX512 and run only after use_avx512().
#pragma once

#include <cstdint>

#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {

/// Four words per lane: lane l of w[j] is word j of philox4x32 on lane l's counter.
struct Philox16 {
  __m512i w[4];
};

/// 32x32 -> 64 bit products of 16 lanes: high and low halves.
FT_AVX512_INLINE void mulhilo16(__m512i a, __m512i multiplier, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, multiplier);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), multiplier);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

/// philox4x32(c0[l], c1[l], offset, offset >> 32, seed, seed >> 32) for the 16 lanes l:
/// the counter of stream block (c1[l] << 32 | c0[l]) at step `offset` (kernels/rng.h).
FT_AVX512_INLINE Philox16 philox4x32_16(__m512i c0, __m512i c1, uint64_t offset, uint64_t seed) {
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m512i c2 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  __m512i c3 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(c0, mul0, &hi0, &lo0);
    mulhilo16(c2, mul1, &hi1, &lo1);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

/// The 64 words of 16 consecutive blocks in stream order: word j of block b is stream element
/// 4·b + j, and ordered[q] holds elements 16q .. 16q + 15.
FT_AVX512_INLINE void philox_element_order(const Philox16& r, __m512i ordered[4]) {
  // Interleave lanes of two vectors: pairs (a[l], b[l]) for l = 0..7 and l = 8..15.
  const __m512i pair_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i pair_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  // Interleave 64-bit pairs: quads for lanes 0..3 and 4..7 of the pair vectors.
  const __m512i quad_lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  const __m512i quad_hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i p01_lo = _mm512_permutex2var_epi32(r.w[0], pair_lo, r.w[1]);
  const __m512i p01_hi = _mm512_permutex2var_epi32(r.w[0], pair_hi, r.w[1]);
  const __m512i p23_lo = _mm512_permutex2var_epi32(r.w[2], pair_lo, r.w[3]);
  const __m512i p23_hi = _mm512_permutex2var_epi32(r.w[2], pair_hi, r.w[3]);
  ordered[0] = _mm512_permutex2var_epi64(p01_lo, quad_lo, p23_lo);
  ordered[1] = _mm512_permutex2var_epi64(p01_lo, quad_hi, p23_lo);
  ordered[2] = _mm512_permutex2var_epi64(p01_hi, quad_lo, p23_hi);
  ordered[3] = _mm512_permutex2var_epi64(p01_hi, quad_hi, p23_hi);
}

/// Uniform floats in [0, 1) from Philox words, as kernels/rng.h's uniform_at converts them.
FT_AVX512_INLINE __m512 to_uniform16(__m512i bits) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(1.0f / 16777216.0f));
}

}  // namespace fusetrain::kernels::cpu_basic
