// Feature files (images' and raw audio's model inputs, preprocessed in Python) and SpecAugment's masks.
#include "fusetrain/data/features.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>

#include "data/counter_random.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data {

bool is_feature_file(const std::string& path) {
  // A safetensors file begins with its header's length (8 bytes, little-endian) and the JSON header; only the
  // metadata key is looked for, so a table (TSV, JSON Lines) is never mistaken for one.
  std::ifstream in(path, std::ios::binary);
  uint64_t length = 0;
  if (!in.read(reinterpret_cast<char*>(&length), sizeof length) || length < 2 || length > (64u << 20)) return false;
  std::string header(static_cast<size_t>(length), '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(length)) || header[0] != '{') return false;
  return header.find(std::string("\"") + kFeatureMetadataKey + "\"") != std::string::npos;
}

namespace {

// The I64 tensor `name` of a feature file, copied out, checked to be 1-D.
std::vector<int64_t> int_vector(const io::SafetensorsFile& file, const std::string& name) {
  const io::SafetensorsEntry* entry = file.find(name);
  FT_CHECK(entry, file.path(), ": a feature file needs the tensor \"", name, "\", found none");
  FT_CHECK(entry->dtype == DType::i64 && entry->shape.rank() == 1, file.path(), ": \"", name,
           "\" must be a 1-D int64 tensor, found ", dtype_name(entry->dtype), " of rank ", entry->shape.rank());
  const Tensor t = file.tensor(name);
  const auto* values = static_cast<const int64_t*>(t.data());
  return std::vector<int64_t>(values, values + t.numel());
}

// Offsets of `count` + 1 entries from 0 to `total`, never decreasing.
void check_offsets(const std::vector<int64_t>& offsets, int64_t total, const std::string& where, const char* name) {
  FT_CHECK(!offsets.empty() && offsets.front() == 0 && offsets.back() == total, where, ": \"", name,
           "\" must run from 0 to ", total, " (the values it indexes)");
  for (size_t i = 1; i < offsets.size(); ++i)
    FT_CHECK(offsets[i] >= offsets[i - 1], where, ": \"", name, "\" goes down at example ", i - 1);
}

}  // namespace

FeatureDataset::FeatureDataset(const std::string& path, bool labelled) : file_(io::SafetensorsFile::open(path)) {
  const auto meta_it = file_.metadata().find(kFeatureMetadataKey);
  FT_CHECK(meta_it != file_.metadata().end(), path, ": expected a feature file (safetensors with \"",
           kFeatureMetadataKey, "\" metadata, as fusetrain.features writes), found none");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(meta_it->second);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str(path, ": its \"", kFeatureMetadataKey, "\" metadata is not JSON (", e.what(), ")"));
  }
  FT_CHECK(meta.is_object() && meta.value("input", nlohmann::json()).is_string() &&
               meta.value("shape", nlohmann::json()).is_array() && meta.value("labels", nlohmann::json()).is_string(),
           path, ": feature metadata needs \"input\" (a name), \"shape\" (a list) and \"labels\" (a kind), found ",
           meta_it->second.substr(0, 200));
  input_ = meta["input"].get<std::string>();
  for (const nlohmann::json& d : meta["shape"]) {
    FT_CHECK(d.is_number_integer() && (d.get<int64_t>() > 0 || d.get<int64_t>() == -1), path,
             ": \"shape\" holds positive sizes or -1 (a free axis), found ", d.dump());
    shape_.push_back(d.get<int64_t>());
  }
  FT_CHECK(!shape_.empty() && std::count(shape_.begin(), shape_.end(), -1) <= 1, path,
           ": \"shape\" needs at least one axis and at most one free (-1) axis");
  if (meta.contains("padding_value")) {
    FT_CHECK(meta["padding_value"].is_number(), path, ": \"padding_value\" must be a number");
    padding_value_ = meta["padding_value"].get<float>();
  }
  if (meta.contains("label_names")) {
    FT_CHECK(meta["label_names"].is_array(), path, ": \"label_names\" must be a list of names");
    for (const nlohmann::json& name : meta["label_names"])
      label_names_.push_back(name.is_string() ? name.get<std::string>() : name.dump());
  }

  if (meta.contains("vocabulary")) {
    FT_CHECK(meta["vocabulary"].is_array() && meta.value("blank", nlohmann::json()).is_number_integer(), path,
             ": \"vocabulary\" must be a list of tokens, with \"blank\" the padding token's id");
    for (const nlohmann::json& token : meta["vocabulary"])
      vocabulary_.push_back(token.is_string() ? token.get<std::string>() : std::string());
    blank_ = meta["blank"].get<int64_t>();
    if (meta.contains("word_delimiter") && meta["word_delimiter"].is_string())
      word_delimiter_ = meta["word_delimiter"].get<std::string>();
  }

  const io::SafetensorsEntry* features = file_.find("features");
  FT_CHECK(features && features->dtype == DType::f32 && features->shape.rank() == 1, path,
           ": a feature file needs \"features\", a 1-D float32 tensor");
  features_tensor_ = file_.tensor("features");
  features_ = static_cast<const float*>(features_tensor_.data());
  feature_offsets_ = int_vector(file_, "feature_offsets");
  check_offsets(feature_offsets_, features_tensor_.numel(), path, "feature_offsets");
  const int64_t n = static_cast<int64_t>(feature_offsets_.size()) - 1;
  FT_CHECK(n > 0, path, ": holds no examples");
  // A free axis (raw audio's length) is the last: an example's values are then one run per batch row.
  FT_CHECK(shape_.back() == -1 || std::count(shape_.begin(), shape_.end(), -1) == 0, path,
           ": a feature file's free axis must be its last");
  for (int64_t d : shape_) fixed_ *= d == -1 ? 1 : d;
  const bool free_axis = shape_.back() == -1;
  const int64_t fixed = fixed_;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t size = feature_offsets_[i + 1] - feature_offsets_[i];
    FT_CHECK(free_axis ? size > 0 && size % fixed == 0 : size == fixed, path, ": example ", i, " holds ", size,
             " values; its shape ", meta["shape"].dump(), " needs ", free_axis ? "a positive multiple of " : "",
             fixed);
  }
  for (int64_t i = 0; i < features_tensor_.numel(); ++i)
    FT_CHECK(std::isfinite(features_[i]), path, ": example ",
             std::upper_bound(feature_offsets_.begin(), feature_offsets_.end(), i) - feature_offsets_.begin() - 1,
             " holds a non-finite value");

  offsets_.assign(static_cast<size_t>(n) + 1, 0);  // no token ids
  const std::string kind = meta["labels"].get<std::string>();
  FT_CHECK(kind == "classes" || kind == "sequences" || kind == "none", path,
           ": \"labels\" is \"classes\", \"sequences\" or \"none\", found \"", kind, "\"");
  FT_CHECK(!labelled || kind != "none", path, ": holds no labels, and this command needs them (training and "
           "evaluation data name a class or a transcription per example)");
  if (kind == "none" || !labelled) return;
  std::vector<int64_t> labels = int_vector(file_, "labels");
  std::vector<int64_t> label_offsets = int_vector(file_, "label_offsets");
  FT_CHECK(static_cast<int64_t>(label_offsets.size()) == n + 1, path, ": \"label_offsets\" has ",
           label_offsets.size(), " entries for ", n, " examples (expected ", n + 1, ")");
  check_offsets(label_offsets, static_cast<int64_t>(labels.size()), path, "label_offsets");
  if (kind == "classes") {
    for (int64_t i = 0; i < n; ++i) {
      FT_CHECK(label_offsets[i + 1] - label_offsets[i] == 1, path, ": example ", i, " has ",
               label_offsets[i + 1] - label_offsets[i], " class labels (expected one)");
      const int64_t label = labels[static_cast<size_t>(label_offsets[i])];
      FT_CHECK(label >= 0 && (label_names_.empty() || label < static_cast<int64_t>(label_names_.size())), path,
               ": example ", i, " has class ", label, ", outside [0, ", label_names_.size(), ")");
      labels_.push_back(label);
    }
    label_kind_ = LabelKind::Class;
  } else {
    for (int64_t label : labels)
      FT_CHECK(label >= 0, path, ": a transcription holds the token id ", label, " (ids are >= 0)");
    token_labels_ = std::move(labels);
    target_offsets_ = std::move(label_offsets);
    label_kind_ = LabelKind::Targets;
  }
}

