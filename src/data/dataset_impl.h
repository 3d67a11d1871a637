// Internal to data/: tokenizing table rows in parallel, shared by the dataset classes.
#pragma once

#include <algorithm>
#include <cctype>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/data/dataset.h"

namespace fusetrain::data::detail {

// Rows tokenized per round: bounds the memory held in per-example vectors before they go to the flat buffers.
constexpr size_t kRowsPerRound = 16384;

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

inline int resolve_threads(int requested) {
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
  for (size_t row : rows) {  // only JSON strings are text
    table.require_text(row, text_column);
    if (pair_column) table.require_text(row, *pair_column);
  }
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

inline std::vector<size_t> all_rows(const Table& table) {
  std::vector<size_t> rows(table.num_rows());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = i;
  return rows;
}

}  // namespace fusetrain::data::detail
