// Collators: dynamic padding to a multiple of 8 with masks, type ids and labels; causal-LM labels; MLM masking
// statistics (15% selected, 80/10/10), specials and padding never selected, and determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

#include "fusetrain/core/error.h"
#include "fusetrain/data/collator.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using namespace fusetrain::data;

constexpr int64_t kPad = 0, kCls = 2, kSep = 3, kMask = 4, kVocab = 1000;

// Numbers separated by spaces are the ids; "a | b" is a pair: [CLS] a [SEP] b [SEP] with type id 1 on the second.
TokenizedText number_tokenizer(std::string_view text, std::optional<std::string_view> pair) {
  TokenizedText out;
  auto add = [&](std::string_view words, int64_t type) {
    size_t i = 0;
    while (i < words.size()) {
      size_t end = words.find(' ', i);
      if (end == std::string_view::npos) end = words.size();
      if (end > i) {
        out.ids.push_back(std::stoll(std::string(words.substr(i, end - i))));
        out.type_ids.push_back(type);
        out.special_tokens_mask.push_back(0);
      }
      i = end + 1;
    }
  };
  auto special = [&](int64_t id, int64_t type) {
    out.ids.push_back(id);
    out.type_ids.push_back(type);
    out.special_tokens_mask.push_back(1);
  };
  special(kCls, 0);
  add(text, 0);
  special(kSep, 0);
  if (pair) {
    add(*pair, 1);
    special(kSep, 1);
  }
  return out;
}

std::string numbers(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) out += std::to_string(id) + " ";
  return out;
}

TEST(DataCollator, PadsToTheLongestRoundedUpToAMultipleOf8) {
  Table table;
  table.columns = {"a", "b", "label"};
  table.rows = {{"11 12", "21", "1"}, {"11 12 13 14 15 16 17", "21 22", "0"}, {"11", "", "1"}};
  TextDataset dataset(table, {.text = "a", .text_pair = "b", .label = "label"}, number_tokenizer);
  ASSERT_EQ(dataset.length(1), 12);
  const std::vector<int64_t> indices = {0, 1};
  Batch batch = collate_padded(dataset, indices, 8, 99);
  EXPECT_EQ(batch.batch_size, 2);
  EXPECT_EQ(batch.seq_len, 16);
  const std::vector<int64_t> row0_ids = {kCls, 11, 12, kSep, 21, kSep, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99};
  const std::vector<int64_t> row0_mask = {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::vector<int64_t> row0_types = {0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::vector<int64_t>(batch.input_ids.begin(), batch.input_ids.begin() + 16), row0_ids);
  EXPECT_EQ(std::vector<int64_t>(batch.attention_mask.begin(), batch.attention_mask.begin() + 16), row0_mask);
  EXPECT_EQ(std::vector<int64_t>(batch.token_type_ids.begin(), batch.token_type_ids.begin() + 16), row0_types);
  const std::vector<int64_t> row1_types = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0};
  EXPECT_EQ(std::vector<int64_t>(batch.token_type_ids.begin() + 16, batch.token_type_ids.end()), row1_types);
  EXPECT_EQ(batch.attention_mask[16 + 11], 1);
  EXPECT_EQ(batch.attention_mask[16 + 12], 0);
  EXPECT_EQ(batch.labels, (std::vector<int64_t>{1, 0}));  // (B) class labels
  EXPECT_TRUE(batch.float_labels.empty());

  EXPECT_EQ(collate_padded(dataset, std::vector<int64_t>{2}, 8).seq_len, 8);  // 3 tokens -> 8
  EXPECT_EQ(collate_padded(dataset, indices, 1).seq_len, 12);                 // no rounding
  EXPECT_EQ(collate_padded(dataset, indices, 0).seq_len, 12);
  EXPECT_EQ(collate_padded(dataset, std::vector<int64_t>{1, 1, 2}, 64).seq_len, 64);
  EXPECT_EQ(error_of([&] { collate_padded(dataset, std::vector<int64_t>{}); }),
            "collate_padded: no examples to collate");
  EXPECT_EQ(error_of([&] {
              collate_padded(dataset, std::vector<int64_t>{0, 3});
            }),
            "collate_padded: example 3 is out of range: the dataset has 3 examples");
}

