#include "fusetrain/core/quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>

#include "fusetrain/core/error.h"

namespace fusetrain::quant {

namespace {

// bitsandbytes' get_4bit_type values, as f32 bit patterns print them.
constexpr std::array<float, 16> kNf4 = {
    -1.0f,        -0x1.647362p-1f, -0x1.0cd660p-1f, -0x1.946540p-2f, -0x1.23449ap-2f, -0x1.7a6a7ep-3f,
    -0x1.74f0e2p-4f, 0.0f,         0x1.45f5fep-4f,  0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c34970p-2f,  0x1.200f56p-1f, 0x1.722766p-1f, 1.0f};
constexpr std::array<float, 16> kFp4 = {
    0.0f,  0x1.555556p-8f,  0x1.555556p-1f,  1.0f,  0x1.555556p-2f,  0.5f,  0x1.555556p-3f,  0.25f,
    0.0f, -0x1.555556p-8f, -0x1.555556p-1f, -1.0f, -0x1.555556p-2f, -0.5f, -0x1.555556p-3f, -0.25f};

// The codes in ascending value (ties in index order, as a stable argsort leaves them) and the f32 midpoints between
// neighbours: bucketize's boundaries.
struct Buckets {
  std::array<uint8_t, 16> order{};
  std::array<float, 15> bounds{};
  explicit Buckets(const float* code) {
    std::iota(order.begin(), order.end(), uint8_t{0});
    std::stable_sort(order.begin(), order.end(), [&](uint8_t a, uint8_t b) { return code[a] < code[b]; });
    for (int i = 0; i < 15; ++i) bounds[size_t(i)] = (code[order[size_t(i)]] + code[order[size_t(i) + 1]]) / 2.0f;
  }
  // torch.bucketize(right=False): the number of boundaries strictly below v, by binary search (four compares; the
  // boundaries ascend, so those below v are a prefix).
  uint8_t code_of(float v) const {
    int b = 0;
    for (int step = 8; step > 0; step >>= 1)
      if (b + step <= 15 && bounds[size_t(b + step - 1)] < v) b += step;
    return order[size_t(b)];
  }
};

}  // namespace

const float* code_4bit(const std::string& quant_type) {
  if (quant_type == "nf4") return kNf4.data();
  if (quant_type == "fp4") return kFp4.data();
  return nullptr;
}

void quantize_4bit(const float* x, int64_t n, int block_shift, const float* code, uint8_t* packed, float* absmax) {
  const Buckets buckets(code);
  const int64_t block = int64_t{1} << block_shift;
  for (int64_t b = 0; b < (n >> block_shift); ++b) {
    const float* xb = x + b * block;
    float m = 0.0f;
    for (int64_t i = 0; i < block; ++i) {
      FT_CHECK(std::isfinite(xb[i]), "quantize_4bit: a non-finite value (", xb[i], ") at element ", b * block + i);
      m = std::max(m, std::fabs(xb[i]));
    }
    absmax[b] = m;
    const float inv = 1.0f / std::max(m, 1e-38f);
    uint8_t* out = packed + (b * block >> 1);
    for (int64_t i = 0; i < block; i += 2) {
      const uint8_t hi = buckets.code_of(std::clamp(xb[i] * inv, -1.0f, 1.0f));
      const uint8_t lo = buckets.code_of(std::clamp(xb[i + 1] * inv, -1.0f, 1.0f));
      out[i >> 1] = static_cast<uint8_t>(hi << 4 | lo);
    }
  }
}

void quantize_int8_rows(const float* x, int64_t rows, int64_t cols, int8_t* q, float* absmax) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float m = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = f16_to_float(float_to_f16(xr[c]));
      FT_CHECK(std::isfinite(v), "quantize_int8: element (", r, ", ", c, ") = ", xr[c], " is ",
               std::isfinite(xr[c]) ? "beyond float16's range, through which LLM.int8 quantises" : "not finite");
      m = std::max(m, std::fabs(v));
    }
    absmax[r] = m;
    // torch evaluates 127.0 / row_stats as reciprocal(row_stats) * 127: two f32 roundings.
    const float scale = (1.0f / m) * 127.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = m == 0.0f ? 0.0f : std::nearbyint(f16_to_float(float_to_f16(xr[c])) * scale);
      q[r * cols + c] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

}  // namespace fusetrain::quant
