// bf16 and f16 conversions, round-to-nearest-even; NaN stays NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fusetrain {

/// fp32 -> bf16 bit pattern, round to nearest even.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

/// bf16 bit pattern -> fp32 (exact).
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// fp32 -> IEEE half bit pattern, round to nearest even, overflow to inf.
uint16_t float_to_f16(float f);
/// IEEE half bit pattern -> fp32 (exact).
float f16_to_float(uint16_t h);

/// Bulk conversions (vectorised where the CPU allows).
void float_to_bf16(uint16_t* out, const float* in, size_t n);
void bf16_to_float(float* out, const uint16_t* in, size_t n);
void float_to_f16(uint16_t* out, const float* in, size_t n);
void f16_to_float(float* out, const uint16_t* in, size_t n);

}  // namespace fusetrain
