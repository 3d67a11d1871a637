// Tokenized datasets: parallel tokenization, transformers-style truncation, label parsing, group_texts.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "fusetrain/core/error.h"
#include "fusetrain/data/dataset.h"
#include "data/dataset_impl.h"

namespace fusetrain::data {

using detail::all_rows;
using detail::tokenize_rows;
using detail::trim;

namespace {

// transformers' longest_first split of `budget` content tokens between a first side of length a and a second of
// length b (tokenizers' truncate_encodings): the shorter side keeps what it can, two long sides share the budget,
// the odd token going to the longer side.
std::pair<int64_t, int64_t> longest_first(int64_t a, int64_t b, int64_t budget) {
  int64_t n1 = a, n2 = b;
  bool swapped = n1 > n2;
  if (swapped) std::swap(n1, n2);
  n2 = n1 > budget ? n1 : std::max(n1, budget - n1);
  if (n1 + n2 > budget) {
    n1 = budget / 2;
    n2 = n1 + budget % 2;
  }
  if (swapped) std::swap(n1, n2);
  return {n1, n2};
}

// Without a given number of classes they are inferred as 0 .. largest + 1; an id missing below the largest is far
// more often a stray label (a typo, a row from another label set) than a class with no example, so it is an error.
void require_contiguous_labels(const std::set<int64_t>& seen, const std::string& source, const char* what) {
  if (seen.empty() || *seen.rbegin() + 1 == static_cast<int64_t>(seen.size())) return;
  std::string listed;
  size_t shown = 0;
  for (int64_t id : seen) {
    if (++shown > 12) {
      listed += str(", ... (", seen.size(), " distinct)");
      break;
    }
    listed += (listed.empty() ? "" : ", ") + std::to_string(id);
  }
  throw Error(str(source, ": the ", what, " are not the contiguous class ids 0 .. ", *seen.rbegin(),
                  " (seen: ", listed, "), so the number of classes cannot be inferred; fix the stray labels, or give ",
                  "the number of classes (--num-labels ", *seen.rbegin() + 1, ") if the classes really are ",
                  *seen.rbegin() + 1));
}

}  // namespace

std::vector<int8_t> sequence_ids(const TokenizedText& tokens) {
  const size_t n = tokens.ids.size();
  auto is_special = [&](size_t i) { return !tokens.special_tokens_mask.empty() && tokens.special_tokens_mask[i]; };
  std::vector<int8_t> sequence(n, -1);
  std::optional<int64_t> first_type;
  bool by_type = false;
  for (size_t i = 0; i < n; ++i) {
    if (is_special(i)) continue;
    const int64_t type = tokens.type_ids.empty() ? 0 : tokens.type_ids[i];
    if (!first_type) first_type = type;
    sequence[i] = type != *first_type;
    by_type = by_type || sequence[i] == 1;
  }
  if (by_type) return sequence;
  // Same type ids throughout (RoBERTa): two runs of content separated by special tokens are a pair.
  size_t runs = 0;
  for (size_t i = 0; i < n; ++i) {
    if (sequence[i] < 0) continue;
    if (i == 0 || sequence[i - 1] < 0) ++runs;
    sequence[i] = runs == 2;
  }
  if (runs != 2)
    for (int8_t& s : sequence)
      if (s > 0) s = 0;
  return sequence;
}

void truncate_tokens(TokenizedText& tokens, int64_t max_length) {
  FT_CHECK(max_length > 0, "max_length must be positive, got ", max_length);
  const size_t n = tokens.ids.size();
  if (static_cast<int64_t>(n) <= max_length) return;
  const std::vector<int8_t> sequence = sequence_ids(tokens);
  const int64_t num_special = std::count(sequence.begin(), sequence.end(), -1);
  FT_CHECK(num_special <= max_length, "max_length ", max_length, " cannot hold the ", num_special,
           " special tokens the tokenizer adds");
  const int64_t budget = max_length - num_special;
  const int64_t second = std::count(sequence.begin(), sequence.end(), 1);
  int64_t keep[2] = {budget, 0};
  if (second > 0) {
    auto [n1, n2] = longest_first(static_cast<int64_t>(n) - num_special - second, second, budget);
    keep[0] = n1;
    keep[1] = n2;
  }

  TokenizedText out;
  int64_t kept[2] = {0, 0};
  for (size_t i = 0; i < n; ++i) {
    if (const int s = sequence[i]; s >= 0) {
      if (kept[s] >= keep[s]) continue;
      ++kept[s];
    }
    out.ids.push_back(tokens.ids[i]);
    if (!tokens.type_ids.empty()) out.type_ids.push_back(tokens.type_ids[i]);
    if (!tokens.special_tokens_mask.empty()) out.special_tokens_mask.push_back(tokens.special_tokens_mask[i]);
    if (!tokens.offsets.empty()) out.offsets.push_back(tokens.offsets[i]);
  }
  tokens = std::move(out);
}

uint64_t TokenizedDataset::fingerprint() const {
  // FNV-1a over 64-bit words: one multiply per element, so a pass over the tokens costs what reading them does.
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t word) { h = (h ^ word) * 0x100000001b3ull; };
  auto add = [&](const auto& values) {
    mix(values.size());
    for (const auto& v : values) {
      uint64_t word = 0;
      std::memcpy(&word, &v, sizeof v);
      mix(word);
    }
  };
  mix(static_cast<uint64_t>(label_kind_));
  add(offsets_);
  add(ids_);
  add(type_ids_);
  add(labels_);
  add(float_labels_);
  add(token_labels_);
  add(target_offsets_);
  return h;
}

