// Added tokens: found in the text before the model runs, longest match at the leftmost position.
#include <algorithm>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {

void AddedVocabulary::Trie::insert(std::string_view pattern, int32_t token) {
  if (pattern.empty()) return;
  if (nodes.empty()) nodes.emplace_back();
  int32_t node = 0;
  for (char ch : pattern) {
    const auto byte = static_cast<unsigned char>(ch);
    auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), byte,
                               [](const auto& child, unsigned char value) { return child.first < value; });
    if (it != children.end() && it->first == byte) {
      node = it->second;
    } else {
      const auto next = static_cast<int32_t>(nodes.size());
      children.insert(it, {byte, next});
      nodes.emplace_back();
      node = next;
    }
  }
  if (nodes[node].token < 0) nodes[node].token = token;  // the first of equal patterns wins
  first_byte[static_cast<unsigned char>(pattern[0])] = true;
}

std::pair<size_t, int32_t> AddedVocabulary::Trie::longest(std::string_view text, size_t at) const {
  std::pair<size_t, int32_t> best{0, -1};
  int32_t node = 0;
  for (size_t i = at; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), byte,
                               [](const auto& child, unsigned char value) { return child.first < value; });
    if (it == children.end() || it->first != byte) break;
    node = it->second;
    if (nodes[node].token >= 0) best = {i + 1 - at, nodes[node].token};
  }
  return best;
}

void AddedVocabulary::build(std::vector<AddedToken> tokens, const Normalizer* normalizer) {
  tokens_ = std::move(tokens);
  by_content_.clear();
  by_id_.clear();
  raw_ = Trie();
  normalized_ = Trie();
  for (size_t k = 0; k < tokens_.size(); ++k) {
    by_content_.emplace(tokens_[k].content, k);
    by_id_.emplace(tokens_[k].id, k);
  }
  // Special tokens first, then the others, as tokenizers orders its patterns.
  PreTokenized scratch;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t k = 0; k < tokens_.size(); ++k) {
      AddedToken& token = tokens_[k];
      if (token.special != (pass == 0)) continue;
      token.decoded = token.content;
      if (!token.normalized) {
        raw_.insert(token.content, static_cast<int32_t>(k));
        continue;
      }
      scratch.reset(token.content);
      if (normalizer != nullptr) normalizer->normalize(scratch);
      token.decoded = scratch.text;
      normalized_.insert(scratch.text, static_cast<int32_t>(k));
    }
  }
}

const AddedToken* AddedVocabulary::find(std::string_view content) const {
  auto it = by_content_.find(content);
  return it == by_content_.end() ? nullptr : &tokens_[it->second];
}

const AddedToken* AddedVocabulary::find(int64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

namespace {

bool word_char_before(std::string_view s, size_t at) {
  if (at == 0) return false;
  size_t start = at - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return unicode::has(unicode::next_char(s, start), unicode::kWord);
}

bool word_char_at(std::string_view s, size_t at) {
  return at < s.size() && unicode::has(unicode::next_char(s, at), unicode::kWord);
}

}  // namespace

void AddedVocabulary::split(PreTokenized& text, const Trie& trie) const {
  if (trie.nodes.empty()) return;
  text.split([&](std::string_view s, PreTokenized::Cuts& cuts) {
    size_t start_offset = 0;  // end of the last added token
    size_t i = 0;
    while (i < s.size()) {
      if (!trie.first_byte[static_cast<unsigned char>(s[i])]) {
        ++i;
        continue;
      }
      const auto [length, index] = trie.longest(s, i);
      if (length == 0) {
        ++i;
        continue;
      }
      const AddedToken& token = tokens_[index];
      size_t start = i, stop = i + length;
      i = stop;  // the search goes on after the match, kept or not
      if (token.single_word && (word_char_before(s, start) || word_char_at(s, stop))) continue;
      if (token.lstrip) {
        size_t new_start = start;
        while (new_start > 0) {
          size_t prev = new_start - 1;
          while (prev > 0 && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
          size_t probe = prev;
          if (!unicode::is_whitespace(unicode::next_char(s, probe))) break;
          new_start = prev;
        }
        start = std::max(new_start, start_offset);
      }
      if (token.rstrip) {
        while (stop < s.size()) {
          size_t next = stop;
          if (!unicode::is_whitespace(unicode::next_char(s, next))) break;
          stop = next;
        }
      }
      start = std::max(start, start_offset);
      if (start_offset < start) cuts.add(static_cast<uint32_t>(start_offset), static_cast<uint32_t>(start));
      cuts.add(static_cast<uint32_t>(start), static_cast<uint32_t>(stop), static_cast<int32_t>(token.id));
      start_offset = stop;
    }
    if (start_offset < s.size()) cuts.add(static_cast<uint32_t>(start_offset), static_cast<uint32_t>(s.size()));
  });
}

}  // namespace fusetrain::data::detail