int64_t FeatureDataset::feature_size(int64_t i) const {
  check_index(i);
  return feature_offsets_[static_cast<size_t>(i) + 1] - feature_offsets_[static_cast<size_t>(i)];
}

std::string FeatureDataset::transcription(std::span<const int64_t> ids, bool grouped) const {
  std::string text;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int64_t id = ids[k];
    if ((grouped && k > 0 && ids[k - 1] == id) || id == blank_ || id < 0 ||
        id >= static_cast<int64_t>(vocabulary_.size()))
      continue;
    const std::string& token = vocabulary_[static_cast<size_t>(id)];
    text += !word_delimiter_.empty() && token == word_delimiter_ ? std::string(" ") : token;
  }
  const size_t begin = text.find_first_not_of(" \t\n\r\f\v");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t\n\r\f\v") - begin + 1);
}

Batch FeatureDataset::collate(std::span<const int64_t> indices) const {
  FT_CHECK(!indices.empty(), "a feature batch needs at least one example");
  int64_t longest = 0;
  for (int64_t i : indices) longest = std::max(longest, feature_size(i));
  const int64_t B = static_cast<int64_t>(indices.size());
  Batch batch;
  batch.batch_size = B;
  FloatInput input{input_, {B}, {}};
  for (int64_t d : shape_) input.shape.push_back(d == -1 ? longest / fixed_ : d);
  const size_t row = static_cast<size_t>(shape_.back() == -1 ? longest : fixed_);
  input.values.assign(static_cast<size_t>(B) * row, padding_value_);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = indices[static_cast<size_t>(b)];
    const float* from = features_ + feature_offsets_[static_cast<size_t>(i)];
    std::copy(from, from + feature_size(i), input.values.data() + static_cast<size_t>(b) * row);
  }
  batch.float_inputs.push_back(std::move(input));
  if (label_kind_ == LabelKind::Class) {
    for (int64_t i : indices) batch.labels.push_back(label(i));
  } else if (label_kind_ == LabelKind::Targets) {
    int64_t L = 1;
    for (int64_t i : indices) L = std::max<int64_t>(L, static_cast<int64_t>(target(i).size()));
    L = (L + 7) / 8 * 8;
    batch.label_seq_len = L;
    batch.labels.assign(static_cast<size_t>(B * L), kIgnoreIndex);
    for (int64_t b = 0; b < B; ++b) {
      const auto t = target(indices[static_cast<size_t>(b)]);
      std::copy(t.begin(), t.end(), batch.labels.begin() + b * L);
    }
  }
  return batch;
}

