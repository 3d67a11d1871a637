// Tensor shapes: a list of non-negative extents, row-major.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace fusetrain {

/// Extents of a row-major tensor. A rank-0 shape is a scalar with one element.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int64_t rank() const { return static_cast<int64_t>(dims_.size()); }
  /// Extent of axis i; negative i counts from the end.
  int64_t operator[](int64_t i) const { return dims_[static_cast<size_t>(i < 0 ? i + rank() : i)]; }
  int64_t& operator[](int64_t i) { return dims_[static_cast<size_t>(i < 0 ? i + rank() : i)]; }
  /// Number of elements (1 for a scalar).
  int64_t numel() const;
  /// Product of extents in [begin, end).
  int64_t numel(int64_t begin, int64_t end) const;
  const std::vector<int64_t>& dims() const { return dims_; }
  bool operator==(const Shape& o) const { return dims_ == o.dims_; }
  bool operator!=(const Shape& o) const { return dims_ != o.dims_; }
  /// "(3, 17, 129)"; "()" for a scalar.
  std::string to_string() const;

 private:
  std::vector<int64_t> dims_;
};

/// Normalises a possibly negative axis against `rank`; throws if out of range.
int64_t normalize_axis(int64_t axis, int64_t rank, const char* what);

/// Numpy-style broadcast of two shapes; throws naming both shapes if incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b);

}  // namespace fusetrain
