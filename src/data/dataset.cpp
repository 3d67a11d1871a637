// Tokenized datasets: parallel tokenization, transformers-style truncation, label parsing, group_texts.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <exception>
#include <thread>

#include "fusetrain/core/error.h"
#include "fusetrain/data/dataset.h"

namespace fusetrain::data {
namespace {

// Rows tokenized per round: bounds the memory held in per-example vectors before they go to the flat buffers.
constexpr size_t kRowsPerRound = 16384;

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Tokenizes table rows `rows` (column `text_column`, and `pair_column` when set) on up to `num_threads` threads,
// truncating each to `max_length` when it is > 0, and hands the results to `consume(row, tokens)` in row order on
// the calling thread. An exception from the tokenizer is rethrown as Error naming the row's line.
template <typename Consume>
void tokenize_rows(const Table& table, const std::vector<size_t>& rows, size_t text_column,
                   std::optional<size_t> pair_column, const TokenizeFn& tokenize, int num_threads, int64_t max_length,
                   Consume&& consume) {
  FT_CHECK(static_cast<bool>(tokenize), table.source, ": no tokenize function given");
  const size_t threads_wanted = static_cast<size_t>(resolve_threads(num_threads));
  std::vector<TokenizedText> results;
  for (size_t round = 0; round < rows.size(); round += kRowsPerRound) {
    const size_t count = std::min(kRowsPerRound, rows.size() - round);
    results.assign(count, TokenizedText{});
    const size_t threads = std::clamp<size_t>(count / 64, 1, threads_wanted);
    std::vector<std::exception_ptr> errors(threads);
    auto work = [&](size_t t) {
      const size_t begin = count * t / threads, end = count * (t + 1) / threads;
      size_t k = begin;
      try {
        for (; k < end; ++k) {
          const std::vector<std::string>& row = table.rows[rows[round + k]];
          std::optional<std::string_view> pair;
          if (pair_column) pair = row[*pair_column];
          TokenizedText tokens = tokenize(row[text_column], pair);
          FT_CHECK(tokens.type_ids.empty() || tokens.type_ids.size() == tokens.ids.size(), "the tokenizer returned ",
                   tokens.type_ids.size(), " type ids for ", tokens.ids.size(), " ids");
          FT_CHECK(tokens.special_tokens_mask.empty() || tokens.special_tokens_mask.size() == tokens.ids.size(),
                   "the tokenizer returned ", tokens.special_tokens_mask.size(), " special-token flags for ",
                   tokens.ids.size(), " ids");
          if (max_length > 0) truncate_tokens(tokens, max_length);
          results[k] = std::move(tokens);
        }
      } catch (const std::exception& e) {
        errors[t] = std::make_exception_ptr(Error(str(table.where(rows[round + k]), ": ", e.what())));
      } catch (...) {
        errors[t] = std::current_exception();
      }
    };
    if (threads == 1) {
      work(0);
    } else {
      std::vector<std::thread> pool;
      for (size_t t = 0; t < threads; ++t) pool.emplace_back(work, t);
      for (auto& thread : pool) thread.join();
    }
    for (auto& error : errors)  // the first failing row's error
      if (error) std::rethrow_exception(error);
    for (size_t k = 0; k < count; ++k) consume(rows[round + k], std::move(results[k]));
  }
}

std::vector<size_t> all_rows(const Table& table) {
  std::vector<size_t> rows(table.num_rows());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = i;
  return rows;
}

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

}  // namespace

void truncate_tokens(TokenizedText& tokens, int64_t max_length) {
  FT_CHECK(max_length > 0, "max_length must be positive, got ", max_length);
  const size_t n = tokens.ids.size();
  if (static_cast<int64_t>(n) <= max_length) return;
  auto is_special = [&](size_t i) { return !tokens.special_tokens_mask.empty() && tokens.special_tokens_mask[i]; };
  std::vector<size_t> content;  // positions of non-special tokens
  for (size_t i = 0; i < n; ++i)
    if (!is_special(i)) content.push_back(i);
  const int64_t num_special = static_cast<int64_t>(n - content.size());
  FT_CHECK(num_special <= max_length, "max_length ", max_length, " cannot hold the ", num_special,
           " special tokens the tokenizer adds");
  const int64_t budget = max_length - num_special;

  // side[k]: 0 for content of the first sequence, 1 for the pair's second sequence.
  std::vector<uint8_t> side(content.size(), 0);
  bool is_pair = false;
  if (!content.empty() && !tokens.type_ids.empty()) {
    const int64_t first_type = tokens.type_ids[content[0]];
    for (size_t k = 0; k < content.size(); ++k) side[k] = tokens.type_ids[content[k]] != first_type;
    is_pair = std::find(side.begin(), side.end(), 1) != side.end();
  }
  if (!is_pair) {  // same type ids throughout (RoBERTa): two runs of content separated by special tokens
    size_t runs = 0;
    for (size_t k = 0; k < content.size(); ++k) {
      if (k == 0 || content[k] != content[k - 1] + 1) ++runs;
      side[k] = runs == 2;
    }
    is_pair = runs == 2;
    if (!is_pair) std::fill(side.begin(), side.end(), 0);
  }
  int64_t keep[2] = {budget, 0};
  if (is_pair) {
    int64_t first = std::count(side.begin(), side.end(), 0);
    auto [n1, n2] = longest_first(first, static_cast<int64_t>(content.size()) - first, budget);
    keep[0] = n1;
    keep[1] = n2;
  }

  TokenizedText out;
  int64_t kept[2] = {0, 0};
  for (size_t i = 0, k = 0; i < n; ++i) {
    if (!is_special(i)) {
      const int s = side[k++];
      if (kept[s] >= keep[s]) continue;
      ++kept[s];
    }
    out.ids.push_back(tokens.ids[i]);
    if (!tokens.type_ids.empty()) out.type_ids.push_back(tokens.type_ids[i]);
    if (!tokens.special_tokens_mask.empty()) out.special_tokens_mask.push_back(tokens.special_tokens_mask[i]);
  }
  tokens = std::move(out);
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
    if (options.num_labels > 0 && !options.regression) num_labels_ = options.num_labels;
  }

  offsets_.reserve(table.num_rows() + 1);
  tokenize_rows(table, all_rows(table), text_column, pair_column, tokenize, options.num_threads, options.max_length,
                [&](size_t, TokenizedText&& tokens) { append(tokens.ids, tokens.type_ids); });
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

}  // namespace fusetrain::data
