#include "fusetrain/core/dtype.h"

#include <cstring>

namespace fusetrain {
namespace {

// Index of the first value of [0, n) whose exponent bits are all ones (inf or NaN), or -1. The inner loop has no
// early exit so that it vectorises; a hit is then located within its block.
template <typename Bits>
int64_t find_all_ones_exponent(const void* data, int64_t n, Bits exponent_mask) {
  constexpr int64_t kBlock = 1024;
  const auto* bytes = static_cast<const unsigned char*>(data);
  auto load = [&](int64_t i) {
    Bits v;
    std::memcpy(&v, bytes + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
    return static_cast<Bits>(v & exponent_mask);
  };
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = begin + kBlock < n ? begin + kBlock : n;
    bool hit = false;
    for (int64_t i = begin; i < end; ++i) hit |= load(i) == exponent_mask;
    if (!hit) continue;
    for (int64_t i = begin; i < end; ++i)
      if (load(i) == exponent_mask) return i;
  }
  return -1;
}

}  // namespace

int64_t find_nonfinite(const void* data, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::f32:
      return find_all_ones_exponent<uint32_t>(data, n, 0x7f800000u);
    case DType::bf16:
      return find_all_ones_exponent<uint16_t>(data, n, 0x7f80u);
    case DType::f16:
      return find_all_ones_exponent<uint16_t>(data, n, 0x7c00u);
    case DType::i64:
    case DType::i32:
    case DType::u8:
      return -1;
  }
  return -1;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i64:
      return "i64";
    case DType::i32:
      return "i32";
    case DType::u8:
      return "u8";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32, DType::u8})
    if (name == dtype_name(t)) return t;
  return std::nullopt;
}

}  // namespace fusetrain
