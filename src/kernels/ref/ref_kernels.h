// Internal header of the plain-loop reference kernels (kernels/ref): element
// access by dtype, strided index maps for broadcasting and permutations, and
// one factory per op, all called from the switch in registry_ref.cpp.
//
// Shape letters: B batch, T query length, S key length, H heads, D head size,
// C channels, V vocabulary, R rows (product of all leading axes), M/N/K matmul.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/shape.h"
#include "fusetrain/kernels/device.h"
#include "fusetrain/kernels/device.h"

namespace fusetrain::kernels::ref {

// ---- element access ---------------------------------------------------------
// Every reference kernel reads and writes elements through these helpers, so a
// kernel written once works for each dtype infer.cpp admits. Floating values
// travel as double; bf16/f16 are rounded (nearest even) only when stored.

/// Element i of a floating or integer tensor, converted to double.
inline double load(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(data)[i];
    case DType::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::f16:
      return f16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(data)[i];
    case DType::u8:
      return static_cast<const uint8_t*>(data)[i];
  }
  return 0.0;
}

/// Element i of an integer tensor (ids, targets) as int64.
inline int64_t load_index(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::i64:
      return static_cast<const int64_t*>(data)[i];
    case DType::i32:
      return static_cast<const int32_t*>(data)[i];
    case DType::u8:
      return static_cast<const uint8_t*>(data)[i];
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      return static_cast<int64_t>(load(data, dtype, i));
  }
  return 0;
}

