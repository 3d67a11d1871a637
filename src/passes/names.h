// The IR names every pass uses, brought into fusetrain::passes once.
#pragma once

#include "fusetrain/ir/graph.h"

namespace fusetrain::passes {

using ir::kNone;
using ir::NodeId;
using ir::OpKind;
using ir::ValueId;

}  // namespace fusetrain::passes
