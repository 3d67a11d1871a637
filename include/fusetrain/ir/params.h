// Decoding a node's attributes into its op's typed parameters (ops/params.h).
#pragma once

#include <string>

#include "fusetrain/ir/attrs.h"
#include "fusetrain/ir/op.h"
#include "fusetrain/ops/params.h"

namespace fusetrain::ir {

using ops::OpParams;
using ops::ParamsOf;

/// Reads every attribute of a node of op `op` once and returns ParamsOf<op>. Absent optional
/// attributes keep the struct's defaults. Throws Error naming the node, the op, the attribute
/// and what was expected when an attribute is unknown to the op, missing, of another type, or
/// a string outside its choices ("approximate", dtype names). Range checks that need shapes
/// stay in shape inference.
OpParams decode_params(OpKind op, const Attrs& attrs, const std::string& node_name);

}  // namespace fusetrain::ir
