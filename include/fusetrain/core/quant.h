// Quantised weights in bitsandbytes' layouts: 4-bit blocks (NF4, FP4) and LLM.int8's rows, the frozen base of a
// QLoRA model.
#pragma once

#include <cstdint>
#include <string>

#include "fusetrain/core/half.h"

namespace fusetrain::quant {

/// LLM.int8's dequantisation factor, 1/127 as bitsandbytes writes it (an f32 multiply, not a division).
inline constexpr float kInt8Scale = 7.874015718698502e-3f;

/// A (rows, cols) matrix quantised as bitsandbytes stores it.
/// 4-bit (`int8` false): the flattened matrix's elements two to a byte, the even one in the high nibble; each block
/// of `blocksize` consecutive elements (a power of two) has one absmax. Element i is code[q(i)] · absmax[i /
/// blocksize], an f32 product, rounded to bf16 when `bf16` (the compute dtype): dequantize_4bit, bit for bit. `code`
/// holds the 16 values of the format (NF4 or FP4).
/// int8 (LLM.int8, `int8` true): one signed byte an element, row-major, and one absmax a row (bitsandbytes' SCB);
/// element (r, c) is (q · absmax[r]) · kInt8Scale in f32: int8_vectorwise_dequant, bit for bit. `code` is unused.
struct QuantMatrix {
  const uint8_t* data = nullptr;
  const float* absmax = nullptr;
  const float* code = nullptr;
  int64_t rows = 0, cols = 0;
  int block_shift = 6;  ///< log2(blocksize), 4-bit only
  bool bf16 = true;
  bool int8 = false;

  float at(int64_t r, int64_t c) const {
    if (int8) return static_cast<float>(static_cast<int8_t>(data[r * cols + c])) * absmax[r] * kInt8Scale;
    const int64_t i = r * cols + c;
    const uint8_t byte = data[i >> 1];
    const float v = code[(i & 1) ? (byte & 0xF) : (byte >> 4)] * absmax[i >> block_shift];
    return bf16 ? bf16_to_float(float_to_bf16(v)) : v;
  }
  /// Elements [begin, begin + n) of row r into out.
  void dequantize_row(int64_t r, int64_t begin, int64_t n, float* out) const {
    for (int64_t k = 0; k < n; ++k) out[k] = at(r, begin + k);
  }
};

/// The 16 values of bitsandbytes' 4-bit format `quant_type` ("nf4" or "fp4"), as get_4bit_type gives them; nullptr
/// for any other name.
const float* code_4bit(const std::string& quant_type);

/// Quantises n values (a whole number of blocks of 2^block_shift) to `code`'s 4-bit format as bitsandbytes'
/// quantize_4bit does: per block absmax = max |x|, each x · (1 / absmax) clamped to [-1, 1] and given the code whose
/// bucket between sorted neighbours' midpoints holds it (a midpoint itself goes to the lower code). packed: n / 2
/// bytes, the even element in the high nibble; absmax: n >> block_shift values. Throws on a non-finite x.
void quantize_4bit(const float* x, int64_t n, int block_shift, const float* code, uint8_t* packed, float* absmax);

/// Quantises a (rows, cols) matrix row by row to int8 as bitsandbytes' int8_vectorwise_quant does for a float16
/// weight (Int8Params converts the weight to float16 first, so x is read through float16): absmax per row = max |x|,
/// q = round-half-even(x · ((1 / absmax) · 127)), in f32 as torch evaluates it. q: rows · cols signed bytes; absmax: rows values. Throws on a value
/// that is not finite in float16.
void quantize_int8_rows(const float* x, int64_t rows, int64_t cols, int8_t* q, float* absmax);

/// log2 of a bitsandbytes block size (a power of two from 32 to 4096), or -1 for any other value.
inline int block_shift(int64_t blocksize) {
  for (int s = 5; s <= 12; ++s)
    if (blocksize == (int64_t{1} << s)) return s;
  return -1;
}

}  // namespace fusetrain::quant
