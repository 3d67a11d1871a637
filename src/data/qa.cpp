// Question answering: SQuAD examples to windowed features with answer spans, and logits back to answers.
#include "fusetrain/data/qa.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "data/dataset_impl.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data {
namespace {

// Byte offset of character `chars` (a code-point index, as Python counts) in UTF-8 `text`; -1 past the end.
int64_t byte_of_char(std::string_view text, int64_t chars) {
  if (chars < 0) return -1;
  int64_t seen = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;  // continuation byte
    if (seen++ == chars) return static_cast<int64_t>(i);
  }
  return seen == chars ? static_cast<int64_t>(text.size()) : -1;
}

// The `answers` field: {"text": [...], "answer_start": [...]}, as reference texts and the first answer's start.
struct Answers {
  std::vector<std::string> texts;
  int64_t first_start = -1;
};

Answers parse_answers(const Table& table, size_t row, size_t column) {
  nlohmann::json value = nlohmann::json::parse(table.rows[row][column], nullptr, /*allow_exceptions=*/false);
  auto text = value.is_object() ? value.find("text") : value.end();
  auto start = value.is_object() ? value.find("answer_start") : value.end();
  bool ok = value.is_object() && text != value.end() && start != value.end() && text->is_array() &&
            start->is_array() && text->size() == start->size();
  FT_CHECK(ok, table.where(row), ": \"", table.columns[column],
           "\" is not an object with \"text\" and \"answer_start\" lists of one length (found ",
           table.rows[row][column].substr(0, 60), ")");
  Answers answers;
  for (size_t i = 0; i < text->size(); ++i) {
    FT_CHECK((*text)[i].is_string() && (*start)[i].is_number_integer(), table.where(row),
             ": answers need string texts and integer answer_start values");
    answers.texts.push_back((*text)[i].get<std::string>());
  }
  if (!start->empty()) answers.first_start = (*start)[0].get<int64_t>();
  return answers;
}

// The n highest logits' positions in `logits`, best first.
std::vector<int64_t> top_positions(std::span<const float> logits, int64_t n) {
  std::vector<int64_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto k = static_cast<std::ptrdiff_t>(std::min<size_t>(static_cast<size_t>(std::max<int64_t>(n, 0)), order.size()));
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
  order.resize(static_cast<size_t>(k));
  return order;
}

// SQuAD's normalize_answer, as words: lower case, punctuation dropped, articles dropped, split on whitespace.
std::vector<std::string> normalized_words(std::string_view text) {
  static const std::string_view kPunctuation = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";
  std::string cleaned;
  for (char c : text)
    if (kPunctuation.find(c) == std::string_view::npos)
      cleaned += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::vector<std::string> words;
  size_t i = 0;
  while (i < cleaned.size()) {
    if (std::isspace(static_cast<unsigned char>(cleaned[i]))) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < cleaned.size() && !std::isspace(static_cast<unsigned char>(cleaned[end]))) ++end;
    std::string word = cleaned.substr(i, end - i);
    if (word != "a" && word != "an" && word != "the") words.push_back(std::move(word));
    i = end;
  }
  return words;
}

double token_f1(std::vector<std::string> prediction, std::vector<std::string> reference) {
  if (prediction.empty() || reference.empty()) return prediction == reference ? 1.0 : 0.0;
  std::sort(prediction.begin(), prediction.end());
  std::sort(reference.begin(), reference.end());
  std::vector<std::string> common;
  std::set_intersection(prediction.begin(), prediction.end(), reference.begin(), reference.end(),
                        std::back_inserter(common));
  if (common.empty()) return 0.0;
  const double precision = static_cast<double>(common.size()) / static_cast<double>(prediction.size());
  const double recall = static_cast<double>(common.size()) / static_cast<double>(reference.size());
  return 2 * precision * recall / (precision + recall);
}

}  // namespace

