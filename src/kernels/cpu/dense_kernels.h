// Internal to kernels/cpu: the two halves of make_cpu_dense_kernel.
#pragma once

#include <memory>

#include "fusetrain/kernels/device.h"

namespace fusetrain::kernels {

/// MatMul and Linear on top of kernels/cpu/gemm (kernels/cpu/matmul.cpp). Null for
/// other ops and for MatMul with out_dtype other than f32.
std::unique_ptr<Kernel> make_cpu_matmul_kernel(const KernelCall& call);

/// LinearCrossEntropy in chunks of rows (kernels/cpu/linear_cross_entropy.cpp). Null for other ops.
std::unique_ptr<Kernel> make_cpu_linear_cross_entropy_kernel(const KernelCall& call);
/// LinearLogProbs and LinearLogProbsWeightGrad.
std::unique_ptr<Kernel> make_cpu_linear_log_probs_kernel(const KernelCall& call);

/// Flash-style Attention and AttentionBackward (kernels/cpu/attention.cpp). Null for other ops.
std::unique_ptr<Kernel> make_cpu_attention_kernel(const KernelCall& call);

/// Conv, ConvBackwardData and ConvBackwardWeight: direct loops or im2col + the GEMM (kernels/cpu/conv.cpp).
std::unique_ptr<Kernel> make_cpu_conv_kernel(const KernelCall& call);

/// How a convolution kernel computes: `chosen` per shape (conv_method_for), or one method for every shape.
enum class ConvMethod { chosen, direct, im2col };
/// The method conv_method_for picks for a shape.
ConvMethod conv_method_for(const ops::ConvGeometry& g);
/// Fixes the method of convolution kernels created afterwards (tests and bench/bench_conv; `chosen` releases it).
void set_conv_method(ConvMethod method);

}  // namespace fusetrain::kernels
