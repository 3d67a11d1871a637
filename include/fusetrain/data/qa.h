// Extractive question answering (SQuAD): each question and context become overlapping windows of tokens
// ("features"), each answer a start and end token per window; predicted start and end logits become answer text,
// scored with SQuAD's exact match and F1.
//
//   Table table = read_table("squad_dev.jsonl");      // columns question, context, answers
//   QuestionAnsweringDataset dev(table, {}, tokenize_with(tokenizer), {.max_length = 384, .doc_stride = 128});
//   std::vector<std::string> texts = decode_answers(dev, start_logits, end_logits, feature_offsets);
//   squad_metrics(texts, dev);                           // {"exact_match": 80.1, "f1": 87.9}
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fusetrain/data/dataset.h"

namespace fusetrain::data {

/// Which columns a QuestionAnsweringDataset reads. `answers` holds SQuAD's object
/// `{"text": ["Denver Broncos"], "answer_start": [177]}` (answer_start counts characters, as Python does).
struct QaColumns {
  std::string question = "question";
  std::string context = "context";
  std::string answers = "answers";  ///< empty for unlabelled data
};

/// Options for QuestionAnsweringDataset (run_qa's defaults).
struct QaDatasetOptions {
  /// Tokens per feature: special tokens, the question and a window of the context.
  int64_t max_length = 384;
  /// Tokens two consecutive windows of one context share.
  int64_t doc_stride = 128;
  /// Threads tokenizing at once; 0 uses every hardware thread.
  int num_threads = 0;
};

/// SQuAD-style examples as features: the question (leading spaces removed) paired with a window of the context,
/// windows overlapping by doc_stride tokens, as transformers' run_qa prepares them. Labelled features carry the
/// first answer's start and end token, or the first token (CLS) twice when the answer is not inside the window.
/// The tokenizer must return offsets. Errors name the row: `<file>:<line>: "answers" is not an object with "text"
/// and "answer_start" lists`, `<file>:<line>: the answer "x" is not at character 12 of the context`,
/// `<file>:<line>: the question takes 380 of max_length 384 tokens, leaving 1 for the context (needs more than
/// doc_stride 128)`.
class QuestionAnsweringDataset : public TokenizedDataset {
 public:
  QuestionAnsweringDataset(const Table& table, const QaColumns& columns, const TokenizeFn& tokenize,
                           const QaDatasetOptions& options = {});
  /// Number of examples (table rows); size() is the number of features.
  int64_t num_examples() const { return static_cast<int64_t>(contexts_.size()); }
  /// The example feature `feature` was cut from.
  int64_t example_of(int64_t feature) const;
  /// Byte span in its example's context of each token of `feature`; {-1, -1} for tokens outside the context.
  std::span<const std::pair<int64_t, int64_t>> context_offsets(int64_t feature) const;
  /// The context of example `example`.
  const std::string& context(int64_t example) const;
  /// The reference answers of example `example` (empty when unlabelled).
  const std::vector<std::string>& answers(int64_t example) const;

 private:
  std::vector<int64_t> example_of_;
  std::vector<std::pair<int64_t, int64_t>> context_offsets_;  // one per entry of ids_
  std::vector<std::string> contexts_;
  std::vector<std::vector<std::string>> answers_;
};

/// How decode_answers searches for spans (run_qa's defaults).
struct QaDecodeOptions {
  int64_t n_best = 20;             ///< start and end candidates tried per feature
  int64_t max_answer_length = 30;  ///< longest answer in tokens
};

/// The best answer text of every example: over its features, the context span (start <= end, at most
/// max_answer_length tokens, among the n_best start and end logits) with the highest start + end logit, "" when no
/// span qualifies. Feature f's logits are start_logits / end_logits [feature_offsets[f], feature_offsets[f + 1]),
/// one per token of the feature.
std::vector<std::string> decode_answers(const QuestionAnsweringDataset& dataset, std::span<const float> start_logits,
                                        std::span<const float> end_logits, std::span<const int64_t> feature_offsets,
                                        const QaDecodeOptions& options = {});

/// SQuAD v1.1's metrics in percent: "exact_match" and "f1" (token overlap), each the best over an example's
/// reference answers, after its normalisation (ASCII lower case, punctuation and the articles a/an/the removed,
/// whitespace collapsed).
std::map<std::string, double> squad_metrics(const std::vector<std::string>& predictions,
                                            const QuestionAnsweringDataset& dataset);

}  // namespace fusetrain::data
