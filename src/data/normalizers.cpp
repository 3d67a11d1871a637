// Normalizers: BertNormalizer, Lowercase, NFD/NFC/NFKD/NFKC, StripAccents, Strip, Replace, Prepend, Sequence.
#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

using nlohmann::json;

bool all_ascii(const PreTokenized& text) {
  for (const Piece& piece : text.pieces) {
    if (piece.added_id >= 0) continue;
    for (uint32_t i = piece.begin; i < piece.end; ++i) {
      if (static_cast<unsigned char>(text.text[i]) >= 0x80) return false;
    }
  }
  return true;
}

void lowercase_pass(PreTokenized& text) {
  text.rewrite([](Rewriter& out) {
    std::string_view s = out.source();
    while (out.position() < s.size()) {
      size_t next = out.position();
      const char32_t c = unicode::next_char(s, next);
      char32_t lower[3];
      const int n = unicode::to_lower(c, lower);
      if (n == 1 && lower[0] == c) {
        out.keep();
        continue;
      }
      out.emit(lower[0], 0);
      for (int k = 1; k < n; ++k) out.emit(lower[k], 1);
    }
  });
}

// Removes the characters for which `drop` holds.
template <typename Drop>
void filter_pass(PreTokenized& text, Drop drop) {
  text.rewrite([&](Rewriter& out) {
    std::string_view s = out.source();
    while (out.position() < s.size()) {
      size_t next = out.position();
      const char32_t c = unicode::next_char(s, next);
      if (drop(c)) {
        out.skip(1);
      } else {
        out.keep();
      }
    }
  });
}

// Unicode normalization of each piece: full decomposition, canonical ordering, then (NFC/NFKC) canonical
// composition, as unicode-normalization-alignments yields it: every output character carries a change (0: it
// replaces the next source character, +1: inserted after it, -n: also removes n more), the first character of a
// decomposition replacing its source and the others inserted; reordering moves characters with their changes,
// and composing a character away makes its starter remove what that character had replaced. Alignments are then
// given positionally by the Rewriter, which is what the library's transform does.
void unicode_normalize_pass(PreTokenized& text, bool compat, bool compose) {
  struct Item {
    char32_t c;
    uint8_t ccc;
    int change;
  };
  thread_local std::vector<Item> items;
  text.rewrite([&](Rewriter& out) {
    std::string_view s = out.source();
    items.clear();
    bool changed = false;
    size_t i = 0;
    while (i < s.size()) {
      const char32_t c = unicode::next_char(s, i);
      char32_t parts[18];
      const int n = unicode::decompose(c, compat, parts);
      if (n == 0) {
        items.push_back(Item{c, unicode::combining_class(c), 0});
      } else {
        changed = true;
        for (int k = 0; k < n; ++k) items.push_back(Item{parts[k], unicode::combining_class(parts[k]), k == 0 ? 0 : 1});
      }
    }
    // Canonical ordering: stable sort of each run of non-starters by combining class.
    for (size_t a = 0; a < items.size();) {
      if (items[a].ccc == 0) {
        ++a;
        continue;
      }
      size_t b = a;
      while (b < items.size() && items[b].ccc != 0) ++b;
      auto by_class = [](const Item& x, const Item& y) { return x.ccc < y.ccc; };
      if (b - a > 1 && !std::is_sorted(items.begin() + a, items.begin() + b, by_class)) {
        std::stable_sort(items.begin() + a, items.begin() + b, by_class);
        changed = true;
      }
      a = b;
    }
    if (compose) {
      size_t kept = 0;
      ptrdiff_t starter = -1;
      uint8_t last_ccc = 0;
      for (size_t k = 0; k < items.size(); ++k) {
        const Item item = items[k];
        if (starter >= 0) {
          const bool adjacent = kept == static_cast<size_t>(starter) + 1;
          if (adjacent || (last_ccc != 0 && last_ccc < item.ccc)) {
            const char32_t composite = unicode::compose(items[starter].c, item.c);
            if (composite != 0) {
              Item& target = items[starter];
              target.c = composite;
              if (target.change <= 0) target.change -= 1 - std::min(item.change, 1);
              changed = true;
              continue;
            }
          }
        }
        if (item.ccc == 0) starter = static_cast<ptrdiff_t>(kept);
        last_ccc = item.ccc;
        items[kept++] = item;
      }
      items.resize(kept);
    }
    if (!changed) {
      out.keep_rest();
      return;
    }
    for (const Item& item : items) out.emit(item.c, item.change);
    while (out.position() < s.size()) out.skip(1);
  });
}

// BertNormalizer drops nonspacing marks; the StripAccents normalizer drops every combining mark.
void strip_marks_pass(PreTokenized& text, uint16_t marks) {
  filter_pass(text, [marks](char32_t c) { return unicode::has(c, marks); });
}

