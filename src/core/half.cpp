#include "fusetrain/core/half.h"

#include <immintrin.h>

#include "core/half_paths.h"
#include "fusetrain/core/cpu.h"

namespace fusetrain {

uint16_t float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (incl. inf) after rounding
  if (abs < 0x38800000u) {                                               // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);           // below half the smallest subnormal
    uint32_t exponent = abs >> 23;
    uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exponent;  // 14 + (112 - exponent) + 1 - 1
    uint32_t value = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (value & 1u))) ++value;
    return static_cast<uint16_t>(sign | value);
  }
  uint32_t value = ((abs >> 13) - (112u << 10));
  uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (value & 1u))) ++value;
  return static_cast<uint16_t>(sign | value);
}

float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

__attribute__((target("avx512f,avx512bf16,avx512vl"))) void float_to_bf16_avx512(uint16_t* out, const float* in,
                                                                                 size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i&>(v));
  }
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

// vcvtps2ph with round-to-nearest-even and vcvtph2ps: the scalar conversions' results, bit for bit.
__attribute__((target("avx512f"))) void float_to_f16_avx512(uint16_t* out, const float* in, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = float_to_f16(in[i]);
}

__attribute__((target("avx512f"))) void f16_to_float_avx512(float* out, const uint16_t* in, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  for (; i < n; ++i) out[i] = f16_to_float(in[i]);
}

// Widening is exact: each bf16 is the high half of its f32.
__attribute__((target("avx512f"))) void bf16_to_float_avx512(float* out, const uint16_t* in, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(wide, 16));
  }
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

}  // namespace

namespace half_paths {

// Without these the bulk conversions ran scalar code on CPUs without AVX-512: f16 operands of the GEMM and the
// f16 casts took 7.7 s of a 24.9 s fp16 Llama step (W4) on a Zen 1, where the f32 step took 19.5 s.
__attribute__((target("avx2,f16c"))) void f16_to_float_avx2(float* out, const uint16_t* in, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = f16_to_float(in[i]);
}

__attribute__((target("avx2,f16c"))) void float_to_f16_avx2(uint16_t* out, const float* in, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = float_to_f16(in[i]);
}

__attribute__((target("avx2"))) void bf16_to_float_avx2(float* out, const uint16_t* in, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(wide, 16));
  }
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

}  // namespace half_paths

void float_to_bf16(uint16_t* out, const float* in, size_t n) {
  if (cpu_features().avx512_bf16) return float_to_bf16_avx512(out, in, n);
  for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

void bf16_to_float(float* out, const uint16_t* in, size_t n) {
  if (cpu_features().avx512f) return bf16_to_float_avx512(out, in, n);
  if (cpu_features().avx2) return half_paths::bf16_to_float_avx2(out, in, n);
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void float_to_f16(uint16_t* out, const float* in, size_t n) {
  if (cpu_features().avx512f) return float_to_f16_avx512(out, in, n);
  if (cpu_features().f16c) return half_paths::float_to_f16_avx2(out, in, n);
  for (size_t i = 0; i < n; ++i) out[i] = float_to_f16(in[i]);
}

void f16_to_float(float* out, const uint16_t* in, size_t n) {
  if (cpu_features().avx512f) return f16_to_float_avx512(out, in, n);
  if (cpu_features().f16c) return half_paths::f16_to_float_avx2(out, in, n);
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_float(in[i]);
}

}  // namespace fusetrain
