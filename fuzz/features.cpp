// A feature file (images' or audio's model inputs, fusetrain.features' safetensors): data::FeatureDataset on the
// input bytes, labelled and unlabelled. When it opens, every example is collated (so a free axis is padded and the
// labels laid out) and, with a vocabulary, each transcription decoded; then SpecAugment's masks drawn over the clips
// with a config of the input's own numbers.
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "fusetrain/data/features.h"

namespace {

namespace data = fusetrain::data;
namespace fuzz = fusetrain::fuzz;

void use(const data::FeatureDataset& d) {
  std::vector<int64_t> indices(static_cast<size_t>(std::min<int64_t>(d.size(), 16)));
  std::iota(indices.begin(), indices.end(), 0);
  const data::Batch batch = d.collate(indices);
  for (const data::FloatInput& input : batch.float_inputs)
    for (float v : input.values) fuzz::sink = fuzz::sink + static_cast<uint64_t>(v != 0);
  fuzz::sink = fuzz::sink + batch.labels.size();
  if (d.has_vocabulary() && d.label_kind() == data::LabelKind::Targets)
    for (int64_t i : indices) fuzz::sink = fuzz::sink + d.transcription(d.target(i), true).size();
  if (d.example_shape().size() == 1 && batch.float_inputs[0].shape.size() == 2) {
    data::SpecAugment spec;
    spec.time_prob = 0.5;
    spec.time_length = 2;
    spec.feature_prob = 0.5;
    spec.feature_length = 3;
    spec.hidden = 7;
    spec.convolutions = {{3, 2}};
    data::Batch masked = batch;
    data::add_spec_augment(masked, d.input_name(), spec, {"mask_time_indices", "mask_feature_indices"}, 1, 2);
    for (const data::FloatInput& input : masked.float_inputs) fuzz::sink = fuzz::sink + input.values.size();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = (fuzz::scratch_dir() / "input.safetensors").string();
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::sink = fuzz::sink + data::is_feature_file(path);
  for (const bool labelled : {true, false})
    fuzz::parses("FeatureDataset", [&] { use(data::FeatureDataset(path, labelled)); });
  return 0;
}