class BertNormalizer final : public Normalizer {
 public:
  BertNormalizer(bool clean_text, bool chinese, bool strip_accents, bool lowercase)
      : clean_text_(clean_text), chinese_(chinese), strip_accents_(strip_accents), lowercase_(lowercase) {}

  void normalize(PreTokenized& text) const override {
    if (all_ascii(text)) {
      // One pass: ASCII has no Chinese characters, accents or multi-character lower case. Runs of bytes that
      // stay as they are are copied at once.
      text.rewrite([&](Rewriter& out) {
        std::string_view s = out.source();
        size_t run = out.position();
        auto flush = [&](size_t at) {
          if (at > run) out.keep_bytes(at - run);
        };
        for (size_t i = run; i < s.size(); ++i) {
          const auto c = static_cast<unsigned char>(s[i]);
          const bool control = clean_text_ && (c < 0x20 || c == 0x7F);
          const bool upper = lowercase_ && c >= 'A' && c <= 'Z';
          if (!control && !upper) continue;
          flush(i);
          if (control && (c == '\t' || c == '\n' || c == '\r')) {
            out.replace_ascii(' ');
          } else if (control) {
            out.skip(1);
          } else {
            out.replace_ascii(static_cast<char>(c + 32));
          }
          run = i + 1;
        }
        flush(s.size());
      });
      return;
    }
    if (clean_text_) {
      text.rewrite([](Rewriter& out) {
        std::string_view s = out.source();
        while (out.position() < s.size()) {
          size_t next = out.position();
          const char32_t c = unicode::next_char(s, next);
          if (c == 0 || c == 0xFFFD || unicode::has(c, unicode::kControl)) {
            out.skip(1);
          } else if (c != ' ' && unicode::is_whitespace(c)) {
            out.emit(' ', 0);
          } else {
            out.keep();
          }
        }
      });
    }
    if (chinese_) {
      text.rewrite([](Rewriter& out) {
        std::string_view s = out.source();
        while (out.position() < s.size()) {
          size_t next = out.position();
          const char32_t c = unicode::next_char(s, next);
          if (unicode::has(c, unicode::kCjk)) {
            out.emit(' ', 1);
            out.emit(c, 0);
            out.emit(' ', 1);
          } else {
            out.keep();
          }
        }
      });
    }
    if (strip_accents_) {
      unicode_normalize_pass(text, /*compat=*/false, /*compose=*/false);
      strip_marks_pass(text, unicode::kMarkNonspacing);
    }
    if (lowercase_) lowercase_pass(text);
  }

 private:
  bool clean_text_, chinese_, strip_accents_, lowercase_;
};

class Lowercase final : public Normalizer {
 public:
  void normalize(PreTokenized& text) const override { lowercase_pass(text); }
};

class UnicodeNormalizer final : public Normalizer {
 public:
  UnicodeNormalizer(bool compat, bool compose) : compat_(compat), compose_(compose) {}
  void normalize(PreTokenized& text) const override {
    if (all_ascii(text)) return;
    unicode_normalize_pass(text, compat_, compose_);
  }

 private:
  bool compat_, compose_;
};

class StripAccents final : public Normalizer {
 public:
  void normalize(PreTokenized& text) const override {
    if (!all_ascii(text)) strip_marks_pass(text, unicode::kCombiningMark);
  }
};

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(PreTokenized& text) const override {
    text.rewrite([&](Rewriter& out) {
      std::string_view s = out.source();
      // Byte offsets of the kept middle [keep_begin, keep_end).
      size_t keep_begin = 0, keep_end = s.size();
      if (left_) {
        while (keep_begin < s.size()) {
          size_t next = keep_begin;
          if (!unicode::is_whitespace(unicode::next_char(s, next))) break;
          keep_begin = next;
        }
      }
      if (right_) {
        while (keep_end > 0) {
          size_t start = keep_end - 1;
          while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
          size_t probe = start;
          if (!unicode::is_whitespace(unicode::next_char(s, probe))) break;
          keep_end = start;
        }
      }
      if (keep_end <= keep_begin) return;  // all whitespace: the piece vanishes
      while (out.position() < keep_begin) out.skip(1);
      while (out.position() < keep_end) out.keep();
    });
  }

 private:
  bool left_, right_;
};

