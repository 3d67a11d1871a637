#include "fusetrain/ops/op.h"

#include <array>

namespace fusetrain::ops {
namespace {

constexpr std::array<OpInfo, kNumOps> kOpTable = {{
#define FT_OP(Name, min_in, max_in, num_out, flags, Params) {OpKind::Name, #Name, min_in, max_in, num_out, flags},
#include "fusetrain/ops/ops.def"
#undef FT_OP
}};

}  // namespace

const OpInfo& op_info(OpKind kind) { return kOpTable[static_cast<size_t>(kind)]; }

std::optional<OpKind> parse_op(std::string_view name) {
  for (const OpInfo& info : kOpTable)
    if (name == info.name) return info.kind;
  return std::nullopt;
}

}  // namespace fusetrain::ops
