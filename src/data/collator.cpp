// Collators: dynamic padding and masked-LM masking with a counter-based generator.
#include "fusetrain/data/collator.h"

#include <algorithm>

#include "fusetrain/core/error.h"
#include "data/counter_random.h"

namespace fusetrain::data {
using detail::below;
using detail::splitmix64;
using detail::unit;

Batch collate_padded(const TokenizedDataset& dataset, std::span<const int64_t> indices, int64_t pad_to_multiple_of,
                     int64_t pad_id, int64_t decoder_start_id) {
  FT_CHECK(!indices.empty(), "collate_padded: no examples to collate");
  FT_CHECK(pad_to_multiple_of >= 0, "collate_padded: pad_to_multiple_of must not be negative, got ",
           pad_to_multiple_of);
  int64_t longest = 1;
  for (int64_t index : indices) {
    FT_CHECK(index >= 0 && index < dataset.size(), "collate_padded: example ", index,
             " is out of range: the dataset has ", dataset.size(), " examples");
    longest = std::max(longest, dataset.length(index));
  }
  const int64_t multiple = std::max<int64_t>(pad_to_multiple_of, 1);
  Batch batch;
  batch.batch_size = static_cast<int64_t>(indices.size());
  batch.seq_len = (longest + multiple - 1) / multiple * multiple;
  const size_t B = static_cast<size_t>(batch.batch_size), T = static_cast<size_t>(batch.seq_len);
  batch.input_ids.assign(B * T, pad_id);  // (B, T)
  batch.attention_mask.assign(B * T, 0);  // (B, T)
  batch.token_type_ids.assign(B * T, 0);  // (B, T)
  for (size_t b = 0; b < B; ++b) {
    std::span<const int64_t> ids = dataset.ids(indices[b]);
    std::span<const int64_t> types = dataset.type_ids(indices[b]);
    std::copy(ids.begin(), ids.end(), batch.input_ids.begin() + static_cast<std::ptrdiff_t>(b * T));
    std::fill_n(batch.attention_mask.begin() + static_cast<std::ptrdiff_t>(b * T), ids.size(), 1);
    std::copy(types.begin(), types.end(), batch.token_type_ids.begin() + static_cast<std::ptrdiff_t>(b * T));
  }
  switch (dataset.label_kind()) {
    case LabelKind::None:
      break;
    case LabelKind::Class:
      for (int64_t index : indices) batch.labels.push_back(dataset.label(index));
      break;
    case LabelKind::Regression:
      for (int64_t index : indices) batch.float_labels.push_back(dataset.float_label(index));
      break;
    case LabelKind::Tokens:
      apply_clm_labels(batch);
      break;
    case LabelKind::TokenClasses:
      batch.labels.assign(B * T, kIgnoreIndex);
      for (size_t b = 0; b < B; ++b) {
        std::span<const int64_t> labels = dataset.token_labels(indices[b]);
        std::copy(labels.begin(), labels.end(), batch.labels.begin() + static_cast<std::ptrdiff_t>(b * T));
      }
      break;
    case LabelKind::Spans:
      for (int64_t index : indices) {
        auto [start, end] = dataset.span(index);
        batch.start_positions.push_back(start);
        batch.end_positions.push_back(end);
      }
      break;
    case LabelKind::Targets: {
      FT_CHECK(decoder_start_id >= 0, "collate_padded: a sequence-to-sequence batch needs the decoder's start token ",
               "(config.json's decoder_start_token_id)");
      int64_t longest_target = 1;
      for (int64_t index : indices) longest_target = std::max<int64_t>(longest_target, int64_t(dataset.target(index).size()));
      const auto L = static_cast<size_t>((longest_target + multiple - 1) / multiple * multiple);
      batch.label_seq_len = static_cast<int64_t>(L);
      batch.labels.assign(B * L, kIgnoreIndex);
      TokenInput decoder{"decoder_input_ids", {batch.batch_size, batch.label_seq_len}, std::vector<int64_t>(B * L, pad_id)};
      for (size_t b = 0; b < B; ++b) {
        std::span<const int64_t> target = dataset.target(indices[b]);
        std::copy(target.begin(), target.end(), batch.labels.begin() + static_cast<std::ptrdiff_t>(b * L));
        decoder.values[b * L] = decoder_start_id;
        std::copy(target.begin(), target.end() - (target.size() == L ? 1 : 0),
                  decoder.values.begin() + static_cast<std::ptrdiff_t>(b * L + 1));
      }
      batch.token_inputs.push_back(std::move(decoder));
      break;
    }
  }
  return batch;
}

void apply_clm_labels(Batch& batch) {
  const size_t n = static_cast<size_t>(batch.batch_size * batch.seq_len);
  FT_CHECK(batch.input_ids.size() == n && batch.attention_mask.size() == n, "apply_clm_labels: a (", batch.batch_size,
           ", ", batch.seq_len, ") batch has ", batch.input_ids.size(), " input ids and ", batch.attention_mask.size(),
           " mask entries");
  batch.labels.resize(n);
  for (size_t i = 0; i < n; ++i) batch.labels[i] = batch.attention_mask[i] ? batch.input_ids[i] : kIgnoreIndex;
}

void apply_mlm_mask(Batch& batch, const MaskSpec& spec, uint64_t seed, uint64_t batch_index) {
  const size_t B = static_cast<size_t>(batch.batch_size), T = static_cast<size_t>(batch.seq_len);
  FT_CHECK(batch.input_ids.size() == B * T && batch.attention_mask.size() == B * T, "apply_mlm_mask: a (", B, ", ", T,
           ") batch has ", batch.input_ids.size(), " input ids and ", batch.attention_mask.size(), " mask entries");
  FT_CHECK(spec.vocab_size > 0, "apply_mlm_mask: vocab_size must be positive, got ", spec.vocab_size);
  FT_CHECK(spec.mask_id >= 0 && spec.mask_id < spec.vocab_size, "apply_mlm_mask: mask id ", spec.mask_id,
           " is outside the vocabulary [0, ", spec.vocab_size, ")");
  FT_CHECK(spec.probability >= 0 && spec.probability <= 1, "apply_mlm_mask: probability must be in [0, 1], got ",
           spec.probability);
  std::vector<int64_t> specials = spec.special_ids;
  std::sort(specials.begin(), specials.end());
  // One stream per batch; each (row, column) draws three independent words from it.
  const uint64_t stream = detail::batch_stream(seed, batch_index);
  batch.labels.assign(B * T, kIgnoreIndex);  // (B, T)
  for (size_t b = 0; b < B; ++b) {
    for (size_t t = 0; t < T; ++t) {
      const size_t i = b * T + t;
      const int64_t id = batch.input_ids[i];
      if (!batch.attention_mask[i] || std::binary_search(specials.begin(), specials.end(), id)) continue;
      const uint64_t counter = stream ^ splitmix64((static_cast<uint64_t>(b) << 32) | t);
      if (unit(splitmix64(counter)) >= spec.probability) continue;
      batch.labels[i] = id;
      const double fate = unit(splitmix64(counter + 1));
      if (fate < 0.8)
        batch.input_ids[i] = spec.mask_id;
      else if (fate < 0.9)
        batch.input_ids[i] = below(splitmix64(counter + 2), static_cast<uint64_t>(spec.vocab_size));
      // else: unchanged
    }
  }
}

}  // namespace fusetrain::data
