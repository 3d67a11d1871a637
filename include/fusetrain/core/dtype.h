// Element types of tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace fusetrain {

/// Element type of a tensor. bf16 and f16 are stored as uint16_t bit patterns.
enum class DType : uint8_t { f32, bf16, f16, i64, i32, u8 };

/// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i64:
      return 8;
    case DType::i32:
      return 4;
    case DType::u8:
      return 1;
  }
  return 0;
}

/// Lower-case name as written in dumps and errors: "f32", "bf16", ...
const char* dtype_name(DType t);

/// Parses a name written by dtype_name; nullopt if unknown.
std::optional<DType> parse_dtype(std::string_view name);

/// True for f32, bf16 and f16.
constexpr bool is_floating(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

/// Index of the first inf or NaN among the `n` values of type `dtype` at `data`, or -1 when every value is finite
/// (always -1 for integer types). Reads the values once, in blocks, so a writer can check what it is about to write.
int64_t find_nonfinite(const void* data, DType dtype, int64_t n);

}  // namespace fusetrain
