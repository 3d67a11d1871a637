#include "fusetrain/runtime/parameters.h"

#include <cstring>

namespace fusetrain::runtime {

ParameterStore::ParameterStore(const ir::Graph& graph) {
  for (ir::ValueId id : graph.params()) {
    const ir::Value& v = graph.value(id);
    FT_CHECK(v.dtype == DType::f32, "parameter \"", v.name, "\" is ", dtype_name(v.dtype),
             "; parameters are stored in f32 (low-precision copies are made by casts)");
    slots_.push_back({v.name, v.shape, 0, v.shape.numel(), true});
  }
  allocate();
}

ParameterStore::ParameterStore(const std::vector<std::pair<std::string, Shape>>& params) {
  for (const auto& [name, shape] : params) {
    FT_CHECK(!contains(name), "parameter \"", name, "\" is declared twice");
    slots_.push_back({name, shape, 0, shape.numel(), true});
  }
  allocate();
}

void ParameterStore::allocate() {
  int64_t offset = 0;
  for (ParamSlot& s : slots_) {
    s.offset = offset;
    offset += static_cast<int64_t>(align_up(static_cast<size_t>(s.numel), kAlignment / sizeof(float)));
  }
  flat_numel_ = offset;
  params_ = aligned_allocate(static_cast<size_t>(flat_numel_) * sizeof(float));
  grads_ = aligned_allocate(static_cast<size_t>(flat_numel_) * sizeof(float));
}

bool ParameterStore::contains(const std::string& name) const {
  for (const ParamSlot& s : slots_)
    if (s.name == name) return true;
  return false;
}

size_t ParameterStore::index(const std::string& name) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].name == name) return i;
  std::string known;
  for (const ParamSlot& s : slots_) known += (known.empty() ? "" : ", ") + s.name;
  throw Error(str("no parameter named \"", name, "\" (parameters: ", known, ")"));
}

Tensor ParameterStore::param(size_t i) const {
  return Tensor::view(params_data() + slots_.at(i).offset, slots_[i].shape, DType::f32);
}

Tensor ParameterStore::grad(size_t i) const {
  return Tensor::view(grads_data() + slots_.at(i).offset, slots_[i].shape, DType::f32);
}

int64_t ParameterStore::num_parameters() const {
  int64_t n = 0;
  for (const ParamSlot& s : slots_) n += s.numel;
  return n;
}

void ParameterStore::zero_grads() {
  if (flat_numel_) std::memset(grads_.get(), 0, static_cast<size_t>(flat_numel_) * sizeof(float));
}

}  // namespace fusetrain::runtime
