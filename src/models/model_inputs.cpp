// Model's input validation: a batch's named tensors against the inputs the family declares.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/quant.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "models/family.h"
#include "models/lora_graph.h"
#include "models/model_units.h"

namespace fusetrain::models {

void require_ids(const Tensor& t, const char* what, int64_t B, int64_t T) {
  FT_CHECK(t.dtype() == DType::i64, what, " must be int64, found ", dtype_name(t.dtype()));
  FT_CHECK(t.shape() == Shape({B, T}), what, " has shape ", t.shape().to_string(), ", expected (", B, ", ", T,
           ") like input_ids");
}

namespace {

// A shape as NumPy prints it: "(8,)" for one axis.
std::string numpy_shape(const Shape& shape) {
  return shape.rank() == 1 ? str("(", shape[0], ",)") : shape.to_string();
}

bool is_label(const std::string& name) {
  return std::find(std::begin(kLabelNames), std::end(kLabelNames), name) != std::end(kLabelNames);
}

}  // namespace

void Model::check_inputs(const Batch& batch) const {
  for (const auto& entry : batch.tensors()) {
    const std::string& name = entry.first;
    const Tensor& tensor = entry.second;
    if (is_label(name)) continue;
    const bool declared =
        std::any_of(inputs_.begin(), inputs_.end(), [&](const InputDecl& d) { return d.name == name; });
    if (declared) continue;
    std::string takes;
    for (const InputDecl& d : inputs_) takes += (takes.empty() ? "" : ", ") + d.name;
    if (name == InputNames::attention_mask && tensor.dtype() == DType::i64) {
      // A graph exported without a mask input attends to every token: a mask without padding asks for just that.
      const int64_t* m = tensor.data_as<int64_t>();
      const int64_t at = std::find_if(m, m + tensor.numel(), [](int64_t x) { return x != 1; }) - m;
      if (at == tensor.numel()) continue;
      throw Error(str(architecture_, " does not take attention_mask (it takes ", takes, "), so it cannot mask the ",
                      "padding the mask marks (value ", m[at], " at flat position ", at, ")"));
    }
    throw Error(str(architecture_, " does not take ", name, " (it takes ", takes, ")"));
  }
  // Every input shares the batch axis of the first one given, and every sequence input the sequence axis of the
  // first one given of its sequence (an encoder-decoder's decoder inputs share the target sequence's).
  const InputDecl* first = nullptr;
  const InputDecl* first_of[2] = {nullptr, nullptr};
  int64_t B = 0, T = 0, lengths[2] = {0, 0};
  for (const InputDecl& input : inputs_) {
    const Tensor& t = batch.get(input.name);
    if (t.data() == nullptr) {
      FT_CHECK(input.source != InputSource::Batch, architecture_, " needs ", input.name, ", ", describe(input),
               "; the batch has none");
      continue;
    }
    FT_CHECK(t.dtype() == input.dtype, input.name, " must be ", element_type_name(input.dtype), ", found ",
             element_type_name(t.dtype()));
    bool fits = t.shape().rank() == input.rank;
    for (size_t k = 0; fits && k < input.fixed.size(); ++k)
      fits = input.fixed[k] < 0 || t.shape()[int64_t(k)] == input.fixed[k];
    FT_CHECK(fits, input.name, " must be ", describe(input), "; found shape ", numpy_shape(t.shape()));
    FT_CHECK(t.numel() > 0, input.name, " is empty: shape ", t.shape().to_string());
    if (first == nullptr) {
      first = &input;
      B = t.shape()[0];
    }
    FT_CHECK(t.shape()[0] == B, input.name, " has batch size ", t.shape()[0], ", but ", first->name, " has ", B);
    if (input.seq_axis < 0) continue;
    const int sequence = input.target ? 1 : 0;
    if (first_of[sequence] == nullptr) {
      first_of[sequence] = &input;
      lengths[sequence] = t.shape()[input.seq_axis];
      continue;
    }
    FT_CHECK(t.shape()[input.seq_axis] == lengths[sequence], input.name, " has shape ", t.shape().to_string(),
             ", expected (", B, ", ", lengths[sequence], ") like ", first_of[sequence]->name);
  }
  T = std::max(lengths[0], lengths[1]);
  FT_CHECK(T <= family_->max_positions(), "sequence length ", T, " exceeds the model's maximum of ",
           family_->max_positions(), " positions");
  const Tensor& mask = batch.get(InputNames::attention_mask);
  if (mask.data() != nullptr && mask.dtype() == DType::i64) {
    // The graph turns the mask into an additive bias, (1 - m) * min: any value but 0 or 1 would silently become
    // NaN (large values), a full mask (2) or a reweighting (negative values).
    const int64_t* m = mask.data_as<int64_t>();
    const int64_t cols = mask.shape()[-1];
    for (int64_t i = 0; i < mask.numel(); ++i)
      FT_CHECK(m[i] == 0 || m[i] == 1, "attention_mask: value ", m[i], " at (", i / cols, ", ", i % cols,
               "); expected 1 for a token to attend to and 0 for padding");
  }
}

}  // namespace fusetrain::models
