// AVX-512 vector math for the tuned CPU kernels: exp, erf, tanh on 16 floats,
// bf16 <-> f32 conversion and masked tails. Every function carries the AVX-512
// target attribute, so it may only be called from functions that carry it too
// (FT_AVX512), which callers reach only after cpu_basic::use_avx512().
// The AVX2 + FMA part at the end (exp8, erf8, tanh8, 8-lane tails and bf16) is for the AVX2 paths (FT_AVX2,
// reached after cpu_basic::use_avx2()).
//
// Accuracy (checked against double-precision libm over [-8, 8]):
//   exp16   relative error < 2e-7 (Cephes expf polynomial, scalef for 2^n,
//           so -inf -> 0, +inf -> inf, NaN -> NaN, no denormal cliff)
//   erf16   absolute error < 4e-7 (odd/even rational on [-4, 4], +-1 outside)
//   tanh16  absolute error < 1e-7 (odd polynomial below 0.625, 1 - 2/(e^2x + 1) above)
//   exp8    as exp16 (the same polynomial; 2^n as two exponent-field factors)
//   erf8, tanh8  as erf16, tanh16 (the same rational function and polynomials)
#pragma once

// GCC 12 warns about the deliberately undefined registers inside its own
// AVX-512 intrinsics (_mm512_undefined_*); silence that for the header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__  // a GCC-only warning; clang would warn that it does not know it
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

#define FT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define FT_AVX512_INLINE inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace fusetrain::kernels::cpu_basic {

/// Mask of the first n (0..16) lanes.
FT_AVX512_INLINE __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }

/// e^x for 16 lanes.
FT_AVX512_INLINE __m512 exp16(__m512 x) {
  // Clamp keeps x - n*ln2 finite; beyond the clamp the result is 0 or inf anyway.
  // max/min take x as the second operand so a NaN in x passes through.
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

/// erf(x) for 16 lanes.
FT_AVX512_INLINE __m512 erf16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-4.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(4.0f), x);
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-2.72614225801306e-10f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.77068142495902e-08f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-2.10102402082508e-06f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-5.69250639462346e-05f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-7.34990630326855e-04f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-2.95459980854025e-03f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.60960333262415e-02f));
  p = _mm512_mul_ps(p, x);
  __m512 q = _mm512_set1_ps(-1.45660718464996e-05f);
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-2.13374055278905e-04f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-1.68282697438203e-03f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-7.37332916720468e-03f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-1.42647390514189e-02f));
  return _mm512_div_ps(p, q);
}

/// tanh(x) for 16 lanes.
FT_AVX512_INLINE __m512 tanh16(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 ax = _mm512_andnot_ps(sign, x);
  // |x| < 0.625: x + x^3 P(x^2)
  const __m512 s = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, s), x, x);
  // otherwise: 1 - 2 / (e^{2|x|} + 1), sign of x (tanh(9) rounds to 1)
  const __m512 e =
      exp16(_mm512_add_ps(_mm512_min_ps(_mm512_set1_ps(9.0f), ax), _mm512_min_ps(_mm512_set1_ps(9.0f), ax)));
  const __m512 large_abs =
      _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  const __m512 large = _mm512_or_ps(large_abs, _mm512_and_ps(x, sign));
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(is_small, large, small);
}

/// 16 bf16 bit patterns -> f32 (exact).
FT_AVX512_INLINE __m512 bf16_to_f32_16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// 16 f32 -> bf16 bit patterns, round to nearest even; NaN stays a quiet NaN
/// (bit for bit what fusetrain::float_to_bf16 returns).
FT_AVX512_INLINE __m256i f32_to_bf16_16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  rounded = _mm512_mask_mov_epi32(rounded, nan, quiet);
  return _mm512_cvtepi32_epi16(rounded);
}

/// x rounded to the nearest bf16 (ties to even) and widened back: the value a bf16 tensor would hold.
FT_AVX512_INLINE __m512 round_bf16_16(__m512 x) { return bf16_to_f32_16(f32_to_bf16_16(x)); }

// ---- AVX2 + FMA ----------------------------------------------------------------------

#define FT_AVX2 __attribute__((target("avx2,fma")))
#define FT_AVX2_INLINE inline __attribute__((always_inline, target("avx2,fma")))

