// Tensor: a typed, shaped view of contiguous row-major memory, owning or not.
#pragma once

#include <cstdint>
#include <memory>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/shape.h"

namespace fusetrain {

/// A contiguous row-major tensor. Either a view of memory it does not own
/// (Tensor::view) or the owner of an aligned buffer shared by its copies
/// (Tensor::empty / Tensor::zeros).
class Tensor {
 public:
  Tensor() = default;
  /// A view of `data`; the caller keeps the memory alive.
  static Tensor view(void* data, Shape shape, DType dtype);
  /// A view of `data` that also holds `keep_alive` (a file mapping, a parent buffer) for as long as any copy of
  /// the tensor lives; owns_memory() is then true.
  static Tensor view_shared(void* data, Shape shape, DType dtype, std::shared_ptr<void> keep_alive);
  /// A new owning tensor, zero-filled.
  static Tensor zeros(Shape shape, DType dtype);
  /// Same as zeros (memory is always initialised).
  static Tensor empty(Shape shape, DType dtype) { return zeros(std::move(shape), dtype); }

  bool defined() const { return data_ != nullptr || shape_.numel() == 0; }
  void* data() const { return data_; }
  /// Typed pointer; throws if T does not match the dtype's size class.
  template <typename T>
  T* data_as() const {
    FT_CHECK(sizeof(T) == dtype_size(dtype_), "tensor of dtype ", dtype_name(dtype_), " accessed as a ", sizeof(T),
             "-byte type");
    return static_cast<T*>(data_);
  }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool owns_memory() const { return storage_ != nullptr; }
  /// Same memory, new shape with the same element count.
  Tensor reshaped(Shape shape) const;
  /// Element i converted to double (for tests and printing, not for kernels).
  double item(int64_t i = 0) const;
  /// Writes value (converted to the dtype) at element i.
  void set_item(int64_t i, double value);
  /// Copies `src` (same shape and dtype) into this tensor's memory.
  void copy_from(const Tensor& src);
  /// A deep copy that owns its memory.
  Tensor clone() const;

 private:
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::f32;
  std::shared_ptr<void> storage_;
};

}  // namespace fusetrain