class Replace final : public Normalizer {
 public:
  /// Replaces every occurrence of `pattern`; with min_run > 0, `pattern` is one character and every run of at
  /// least min_run of it is replaced (the regex "c{n,}", as SentencePiece conversions collapse spaces).
  Replace(std::string pattern, std::string content, size_t min_run = 0)
      : pattern_(std::move(pattern)), content_(std::move(content)), min_run_(min_run) {}
  void normalize(PreTokenized& text) const override {
    if (pattern_.empty()) return;
    text.rewrite([&](Rewriter& out) {
      std::string_view s = out.source();
      size_t at = 0;
      while (true) {
        size_t found = s.find(pattern_, at), length = pattern_.size();
        if (min_run_ > 0) {  // the next run of the character at least min_run long
          while (found != std::string_view::npos) {
            size_t end = found;
            while (s.compare(end, pattern_.size(), pattern_) == 0) end += pattern_.size();
            if ((end - found) / pattern_.size() >= min_run_) {
              length = end - found;
              break;
            }
            found = s.find(pattern_, end);
          }
        }
        const size_t stop = found == std::string_view::npos ? s.size() : found;
        while (out.position() < stop) out.keep();
        if (found == std::string_view::npos) break;
        // The replacement takes the alignment of the last replaced byte (tokenizers' replace()).
        size_t chars = 0;
        for (size_t i = found; i < found + length; i += unicode::char_length(s[i])) ++chars;
        out.skip(chars);
        size_t i = 0;
        while (i < content_.size()) out.emit(unicode::next_char(content_, i), 1);
        at = found + length;
      }
    });
  }

 private:
  std::string pattern_, content_;
  size_t min_run_;
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(PreTokenized& text) const override {
    if (prefix_.empty()) return;
    text.rewrite([&](Rewriter& out) {
      std::string_view s = out.source();
      size_t next = 0;
      const char32_t first = unicode::next_char(s, next);
      size_t i = 0;
      bool head = true;
      while (i < prefix_.size()) {
        out.emit(unicode::next_char(prefix_, i), head ? 0 : 1);
        head = false;
      }
      out.emit(first, 1);
      out.keep_rest();
    });
  }

 private:
  std::string prefix_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(PreTokenized& text) const override {
    for (const auto& step : steps_) step->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

bool flag(const json& config, const char* key, bool fallback) {
  auto it = config.find(key);
  return (it == config.end() || it->is_null()) ? fallback : it->get<bool>();
}

std::string string_pattern(const json& config, const std::string& where, const std::string& component) {
  const json& pattern = config.at("pattern");
  if (pattern.contains("String")) return pattern.at("String").get<std::string>();
  throw Error(str(where, ": ", component, " with pattern ", pattern.dump(),
                  " is not supported (only {\"String\": ...} patterns are)"));
}

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& config, const std::string& where) {
  if (config.is_null()) return nullptr;
  const std::string type = config.value("type", "");
  if (type == "BertNormalizer") {
    const bool lowercase = flag(config, "lowercase", true);
    return std::make_unique<BertNormalizer>(flag(config, "clean_text", true),
                                            flag(config, "handle_chinese_chars", true),
                                            flag(config, "strip_accents", lowercase), lowercase);
  }
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(false, false);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(true, false);
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(false, true);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(true, true);
  if (type == "StripAccents") return std::make_unique<StripAccents>();
  if (type == "Strip")
    return std::make_unique<Strip>(flag(config, "strip_left", true), flag(config, "strip_right", true));
  if (type == "Replace") {
    const json& pattern = config.at("pattern");
    if (pattern.contains("Regex") && pattern.at("Regex").is_string()) {
      // "c{n,}" (c a literal character that is no regex syntax): runs of c at least n long.
      const std::string regex = pattern.at("Regex").get<std::string>();
      size_t next = 0;
      const char32_t c = regex.empty() ? 0 : unicode::next_char(regex, next);
      const std::string_view rest = std::string_view(regex).substr(next);
      size_t n = 0;
      const bool literal =
          c != 0 && (c >= 0x80 || std::string_view("\\^$.|?*+()[]{}").find(static_cast<char>(c)) ==
                                      std::string_view::npos);
      if (literal && rest.size() >= 4 && rest.front() == '{' && rest.substr(rest.size() - 2) == ",}" &&
          std::from_chars(rest.data() + 1, rest.data() + rest.size() - 2, n).ptr == rest.data() + rest.size() - 2 &&
          n > 0)
        return std::make_unique<Replace>(regex.substr(0, next), config.value("content", std::string()), n);
      throw Error(str(where, ": Replace normalizer with pattern ", pattern.dump(),
                      " is not supported ({\"String\": ...} patterns and {\"Regex\": \"c{n,}\"} are)"));
    }
    return std::make_unique<Replace>(string_pattern(config, where, "Replace normalizer"),
                                     config.value("content", std::string()));
  }
  if (type == "Prepend") return std::make_unique<Prepend>(config.value("prepend", std::string()));
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const json& step : config.at("normalizers")) {
      if (auto normalizer = make_normalizer(step, where)) steps.push_back(std::move(normalizer));
    }
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  throw Error(str(where, ": normalizer type \"", type,
                  "\" is not supported (supported: BertNormalizer, Lowercase, NFD, NFC, NFKD, NFKC, StripAccents, "
                  "Strip, Replace, Prepend, Sequence)"));
}

}  // namespace fusetrain::data::detail
