// Collators: examples to a padded batch (dynamic padding to a multiple of 8), and masked-LM masking.
//
//   Batch batch = collate_padded(dataset, indices, 8, tokenizer.pad_id());   // (B, T), T a multiple of 8
//   apply_mlm_mask(batch, mask_spec(tokenizer), seed, step);                  // for masked LM
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fusetrain/data/dataset.h"

namespace fusetrain::data {

/// A float input of a batch, e.g. pixel_values (B, C, H, W).
struct FloatInput {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

/// An integer input of a batch that is not one of its (B, T) token fields, e.g. an encoder-decoder's
/// decoder_input_ids (B, target sequence).
struct TokenInput {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> values;
};

/// One batch as plain data. Token tensors are row-major (B, T) with B = batch_size, T = seq_len.
struct Batch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;  ///< 0 for a batch without token inputs (images)
  std::vector<int64_t> input_ids;       ///< (B, T), padding = the pad id
  std::vector<int64_t> attention_mask;  ///< (B, T), 1 on tokens, 0 on padding
  std::vector<int64_t> token_type_ids;  ///< (B, T), 0 on padding
  /// (B, T) from a Python collator, or empty. Without an attention_mask, ids restarting inside a row mark packed
  /// examples (models::BatchSpec::packed).
  std::vector<int64_t> position_ids;
  int64_t counted_tokens = -1;  ///< the tokens a Python collator counts for its trainer's num_tokens; -1: none
  /// (B) class labels; or (B, T) token labels with kIgnoreIndex on padding (language modelling, token
  /// classification); or empty.
  std::vector<int64_t> labels;
  std::vector<float> float_labels;      ///< (B) regression targets, or empty
  std::vector<int64_t> start_positions;  ///< (B) question answering: the answer's first token, or empty
  std::vector<int64_t> end_positions;    ///< (B) question answering: the answer's last token, or empty
  std::vector<FloatInput> float_inputs;  ///< inputs that are not tokens (pixel_values), from a Python collator
  /// Integer inputs beyond the (B, T) token fields (decoder_input_ids, decoder_attention_mask), from a Python
  /// collator.
  std::vector<TokenInput> token_inputs;
  /// The labels' second axis where it is not T: an encoder-decoder's (B, target sequence) labels; 0: T.
  int64_t label_seq_len = 0;
};

/// Collates examples `indices` of `dataset` with dynamic padding: T is the longest example in the batch rounded up
/// to a multiple of `pad_to_multiple_of` (1 or 0: no rounding; at least 1), padded on the right with `pad_id`,
/// attention mask 0 and type id 0. Labels follow dataset.label_kind(): Class gives (B) labels, Regression (B)
/// float_labels, Tokens (B, T) labels = input_ids with kIgnoreIndex on padding (causal LM; apply_mlm_mask turns
/// them into masked-LM labels), TokenClasses (B, T) labels with kIgnoreIndex on padding, Spans start_positions and
/// end_positions, Targets (B, L) labels (L the longest target, rounded up likewise) with kIgnoreIndex on padding and
/// decoder_input_ids (B, L), the labels shifted right after `decoder_start_id` with padding as `pad_id` (transformers'
/// shift_tokens_right). Throws Error on an empty or out-of-range index list, or on targets without a
/// decoder_start_id >= 0.
Batch collate_padded(const TokenizedDataset& dataset, std::span<const int64_t> indices, int64_t pad_to_multiple_of = 8,
                     int64_t pad_id = 0, int64_t decoder_start_id = -1);

/// Sets (B, T) labels for causal LM: the input ids, kIgnoreIndex where attention_mask is 0.
void apply_clm_labels(Batch& batch);

/// What masked-LM masking needs from the tokenizer.
struct MaskSpec {
  int64_t mask_id = 0;                    ///< the [MASK] / <mask> token
  int64_t vocab_size = 0;                 ///< random replacements are drawn from [0, vocab_size)
  std::vector<int64_t> special_ids = {};  ///< never selected ([CLS], [SEP], [PAD], ...)
  double probability = 0.15;              ///< chance each other token is selected
};

/// The MaskSpec of a data::Tokenizer (anything with mask_id(), vocab_size() and special_ids()).
template <typename TokenizerT>
MaskSpec mask_spec(const TokenizerT& tokenizer, double probability = 0.15) {
  const auto& specials = tokenizer.special_ids();
  return MaskSpec{tokenizer.mask_id(), tokenizer.vocab_size(), std::vector<int64_t>(specials.begin(), specials.end()),
                  probability};
}

/// transformers' DataCollatorForLanguageModeling (mlm=True): every token that is neither special nor padding is
/// selected with spec.probability; labels become the original id where selected and kIgnoreIndex elsewhere; of the
/// selected, 80% become mask_id, 10% a random id in [0, vocab_size), 10% stay unchanged. The draws are a pure
/// function of (seed, batch_index, row, column) (splitmix64 counters), so a resumed run reproduces its masks and a
/// token's fate does not depend on how far the batch is padded.
void apply_mlm_mask(Batch& batch, const MaskSpec& spec, uint64_t seed, uint64_t batch_index);

}  // namespace fusetrain::data
