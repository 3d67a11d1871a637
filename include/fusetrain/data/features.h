// Float-input examples for the command line: images' pixel_values and raw audio's input_values, read from a
// feature file (written by the Python package's fusetrain.features, which decodes and preprocesses them), collated
// into batches; and SpecAugment's masks for speech models that train with them.
//
//   FeatureDataset train("train.safetensors", true);
//   Batch batch = train.collate(indices);                       // pixel_values (B, 3, H, W), labels (B)
//   add_spec_augment(batch, spec, seed, batch_index);            // mask_time_indices (B, frames), ...
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fusetrain/data/collator.h"
#include "fusetrain/data/dataset.h"
#include "fusetrain/io/safetensors.h"

namespace fusetrain::data {

/// The metadata key of a feature file: a JSON object describing its examples.
inline constexpr const char* kFeatureMetadataKey = "fusetrain.features";

/// Whether `path` is a feature file: a safetensors file whose metadata has kFeatureMetadataKey. Reads only the
/// header; false for anything else (a table, a missing file).
bool is_feature_file(const std::string& path);

/// Examples whose model input is one float tensor each, held in a feature file:
///   features        F32, every example's values one after another;
///   feature_offsets I64 (N + 1), example i at features[offsets[i], offsets[i + 1]);
///   labels, label_offsets  I64: one class per example, or a token sequence per example (CTC transcriptions);
///                   absent in unlabelled files;
/// metadata["fusetrain.features"] = {"input": "pixel_values" | "input_values" | ..., "shape": the per-example
/// shape with -1 on a free axis, "padding_value": x, "labels": "classes" | "sequences" | "none",
/// "label_names": [...]}. The dataset holds no token ids; its labels are LabelKind::Class or LabelKind::Targets.
class FeatureDataset : public TokenizedDataset {
 public:
  /// Reads and checks `path`; `labelled`: the file must hold labels (training, evaluation). Throws Error naming
  /// the file and the first inconsistency (offsets, an example's size against the shape, a label out of range).
  FeatureDataset(const std::string& path, bool labelled);

  /// The model input the examples are (e.g. "pixel_values").
  const std::string& input_name() const { return input_; }
  /// The per-example shape, -1 on a free axis (padded per batch to its longest example).
  const std::vector<int64_t>& example_shape() const { return shape_; }
  /// The class names, position = id (classes only; may be empty).
  const std::vector<std::string>& label_names() const { return label_names_; }
  /// The number of values of example i.
  int64_t feature_size(int64_t i) const;
  /// Whether the file carries its tokenizer's vocabulary (CTC transcriptions: "vocabulary", "blank",
  /// "word_delimiter"), which transcription() decodes with.
  bool has_vocabulary() const { return !vocabulary_.empty(); }
  /// The text of token ids as transformers' Wav2Vec2CTCTokenizer.decode gives it: runs of one id taken once when
  /// `grouped` (a CTC model's frames), the blank (padding) token dropped, the word delimiter a space, the tokens
  /// joined and the ends stripped; an id outside the vocabulary is skipped.
  std::string transcription(std::span<const int64_t> ids, bool grouped) const;

  /// The batch of examples `indices`, in that order: the input (B, shape...) with a free axis padded on the right
  /// to the longest example of the batch with the file's padding value; labels (B) for classes, or (B, L) for
  /// sequences, L the longest rounded up to a multiple of 8, padded with kIgnoreIndex (label_seq_len = L). Throws
  /// Error on an empty or out-of-range index list.
  Batch collate(std::span<const int64_t> indices) const;

 private:
  io::SafetensorsFile file_;
  std::string input_;
  std::vector<int64_t> shape_;
  int64_t fixed_ = 1;  // the product of shape_'s sizes but the free axis
  float padding_value_ = 0;
  std::vector<std::string> label_names_;
  std::vector<std::string> vocabulary_;
  int64_t blank_ = -1;
  std::string word_delimiter_;
  std::vector<int64_t> feature_offsets_;
  Tensor features_tensor_;  // a view into the file's mapping
  const float* features_ = nullptr;
};

/// SpecAugment as transformers' Wav2Vec2-family models draw it in training (their _compute_mask_indices): spans
/// of `length` along an axis, their count prob * size / length + a uniform draw, at least min_masks, starts
/// distinct and uniform. Read from a model's config.json.
struct SpecAugment {
  double time_prob = 0;  ///< mask_time_prob: masks (batch, frames), written as mask_time_indices
  int64_t time_length = 10;
  int64_t time_min_masks = 2;
  double feature_prob = 0;  ///< mask_feature_prob: masks (batch, hidden), written as mask_feature_indices
  int64_t feature_length = 10;
  int64_t feature_min_masks = 0;
  int64_t hidden = 0;  ///< hidden_size: the feature mask's width
  /// The feature encoder's (kernel, stride) per convolution: frames = the audio length through each.
  std::vector<std::pair<int64_t, int64_t>> convolutions;

  /// The settings of a config.json (apply_spec_augment, mask_time_*, mask_feature_*, hidden_size, conv_kernel,
  /// conv_stride); all-zero probabilities when apply_spec_augment is false. Throws Error on a malformed field.
  static SpecAugment from_config(const nlohmann::json& config);
  /// The frames the feature encoder makes of `samples` audio samples (0 when too short).
  int64_t frames(int64_t samples) const;
};

/// One mask of transformers' _compute_mask_indices, (rows, columns) row-major, 1 where masked: every row gets
/// the same number of spans (from one uniform draw for the batch, as transformers draws one epsilon), each row's
/// starts drawn without replacement from [0, columns - length], spans clipped at the end. A pure function of
/// (seed, batch_index, salt).
std::vector<float> spec_augment_mask(int64_t rows, int64_t columns, double prob, int64_t length, int64_t min_masks,
                                     uint64_t seed, uint64_t batch_index, uint64_t salt);

/// Adds `spec`'s masks to a batch of raw audio (its float input `input_name` of shape (B, samples)) as the float
/// inputs `mask_time_indices` (B, frames) and `mask_feature_indices` (B, hidden), each only where `wanted` names it
/// and its probability is above 0.
void add_spec_augment(Batch& batch, const std::string& input_name, const SpecAugment& spec,
                      const std::vector<std::string>& wanted, uint64_t seed, uint64_t batch_index);

}  // namespace fusetrain::data