void TokenizedDataset::check_index(int64_t i) const {
  FT_CHECK(i >= 0 && i < size(), "example ", i, " is out of range: the dataset has ", size(), " examples");
}

std::span<const int64_t> TokenizedDataset::ids(int64_t i) const {
  check_index(i);
  const auto begin = static_cast<size_t>(offsets_[i]), end = static_cast<size_t>(offsets_[i + 1]);
  return std::span<const int64_t>(ids_.data() + begin, end - begin);
}

std::span<const int64_t> TokenizedDataset::type_ids(int64_t i) const {
  check_index(i);
  if (type_ids_.empty()) return {};
  const auto begin = static_cast<size_t>(offsets_[i]), end = static_cast<size_t>(offsets_[i + 1]);
  return std::span<const int64_t>(type_ids_.data() + begin, end - begin);
}

int64_t TokenizedDataset::length(int64_t i) const {
  check_index(i);
  return offsets_[i + 1] - offsets_[i];
}

int64_t TokenizedDataset::label(int64_t i) const {
  check_index(i);
  FT_CHECK(label_kind_ == LabelKind::Class, "the dataset has no class labels");
  return labels_[static_cast<size_t>(i)];
}

float TokenizedDataset::float_label(int64_t i) const {
  check_index(i);
  FT_CHECK(label_kind_ == LabelKind::Regression, "the dataset has no regression labels");
  return float_labels_[static_cast<size_t>(i)];
}

std::span<const int64_t> TokenizedDataset::token_labels(int64_t i) const {
  check_index(i);
  FT_CHECK(label_kind_ == LabelKind::TokenClasses, "the dataset has no token labels");
  const auto begin = static_cast<size_t>(offsets_[i]), end = static_cast<size_t>(offsets_[i + 1]);
  return std::span<const int64_t>(token_labels_.data() + begin, end - begin);
}

std::pair<int64_t, int64_t> TokenizedDataset::span(int64_t i) const {
  check_index(i);
  FT_CHECK(label_kind_ == LabelKind::Spans, "the dataset has no answer spans");
  return {token_labels_[2 * static_cast<size_t>(i)], token_labels_[2 * static_cast<size_t>(i) + 1]};
}

std::span<const int64_t> TokenizedDataset::target(int64_t i) const {
  check_index(i);
  FT_CHECK(label_kind_ == LabelKind::Targets, "the dataset has no target sequences");
  const auto begin = static_cast<size_t>(target_offsets_[static_cast<size_t>(i)]);
  const auto end = static_cast<size_t>(target_offsets_[static_cast<size_t>(i) + 1]);
  return {token_labels_.data() + begin, end - begin};
}