/// Converts a double to an integer dtype's value: truncation toward zero,
/// saturating at the type's range, NaN -> 0.
template <typename I>
I saturate_to(double v) {
  if (std::isnan(v)) return 0;
  if (v <= static_cast<double>(std::numeric_limits<I>::lowest())) return std::numeric_limits<I>::lowest();
  if (v >= static_cast<double>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  return static_cast<I>(v);
}

/// Adds two integers with wrap-around (no signed-overflow UB).
template <typename I>
I wrapping_add(I a, I b) {
  using U = std::make_unsigned_t<I>;
  return static_cast<I>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}

/// Writes v (or, with `accumulate`, existing + v) to element i, rounding to the
/// dtype: f32 once from double, bf16/f16 via f32 (as optimized kernels do).
/// Integer dtypes truncate and saturate (see saturate_to).
inline void store(void* data, DType dtype, int64_t i, double v, bool accumulate) {
  switch (dtype) {
    case DType::f32: {
      float* p = static_cast<float*>(data) + i;
      *p = static_cast<float>(accumulate ? static_cast<double>(*p) + v : v);
      return;
    }
    case DType::bf16: {
      uint16_t* p = static_cast<uint16_t*>(data) + i;
      *p = float_to_bf16(static_cast<float>(accumulate ? static_cast<double>(bf16_to_float(*p)) + v : v));
      return;
    }
    case DType::f16: {
      uint16_t* p = static_cast<uint16_t*>(data) + i;
      *p = float_to_f16(static_cast<float>(accumulate ? static_cast<double>(f16_to_float(*p)) + v : v));
      return;
    }
    case DType::i64: {
      int64_t* p = static_cast<int64_t*>(data) + i;
      int64_t x = saturate_to<int64_t>(v);
      *p = accumulate ? wrapping_add(*p, x) : x;
      return;
    }
    case DType::i32: {
      int32_t* p = static_cast<int32_t*>(data) + i;
      int32_t x = saturate_to<int32_t>(v);
      *p = accumulate ? wrapping_add(*p, x) : x;
      return;
    }
    case DType::u8: {
      uint8_t* p = static_cast<uint8_t*>(data) + i;
      uint8_t x = saturate_to<uint8_t>(v);
      *p = accumulate ? static_cast<uint8_t>(*p + x) : x;
      return;
    }
  }
}

/// out[out_i] = in[in_i] (same dtype): a bit-exact copy, or with `accumulate`
/// an addition in the dtype's arithmetic (integers wrap, floats round once).
inline void copy_element(void* out, int64_t out_i, const void* in, int64_t in_i, DType dtype, bool accumulate) {
  const size_t size = dtype_size(dtype);
  if (!accumulate) {
    std::memcpy(static_cast<char*>(out) + static_cast<size_t>(out_i) * size,
                static_cast<const char*>(in) + static_cast<size_t>(in_i) * size, size);
    return;
  }
  switch (dtype) {
    case DType::i64: {
      int64_t* p = static_cast<int64_t*>(out) + out_i;
      *p = wrapping_add(*p, static_cast<const int64_t*>(in)[in_i]);
      return;
    }
    case DType::i32: {
      int32_t* p = static_cast<int32_t*>(out) + out_i;
      *p = wrapping_add(*p, static_cast<const int32_t*>(in)[in_i]);
      return;
    }
    case DType::u8: {
      uint8_t* p = static_cast<uint8_t*>(out) + out_i;
      *p = static_cast<uint8_t>(*p + static_cast<const uint8_t*>(in)[in_i]);
      return;
    }
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      store(out, dtype, out_i, load(in, dtype, in_i), true);
      return;
  }
}

/// Whether output i of this call adds into its destination.
inline bool accumulate_flag(const KernelArgs& args, size_t i) {
  return i < args.accumulate.size() && args.accumulate[i] != 0;
}

// ---- index maps ---------------------------------------------------------------

/// Maps a flat row-major index over `dims` to an element offset through
/// `strides` (one per axis; 0 on broadcast axes). Built at plan time; offset()
/// does not allocate.
struct StridedIndex {
  std::vector<int64_t> dims;
  std::vector<int64_t> strides;

  int64_t offset(int64_t flat) const {
    int64_t off = 0;
    for (size_t a = dims.size(); a-- > 0;) {
      off += (flat % dims[a]) * strides[a];
      flat /= dims[a];
    }
    return off;
  }
};

/// Row-major strides of a contiguous tensor of `shape`.
std::vector<int64_t> contiguous_strides(const Shape& shape);

/// Index map from positions of `out` to elements of `in`, where `in`
/// broadcasts to `out` by numpy rules (aligned right, extent-1 axes repeat).
StridedIndex broadcast_index(const Shape& in, const Shape& out);

// ---- the call's tensors, read at construction -------------------------------------

inline const Shape& input_shape(const KernelCall& call, size_t i) { return call.inputs[i].shape; }
inline DType input_dtype(const KernelCall& call, size_t i) { return call.inputs[i].dtype; }
inline const Shape& output_shape(const KernelCall& call, size_t i) {
  return call.outputs[i].shape;
}
inline DType output_dtype(const KernelCall& call, size_t i) { return call.outputs[i].dtype; }

/// `Op "name"` for error messages raised while a kernel runs.
std::string node_label(const KernelCall& call);

/// Base of every reference kernel: they all honour KernelArgs::accumulate.
class RefKernel : public Kernel {
 public:
  bool accumulates() const override { return true; }
};

/// GELU of x, the erf form or its tanh approximation (elementwise_ref.cpp).
double gelu_forward(double x, bool tanh_approximation);
/// d gelu(x) / dx for either formula (elementwise_ref.cpp).
double gelu_derivative(double x, bool tanh_approximation);

// ---- factories, one per op (registry_ref.cpp dispatches) ------------------------

// elementwise_ref.cpp
std::unique_ptr<Kernel> make_fill_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_binary_ref(const KernelCall& call);  // Add Sub Mul Div
std::unique_ptr<Kernel> make_scale_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_gelu_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_gelu_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_tanh_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_tanh_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_relu_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_relu_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_math_ref(const KernelCall& call);  // Pow, Sqrt, Erf
std::unique_ptr<Kernel> make_swiglu_ref(const KernelCall& call);  // SwiGLU, SwiGLUBackward
std::unique_ptr<Kernel> make_erf_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_dropout_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_dropout_add_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_cast_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_copy_ref(const KernelCall& call);

// matmul_ref.cpp
std::unique_ptr<Kernel> make_matmul_ref(const KernelCall& call);
// loss_ref.cpp (binary cross-entropy with logits)
std::unique_ptr<Kernel> make_sigmoid_cross_entropy_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_sigmoid_cross_entropy_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_linear_ref(const KernelCall& call);  // Linear, LinearGelu
std::unique_ptr<Kernel> make_matmul_gelu_backward_ref(const KernelCall& call);

// norm_ref.cpp
std::unique_ptr<Kernel> make_softmax_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_softmax_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_layernorm_ref(const KernelCall& call);  // LayerNorm, AddLayerNorm
std::unique_ptr<Kernel> make_layernorm_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_rmsnorm_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_rmsnorm_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_rope_ref(const KernelCall& call);
// conv_ref.cpp
std::unique_ptr<Kernel> make_conv_ref(const KernelCall& call);  // Conv, ConvBackwardData, ConvBackwardWeight

// movement_ref.cpp
std::unique_ptr<Kernel> make_reshape_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_transpose_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_split_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_concat_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_slice_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_slice_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_expand_to_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_embedding_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_embedding_backward_ref(const KernelCall& call);

// reduce_ref.cpp
std::unique_ptr<Kernel> make_reduce_ref(const KernelCall& call);  // ReduceSum ReduceMean
std::unique_ptr<Kernel> make_reduce_sum_to_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_cast_column_sum_ref(const KernelCall& call);

// loss_ref.cpp
std::unique_ptr<Kernel> make_cross_entropy_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_cross_entropy_backward_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_linear_cross_entropy_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_token_stats_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_token_log_probs_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_token_log_probs_backward_ref(const KernelCall& call);
/// LinearLogProbs and LinearLogProbsWeightGrad.
std::unique_ptr<Kernel> make_linear_log_probs_ref(const KernelCall& call);
/// QuantizedLinear and QuantizedLinearBackward.
std::unique_ptr<Kernel> make_quantized_linear_ref(const KernelCall& call);
/// PreferenceLoss and PreferenceLossBackward.
std::unique_ptr<Kernel> make_preference_loss_ref(const KernelCall& call);
/// CtcLoss and CtcLossBackward.
std::unique_ptr<Kernel> make_ctc_loss_ref(const KernelCall& call);

// pool_ref.cpp
/// Pool and PoolBackward.
std::unique_ptr<Kernel> make_pool_ref(const KernelCall& call);

// attention_ref.cpp
std::unique_ptr<Kernel> make_attention_ref(const KernelCall& call);
std::unique_ptr<Kernel> make_attention_backward_ref(const KernelCall& call);

}  // namespace fusetrain::kernels::ref
