// The bulk conversions' AVX2 + F16C variants, declared so that the tests can run them on any CPU that has
// AVX2 and F16C, including one whose bulk conversions take the AVX-512 variants.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fusetrain::half_paths {

/// vcvtph2ps on 8 lanes: f16_to_float's results, bit for bit (NaN stays NaN).
void f16_to_float_avx2(float* out, const uint16_t* in, size_t n);
/// vcvtps2ph with round-to-nearest-even on 8 lanes: float_to_f16's results (NaN stays NaN).
void float_to_f16_avx2(uint16_t* out, const float* in, size_t n);
/// Zero-extend and shift on 8 lanes: exact, as bf16_to_float.
void bf16_to_float_avx2(float* out, const uint16_t* in, size_t n);

}  // namespace fusetrain::half_paths