namespace {

int64_t json_int(const nlohmann::json& config, const char* key, int64_t fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  FT_CHECK(config[key].is_number_integer() && config[key].get<int64_t>() >= 0, "config.json: \"", key,
           "\" must be a non-negative integer, found ", config[key].dump());
  return config[key].get<int64_t>();
}

double json_prob(const nlohmann::json& config, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return 0;
  FT_CHECK(config[key].is_number() && config[key].get<double>() >= 0 && config[key].get<double>() <= 1,
           "config.json: \"", key, "\" must be a probability in [0, 1], found ", config[key].dump());
  return config[key].get<double>();
}

}  // namespace

SpecAugment SpecAugment::from_config(const nlohmann::json& config) {
  SpecAugment s;
  if (config.contains("apply_spec_augment") && config["apply_spec_augment"].is_boolean() &&
      !config["apply_spec_augment"].get<bool>())
    return s;
  s.time_prob = json_prob(config, "mask_time_prob");
  s.time_length = json_int(config, "mask_time_length", 10);
  s.time_min_masks = json_int(config, "mask_time_min_masks", 2);
  s.feature_prob = json_prob(config, "mask_feature_prob");
  s.feature_length = json_int(config, "mask_feature_length", 10);
  s.feature_min_masks = json_int(config, "mask_feature_min_masks", 0);
  s.hidden = json_int(config, "hidden_size", 0);
  const auto kernels = config.value("conv_kernel", nlohmann::json::array());
  const auto strides = config.value("conv_stride", nlohmann::json::array());
  FT_CHECK(kernels.is_array() && strides.is_array() && kernels.size() == strides.size(),
           "config.json: \"conv_kernel\" and \"conv_stride\" must be lists of one length");
  for (size_t k = 0; k < kernels.size(); ++k) {
    FT_CHECK(kernels[k].is_number_integer() && strides[k].is_number_integer() && kernels[k].get<int64_t>() > 0 &&
                 strides[k].get<int64_t>() > 0,
             "config.json: conv_kernel and conv_stride hold positive integers, found ", kernels[k].dump(), " and ",
             strides[k].dump());
    s.convolutions.emplace_back(kernels[k].get<int64_t>(), strides[k].get<int64_t>());
  }
  FT_CHECK(s.time_length > 0 && s.feature_length > 0, "config.json: mask_time_length and mask_feature_length must "
           "be positive");
  return s;
}

