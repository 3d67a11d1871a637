// models::Batch and the declared inputs of token models.
#include "fusetrain/models/inputs.h"

#include <algorithm>

#include "fusetrain/core/error.h"

namespace fusetrain::models {

Batch& Batch::set(std::string_view name, Tensor tensor) {
  auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const auto& entry) { return entry.first == name; });
  if (tensor.data() == nullptr) {
    if (it != tensors_.end()) tensors_.erase(it);
  } else if (it != tensors_.end()) {
    it->second = std::move(tensor);
  } else {
    tensors_.emplace_back(std::string(name), std::move(tensor));
  }
  return *this;
}

const Tensor& Batch::get(std::string_view name) const {
  static const Tensor kAbsent;
  for (const auto& [key, tensor] : tensors_)
    if (key == name) return tensor;
  return kAbsent;
}

std::string element_type_name(DType dtype) {
  switch (dtype) {
    case DType::i64:
      return "int64";
    case DType::f32:
      return "float32";
    default:
      return dtype_name(dtype);
  }
}

std::string describe(const InputDecl& input) {
  std::string axes;
  for (int64_t k = 0; k < input.rank; ++k) {
    std::string axis;
    if (k == 0)
      axis = "batch";
    else if (k == input.seq_axis)
      axis = input.target ? "target sequence" : "sequence";
    else if (size_t(k) < input.fixed.size() && input.fixed[size_t(k)] >= 0)
      axis = std::to_string(input.fixed[size_t(k)]);
    else
      axis = "any";
    axes += (k == 0 ? "" : ", ") + axis;
  }
  return str(element_type_name(input.dtype), " (", axes, ")");
}

std::vector<InputDecl> token_inputs(bool token_types) {
  std::vector<InputDecl> inputs = {
      {"input_ids", DType::i64, 2, 1, InputSource::Batch, {}},
      {"attention_mask", DType::i64, 2, 1, InputSource::Optional, {}},
  };
  if (token_types) inputs.push_back({"token_type_ids", DType::i64, 2, 1, InputSource::Optional, {}});
  inputs.push_back({"position_ids", DType::i64, 2, 1, InputSource::Derived, {}});
  return inputs;
}

}  // namespace fusetrain::models
