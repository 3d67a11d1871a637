// The op table as the IR names it: ir::OpKind and friends are the ops layer's.
#pragma once

#include "fusetrain/ops/op.h"

namespace fusetrain::ir {

using ops::kAlias;
using ops::kDifferentiable;
using ops::kElementwise;
using ops::kInPlace;
using ops::kInPlaceInput1;
using ops::kNumOps;
using ops::op_flags;
using ops::op_info;
using ops::op_name;
using ops::OpFlags;
using ops::OpInfo;
using ops::OpKind;
using ops::parse_op;

}  // namespace fusetrain::ir
