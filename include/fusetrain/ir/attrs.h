// Node attributes: a small ordered list of named values.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fusetrain::ir {

/// One attribute value: an integer, a float, a list of integers or a string.
using AttrValue = std::variant<int64_t, double, std::vector<int64_t>, std::string>;

/// Attributes of a node. Read at plan-compile time, never inside a step.
class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<std::string, AttrValue>> items) : items_(items) {}

  /// Sets (or replaces) an attribute; returns *this for chaining.
  Attrs& set(const std::string& name, AttrValue value);
  bool has(const std::string& name) const;
  /// Typed getters; throw Error naming the attribute if missing or of another type.
  int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  const std::vector<int64_t>& get_ints(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  /// Getters with a default for optional attributes.
  int64_t get_int(const std::string& name, int64_t fallback) const;
  double get_float(const std::string& name, double fallback) const;
  std::string get_string(const std::string& name, const std::string& fallback) const;
  const std::vector<std::pair<std::string, AttrValue>>& items() const { return items_; }
  /// "axis=1, perm=[0,2,1,3]"
  std::string to_string() const;

 private:
  const AttrValue* find(const std::string& name) const;
  std::vector<std::pair<std::string, AttrValue>> items_;
};

/// The attributes that decide the mask of a node applying dropout: "p", "seed" and, when set,
/// the stream index map ("index_block", "index_stride", "index_start"; see kernels/rng.h).
Attrs dropout_attrs(const Attrs& from);

}  // namespace fusetrain::ir
