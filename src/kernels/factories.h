// Kernel factories, one per family; kernels/registry.cpp chooses among them.
#pragma once

#include <memory>

#include "kernels/kernel.h"

namespace fusetrain::kernels {

/// Plain-loop reference kernel for any op (kernels/ref). Never returns null.
std::unique_ptr<Kernel> make_ref_kernel(const ir::Graph& graph, const ir::Node& node);

/// Tuned CPU kernels for elementwise, normalisation, softmax, embedding, data
/// movement, reductions and the loss (kernels/cpu). Null if `node` is not one of them.
std::unique_ptr<Kernel> make_cpu_basic_kernel(const ir::Graph& graph, const ir::Node& node);

/// Tuned CPU kernels for MatMul, Linear, Attention and AttentionBackward
/// (kernels/cpu/matmul.cpp, kernels/cpu/attention.cpp). Null for other ops.
std::unique_ptr<Kernel> make_cpu_dense_kernel(const ir::Graph& graph, const ir::Node& node);

}  // namespace fusetrain::kernels
