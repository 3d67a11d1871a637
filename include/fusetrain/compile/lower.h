// Lowering: from a graph node to the backend-neutral call a Device builds a kernel from.
#pragma once

#include "fusetrain/ir/graph.h"
#include "fusetrain/kernels/device.h"

namespace fusetrain::compile {

/// The KernelCall that computes `node` of `graph`: its op, its attributes decoded into the
/// op's typed parameters (ir::decode_params, which throws Error naming the node on a bad
/// attribute), and the shape and dtype of each input and output.
kernels::KernelCall lower(const ir::Graph& graph, const ir::Node& node);

}  // namespace fusetrain::compile
