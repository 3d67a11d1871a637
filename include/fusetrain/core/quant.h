// Block-quantised weights in bitsandbytes' 4-bit layouts (NF4, FP4): the frozen base of a QLoRA model.
#pragma once

#include <cstdint>

#include "fusetrain/core/half.h"

namespace fusetrain::quant {

/// A (rows, cols) matrix quantised to 4 bits as bitsandbytes stores it: the flattened matrix's elements two to a
/// byte, the even one in the high nibble; each block of `blocksize` consecutive elements (a power of two) has one
/// absmax. Element i is code[q(i)] · absmax[i / blocksize], an f32 product, rounded to bf16 when `bf16` (the compute
/// dtype): bitsandbytes' dequantize_4bit, bit for bit. `code` holds the 16 values of the format (NF4 or FP4).
struct Matrix4bit {
  const uint8_t* data = nullptr;
  const float* absmax = nullptr;
  const float* code = nullptr;
  int64_t rows = 0, cols = 0;
  int block_shift = 6;  ///< log2(blocksize)
  bool bf16 = true;

  float at(int64_t i) const {
    const uint8_t byte = data[i >> 1];
    const float v = code[(i & 1) ? (byte & 0xF) : (byte >> 4)] * absmax[i >> block_shift];
    return bf16 ? bf16_to_float(float_to_bf16(v)) : v;
  }
  float at(int64_t r, int64_t c) const { return at(r * cols + c); }
  /// Elements [begin, begin + n) of the flattened matrix into out.
  void dequantize(int64_t begin, int64_t n, float* out) const {
    for (int64_t k = 0; k < n; ++k) out[k] = at(begin + k);
  }
};

/// log2 of a bitsandbytes block size (a power of two from 32 to 4096), or -1 for any other value.
inline int block_shift(int64_t blocksize) {
  for (int s = 5; s <= 12; ++s)
    if (blocksize == (int64_t{1} << s)) return s;
  return -1;
}

}  // namespace fusetrain::quant
