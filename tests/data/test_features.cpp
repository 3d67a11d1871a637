// Feature files (images and audio preprocessed in Python): reading, collation with padding of a free axis, every
// malformed file refused with one clear error; SpecAugment's masks: transformers' span count, distinct starts,
// determinism per (seed, batch).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>

#include "fusetrain/core/error.h"
#include "fusetrain/data/features.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using namespace fusetrain::data;

Tensor f32(std::vector<float> v) {
  Tensor t = Tensor::zeros({static_cast<int64_t>(v.size())}, DType::f32);
  std::copy(v.begin(), v.end(), t.data_as<float>());
  return t;
}

Tensor i64(std::vector<int64_t> v) {
  Tensor t = Tensor::zeros({static_cast<int64_t>(v.size())}, DType::i64);
  std::copy(v.begin(), v.end(), t.data_as<int64_t>());
  return t;
}

// A file as fusetrain.features writes it.
struct FileSpec {
  std::vector<float> features;
  std::vector<int64_t> offsets, labels, label_offsets;
  std::string meta;
};

std::string write(const TempDir& dir, const FileSpec& f, const std::string& name = "f.safetensors") {
  std::vector<std::pair<std::string, Tensor>> tensors = {{"features", f32(f.features)},
                                                         {"feature_offsets", i64(f.offsets)}};
  if (!f.label_offsets.empty()) {
    tensors.emplace_back("labels", i64(f.labels));
    tensors.emplace_back("label_offsets", i64(f.label_offsets));
  }
  const std::string path = (dir.path / name).string();
  io::save_safetensors(path, tensors, {{kFeatureMetadataKey, f.meta}});
  return path;
}

// Three 1x2x2 "images" of classes 2, 0, 1.
FileSpec images() {
  return {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {0, 4, 8, 12}, {2, 0, 1}, {0, 1, 2, 3},
          R"({"input": "pixel_values", "shape": [1, 2, 2], "labels": "classes", "label_names": ["a", "b", "c"]})"};
}

// Three clips of 3, 5 and 2 samples with transcriptions of 2, 3 and 1 tokens.
FileSpec clips() {
  return {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {0, 3, 8, 10}, {5, 6, 7, 8, 9, 4}, {0, 2, 5, 6},
          R"({"input": "input_values", "shape": [-1], "padding_value": -1.5, "labels": "sequences"})"};
}

TEST(FeatureDataset, CollatesImagesWithTheirClasses) {
  TempDir dir;
  const std::string path = write(dir, images());
  EXPECT_TRUE(is_feature_file(path));
  FeatureDataset d(path, true);
  EXPECT_EQ(d.size(), 3);
  EXPECT_EQ(d.label_kind(), LabelKind::Class);
  EXPECT_EQ(d.label_names(), (std::vector<std::string>{"a", "b", "c"}));
  const std::vector<int64_t> order = {2, 0};
  const Batch b = d.collate(order);
  ASSERT_EQ(b.float_inputs.size(), 1u);
  EXPECT_EQ(b.float_inputs[0].name, "pixel_values");
  EXPECT_EQ(b.float_inputs[0].shape, (std::vector<int64_t>{2, 1, 2, 2}));
  EXPECT_EQ(b.float_inputs[0].values, (std::vector<float>{9, 10, 11, 12, 1, 2, 3, 4}));
  EXPECT_EQ(b.labels, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(b.seq_len, 0);
}

TEST(FeatureDataset, PadsAudioToTheLongestClipAndTranscriptionsToAMultipleOf8) {
  TempDir dir;
  FeatureDataset d(write(dir, clips()), true);
  EXPECT_EQ(d.label_kind(), LabelKind::Targets);
  const std::vector<int64_t> order = {0, 1, 2};
  const Batch b = d.collate(order);
  EXPECT_EQ(b.float_inputs[0].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(b.float_inputs[0].values,
            (std::vector<float>{1, 2, 3, -1.5, -1.5, 4, 5, 6, 7, 8, 9, 10, -1.5, -1.5, -1.5}));
  EXPECT_EQ(b.label_seq_len, 8);
  std::vector<int64_t> want(24, kIgnoreIndex);
  want[0] = 5, want[1] = 6, want[8] = 7, want[9] = 8, want[10] = 9, want[16] = 4;
  EXPECT_EQ(b.labels, want);
  // Unlabelled reading ignores the labels.
  EXPECT_EQ(FeatureDataset(write(dir, clips(), "g.safetensors"), false).label_kind(), LabelKind::None);
}

TEST(FeatureDataset, DecodesTranscriptionsAsTheCtcTokenizer) {
  TempDir dir;
  FileSpec f = clips();
  f.meta = R"({"input": "input_values", "shape": [-1], "labels": "sequences", "blank": 0,
               "vocabulary": ["<pad>", "|", "a", "b", "<unk>"], "word_delimiter": "|"})";
  FeatureDataset d(write(dir, f), true);
  ASSERT_TRUE(d.has_vocabulary());
  // Frames: runs taken once, the blank between two a's keeps both, the delimiter a space, the ends stripped.
  const std::vector<int64_t> frames = {0, 2, 2, 0, 2, 1, 1, 3, 3, 4, 1, 0, 9};
  EXPECT_EQ(d.transcription(frames, true), "aa b<unk>");
  const std::vector<int64_t> labels = {2, 2, 1, 3};  // references are not grouped
  EXPECT_EQ(d.transcription(labels, false), "aa b");
  EXPECT_FALSE(FeatureDataset(write(dir, clips(), "plain.safetensors"), true).has_vocabulary());
}