TokenizedDataset TokenizedDataset::from_flat(FlatExamples e) {
  const auto n_ids = static_cast<int64_t>(e.ids.size());
  FT_CHECK(!e.offsets.empty() && e.offsets.front() == 0, "offsets must start at 0");
  FT_CHECK(e.offsets.back() == n_ids, "offsets end at ", e.offsets.back(), " but there are ", n_ids, " ids");
  const int64_t n = static_cast<int64_t>(e.offsets.size()) - 1;
  FT_CHECK(!e.without_tokens || n_ids == 0, "a dataset without tokens holds ", n_ids, " ids");
  for (int64_t i = 0; i < n && !e.without_tokens; ++i)
    FT_CHECK(e.offsets[i + 1] > e.offsets[i], "example ", i, " has no tokens (offsets ", e.offsets[i], " to ",
             e.offsets[i + 1], ")");
  FT_CHECK(e.type_ids.empty() || static_cast<int64_t>(e.type_ids.size()) == n_ids, "expected ", n_ids,
           " token type ids (one per id), found ", e.type_ids.size());
  if (e.vocab_size > 0)
    for (int64_t k = 0; k < n_ids; ++k)
      FT_CHECK(e.ids[k] >= 0 && e.ids[k] < e.vocab_size, "token id ", e.ids[k], " of example ",
               std::upper_bound(e.offsets.begin(), e.offsets.end(), k) - e.offsets.begin() - 1,
               " is outside the vocabulary [0, ", e.vocab_size, ")");
  auto expect_labels = [&](size_t found, int64_t expected, const char* what) {
    FT_CHECK(static_cast<int64_t>(found) == expected, "expected ", expected, " ", what, ", found ", found);
  };
  auto check_classes = [&](bool allow_ignore) {
    if (e.num_labels <= 0) return;
    for (size_t k = 0; k < e.labels.size(); ++k) {
      const int64_t label = e.labels[k];
      if (allow_ignore && label == kIgnoreIndex) continue;
      FT_CHECK(label >= 0 && label < e.num_labels, "label ", label, " (", allow_ignore ? "token " : "example ", k,
               ") is out of range: the model has ", e.num_labels, " labels, so labels must lie in [0, ",
               e.num_labels, ")");
    }
  };
  switch (e.label_kind) {
    case LabelKind::None:
    case LabelKind::Tokens:
      break;
    case LabelKind::Class:
      expect_labels(e.labels.size(), n, "class labels (one per example)");
      check_classes(false);
      break;
    case LabelKind::Regression:
      expect_labels(e.float_labels.size(), n, "regression targets (one per example)");
      break;
    case LabelKind::TokenClasses:
      expect_labels(e.labels.size(), n_ids, "token labels (one per id)");
      check_classes(true);
      break;
    case LabelKind::Spans:
      expect_labels(e.labels.size(), 2 * n, "span positions (start and end per example)");
      break;
    case LabelKind::Targets:
      throw Error("flat examples carry no target sequences: a sequence-to-sequence batch comes from a collator");
  }
  TokenizedDataset d;
  d.offsets_ = std::move(e.offsets);
  d.ids_ = std::move(e.ids);
  if (std::any_of(e.type_ids.begin(), e.type_ids.end(), [](int64_t t) { return t != 0; }))
    d.type_ids_ = std::move(e.type_ids);
  d.label_kind_ = e.label_kind;
  if (e.label_kind == LabelKind::Class) d.labels_ = std::move(e.labels);
  if (e.label_kind == LabelKind::TokenClasses || e.label_kind == LabelKind::Spans) d.token_labels_ = std::move(e.labels);
  d.float_labels_ = std::move(e.float_labels);
  for (int64_t i = 0; i < n; ++i) d.longest_ = std::max(d.longest_, d.offsets_[i + 1] - d.offsets_[i]);
  return d;
}

