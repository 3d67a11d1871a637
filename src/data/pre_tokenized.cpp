// The text of one encode call: pieces, alignments, the rewriting and splitting rules tokenizers applies to them.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {

void Rewriter::skip(size_t n) {
  for (size_t k = 0; k < n && read_ < source_.size(); ++k) {
    read_ += unicode::char_length(static_cast<unsigned char>(source_[read_]));
  }
}

void Rewriter::emit(char32_t c, int change) {
  Align align;
  if (change > 0) {
    align = read_ == 0 ? Align{origin_, origin_} : source_align_[read_ - 1];
  } else {
    FT_CHECK(read_ < source_.size(), "tokenizer: a normalizer replaced past the end of its text");
    align = source_align_[read_];
    read_ += unicode::char_length(static_cast<unsigned char>(source_[read_]));
    if (change < 0) skip(static_cast<size_t>(-change));
  }
  char bytes[4];
  const size_t n = unicode::encode_utf8(c, bytes);
  out_.append(bytes, n);
  for (size_t k = 0; k < n; ++k) out_align_.push_back(align);
}

void Rewriter::keep() {
  const size_t n = unicode::char_length(static_cast<unsigned char>(source_[read_]));
  out_.append(source_.data() + read_, n);
  out_align_.insert(out_align_.end(), source_align_ + read_, source_align_ + read_ + n);
  read_ += n;
}

void Rewriter::keep_rest() {
  out_.append(source_.data() + read_, source_.size() - read_);
  out_align_.insert(out_align_.end(), source_align_ + read_, source_align_ + source_.size());
  read_ = source_.size();
}

void PreTokenized::reset(std::string_view input) {
  text.assign(input);
  align.resize(input.size());
  size_t i = 0;
  while (i < input.size()) {
    const size_t n = unicode::char_length(static_cast<unsigned char>(input[i]));
    const Align a{static_cast<uint32_t>(i), static_cast<uint32_t>(i + n)};
    for (size_t k = 0; k < n; ++k) align[i + k] = a;
    i += n;
  }
  pieces.clear();
  if (!input.empty()) pieces.push_back(Piece{0, static_cast<uint32_t>(input.size()), 0, -1});
}

void PreTokenized::Cuts::add(uint32_t begin, uint32_t end, int32_t added_id) {
  if (end <= begin) return;
  const uint32_t absolute_begin = piece_->begin + begin;
  owner_->next_pieces_.push_back(
      Piece{absolute_begin, piece_->begin + end, owner_->align[absolute_begin].start, added_id});
}

void PreTokenized::Cuts::add_matches(const std::vector<Match>& matches, SplitBehavior behavior) {
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Match& m : matches) add(m.begin, m.end);
      return;
    case SplitBehavior::kRemoved:
      for (const Match& m : matches) {
        if (!m.is_match) add(m.begin, m.end);
      }
      return;
    case SplitBehavior::kContiguous:
    case SplitBehavior::kMergedWithPrevious: {
      // Runs of matches (contiguous) or one match glued to the stretch before it.
      bool previous_match = false;
      bool have = false;
      uint32_t begin = 0, end = 0;
      for (const Match& m : matches) {
        const bool glue =
            behavior == SplitBehavior::kContiguous ? (m.is_match == previous_match) : (m.is_match && !previous_match);
        if (glue && have) {
          end = m.end;
        } else {
          if (have) add(begin, end);
          begin = m.begin, end = m.end, have = true;
        }
        previous_match = m.is_match;
      }
      if (have) add(begin, end);
      return;
    }
    case SplitBehavior::kMergedWithNext: {
      // Each match glued to the stretch after it: walk backwards, then emit in order.
      thread_local std::vector<std::pair<uint32_t, uint32_t>> ranges;
      ranges.clear();
      bool previous_match = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        if (it->is_match && !previous_match && !ranges.empty()) {
          ranges.back().first = it->begin;
        } else {
          ranges.emplace_back(it->begin, it->end);
        }
        previous_match = it->is_match;
      }
      for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) add(it->first, it->second);
      return;
    }
  }
}

SplitBehavior parse_split_behavior(const nlohmann::json& value, const std::string& where) {
  const std::string name = value.is_string() ? value.get<std::string>() : "";
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  throw Error(str(where, ": split behavior ", value.dump(),
                  " is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous"));
}

void Segment::truncate(size_t length) {
  if (length >= ids.size()) return;
  ids.resize(length), type_ids.resize(length), offsets.resize(length);
  if (!leading.empty()) leading.resize(length), trailing.resize(length);
}

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

int byte_of_char(char32_t c) {
  static const std::array<int16_t, 324> inverse = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    const auto& forward = byte_to_char();
    for (int b = 0; b < 256; ++b) t[forward[b]] = static_cast<int16_t>(b);
    return t;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

std::pair<uint16_t, uint16_t> whitespace_ends(std::string_view token) {
  auto is_space = [](char32_t c) { return c == 0x120 || unicode::is_whitespace(c); };
  size_t leading = 0, i = 0;
  while (i < token.size() && is_space(unicode::next_char(token, i))) ++leading;
  size_t trailing = 0, end = token.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(token[start]) & 0xC0) == 0x80) --start;
    size_t probe = start;
    if (!is_space(unicode::next_char(token, probe))) break;
    ++trailing, end = start;
  }
  return {static_cast<uint16_t>(std::min<size_t>(leading, 0xFFFF)),
          static_cast<uint16_t>(std::min<size_t>(trailing, 0xFFFF))};
}

}  // namespace fusetrain::data::detail
