// Parameters and their gradients in flat, contiguous buffers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/tensor.h"
#include "fusetrain/ir/graph.h"
#include "fusetrain/kernels/device.h"

namespace fusetrain::runtime {

/// One parameter: a view at `offset` (in elements) of the flat buffers.
struct ParamSlot {
  std::string name;
  Shape shape;
  int64_t offset = 0;  ///< elements from the start; a multiple of 16 (64 bytes)
  int64_t numel = 0;
  bool weight_decay = true;  ///< false for biases and LayerNorm weights
  /// The table of an Embedding op (an nn.Embedding's weight): 8-bit optimizers keep its state in 32 bits, as
  /// transformers' Trainer has bitsandbytes do.
  bool embedding_table = false;
};

/// One frozen parameter (ir::ValueKind::Frozen): a view at `offset` bytes of the frozen buffer, in its own dtype.
struct FrozenSlot {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;  ///< f32, or bf16 for a LoRA base weight kept in bf16
  size_t offset = 0;         ///< bytes from the start; a multiple of 64
  int64_t numel = 0;
};

/// All trainable parameters of a model in one f32 buffer and their gradients in another
/// with the same layout. Zeroing gradients is one memset; the optimizer is one
/// loop over the buffers; each parameter is a Tensor view at its offset.
/// Frozen parameters (LoRA's base weights) live in a third buffer, with no gradient and no optimizer state.
class ParameterStore {
 public:
  ParameterStore() = default;
  /// Lays out the parameters of `graph` (trainable ones f32; frozen ones in their graph dtype), in declaration order;
  /// a parameter read as an Embedding op's table is marked ParamSlot::embedding_table. The buffers are `device`'s.
  explicit ParameterStore(const ir::Graph& graph, const kernels::Device& device = kernels::default_device());
  /// Lays out the given named shapes.
  explicit ParameterStore(const std::vector<std::pair<std::string, Shape>>& params,
                          const kernels::Device& device = kernels::default_device());
  /// The device whose memory holds the parameters and gradients (plans and optimizers over the store use it).
  const kernels::Device& device() const { return *device_; }

  const std::vector<ParamSlot>& slots() const { return slots_; }
  /// Index of the parameter called `name`; throws Error listing the known names if absent.
  size_t index(const std::string& name) const;
  bool contains(const std::string& name) const;
  Tensor param(size_t i) const;
  Tensor grad(size_t i) const;
  Tensor param(const std::string& name) const { return param(index(name)); }
  Tensor grad(const std::string& name) const { return grad(index(name)); }
  /// Total elements including alignment padding (the length of the flat buffers).
  int64_t flat_numel() const { return flat_numel_; }
  /// Sum of the parameters' element counts.
  int64_t num_parameters() const;
  float* params_data() const { return static_cast<float*>(params_.get()); }
  float* grads_data() const { return static_cast<float*>(grads_.get()); }
  /// Frozen parameters: no gradient, never touched by an optimizer.
  const std::vector<FrozenSlot>& frozen_slots() const { return frozen_slots_; }
  bool contains_frozen(const std::string& name) const;
  /// The frozen parameter called `name` (in its dtype); throws Error if absent.
  Tensor frozen(const std::string& name) const;
  Tensor frozen(size_t i) const;
  /// Sum of the frozen parameters' element counts.
  int64_t num_frozen_parameters() const;
  /// Bytes of the frozen buffer (each frozen parameter in its dtype, 64-byte aligned).
  size_t frozen_bytes() const { return frozen_bytes_; }
  /// Sets every gradient to zero (one memset).
  void zero_grads();
  /// Marks which parameters get weight decay (by default all of them).
  void set_weight_decay(size_t i, bool decay) { slots_[i].weight_decay = decay; }

 private:
  void allocate();
  std::vector<ParamSlot> slots_;
  std::vector<FrozenSlot> frozen_slots_;
  int64_t flat_numel_ = 0;
  size_t frozen_bytes_ = 0;
  const kernels::Device* device_ = &kernels::default_device();
  kernels::DeviceBuffer frozen_;
  kernels::DeviceBuffer params_;
  kernels::DeviceBuffer grads_;
};

}  // namespace fusetrain::runtime