int64_t SpecAugment::frames(int64_t samples) const {
  for (const auto& [kernel, stride] : convolutions) samples = samples < kernel ? 0 : (samples - kernel) / stride + 1;
  return samples;
}

std::vector<float> spec_augment_mask(int64_t rows, int64_t columns, double prob, int64_t length, int64_t min_masks,
                                     uint64_t seed, uint64_t batch_index, uint64_t salt) {
  FT_CHECK(rows > 0 && columns >= 0 && length > 0, "spec_augment_mask: rows ", rows, ", columns ", columns,
           ", span length ", length);
  std::vector<float> mask(static_cast<size_t>(rows * columns), 0.0f);
  const uint64_t stream = detail::batch_stream(seed, batch_index, salt);
  const double epsilon = detail::unit(detail::splitmix64(stream));
  // transformers' compute_num_masked_span, for every row's length (the whole axis: no attention mask).
  int64_t spans = static_cast<int64_t>(prob * static_cast<double>(columns) / static_cast<double>(length) + epsilon);
  spans = std::max(spans, min_masks);
  if (spans * length > columns) spans = columns / length;
  if (columns - (length - 1) < spans) spans = std::max<int64_t>(columns - (length - 1), 0);
  if (spans == 0) return mask;
  const int64_t starts = columns - (length - 1);  // > 0 here: spans >= 1 needs it
  std::vector<int64_t> pool(static_cast<size_t>(starts));
  for (int64_t r = 0; r < rows; ++r) {
    // Partial Fisher-Yates: the first `spans` of a uniform permutation of the starts.
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t k = 0; k < spans; ++k) {
      const uint64_t counter = (static_cast<uint64_t>(r) << 32) | static_cast<uint64_t>(k);
      const uint64_t bits = detail::splitmix64(stream ^ detail::splitmix64(counter));
      const int64_t pick = k + detail::below(bits, static_cast<uint64_t>(starts - k));
      std::swap(pool[static_cast<size_t>(k)], pool[static_cast<size_t>(pick)]);
      for (int64_t c = pool[static_cast<size_t>(k)]; c < std::min(columns, pool[static_cast<size_t>(k)] + length); ++c)
        mask[static_cast<size_t>(r * columns + c)] = 1.0f;
    }
  }
  return mask;
}

void add_spec_augment(Batch& batch, const std::string& input_name, const SpecAugment& spec,
                      const std::vector<std::string>& wanted, uint64_t seed, uint64_t batch_index) {
  const auto wants = [&](const char* name) { return std::find(wanted.begin(), wanted.end(), name) != wanted.end(); };
  const auto audio = std::find_if(batch.float_inputs.begin(), batch.float_inputs.end(),
                                  [&](const FloatInput& f) { return f.name == input_name; });
  FT_CHECK(audio != batch.float_inputs.end() && audio->shape.size() == 2, "SpecAugment needs the batch's ",
           input_name, " as (batch, samples)");
  const int64_t B = batch.batch_size;
  if (wants("mask_time_indices") && spec.time_prob > 0) {
    const int64_t frames = spec.frames(audio->shape[1]);
    batch.float_inputs.push_back({"mask_time_indices", {B, frames},
                                  spec_augment_mask(B, frames, spec.time_prob, spec.time_length, spec.time_min_masks,
                                                    seed, batch_index, 0x5A17)});
  }
  if (wants("mask_feature_indices") && spec.feature_prob > 0) {
    FT_CHECK(spec.hidden > 0, "SpecAugment's feature mask needs hidden_size in config.json");
    batch.float_inputs.push_back({"mask_feature_indices", {B, spec.hidden},
                                  spec_augment_mask(B, spec.hidden, spec.feature_prob, spec.feature_length,
                                                    spec.feature_min_masks, seed, batch_index, 0xFEA7)});
  }
}

}  // namespace fusetrain::data