TEST(FeatureDataset, RefusesMalformedFilesNamingTheFault) {
  TempDir dir;
  const auto refused = [&](FileSpec f, const std::string& expected, bool labelled = true) {
    const std::string path = write(dir, f);
    EXPECT_CONTAINS(error_of([&] { FeatureDataset(path, labelled); }), expected);
  };
  FileSpec f = images();
  f.offsets = {0, 4, 9, 12};
  refused(f, "example 1 holds 5 values");
  f = images();
  f.offsets = {0, 8, 4, 12};
  refused(f, "goes down at example 1");
  f = images();
  f.labels = {2, 0, 3};
  refused(f, "example 2 has class 3, outside [0, 3)");
  {
    // A NaN written by another writer (save_safetensors refuses one itself): the sixth value patched in the bytes.
    const std::string path = write(dir, images(), "nan.safetensors");
    std::string bytes = read_file(path);
    uint64_t header = 0;
    std::memcpy(&header, bytes.data(), sizeof header);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(bytes.data() + 8 + header + 5 * sizeof(float), &nan, sizeof nan);  // features come first
    write_file(path, bytes);
    EXPECT_CONTAINS(error_of([&] { FeatureDataset(path, true); }), "example 1 holds a non-finite value");
  }
  f = images();
  f.meta = R"({"input": "pixel_values", "shape": [1, 2, 2], "labels": "none"})";
  refused(f, "holds no labels");
  f.meta = R"({"input": 3})";
  refused(f, "feature metadata needs");
  f.meta = "not json";
  refused(f, "is not JSON");
  f = clips();
  f.label_offsets = {0, 2, 5};
  refused(f, "\"label_offsets\" has 3 entries for 3 examples");
  f = clips();
  f.labels[1] = -4;
  refused(f, "token id -4");
  f = clips();
  f.meta = R"({"input": "input_values", "shape": [-1, -1], "labels": "sequences"})";
  refused(f, "at most one free (-1) axis");
  // Not a feature file: a table, a missing file.
  std::ofstream(dir.path / "t.tsv") << "text\tlabel\nabc\t0\n";
  EXPECT_FALSE(is_feature_file((dir.path / "t.tsv").string()));
  EXPECT_FALSE(is_feature_file((dir.path / "none.safetensors").string()));
  io::save_safetensors((dir.path / "w.safetensors").string(), {{"w", f32({1})}});
  EXPECT_FALSE(is_feature_file((dir.path / "w.safetensors").string()));
  EXPECT_CONTAINS(error_of([&] { FeatureDataset((dir.path / "w.safetensors").string(), true); }),
                  "expected a feature file");
}

// transformers' compute_num_masked_span for the whole axis with epsilon in [0, 1).
std::pair<int64_t, int64_t> span_count_range(int64_t columns, double prob, int64_t length, int64_t min_masks) {
  auto count = [&](double epsilon) {
    int64_t n = std::max(static_cast<int64_t>(prob * columns / length + epsilon), min_masks);
    if (n * length > columns) n = columns / length;
    return std::min(n, std::max<int64_t>(columns - (length - 1), 0));
  };
  return {count(0.0), count(0.999999)};
}

