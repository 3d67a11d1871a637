#include "fusetrain/runtime/parameters.h"

#include <cstring>
#include <set>

namespace fusetrain::runtime {

ParameterStore::ParameterStore(const ir::Graph& graph, const kernels::Device& device) : device_(&device) {
  std::set<ir::ValueId> tables;
  for (const ir::Node& node : graph.nodes())
    if (node.op == ir::OpKind::Embedding) tables.insert(node.inputs[0]);
  for (ir::ValueId id : graph.params()) {
    const ir::Value& v = graph.value(id);
    FT_CHECK(v.dtype == DType::f32, "parameter \"", v.name, "\" is ", dtype_name(v.dtype),
             "; parameters are stored in f32 (low-precision copies are made by casts)");
    slots_.push_back({v.name, v.shape, 0, v.shape.numel(), true, tables.count(id) > 0});
  }
  for (ir::ValueId id : graph.frozen()) {
    const ir::Value& v = graph.value(id);
    frozen_slots_.push_back({v.name, v.shape, v.dtype, 0, v.shape.numel()});
  }
  allocate();
}

ParameterStore::ParameterStore(const std::vector<std::pair<std::string, Shape>>& params,
                               const kernels::Device& device)
    : device_(&device) {
  for (const auto& [name, shape] : params) {
    FT_CHECK(!contains(name), "parameter \"", name, "\" is declared twice");
    slots_.push_back({name, shape, 0, shape.numel(), true, false});
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
  params_ = device_->allocate(static_cast<size_t>(flat_numel_) * sizeof(float));
  grads_ = device_->allocate(static_cast<size_t>(flat_numel_) * sizeof(float));
  size_t bytes = 0;
  for (FrozenSlot& s : frozen_slots_) {
    s.offset = bytes;
    bytes += align_up(static_cast<size_t>(s.numel) * dtype_size(s.dtype));
  }
  if (bytes) frozen_ = device_->allocate(bytes);
  frozen_bytes_ = bytes;
}

bool ParameterStore::contains_frozen(const std::string& name) const {
  for (const FrozenSlot& s : frozen_slots_)
    if (s.name == name) return true;
  return false;
}

Tensor ParameterStore::frozen(size_t i) const {
  const FrozenSlot& s = frozen_slots_.at(i);
  return Tensor::view(static_cast<char*>(frozen_.get()) + s.offset, s.shape, s.dtype);
}

Tensor ParameterStore::frozen(const std::string& name) const {
  for (size_t i = 0; i < frozen_slots_.size(); ++i)
    if (frozen_slots_[i].name == name) return frozen(i);
  throw Error(str("no frozen parameter named \"", name, "\""));
}

int64_t ParameterStore::num_frozen_parameters() const {
  int64_t n = 0;
  for (const FrozenSlot& s : frozen_slots_) n += s.numel;
  return n;
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
  kernels::StepContext ctx;
  if (flat_numel_) device_->zero(grads_.get(), static_cast<size_t>(flat_numel_) * sizeof(float), ctx);
}

}  // namespace fusetrain::runtime