void TokenizedDataset::append(std::span<const int64_t> ids, std::span<const int64_t> type_ids) {
  const bool any_type = std::any_of(type_ids.begin(), type_ids.end(), [](int64_t t) { return t != 0; });
  if (any_type && type_ids_.size() < ids_.size()) type_ids_.assign(ids_.size(), 0);  // first non-zero type id
  if (any_type || !type_ids_.empty()) {
    if (type_ids.empty())
      type_ids_.insert(type_ids_.end(), ids.size(), 0);
    else
      type_ids_.insert(type_ids_.end(), type_ids.begin(), type_ids.end());
  }
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  offsets_.push_back(static_cast<int64_t>(ids_.size()));
  longest_ = std::max(longest_, static_cast<int64_t>(ids.size()));
}

TextDataset::TextDataset(const Table& table, const TextColumns& columns, const TokenizeFn& tokenize,
                         const TextDatasetOptions& options) {
  FT_CHECK(options.max_length > 0, table.source, ": max_length must be positive, got ", options.max_length);
  FT_CHECK(options.num_labels >= 0, table.source, ": num_labels must not be negative, got ", options.num_labels);
  const size_t text_column = table.column(columns.text);
  std::optional<size_t> pair_column;
  if (!columns.text_pair.empty()) pair_column = table.column(columns.text_pair);

  // Labels first: a bad label fails before any tokenizing.
  if (!columns.label.empty()) {
    const size_t label_column = table.column(columns.label);
    label_kind_ = options.regression ? LabelKind::Regression : LabelKind::Class;
    for (size_t row = 0; row < table.num_rows(); ++row) {
      std::string_view text = trim(table.rows[row][label_column]);
      const char* end = text.data() + text.size();
      if (options.regression) {
        float value = 0;
        auto [stop, error] = std::from_chars(text.data(), end, value);
        FT_CHECK(error == std::errc() && stop == end && !text.empty() && std::isfinite(value), table.where(row),
                 ": label \"", table.rows[row][label_column], "\" is not a number");
        float_labels_.push_back(value);
      } else {
        int64_t value = 0;
        auto [stop, error] = std::from_chars(text.data(), end, value);
        FT_CHECK(error == std::errc() && stop == end && !text.empty(), table.where(row), ": label \"",
                 table.rows[row][label_column], "\" is not an integer");
        FT_CHECK(value >= 0, table.where(row), ": label ", value, " is negative (class labels count from 0)");
        FT_CHECK(options.num_labels == 0 || value < options.num_labels, table.where(row), ": label ", value,
                 " is out of range [0, ", options.num_labels, ")");
        labels_.push_back(value);
        num_labels_ = std::max(num_labels_, value + 1);
      }
    }
    if (options.num_labels == 0 && !options.regression)
      require_contiguous_labels(std::set<int64_t>(labels_.begin(), labels_.end()), table.source, "labels");
    if (options.num_labels > 0 && !options.regression) num_labels_ = options.num_labels;
  }

  offsets_.reserve(table.num_rows() + 1);
  tokenize_rows(table, all_rows(table), text_column, pair_column, tokenize, options.num_threads, options.max_length,
                [&](size_t, TokenizedText&& tokens) { append(tokens.ids, tokens.type_ids); });
}

Seq2SeqDataset::Seq2SeqDataset(const Table& table, const Seq2SeqColumns& columns, const TokenizeFn& tokenize,
                               const Seq2SeqDatasetOptions& options) {
  FT_CHECK(options.max_length > 0 && options.max_target_length > 0, table.source,
           ": max_length and max_target_length must be positive, got ", options.max_length, " and ",
           options.max_target_length);
  const size_t source_column = table.column(columns.source);
  std::optional<size_t> target_column;
  if (!columns.target.empty()) target_column = table.column(columns.target);
  offsets_.reserve(table.num_rows() + 1);
  tokenize_rows(table, all_rows(table), source_column, std::nullopt, tokenize, options.num_threads,
                options.max_length, [&](size_t, TokenizedText&& tokens) { append(tokens.ids, tokens.type_ids); });
  if (!target_column) return;
  label_kind_ = LabelKind::Targets;
  target_offsets_.reserve(table.num_rows() + 1);
  tokenize_rows(table, all_rows(table), *target_column, std::nullopt, tokenize, options.num_threads,
                options.max_target_length, [&](size_t row, TokenizedText&& tokens) {
                  FT_CHECK(!tokens.ids.empty(), table.where(row), ": the target \"",
                           table.rows[row][*target_column], "\" has no tokens");
                  token_labels_.insert(token_labels_.end(), tokens.ids.begin(), tokens.ids.end());
                  target_offsets_.push_back(static_cast<int64_t>(token_labels_.size()));
                });
}