QuestionAnsweringDataset::QuestionAnsweringDataset(const Table& table, const QaColumns& columns,
                                                   const TokenizeFn& tokenize, const QaDatasetOptions& options) {
  FT_CHECK(options.max_length > 0, table.source, ": max_length must be positive, got ", options.max_length);
  FT_CHECK(options.doc_stride >= 0, table.source, ": doc_stride must not be negative, got ", options.doc_stride);
  const size_t question_column = table.column(columns.question), context_column = table.column(columns.context);
  const bool labelled = !columns.answers.empty();
  const size_t answers_column = labelled ? table.column(columns.answers) : 0;

  // The first answer of each row as a byte span of its context ({-1, -1}: none); questions lose leading spaces.
  Table pairs{table.source, {"question", "context"}, {}, table.row_lines, {}};
  std::vector<std::pair<int64_t, int64_t>> answer_bytes(table.num_rows(), {-1, -1});
  for (size_t row = 0; row < table.num_rows(); ++row) {
    table.require_text(row, question_column);
    table.require_text(row, context_column);
    std::string_view question = table.rows[row][question_column];
    while (!question.empty() && std::isspace(static_cast<unsigned char>(question.front()))) question.remove_prefix(1);
    const std::string& context = table.rows[row][context_column];
    pairs.rows.push_back({std::string(question), context});
    contexts_.push_back(context);
    answers_.emplace_back();
    if (!labelled) continue;
    Answers answers = parse_answers(table, row, answers_column);
    if (!answers.texts.empty()) {
      const std::string& text = answers.texts[0];
      const int64_t start = byte_of_char(context, answers.first_start);
      FT_CHECK(start >= 0 && context.compare(static_cast<size_t>(start), text.size(), text) == 0, table.where(row),
               ": the answer \"", text, "\" is not at character ", answers.first_start, " of the context");
      answer_bytes[row] = {start, start + static_cast<int64_t>(text.size())};
    }
    answers_.back() = std::move(answers.texts);
  }
  label_kind_ = labelled ? LabelKind::Spans : LabelKind::None;

  detail::tokenize_rows(pairs, detail::all_rows(pairs), 0, 1, tokenize, options.num_threads, 0,
                        [&](size_t row, TokenizedText&& tokens) {
    FT_CHECK(tokens.offsets.size() == tokens.ids.size(), table.where(row),
             ": the tokenizer returned no token offsets; question answering needs them");
    const std::vector<int8_t> sequence = sequence_ids(tokens);
    const auto first = std::find(sequence.begin(), sequence.end(), 1);
    FT_CHECK(first != sequence.end(), table.where(row), ": the context has no tokens");
    const int64_t c0 = first - sequence.begin();
    const int64_t c1 = static_cast<int64_t>(sequence.rend() - std::find(sequence.rbegin(), sequence.rend(), 1));
    const int64_t n = static_cast<int64_t>(tokens.ids.size());
    const int64_t fixed = n - (c1 - c0), window = options.max_length - fixed;
    FT_CHECK(window > options.doc_stride, table.where(row), ": the question takes ", fixed, " of max_length ",
             options.max_length, " tokens (special tokens included), leaving ", window,
             " for the context (needs more than doc_stride ", options.doc_stride, ")");
    std::vector<int64_t> ids, types;
    for (int64_t start = c0;; start = start + window - options.doc_stride) {
      const int64_t end = std::min(start + window, c1);
      ids.clear();
      types.clear();
      auto take = [&](int64_t from, int64_t to, bool in_context) {
        for (int64_t i = from; i < to; ++i) {
          ids.push_back(tokens.ids[static_cast<size_t>(i)]);
          if (!tokens.type_ids.empty()) types.push_back(tokens.type_ids[static_cast<size_t>(i)]);
          context_offsets_.push_back(in_context ? tokens.offsets[static_cast<size_t>(i)]
                                                : std::pair<int64_t, int64_t>{-1, -1});
        }
      };
      take(0, c0, false);
      take(start, end, true);
      take(c1, n, false);
      append(ids, types);
      example_of_.push_back(static_cast<int64_t>(row));
      if (labelled) {
        // run_qa's labels: the tokens holding the answer's first and last byte, or the first token (CLS) twice
        // when the answer is not wholly inside this window.
        auto [answer_start, answer_end] = answer_bytes[row];
        const auto& offsets = tokens.offsets;
        int64_t s = 0, e = 0;
        if (answer_start >= 0 && offsets[static_cast<size_t>(start)].first <= answer_start &&
            offsets[static_cast<size_t>(end - 1)].second >= answer_end) {
          s = start;
          while (s + 1 < end && offsets[static_cast<size_t>(s + 1)].first <= answer_start) ++s;
          e = end - 1;
          while (e - 1 >= start && offsets[static_cast<size_t>(e - 1)].second >= answer_end) --e;
          s += c0 - start;
          e += c0 - start;
        }
        token_labels_.push_back(s);
        token_labels_.push_back(e);
      }
      if (end == c1) break;
    }
  });
}