/// All-ones in the first n lanes of 8 (n <= 0: none, n >= 8: all), for blends and masked loads.
FT_AVX2_INLINE __m256i lanes8(int64_t n) {
  const int32_t count = static_cast<int32_t>(n < 0 ? 0 : n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// The first min(n, 8) floats at p, zeros after (a plain load when n >= 8).
FT_AVX2_INLINE __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(n));
}

/// Stores the first min(n, 8) lanes of v at p.
FT_AVX2_INLINE void store8(float* p, int64_t n, __m256 v) {
  if (n >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lanes8(n), v);
}

/// e^x for 8 lanes: exp16's reduction and polynomial. AVX2 has no scalef, so 2^n is applied as 2^h · 2^(n − h)
/// with h = n >> 1: both factors stay normal for every n the clamp allows ([−150, 128]), so small results
/// round into the denormals as exp16's do, −inf gives 0, +inf gives inf and NaN stays NaN.
FT_AVX2_INLINE __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);  // x second: a NaN passes through
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, low), high);
}

/// erf(x) for 8 lanes: erf16's rational function.
FT_AVX2_INLINE __m256 erf8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-4.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(4.0f), x);
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-2.72614225801306e-10f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.77068142495902e-08f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-2.10102402082508e-06f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-5.69250639462346e-05f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-7.34990630326855e-04f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-2.95459980854025e-03f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.60960333262415e-02f));
  p = _mm256_mul_ps(p, x);
  __m256 q = _mm256_set1_ps(-1.45660718464996e-05f);
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-2.13374055278905e-04f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-1.68282697438203e-03f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-7.37332916720468e-03f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-1.42647390514189e-02f));
  return _mm256_div_ps(p, q);
}

/// tanh(x) for 8 lanes: tanh16's two forms.
FT_AVX2_INLINE __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_andnot_ps(sign, x);
  const __m256 s = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, s), x, x);
  const __m256 a9 = _mm256_min_ps(_mm256_set1_ps(9.0f), ax);
  const __m256 e = exp8(_mm256_add_ps(a9, a9));
  const __m256 large_abs =
      _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  const __m256 large = _mm256_or_ps(large_abs, _mm256_and_ps(x, sign));
  return _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

/// Sum of the 8 lanes.
FT_AVX2_INLINE float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// Largest of the 8 lanes (NaN lanes as _mm256_max_ps treats them).
FT_AVX2_INLINE float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// Largest of x[0, n) (−inf for n = 0; NaN elements as _mm256_max_ps treats them): the max pass of a row's softmax.
FT_AVX2_INLINE float row_max8(const float* x, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
  __m256 m0 = neg_inf, m1 = neg_inf;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
  }
  for (; i < n; i += 8)
    m0 = _mm256_max_ps(m0, _mm256_blendv_ps(neg_inf, load8(x + i, n - i), _mm256_castsi256_ps(lanes8(n - i))));
  return reduce_max8(_mm256_max_ps(m0, m1));
}

/// 8 bf16 bit patterns -> f32 (exact).
FT_AVX2_INLINE __m256 bf16_to_f32_8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/// The first min(n, 8) bf16 values at p widened to f32, zeros after.
FT_AVX2_INLINE __m256 load8_bf16(const uint16_t* p, int64_t n) {
  if (n >= 8) return bf16_to_f32_8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t tail[8] = {};
  for (int64_t i = 0; i < n; ++i) tail[i] = p[i];
  return bf16_to_f32_8(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

/// 8 f32 -> bf16 bit patterns, rounded as f32_to_bf16_16 rounds (nearest even, NaN stays a quiet NaN).
FT_AVX2_INLINE __m128i f32_to_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i v = _mm256_blendv_epi8(rounded, quiet, nan);  // each lane < 2^16: packus keeps it
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/// x rounded to the nearest bf16 (ties to even) and widened back, as round_bf16_16.
FT_AVX2_INLINE __m256 round_bf16_8(__m256 x) { return bf16_to_f32_8(f32_to_bf16_8(x)); }

/// Stores the first min(n, 8) lanes of v, rounded to bf16, at p.
FT_AVX2_INLINE void store8_bf16(uint16_t* p, int64_t n, __m256 v) {
  const __m128i h = f32_to_bf16_8(v);
  if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  alignas(16) uint16_t tail[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tail), h);
  for (int64_t i = 0; i < n; ++i) p[i] = tail[i];
}

}  // namespace fusetrain::kernels::cpu_basic