LmDataset::LmDataset(const Table& table, const std::string& text_column, const TokenizeFn& tokenize,
                     const LmDatasetOptions& options) {
  label_kind_ = LabelKind::Tokens;
  const size_t column = table.column(text_column);
  if (options.line_by_line) {
    FT_CHECK(options.max_length > 0, table.source, ": max_length must be positive, got ", options.max_length);
    std::vector<size_t> rows;  // run_mlm skips empty and whitespace-only lines
    for (size_t row = 0; row < table.num_rows(); ++row)
      if (!trim(table.rows[row][column]).empty()) rows.push_back(row);
    tokenize_rows(table, rows, column, std::nullopt, tokenize, options.num_threads, options.max_length,
                  [&](size_t, TokenizedText&& tokens) { append(tokens.ids, tokens.type_ids); });
    return;
  }

  FT_CHECK(options.block_size > 0, table.source, ": block_size must be positive, got ", options.block_size);
  FT_CHECK(options.lines_per_group >= 0, table.source, ": lines_per_group must not be negative, got ",
           options.lines_per_group);
  const size_t block = static_cast<size_t>(options.block_size);
  const size_t group = options.lines_per_group > 0 ? static_cast<size_t>(options.lines_per_group) : 0;
  // group_texts, streamed: whole blocks leave `pending` as soon as they fill; what is left at the end of a group is
  // the remainder transformers drops.
  std::vector<int64_t> pending_ids, pending_types;
  size_t lines_in_group = 0;
  auto emit_blocks = [&] {
    size_t start = 0;
    for (; start + block <= pending_ids.size(); start += block)
      append(std::span<const int64_t>(pending_ids.data() + start, block),
             std::span<const int64_t>(pending_types.data() + start, block));
    pending_ids.erase(pending_ids.begin(), pending_ids.begin() + static_cast<std::ptrdiff_t>(start));
    pending_types.erase(pending_types.begin(), pending_types.begin() + static_cast<std::ptrdiff_t>(start));
  };
  tokenize_rows(table, all_rows(table), column, std::nullopt, tokenize, options.num_threads, 0,
                [&](size_t, TokenizedText&& tokens) {
                  pending_ids.insert(pending_ids.end(), tokens.ids.begin(), tokens.ids.end());
                  if (tokens.type_ids.empty())
                    pending_types.insert(pending_types.end(), tokens.ids.size(), 0);
                  else
                    pending_types.insert(pending_types.end(), tokens.type_ids.begin(), tokens.type_ids.end());
                  if (pending_ids.size() >= 2 * block) emit_blocks();
                  if (group > 0 && ++lines_in_group == group) {
                    emit_blocks();
                    pending_ids.clear();
                    pending_types.clear();
                    lines_in_group = 0;
                  }
                });
  emit_blocks();
}

