#include "fusetrain/core/shape.h"

#include <algorithm>

#include "fusetrain/core/error.h"

namespace fusetrain {

int64_t Shape::numel() const { return numel(0, rank()); }

int64_t Shape::numel(int64_t begin, int64_t end) const {
  int64_t n = 1;
  for (int64_t i = begin; i < end; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

std::string Shape::to_string() const {
  std::string s = "(";
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  return s + ")";
}

int64_t normalize_axis(int64_t axis, int64_t rank, const char* what) {
  FT_CHECK(axis >= -rank && axis < rank, what, ": axis ", axis, " is out of range for rank ", rank);
  return axis < 0 ? axis + rank : axis;
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  int64_t rank = std::max(a.rank(), b.rank());
  std::vector<int64_t> out(static_cast<size_t>(rank));
  for (int64_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.rank() ? 1 : a[i - (rank - a.rank())];
    int64_t db = i < rank - b.rank() ? 1 : b[i - (rank - b.rank())];
    FT_CHECK(da == db || da == 1 || db == 1, "shapes ", a.to_string(), " and ", b.to_string(),
             " do not broadcast (axis ", i, ": ", da, " vs ", db, ")");
    out[static_cast<size_t>(i)] = da == 1 ? db : da;
  }
  return Shape(std::move(out));
}

}  // namespace fusetrain
