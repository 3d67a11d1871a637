#include "fusetrain/core/dtype.h"

namespace fusetrain {

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