PromptResponseDataset::PromptResponseDataset(const Table& table, const PromptColumns& columns,
                                             const TokenizeFn& tokenize_prompt, const TokenizeFn& tokenize_response,
                                             const PromptResponseOptions& options) {
  label_kind_ = LabelKind::TokenClasses;
  FT_CHECK(options.max_length > 1, table.source, ": max_length must be at least 2, got ", options.max_length);
  const size_t prompt_column = table.column(columns.prompt), response_column = table.column(columns.response);
  const std::vector<size_t> rows = all_rows(table);
  std::vector<std::vector<int64_t>> prompts(table.num_rows());
  tokenize_rows(table, rows, prompt_column, std::nullopt, tokenize_prompt, options.num_threads, 0,
                [&](size_t row, TokenizedText&& tokens) { prompts[row] = std::move(tokens.ids); });
  const size_t limit = static_cast<size_t>(options.max_length);
  tokenize_rows(table, rows, response_column, std::nullopt, tokenize_response, options.num_threads, 0,
                [&](size_t row, TokenizedText&& tokens) {
                  std::vector<int64_t>& ids = prompts[row];
                  FT_CHECK(ids.size() < limit, table.where(row), ": the prompt alone is ", ids.size(),
                           " tokens, which leaves no room for the response within max_length ", options.max_length);
                  std::vector<int64_t> labels(ids.size(), kIgnoreIndex);
                  std::vector<int64_t> response = std::move(tokens.ids);
                  if (options.eos_id >= 0) response.push_back(options.eos_id);
                  for (int64_t id : response) {
                    if (ids.size() == limit) break;
                    ids.push_back(id);
                    labels.push_back(id);
                  }
                  append(ids, {});
                  token_labels_.insert(token_labels_.end(), labels.begin(), labels.end());
                  std::vector<int64_t>().swap(prompts[row]);
                });
}

namespace {

// A row's JSON array column (`["EU", "rejects"]`, `[3, 0]`): the parsed array, or Error naming the row.
nlohmann::json json_array(const Table& table, size_t row, size_t column) {
  nlohmann::json value = nlohmann::json::parse(table.rows[row][column], nullptr, /*allow_exceptions=*/false);
  FT_CHECK(value.is_array(), table.where(row), ": \"", table.columns[column], "\" is not a JSON array (found ",
           table.rows[row][column].substr(0, 40), ")");
  return value;
}

}  // namespace

std::vector<std::string> collect_tag_names(const Table& table, const std::string& tags_column) {
  const size_t column = table.column(tags_column);
  std::set<std::string> names;
  for (size_t row = 0; row < table.num_rows(); ++row)
    for (const auto& tag : json_array(table, row, column))
      if (tag.is_string()) names.insert(tag.get<std::string>());
  return {names.begin(), names.end()};
}

