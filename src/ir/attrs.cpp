#include "fusetrain/ir/attrs.h"

#include <sstream>

#include "fusetrain/core/error.h"

namespace fusetrain::ir {
namespace {

template <typename T>
const T& expect(const AttrValue* v, const std::string& name, const char* type) {
  FT_CHECK(v != nullptr, "missing attribute \"", name, "\"");
  const T* p = std::get_if<T>(v);
  FT_CHECK(p != nullptr, "attribute \"", name, "\" should be ", type);
  return *p;
}

}  // namespace

Attrs& Attrs::set(const std::string& name, AttrValue value) {
  for (auto& [key, v] : items_)
    if (key == name) {
      v = std::move(value);
      return *this;
    }
  items_.emplace_back(name, std::move(value));
  return *this;
}

const AttrValue* Attrs::find(const std::string& name) const {
  for (const auto& [key, v] : items_)
    if (key == name) return &v;
  return nullptr;
}

bool Attrs::has(const std::string& name) const { return find(name) != nullptr; }

int64_t Attrs::get_int(const std::string& name) const { return expect<int64_t>(find(name), name, "an integer"); }

double Attrs::get_float(const std::string& name) const {
  const AttrValue* v = find(name);
  if (v != nullptr)
    if (const int64_t* i = std::get_if<int64_t>(v)) return static_cast<double>(*i);
  return expect<double>(v, name, "a number");
}

const std::vector<int64_t>& Attrs::get_ints(const std::string& name) const {
  return expect<std::vector<int64_t>>(find(name), name, "a list of integers");
}

const std::string& Attrs::get_string(const std::string& name) const {
  return expect<std::string>(find(name), name, "a string");
}

int64_t Attrs::get_int(const std::string& name, int64_t fallback) const { return has(name) ? get_int(name) : fallback; }
double Attrs::get_float(const std::string& name, double fallback) const {
  return has(name) ? get_float(name) : fallback;
}
std::string Attrs::get_string(const std::string& name, const std::string& fallback) const {
  return has(name) ? get_string(name) : fallback;
}

std::string Attrs::to_string() const {
  std::ostringstream out;
  bool first = true;
  for (const auto& [key, v] : items_) {
    if (!first) out << ", ";
    first = false;
    out << key << '=';
    if (auto* i = std::get_if<int64_t>(&v))
      out << *i;
    else if (auto* d = std::get_if<double>(&v))
      out << *d;
    else if (auto* s = std::get_if<std::string>(&v))
      out << '"' << *s << '"';
    else {
      const auto& list = std::get<std::vector<int64_t>>(v);
      out << '[';
      for (size_t k = 0; k < list.size(); ++k) out << (k ? "," : "") << list[k];
      out << ']';
    }
  }
  return out.str();
}

Attrs dropout_attrs(const Attrs& from) {
  Attrs out{{"p", from.get_float("p", 0.0)}, {"seed", from.get_int("seed", 0)}};
  for (const char* name : {"index_block", "index_stride", "index_start"})
    if (from.has(name)) out.set(name, from.get_int(name));
  return out;
}

}  // namespace fusetrain::ir
