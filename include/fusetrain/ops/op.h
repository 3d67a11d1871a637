// Op kinds and their static properties, generated from ops.def. The ops layer sits below both
// ir (graphs of ops) and kernels (which compute one op and never see a graph).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace fusetrain::ops {

enum OpFlags : unsigned {
  kDifferentiable = 1u << 0,  ///< has a gradient rule and a gradient check
  kElementwise = 1u << 1,     ///< output element i depends only on input element i
  kInPlace = 1u << 2,         ///< output 0 may share input 0's memory if input 0 dies here
  kAlias = 1u << 3,           ///< output 0 is input 0's memory under a new shape
  kInPlaceInput1 = 1u << 4,   ///< output 0 may share input 1's memory if input 1 dies here
};

/// Every op the IR knows, in ops.def order.
enum class OpKind : uint16_t {
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) Name,
#include "fusetrain/ops/ops.def"
#undef FT_OP
};

/// Number of op kinds.
constexpr int kNumOps = 0
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) +1
#include "fusetrain/ops/ops.def"
#undef FT_OP
    ;

/// Flags of an op, usable in constant expressions.
constexpr unsigned op_flags(OpKind kind) {
  switch (kind) {
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) \
  case OpKind::Name:                                \
    return flags;
#include "fusetrain/ops/ops.def"
#undef FT_OP
  }
  return 0;
}

/// Static description of an op, one row of ops.def.
struct OpInfo {
  OpKind kind;
  const char* name;
  int min_inputs;
  int max_inputs;   ///< -1: variadic
  int num_outputs;  ///< -1: set by attributes
  unsigned flags;
  bool has(unsigned flag) const { return (flags & flag) != 0; }
};

/// The row of ops.def for `kind`.
const OpInfo& op_info(OpKind kind);
/// The op's name as written in ops.def ("MatMul").
inline const char* op_name(OpKind kind) { return op_info(kind).name; }
/// Looks an op up by name; nullopt if unknown.
std::optional<OpKind> parse_op(std::string_view name);

}  // namespace fusetrain::ops
