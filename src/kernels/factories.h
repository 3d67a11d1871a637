// Kernel factories, one per family; the devices in kernels/device.cpp choose among them.
#pragma once

#include <memory>

#include "fusetrain/kernels/device.h"

namespace fusetrain::kernels {

/// Plain-loop reference kernel for any op (kernels/ref). Never returns null.
std::unique_ptr<Kernel> make_ref_kernel(const KernelCall& call);

/// Tuned CPU kernels for elementwise, normalisation, softmax, embedding, data
/// movement, reductions and the loss (kernels/cpu). Null if `call` is not one of them.
std::unique_ptr<Kernel> make_cpu_basic_kernel(const KernelCall& call);

// The elementwise optimizer updates both CPU devices run (kernels/cpu/optimizer_update.cpp).
void cpu_optimizer_update(const OptimizerUpdate& update, const OptimizerSpan& span, const StepContext& ctx);
void cpu_adafactor_update(const AdafactorUpdate& update, const OptimizerSpan& span, const StepContext& ctx);

/// Tuned CPU kernels for MatMul, Linear, Attention and AttentionBackward
/// (kernels/cpu/matmul.cpp, kernels/cpu/attention.cpp). Null for other ops.
std::unique_ptr<Kernel> make_cpu_dense_kernel(const KernelCall& call);

}  // namespace fusetrain::kernels