TEST(DataCollator, RegressionAndUnlabelled) {
  Table table;
  table.columns = {"a", "score"};
  table.rows = {{"11", "0.25"}, {"12 13", "-3"}};
  TextDataset regression(table, {.text = "a", .label = "score"}, number_tokenizer, {.regression = true});
  Batch batch = collate_padded(regression, std::vector<int64_t>{1, 0});
  EXPECT_EQ(batch.float_labels, (std::vector<float>{-3.0f, 0.25f}));
  EXPECT_TRUE(batch.labels.empty());
  EXPECT_TRUE(std::all_of(batch.token_type_ids.begin(), batch.token_type_ids.end(), [](int64_t t) { return t == 0; }));
  TextDataset unlabelled(table, {.text = "a"}, number_tokenizer);
  Batch plain = collate_padded(unlabelled, std::vector<int64_t>{0});
  EXPECT_TRUE(plain.labels.empty());
  EXPECT_TRUE(plain.float_labels.empty());
}

TEST(DataCollator, CausalLmLabelsAreTheIdsWithPaddingIgnored) {
  Table table;
  table.columns = {"text"};
  table.rows = {{"11 12 13"}, {"14"}};
  LmDataset dataset(table, "text", number_tokenizer, {.line_by_line = true});
  Batch batch = collate_padded(dataset, std::vector<int64_t>{0, 1}, 8, kPad);
  ASSERT_EQ(batch.seq_len, 8);
  const int64_t x = kIgnoreIndex;
  const std::vector<int64_t> expected = {kCls, 11, 12,   13, kSep, x, x, x,  //
                                         kCls, 14, kSep, x,  x,    x, x, x};
  EXPECT_EQ(batch.labels, expected);
}

// A large batch of random non-special ids in [10, kVocab) with specials around each line and much padding.
Batch large_batch(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Table table;
  table.columns = {"text"};
  for (int i = 0; i < 128; ++i) {
    std::vector<int64_t> ids(20 + rng() % 480);
    for (auto& id : ids) id = 10 + static_cast<int64_t>(rng() % (kVocab - 10));
    table.rows.push_back({numbers(ids)});
  }
  LmDataset dataset(table, "text", number_tokenizer, {.line_by_line = true, .max_length = 512});
  std::vector<int64_t> indices(128);
  std::iota(indices.begin(), indices.end(), 0);
  return collate_padded(dataset, indices, 8, kPad);
}

const MaskSpec kSpec{.mask_id = kMask, .vocab_size = kVocab, .special_ids = {kPad, 1, kCls, kSep, kMask}};

TEST(DataCollator, MlmSelectsFifteenPercentAndSplits80_10_10) {
  const Batch original = large_batch(1);
  Batch batch = original;
  apply_mlm_mask(batch, kSpec, /*seed=*/1234, /*batch_index=*/7);
  ASSERT_EQ(batch.labels.size(), original.input_ids.size());
  int64_t eligible = 0, selected = 0, masked = 0, random = 0, unchanged = 0;
  for (size_t i = 0; i < original.input_ids.size(); ++i) {
    const int64_t id = original.input_ids[i];
    const bool special = id == kCls || id == kSep;
    if (!original.attention_mask[i] || special) {  // padding and specials: never selected, never changed
      ASSERT_EQ(batch.labels[i], -100) << i;
      ASSERT_EQ(batch.input_ids[i], id) << i;
      continue;
    }
    ++eligible;
    if (batch.labels[i] == -100) {
      ASSERT_EQ(batch.input_ids[i], id);
      continue;
    }
    ++selected;
    ASSERT_EQ(batch.labels[i], id);  // the label is the original token
    if (batch.input_ids[i] == kMask) {
      ++masked;
    } else if (batch.input_ids[i] == id) {
      ++unchanged;
    } else {
      ++random;
      ASSERT_GE(batch.input_ids[i], 0);
      ASSERT_LT(batch.input_ids[i], kVocab);
    }
  }
  ASSERT_GT(eligible, 25000);
  const double p = static_cast<double>(selected) / static_cast<double>(eligible);
  EXPECT_NEAR(p, 0.15, 0.01) << selected << " of " << eligible;
  EXPECT_NEAR(static_cast<double>(masked) / static_cast<double>(selected), 0.8, 0.03);
  EXPECT_NEAR(static_cast<double>(random) / static_cast<double>(selected), 0.1, 0.02);
  EXPECT_NEAR(static_cast<double>(unchanged) / static_cast<double>(selected), 0.1, 0.02);
  // Padding positions keep the pad id in input_ids even though it is also a special id.
  EXPECT_EQ(std::count(batch.attention_mask.begin(), batch.attention_mask.end(), 0),
            std::count(original.attention_mask.begin(), original.attention_mask.end(), 0));
}

