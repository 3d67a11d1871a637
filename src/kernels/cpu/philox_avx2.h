// Philox4x32-10 of kernels/rng.h on 8 counters at once, for CPUs with AVX2 but not AVX-512 (philox_avx512.h is the
// 16-lane copy): dropout.cpp and attention.cpp draw their masks with it on the AVX2 path.
// tests/kernels/test_device.cpp checks it against the scalar philox4x32 bit for bit. Callers carry FT_AVX2 and run
// only after use_avx2().
#pragma once

#include <cstdint>

#include "kernels/cpu/vec_math.h"

namespace fusetrain::kernels::cpu_basic {

/// Four words per lane: lane l of w[j] is word j of philox4x32 on lane l's counter.
struct Philox8 {
  __m256i w[4];
};

/// 32x32 -> 64 bit products of 8 lanes: high and low halves.
FT_AVX2_INLINE void mulhilo8(__m256i a, __m256i multiplier, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, multiplier);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), multiplier);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/// philox4x32(c0[l], c1[l], offset, offset >> 32, seed, seed >> 32) for the 8 lanes l: the counter of stream block
/// (c1[l] << 32 | c0[l]) at step `offset` (kernels/rng.h).
FT_AVX2_INLINE Philox8 philox4x32_8(__m256i c0, __m256i c1, uint64_t offset, uint64_t seed) {
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m256i c2 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  __m256i c3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, mul0, &hi0, &lo0);
    mulhilo8(c2, mul1, &hi1, &lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

/// The 32 words of 8 consecutive blocks in stream order: word j of block b is stream element 4·b + j, and
/// ordered[q] holds elements 8q .. 8q + 7 (blocks 2q and 2q + 1). A 4 x 8 transpose.
FT_AVX2_INLINE void philox_element_order(const Philox8& r, __m256i ordered[4]) {
  // Within each 128-bit half (blocks 0-3 | 4-7): pairs of words, then the four words of one block.
  const __m256i t0 = _mm256_unpacklo_epi32(r.w[0], r.w[1]), t1 = _mm256_unpackhi_epi32(r.w[0], r.w[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r.w[2], r.w[3]), t3 = _mm256_unpackhi_epi32(r.w[2], r.w[3]);
  const __m256i b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
  ordered[0] = _mm256_permute2x128_si256(b04, b15, 0x20);  // blocks 0, 1
  ordered[1] = _mm256_permute2x128_si256(b26, b37, 0x20);  // blocks 2, 3
  ordered[2] = _mm256_permute2x128_si256(b04, b15, 0x31);  // blocks 4, 5
  ordered[3] = _mm256_permute2x128_si256(b26, b37, 0x31);  // blocks 6, 7
}

/// Uniform floats in [0, 1) from Philox words, as kernels/rng.h's uniform_at converts them.
FT_AVX2_INLINE __m256 to_uniform8(__m256i bits) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 8)), _mm256_set1_ps(1.0f / 16777216.0f));
}

}  // namespace fusetrain::kernels::cpu_basic