int64_t QuestionAnsweringDataset::example_of(int64_t feature) const {
  check_index(feature);
  return example_of_[static_cast<size_t>(feature)];
}

std::span<const std::pair<int64_t, int64_t>> QuestionAnsweringDataset::context_offsets(int64_t feature) const {
  check_index(feature);
  return {context_offsets_.data() + offsets_[feature], static_cast<size_t>(length(feature))};
}

const std::string& QuestionAnsweringDataset::context(int64_t example) const {
  FT_CHECK(example >= 0 && example < num_examples(), "example ", example, " is out of range: the dataset has ",
           num_examples(), " examples");
  return contexts_[static_cast<size_t>(example)];
}

const std::vector<std::string>& QuestionAnsweringDataset::answers(int64_t example) const {
  context(example);  // range check
  return answers_[static_cast<size_t>(example)];
}

std::vector<std::string> decode_answers(const QuestionAnsweringDataset& dataset, std::span<const float> start_logits,
                                        std::span<const float> end_logits, std::span<const int64_t> feature_offsets,
                                        const QaDecodeOptions& options) {
  FT_CHECK(static_cast<int64_t>(feature_offsets.size()) == dataset.size() + 1, "decode_answers: ",
           feature_offsets.size(), " feature offsets for ", dataset.size(), " features (expected one more)");
  FT_CHECK(start_logits.size() == end_logits.size() &&
               static_cast<int64_t>(start_logits.size()) == feature_offsets.back(),
           "decode_answers: ", start_logits.size(), " start and ", end_logits.size(), " end logits for ",
           feature_offsets.back(), " tokens");
  std::vector<std::string> answers(static_cast<size_t>(dataset.num_examples()));
  std::vector<float> best(answers.size(), -std::numeric_limits<float>::infinity());
  for (int64_t f = 0; f < dataset.size(); ++f) {
    const auto begin = static_cast<size_t>(feature_offsets[static_cast<size_t>(f)]);
    const auto count = static_cast<size_t>(feature_offsets[static_cast<size_t>(f) + 1]) - begin;
    FT_CHECK(static_cast<int64_t>(count) == dataset.length(f), "decode_answers: feature ", f, " has ",
             dataset.length(f), " tokens but ", count, " logits");
    std::span<const float> s = start_logits.subspan(begin, count), e = end_logits.subspan(begin, count);
    std::span<const std::pair<int64_t, int64_t>> offsets = dataset.context_offsets(f);
    const auto example = static_cast<size_t>(dataset.example_of(f));
    for (int64_t i : top_positions(s, options.n_best))
      for (int64_t j : top_positions(e, options.n_best)) {
        const auto& first = offsets[static_cast<size_t>(i)];
        const auto& last = offsets[static_cast<size_t>(j)];
        if (first.first < 0 || last.first < 0 || j < i || j - i + 1 > options.max_answer_length) continue;
        const float score = s[static_cast<size_t>(i)] + e[static_cast<size_t>(j)];
        if (score <= best[example]) continue;
        best[example] = score;
        answers[example] = dataset.context(static_cast<int64_t>(example))
                               .substr(static_cast<size_t>(first.first), static_cast<size_t>(last.second - first.first));
      }
  }
  return answers;
}

std::map<std::string, double> squad_metrics(const std::vector<std::string>& predictions,
                                            const QuestionAnsweringDataset& dataset) {
  FT_CHECK(static_cast<int64_t>(predictions.size()) == dataset.num_examples(), "squad_metrics: ", predictions.size(),
           " predictions for ", dataset.num_examples(), " examples");
  double exact = 0, f1 = 0;
  for (size_t i = 0; i < predictions.size(); ++i) {
    const std::vector<std::string> predicted = normalized_words(predictions[i]);
    std::vector<std::string> references = dataset.answers(static_cast<int64_t>(i));
    if (references.empty()) references.emplace_back();  // unanswerable: the empty answer is right
    double best_exact = 0, best_f1 = 0;
    for (const std::string& reference : references) {
      const std::vector<std::string> words = normalized_words(reference);
      best_exact = std::max(best_exact, predicted == words ? 1.0 : 0.0);
      best_f1 = std::max(best_f1, token_f1(predicted, words));
    }
    exact += best_exact;
    f1 += best_f1;
  }
  const double n = std::max<double>(1.0, static_cast<double>(predictions.size()));
  return {{"exact_match", 100 * exact / n}, {"f1", 100 * f1 / n}};
}

}  // namespace fusetrain::data
