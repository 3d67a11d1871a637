// Lowering: from a graph node to the backend-neutral call a Device builds a kernel from.
#pragma once

#include "fusetrain/ir/graph.h"
#include <memory>

#include "fusetrain/kernels/device.h"
#include "fusetrain/runtime/plan.h"

namespace fusetrain::compile {

/// The KernelCall that computes `node` of `graph`: its op, its attributes decoded into the
/// op's typed parameters (ir::decode_params, which throws Error naming the node on a bad
/// attribute), and the shape and dtype of each input and output.
kernels::KernelCall lower(const ir::Graph& graph, const ir::Node& node);

/// Lowers `graph` for the runtime: verifies it, schedules the nodes its outputs need (in graph order, each node
/// that alone writes a parameter's gradient moved up to where its inputs are ready, so data-parallel communication
/// of that gradient need not wait for the end of backward), has the device (the store's, or the reference device
/// with options.reference_kernels) build each node's kernel, and plans the arena from the kernels' scratch sizes.
runtime::LoweredProgram lower_program(const ir::Graph& graph, const runtime::ParameterStore& params,
                                      const runtime::PlanOptions& options = {});

/// lower_program bound to memory (runtime::Plan::bind): a graph compiled once for fixed input shapes against
/// `params`, which must outlive the plan. After it, Plan::run performs no heap allocation.
std::unique_ptr<runtime::Plan> compile_plan(const ir::Graph& graph, runtime::ParameterStore& params,
                                            const runtime::PlanOptions& options = {});

}  // namespace fusetrain::compile