TEST(DataCollator, MlmIsDeterministicPerSeedAndBatch) {
  const Batch original = large_batch(2);
  auto masked = [&](uint64_t seed, uint64_t batch_index) {
    Batch batch = original;
    apply_mlm_mask(batch, kSpec, seed, batch_index);
    return batch;
  };
  Batch a = masked(5, 100), b = masked(5, 100);
  EXPECT_EQ(a.input_ids, b.input_ids);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_NE(masked(5, 101).labels, a.labels);
  EXPECT_NE(masked(6, 100).labels, a.labels);
  EXPECT_NE(masked(100, 5).labels, a.labels);  // seed and batch index are not interchangeable

  // A token's fate does not depend on how far the batch is padded.
  Table table;
  table.columns = {"text"};
  table.rows = {{numbers({11, 12, 13, 14, 15, 16, 17, 18, 19, 20})}, {numbers({30, 31, 32})}};
  LmDataset dataset(table, "text", number_tokenizer, {.line_by_line = true});
  const std::vector<int64_t> indices = {0, 1};
  Batch narrow = collate_padded(dataset, indices, 8), wide = collate_padded(dataset, indices, 64);
  MaskSpec always = kSpec;
  always.probability = 0.5;
  apply_mlm_mask(narrow, always, 9, 3);
  apply_mlm_mask(wide, always, 9, 3);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < narrow.seq_len; ++t) {
      EXPECT_EQ(narrow.input_ids[b * narrow.seq_len + t], wide.input_ids[b * wide.seq_len + t]);
      EXPECT_EQ(narrow.labels[b * narrow.seq_len + t], wide.labels[b * wide.seq_len + t]);
    }
}

TEST(DataCollator, MlmProbabilityBoundsAndErrors) {
  const Batch original = large_batch(3);
  Batch none = original;
  MaskSpec spec = kSpec;
  spec.probability = 0;
  apply_mlm_mask(none, spec, 1, 1);
  EXPECT_EQ(none.input_ids, original.input_ids);
  EXPECT_TRUE(std::all_of(none.labels.begin(), none.labels.end(), [](int64_t l) { return l == -100; }));
  Batch all = original;
  spec.probability = 1;
  apply_mlm_mask(all, spec, 1, 1);
  for (size_t i = 0; i < original.input_ids.size(); ++i) {
    const int64_t id = original.input_ids[i];
    const bool eligible = original.attention_mask[i] && id != kCls && id != kSep;
    ASSERT_EQ(all.labels[i], eligible ? id : -100);
  }
  Batch batch = original;
  spec.mask_id = kVocab;
  EXPECT_EQ(error_of([&] { apply_mlm_mask(batch, spec, 1, 1); }),
            "apply_mlm_mask: mask id 1000 is outside the vocabulary [0, 1000)");
  spec.mask_id = kMask;
  spec.probability = 1.5;
  EXPECT_EQ(error_of([&] { apply_mlm_mask(batch, spec, 1, 1); }),
            "apply_mlm_mask: probability must be in [0, 1], got 1.5");
}

// mask_spec reads a tokenizer's ids (here a stand-in with the Tokenizer's accessors).
TEST(DataCollator, MaskSpecFromATokenizer) {
  struct FakeTokenizer {
    std::vector<int64_t> specials = {0, 101, 102, 103};
    int64_t mask_id() const { return 103; }
    int64_t vocab_size() const { return 30522; }
    const std::vector<int64_t>& special_ids() const { return specials; }
  } tokenizer;
  MaskSpec spec = mask_spec(tokenizer);
  EXPECT_EQ(spec.mask_id, 103);
  EXPECT_EQ(spec.vocab_size, 30522);
  EXPECT_EQ(spec.special_ids, tokenizer.specials);
  EXPECT_DOUBLE_EQ(spec.probability, 0.15);
}

}  // namespace
}  // namespace fusetrain::testing