TEST(SpecAugment, DrawsTransformersSpanCountsWithDistinctStarts) {
  for (const auto& [columns, prob, length, min_masks] :
       std::vector<std::tuple<int64_t, double, int64_t, int64_t>>{{50, 0.3, 4, 2}, {49, 0.05, 10, 2}, {7, 0.9, 3, 0},
                                                                  {36, 0.25, 5, 0}, {3, 0.5, 10, 2}}) {
    const auto [low, high] = span_count_range(columns, prob, length, min_masks);
    for (uint64_t batch = 0; batch < 20; ++batch) {
      const std::vector<float> mask = spec_augment_mask(4, columns, prob, length, min_masks, 7, batch, 1);
      ASSERT_EQ(mask.size(), static_cast<size_t>(4 * columns));
      for (int64_t r = 0; r < 4; ++r) {
        const float* row = mask.data() + r * columns;
        const int64_t masked = static_cast<int64_t>(std::accumulate(row, row + columns, 0.0));
        // Spans may overlap (transformers' starts are distinct, not their spans): between one span and all of them.
        EXPECT_LE(masked, high * length) << columns << " " << prob;
        EXPECT_GE(masked, low == 0 ? 0 : length) << columns << " " << prob;
        if (high == 0) EXPECT_EQ(masked, 0);
      }
    }
  }
}

TEST(SpecAugment, MasksAFractionNearTheProbabilityAndIsAPureFunctionOfSeedAndBatch) {
  // prob 0.2, length 5 over 1000 columns: 40 spans of 5 starts from 996, overlaps taking some: E[masked] ~ 0.18.
  double total = 0;
  for (uint64_t batch = 0; batch < 10; ++batch) {
    const std::vector<float> mask = spec_augment_mask(2, 1000, 0.2, 5, 0, 3, batch, 1);
    total += std::accumulate(mask.begin(), mask.end(), 0.0);
  }
  EXPECT_NEAR(total / (10 * 2 * 1000), 0.18, 0.02);
  EXPECT_EQ(spec_augment_mask(3, 40, 0.3, 4, 2, 9, 5, 1), spec_augment_mask(3, 40, 0.3, 4, 2, 9, 5, 1));
  EXPECT_NE(spec_augment_mask(3, 40, 0.3, 4, 2, 9, 5, 1), spec_augment_mask(3, 40, 0.3, 4, 2, 9, 6, 1));
  EXPECT_NE(spec_augment_mask(3, 40, 0.3, 4, 2, 9, 5, 1), spec_augment_mask(3, 40, 0.3, 4, 2, 10, 5, 1));
}

TEST(SpecAugment, ReadsTheConfigAndAddsMasksOfTheFramesTheEncoderMakes) {
  const nlohmann::json config = {{"mask_time_prob", 0.3}, {"mask_time_length", 2}, {"mask_time_min_masks", 1},
                                 {"mask_feature_prob", 0.2}, {"mask_feature_length", 3}, {"hidden_size", 12},
                                 {"conv_kernel", {10, 3, 3}}, {"conv_stride", {5, 2, 2}}};
  const SpecAugment spec = SpecAugment::from_config(config);
  EXPECT_EQ(spec.frames(1000), 49);  // (1000-10)/5+1 = 199, (199-3)/2+1 = 99, (99-3)/2+1 = 49
  EXPECT_EQ(spec.frames(9), 0);
  Batch b;
  b.batch_size = 2;
  b.float_inputs.push_back({"input_values", {2, 1000}, std::vector<float>(2000)});
  add_spec_augment(b, "input_values", spec, {"mask_time_indices", "mask_feature_indices"}, 1, 0);
  ASSERT_EQ(b.float_inputs.size(), 3u);
  EXPECT_EQ(b.float_inputs[1].name, "mask_time_indices");
  EXPECT_EQ(b.float_inputs[1].shape, (std::vector<int64_t>{2, 49}));
  EXPECT_EQ(b.float_inputs[2].shape, (std::vector<int64_t>{2, 12}));
  // Off: apply_spec_augment false, or a model that reads no masks.
  nlohmann::json off = config;
  off["apply_spec_augment"] = false;
  Batch c = b;
  c.float_inputs.resize(1);
  add_spec_augment(c, "input_values", SpecAugment::from_config(off), {"mask_time_indices"}, 1, 0);
  add_spec_augment(c, "input_values", spec, {}, 1, 0);
  EXPECT_EQ(c.float_inputs.size(), 1u);
  nlohmann::json bad = config;
  bad["mask_time_prob"] = 1.5;
  EXPECT_CONTAINS(error_of([&] { SpecAugment::from_config(bad); }), "mask_time_prob");
  bad = config;
  bad["conv_stride"] = {5, 2};
  EXPECT_CONTAINS(error_of([&] { SpecAugment::from_config(bad); }), "one length");
}

}  // namespace
}  // namespace fusetrain::testing