TokenClassificationDataset::TokenClassificationDataset(const Table& table, const TokenColumns& columns,
                                                       const TokenizeFn& tokenize, const TokenDatasetOptions& options)
    : label_names_(options.label_names) {
  FT_CHECK(options.max_length > 0, table.source, ": max_length must be positive, got ", options.max_length);
  const size_t words_column = table.column(columns.words);
  const bool labelled = !columns.tags.empty();
  const size_t tags_column = labelled ? table.column(columns.tags) : 0;
  if (labelled && label_names_.empty()) label_names_ = collect_tag_names(table, columns.tags);

  // Each word after a space (" EU rejects ..."): byte-level BPE then sees every word with its leading space, as
  // transformers' is_split_into_words encodes words for RoBERTa; BERT's pre-tokenizer drops the spaces.
  // word_ends[row][w] is where word w ends in that text.
  Table joined{table.source, {"text"}, {}, table.row_lines, {}};  // the joined text is a string in every row
  std::vector<std::vector<int64_t>> word_ends(table.num_rows()), tags(table.num_rows());
  for (size_t row = 0; row < table.num_rows(); ++row) {
    std::string text;
    for (const auto& word : json_array(table, row, words_column)) {
      FT_CHECK(word.is_string(), table.where(row), ": \"", columns.words, "\" is not a JSON array of strings");
      text += ' ';
      text += word.get<std::string>();
      word_ends[row].push_back(static_cast<int64_t>(text.size()));
    }
    joined.rows.push_back({std::move(text)});
    if (!labelled) continue;
    nlohmann::json row_tags = json_array(table, row, tags_column);
    FT_CHECK(row_tags.size() == word_ends[row].size(), table.where(row), ": ", word_ends[row].size(), " words but ",
             row_tags.size(), " tags");
    for (const auto& tag : row_tags) {
      int64_t id = -1;
      if (tag.is_string()) {
        auto it = std::find(label_names_.begin(), label_names_.end(), tag.get<std::string>());
        FT_CHECK(it != label_names_.end(), table.where(row), ": tag \"", tag.get<std::string>(),
                 "\" is not one of the labels (", join(label_names_), ")");
        id = it - label_names_.begin();
      } else {
        FT_CHECK(tag.is_number_integer(), table.where(row), ": tag ", tag.dump(), " is neither an integer nor a name");
        id = tag.get<int64_t>();
        const int64_t limit = !label_names_.empty() ? static_cast<int64_t>(label_names_.size()) : options.num_labels;
        FT_CHECK(id >= 0 && (limit == 0 || id < limit), table.where(row), ": tag ", id, " is out of range [0, ",
                 limit > 0 ? std::to_string(limit) : std::string("inf"), ")");
      }
      tags[row].push_back(id);
      num_labels_ = std::max(num_labels_, id + 1);
    }
  }
  if (!label_names_.empty()) {
    num_labels_ = static_cast<int64_t>(label_names_.size());
  } else if (options.num_labels > 0) {
    num_labels_ = options.num_labels;
  } else {
    std::set<int64_t> seen;
    for (const auto& row : tags) seen.insert(row.begin(), row.end());
    require_contiguous_labels(seen, table.source, "tags");
  }
  label_kind_ = labelled ? LabelKind::TokenClasses : LabelKind::None;
  // With label_all_tokens, a word's later sub-tokens get I-X where its tag is B-X (run_ner's b_to_i_label).
  std::vector<int64_t> inside(static_cast<size_t>(num_labels_));
  for (size_t k = 0; k < inside.size(); ++k) {
    inside[k] = static_cast<int64_t>(k);
    if (k < label_names_.size() && label_names_[k].rfind("B-", 0) == 0) {
      auto it = std::find(label_names_.begin(), label_names_.end(), "I-" + label_names_[k].substr(2));
      if (it != label_names_.end()) inside[k] = it - label_names_.begin();
    }
  }

  offsets_.reserve(table.num_rows() + 1);
  tokenize_rows(joined, all_rows(joined), 0, std::nullopt, tokenize, options.num_threads, options.max_length,
                [&](size_t row, TokenizedText&& tokens) {
                  FT_CHECK(tokens.offsets.size() == tokens.ids.size(), table.where(row),
                           ": the tokenizer returned no token offsets; token classification needs them");
                  append(tokens.ids, tokens.type_ids);
                  const std::vector<int64_t>& ends = word_ends[row];
                  const auto words = static_cast<int64_t>(ends.size());
                  int64_t previous_word = -1;
                  for (size_t i = 0; i < tokens.ids.size(); ++i) {
                    const bool special = !tokens.special_tokens_mask.empty() && tokens.special_tokens_mask[i];
                    // The word a token belongs to: the first whose end lies past the token's start (a token
                    // starting on the space before a word belongs to that word).
                    int64_t word =
                        special ? -1 : std::upper_bound(ends.begin(), ends.end(), tokens.offsets[i].first) - ends.begin();
                    if (word >= words) word = -1;
                    word_ids_.push_back(word);
                    if (!labelled) continue;
                    int64_t label = kIgnoreIndex;
                    if (word >= 0 && word != previous_word)
                      label = tags[row][static_cast<size_t>(word)];
                    else if (word >= 0 && options.label_all_tokens)
                      label = inside[static_cast<size_t>(tags[row][static_cast<size_t>(word)])];
                    token_labels_.push_back(label);
                    if (word >= 0) previous_word = word;
                  }
                });
}

std::span<const int64_t> TokenClassificationDataset::word_ids(int64_t i) const {
  check_index(i);
  const auto begin = static_cast<size_t>(offsets_[i]), end = static_cast<size_t>(offsets_[i + 1]);
  return std::span<const int64_t>(word_ids_.data() + begin, end - begin);
}

}  // namespace fusetrain::data
