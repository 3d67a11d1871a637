// What a model reads: its declared inputs, and a batch of named tensors checked against them.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fusetrain/core/tensor.h"

namespace fusetrain::models {

/// Where an input's values come from.
enum class InputSource : uint8_t {
  Batch,     ///< the batch must provide it (input_ids, pixel_values)
  Optional,  ///< the batch may provide it; otherwise a default (an all-ones attention mask, zero token types)
  Derived,   ///< the model computes it when the batch leaves it out (position ids from input_ids)
};

/// One input a model's graphs read. Axis 0 is always the batch.
struct InputDecl {
  std::string name;
  DType dtype = DType::i64;
  int64_t rank = 2;
  int64_t seq_axis = 1;  ///< the axis every sequence input shares (-1: the input has none, e.g. pixel_values)
  InputSource source = InputSource::Batch;
  /// Sizes of the axes that are fixed (-1 where the batch decides; empty: every axis but batch and sequence
  /// is free), e.g. pixel_values (-1, 3, 224, 224) of a graph exported for 224x224 images.
  std::vector<int64_t> fixed;
  /// The sequence axis is an encoder-decoder's target sequence (decoder_input_ids, decoder_attention_mask): the
  /// inputs that set it share one length, and the others another.
  bool target = false;
};

/// The decoder inputs of an encoder-decoder, (batch, target sequence) int64: decoder_input_ids, which the batch
/// gives (the labels shifted right, as the model's own prepare_decoder_input_ids_from_labels does), and the
/// optional decoder_attention_mask.
inline constexpr const char* kDecoderInputNames[] = {"decoder_input_ids", "decoder_attention_mask"};

/// The label tensors a batch may carry besides the declared inputs (their checks depend on the head).
inline constexpr const char* kLabelNames[] = {"labels", "start_positions", "end_positions", "ref_logps"};

/// One batch of named tensors, views of caller memory: a model checks each against its declared inputs
/// (Model::inputs) and its labels against its head; a tensor with no data counts as absent.
class Batch {
 public:
  /// Sets (or replaces) the tensor named `name`; a tensor without data removes it.
  Batch& set(std::string_view name, Tensor tensor);
  /// The tensor named `name`, or an undefined Tensor when the batch has none.
  const Tensor& get(std::string_view name) const;
  bool has(std::string_view name) const { return get(name).data() != nullptr; }
  /// Every tensor, in the order they were set.
  const std::vector<std::pair<std::string, Tensor>>& tensors() const { return tensors_; }

 private:
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

/// What `input` expects, for errors: "float32 (batch, 3, 224, 224)", "int64 (batch, sequence)".
std::string describe(const InputDecl& input);
/// The name PyTorch and NumPy give a dtype ("int64", "float32"; others as dtype_name).
std::string element_type_name(DType dtype);

/// The declared inputs of a model whose inputs are token sequences: input_ids, attention_mask, token_type_ids
/// (when `token_types`) and position_ids, all (batch, sequence) int64.
std::vector<InputDecl> token_inputs(bool token_types);

}  // namespace fusetrain::models
