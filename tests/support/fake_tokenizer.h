// A fake tokenizer for dataset tests: whitespace words with predictable ids, BERT-, RoBERTa- or GPT-2-style
// special tokens, type ids and byte offsets, so expected features can be written down by hand.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fusetrain/data/dataset.h"

namespace fusetrain::testing {

using data::TokenizedText;
using data::TokenizeFn;

constexpr int64_t kCls = 2, kSep = 3;

// Whitespace words; a word that is a number is its own id, any other word gets 100 + (its length). With
// `split_long`, a word of more than 4 bytes is two tokens: its first 4 bytes (id 104) and the rest (100 + length).
// Bert: [CLS] A [SEP] (B [SEP] with type id 1); Roberta: <s> A </s></s> B </s>, all type 0; Gpt2: no specials.
// Offsets are byte spans in the text each token came from; special tokens get (0, 0).
enum class Style { Bert, Roberta, Gpt2 };
struct FakeTokenizer {
  Style style = Style::Bert;
  bool split_long = false;

  void token(int64_t id, int64_t type, size_t begin, size_t end, TokenizedText& out) const {
    out.ids.push_back(id);
    out.type_ids.push_back(type);
    out.special_tokens_mask.push_back(0);
    out.offsets.emplace_back(begin, end);
  }
  void words(std::string_view text, int64_t type, TokenizedText& out) const {
    size_t i = 0;
    while (i < text.size()) {
      if (text[i] == ' ' || text[i] == '\t') {
        ++i;
        continue;
      }
      size_t end = text.find_first_of(" \t", i);
      if (end == std::string_view::npos) end = text.size();
      std::string word(text.substr(i, end - i));
      bool number = word.find_first_not_of("0123456789") == std::string::npos;
      if (split_long && !number && word.size() > 4) {
        token(104, type, i, i + 4, out);
        token(100 + static_cast<int64_t>(word.size()) - 4, type, i + 4, end, out);
      } else {
        token(number ? std::stoll(word) : 100 + static_cast<int64_t>(word.size()), type, i, end, out);
      }
      i = end;
    }
  }
  static void special(int64_t id, int64_t type, TokenizedText& out) {
    out.ids.push_back(id);
    out.type_ids.push_back(type);
    out.special_tokens_mask.push_back(1);
    out.offsets.emplace_back(0, 0);
  }
  TokenizedText operator()(std::string_view text, std::optional<std::string_view> pair) const {
    TokenizedText out;
    if (style != Style::Gpt2) special(kCls, 0, out);
    words(text, 0, out);
    if (style != Style::Gpt2) special(kSep, 0, out);
    if (pair) {
      int64_t type = style == Style::Bert ? 1 : 0;
      if (style == Style::Roberta) special(kSep, 0, out);
      words(*pair, type, out);
      if (style != Style::Gpt2) special(kSep, type, out);
    }
    return out;
  }
};

inline TokenizeFn fake(Style style = Style::Bert, bool split_long = false) { return FakeTokenizer{style, split_long}; }

}  // namespace fusetrain::testing
