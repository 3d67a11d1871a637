// Pre-tokenizers: BertPreTokenizer, ByteLevel (GPT-2's pattern, written out by hand), Whitespace, WhitespaceSplit,
// Punctuation, Digits, Metaspace, Split, CharDelimiterSplit, Sequence.
#include <array>
#include <nlohmann/json.hpp>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

using nlohmann::json;

// The pattern GPT-2 (and tokenizers' ByteLevel) splits on.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Llama 3's (tiktoken cl100k's) pattern, and Qwen2's, which takes one digit at a time instead of up to three.
constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

enum class CharClass { kLetter, kNumber, kSpace, kOther };

inline CharClass classify(char32_t c) {
  const uint16_t f = unicode::flags(c);
  if (f & unicode::kLetter) return CharClass::kLetter;
  if (f & unicode::kNumber) return CharClass::kNumber;
  if (f & unicode::kWhitespace) return CharClass::kSpace;
  return CharClass::kOther;
}

// Matches of GPT-2's pattern in s, covering all of it (every character belongs to one of its alternatives).
// Alternatives are tried in the pattern's order at each position, as a backtracking regex engine does.
void gpt2_matches(std::string_view s, std::vector<Match>& out) {
  out.clear();
  const size_t n = s.size();
  size_t i = 0;
  auto run = [&](size_t from, CharClass cls) {  // end of the run of `cls` characters starting at from
    size_t j = from;
    while (j < n) {
      size_t next = j;
      if (classify(unicode::next_char(s, next)) != cls) break;
      j = next;
    }
    return j;
  };
  while (i < n) {
    const size_t start = i;
    size_t after = i;
    const char32_t c = unicode::next_char(s, after);
    if (c == '\'' && after < n) {
      const std::string_view rest = s.substr(after);
      size_t length = 0;
      if (rest[0] == 's' || rest[0] == 't' || rest[0] == 'm' || rest[0] == 'd') {
        length = 1;
      } else if (rest.size() >= 2 &&
                 (rest.substr(0, 2) == "re" || rest.substr(0, 2) == "ve" || rest.substr(0, 2) == "ll")) {
        length = 2;
      }
      if (length > 0) {
        i = after + length;
        out.push_back(Match{static_cast<uint32_t>(start), static_cast<uint32_t>(i), true});
        continue;
      }
    }
    const CharClass cls = classify(c);
    if (c == ' ' && after < n) {
      size_t probe = after;
      const CharClass next_cls = classify(unicode::next_char(s, probe));
      if (next_cls != CharClass::kSpace) {  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+"
        i = run(after, next_cls);
        out.push_back(Match{static_cast<uint32_t>(start), static_cast<uint32_t>(i), true});
        continue;
      }
    }
    if (cls != CharClass::kSpace) {
      i = run(start, cls);
      out.push_back(Match{static_cast<uint32_t>(start), static_cast<uint32_t>(i), true});
      continue;
    }
    // "\s+(?!\S)": the whole run at the end of the text, else the run less its last character; "\s+" when the
    // run is a single character followed by a non-space.
    const size_t end = run(start, CharClass::kSpace);
    if (end == n) {
      i = end;
    } else {
      size_t last = end - 1;
      while ((static_cast<unsigned char>(s[last]) & 0xC0) == 0x80) --last;
      i = last > start ? last : end;
    }
    out.push_back(Match{static_cast<uint32_t>(start), static_cast<uint32_t>(i), true});
  }
}

// The length of a contraction after an apostrophe, matched case-insensitively as (?i:s|t|re|ve|m|ll|d) (Unicode
// simple case folding: 's' also matches U+017F LATIN SMALL LETTER LONG S), or 0.
size_t contraction_length(std::string_view rest) {
  auto lower = [](char c) { return static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c); };
  if (rest.empty()) return 0;
  const char a = lower(rest[0]);
  if (rest.size() >= 2) {
    const char b = lower(rest[1]);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 2;
  }
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 1;
  if (rest.substr(0, 2) == "\xC5\xBF") return 2;  // ſ, U+017F, folds to s
  return 0;
}

// Matches of Llama 3's pattern (digit runs of up to `max_digits`: 3, or Qwen2's 1) in s, covering all of it, with
// the alternatives tried in the pattern's order at each position as a backtracking regex engine tries them.
void llama3_matches(std::string_view s, int max_digits, std::vector<Match>& out) {
  out.clear();
  const size_t n = s.size();
  auto class_at = [&](size_t at, size_t& next) {
    next = at;
    return classify(unicode::next_char(s, next));
  };
  auto run = [&](size_t from, CharClass cls) {  // end of the run of `cls` characters starting at from
    size_t j = from, next = from;
    while (j < n && class_at(j, next) == cls) j = next;
    return j;
  };
  auto is_newline = [&](size_t at) { return at < n && (s[at] == '\r' || s[at] == '\n'); };
  size_t i = 0;
  auto emit = [&](size_t start, size_t end) {
    out.push_back(Match{static_cast<uint32_t>(start), static_cast<uint32_t>(end), true});
    i = end;
  };
  while (i < n) {
    const size_t start = i;
    size_t after = i;
    const char32_t c = unicode::next_char(s, after);
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (c == '\'') {
      const size_t length = contraction_length(s.substr(after));
      if (length > 0) {
        emit(start, after + length);
        continue;
      }
    }
    const CharClass cls = classify(c);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (cls == CharClass::kLetter) {
      emit(start, run(start, CharClass::kLetter));
      continue;
    }
    size_t probe = after;
    if (cls != CharClass::kNumber && !is_newline(start) && after < n &&
        class_at(after, probe) == CharClass::kLetter) {
      emit(start, run(after, CharClass::kLetter));
      continue;
    }
    // \p{N}{1,max}
    if (cls == CharClass::kNumber) {
      size_t j = start, next = start;
      for (int k = 0; k < max_digits && j < n && class_at(j, next) == CharClass::kNumber; ++k) j = next;
      emit(start, j);
      continue;
    }
    // " ?[^\s\p{L}\p{N}]+[\r\n]*"
    {
      const size_t from = c == ' ' ? after : start;
      size_t end = run(from, CharClass::kOther);
      if (end > from) {
        while (is_newline(end)) ++end;
        emit(start, end);
        continue;
      }
    }
    // c is whitespace. "\s*[\r\n]+": up to the run's last line break.
    const size_t end = run(start, CharClass::kSpace);
    size_t last_break = std::string_view::npos;
    for (size_t j = start; j < end; ++j)
      if (is_newline(j)) last_break = j;
    if (last_break != std::string_view::npos) {
      emit(start, last_break + 1);
      continue;
    }
    // "\s+(?!\S)": the whole run at the end of the text, else the run less its last character; "\s+" when the run
    // is a single character followed by a non-space.
    if (end == n) {
      emit(start, end);
      continue;
    }
    size_t last = end - 1;
    while ((static_cast<unsigned char>(s[last]) & 0xC0) == 0x80) --last;
    emit(start, last > start ? last : end);
  }
}

// Each character for which `is_match` holds is a match of its own (tokenizers' char-predicate pattern).
template <typename Predicate>
void char_matches(std::string_view s, Predicate is_match, std::vector<Match>& out) {
  out.clear();
  size_t last = 0, i = 0;
  while (i < s.size()) {
    const size_t at = i;
    if (is_match(unicode::next_char(s, i))) {
      if (last < at) out.push_back(Match{static_cast<uint32_t>(last), static_cast<uint32_t>(at), false});
      out.push_back(Match{static_cast<uint32_t>(at), static_cast<uint32_t>(i), true});
      last = i;
    }
  }
  if (last < s.size()) out.push_back(Match{static_cast<uint32_t>(last), static_cast<uint32_t>(s.size()), false});
}

// Non-overlapping occurrences of a literal string.
void string_matches(std::string_view s, std::string_view pattern, std::vector<Match>& out) {
  out.clear();
  if (pattern.empty()) {
    out.push_back(Match{0, static_cast<uint32_t>(s.size()), false});
    return;
  }
  size_t last = 0;
  for (size_t found = s.find(pattern); found != std::string_view::npos; found = s.find(pattern, last)) {
    if (last < found) out.push_back(Match{static_cast<uint32_t>(last), static_cast<uint32_t>(found), false});
    out.push_back(Match{static_cast<uint32_t>(found), static_cast<uint32_t>(found + pattern.size()), true});
    last = found + pattern.size();
  }
  if (last < s.size()) out.push_back(Match{static_cast<uint32_t>(last), static_cast<uint32_t>(s.size()), false});
}

std::vector<Match>& scratch_matches() {
  thread_local std::vector<Match> matches;
  return matches;
}

// Prepends `prefix` to each piece still to tokenize for which `wanted(piece)` holds (tokenizers' prepend():
// the prefix and the old first character all take the first character's alignment).
template <typename Wanted>
void prepend_pieces(PreTokenized& text, std::string_view prefix, Wanted wanted) {
  thread_local std::vector<uint8_t> decisions;
  decisions.clear();
  bool any = false;
  for (const Piece& piece : text.pieces) {
    if (piece.added_id >= 0) continue;
    decisions.push_back(wanted(text.view(piece), piece) ? 1 : 0);
    any = any || decisions.back();
  }
  if (!any) return;
  size_t index = 0;  // rewrite() visits the pieces still to tokenize in the same order
  text.rewrite([&](Rewriter& out) {
    if (!decisions[index++]) {
      out.keep_rest();
      return;
    }
    std::string_view s = out.source();
    size_t next = 0;
    const char32_t first = unicode::next_char(s, next);
    size_t i = 0;
    bool head = true;
    while (i < prefix.size()) {
      out.emit(unicode::next_char(prefix, i), head ? 0 : 1);
      head = false;
    }
    out.emit(first, 1);
    out.keep_rest();
  });
}

class BertPreTokenizer final : public PreTokenizer {
 public:
  void pre_tokenize(PreTokenized& text) const override {
    // Whitespace removed, punctuation isolated, in one pass.
    text.split([](std::string_view s, PreTokenized::Cuts& cuts) {
      uint32_t word = 0;
      size_t i = 0;
      while (i < s.size()) {
        const auto at = static_cast<uint32_t>(i);
        const uint16_t f = unicode::flags(unicode::next_char(s, i));
        if (f & unicode::kWhitespace) {
          cuts.add(word, at);
          word = static_cast<uint32_t>(i);
        } else if (f & unicode::kPunctuation) {
          cuts.add(word, at);
          cuts.add(at, static_cast<uint32_t>(i));
          word = static_cast<uint32_t>(i);
        }
      }
      cuts.add(word, static_cast<uint32_t>(s.size()));
    });
  }
};

class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}

  void pre_tokenize(PreTokenized& text) const override {
    if (add_prefix_space_) {
      prepend_pieces(text, space_, [](std::string_view s, const Piece&) { return s[0] != ' '; });
    }
    if (use_regex_) {
      text.split([](std::string_view s, PreTokenized::Cuts& cuts) {
        auto& matches = scratch_matches();
        gpt2_matches(s, matches);
        cuts.add_matches(matches, SplitBehavior::kIsolated);
      });
    }
    // Every byte becomes its printable stand-in; all of a character's bytes keep the character's alignment
    // (tokenizers: the first replaces the character, the others are inserted after it).
    static const std::array<std::string, 256> mapped = [] {
      std::array<std::string, 256> table;
      for (int b = 0; b < 256; ++b) unicode::append_utf8(table[b], byte_to_char()[b]);
      return table;
    }();
    text.rewrite([&](Rewriter& out) {
      std::string_view s = out.source();
      while (out.position() < s.size()) {
        const size_t at = out.position();
        const size_t n = unicode::char_length(static_cast<unsigned char>(s[at]));
        const Align align = out.source_align(at);
        for (size_t k = 0; k < n; ++k) out.write(mapped[static_cast<unsigned char>(s[at + k])], align);
        out.consume(n);
      }
    });
  }

 private:
  bool add_prefix_space_, use_regex_;
  std::string space_ = " ";
};

class Whitespace final : public PreTokenizer {
 public:
  void pre_tokenize(PreTokenized& text) const override {
    // Keeps the matches of \w+|[^\w\s]+, drops the rest (whitespace).
    text.split([](std::string_view s, PreTokenized::Cuts& cuts) {
      size_t i = 0;
      int current = -1;  // 0: word run, 1: symbol run, -1: none
      uint32_t begin = 0;
      while (i < s.size()) {
        const auto at = static_cast<uint32_t>(i);
        const uint16_t f = unicode::flags(unicode::next_char(s, i));
        const int kind = (f & unicode::kWord) ? 0 : (f & unicode::kWhitespace) ? -1 : 1;
        if (kind != current) {
          if (current >= 0) cuts.add(begin, at);
          begin = at;
          current = kind;
        }
      }
      if (current >= 0) cuts.add(begin, static_cast<uint32_t>(s.size()));
    });
  }
};

// Splits on characters for which a predicate holds, with a behavior.
class CharSplit final : public PreTokenizer {
 public:
  CharSplit(std::function<bool(char32_t)> predicate, SplitBehavior behavior)
      : predicate_(std::move(predicate)), behavior_(behavior) {}
  void pre_tokenize(PreTokenized& text) const override {
    text.split([&](std::string_view s, PreTokenized::Cuts& cuts) {
      auto& matches = scratch_matches();
      char_matches(s, predicate_, matches);
      cuts.add_matches(matches, behavior_);
    });
  }

 private:
  std::function<bool(char32_t)> predicate_;
  SplitBehavior behavior_;
};

class Metaspace final : public PreTokenizer {
 public:
  enum class Prepend { kAlways, kFirst, kNever };
  Metaspace(char32_t replacement, Prepend prepend, bool split)
      : replacement_(replacement), prepend_(prepend), split_(split) {
    unicode::append_utf8(replacement_text_, replacement);
  }

  void pre_tokenize(PreTokenized& text) const override {
    // Spaces become the replacement (each taking its space's alignment).
    text.rewrite([&](Rewriter& out) {
      std::string_view s = out.source();
      while (out.position() < s.size()) {
        if (s[out.position()] == ' ') {
          out.skip(1);
          out.emit(replacement_, 1);
        } else {
          out.keep();
        }
      }
    });
    if (prepend_ != Prepend::kNever) {
      const bool first_only = prepend_ == Prepend::kFirst;
      prepend_pieces(text, replacement_text_, [&](std::string_view s, const Piece& piece) {
        return s.substr(0, replacement_text_.size()) != replacement_text_ && (!first_only || piece.origin == 0);
      });
    }
    if (split_) {
      text.split([&](std::string_view s, PreTokenized::Cuts& cuts) {
        auto& matches = scratch_matches();
        string_matches(s, replacement_text_, matches);
        cuts.add_matches(matches, SplitBehavior::kMergedWithNext);
      });
    }
  }

 private:
  char32_t replacement_;
  std::string replacement_text_;
  Prepend prepend_;
  bool split_;
};

class Split final : public PreTokenizer {
 public:
  /// The regular expressions fusetrain implements by hand.
  enum class Regex { kNone, kGpt2, kLlama3, kQwen2 };
  Split(std::string pattern, Regex regex, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), regex_(regex), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(PreTokenized& text) const override {
    text.split([&](std::string_view s, PreTokenized::Cuts& cuts) {
      auto& matches = scratch_matches();
      if (regex_ == Regex::kGpt2) {
        gpt2_matches(s, matches);
      } else if (regex_ == Regex::kLlama3 || regex_ == Regex::kQwen2) {
        llama3_matches(s, regex_ == Regex::kLlama3 ? 3 : 1, matches);
      } else {
        string_matches(s, pattern_, matches);
      }
      if (invert_) {
        for (Match& m : matches) m.is_match = !m.is_match;
      }
      cuts.add_matches(matches, behavior_);
    });
  }

 private:
  std::string pattern_;
  Regex regex_;
  SplitBehavior behavior_;
  bool invert_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(PreTokenized& text) const override {
    for (const auto& step : steps_) step->pre_tokenize(text);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

char32_t single_char(const json& value, const std::string& where, const char* what) {
  const std::string s = value.get<std::string>();
  size_t i = 0;
  FT_CHECK(!s.empty() && unicode::find_invalid_utf8(s) == std::string::npos, where, ": ", what, " ", value.dump(),
           " is not one character");
  const char32_t c = unicode::next_char(s, i);
  FT_CHECK(i == s.size(), where, ": ", what, " ", value.dump(), " is not one character");
  return c;
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& config, const std::string& where) {
  if (config.is_null()) return nullptr;
  const std::string type = config.value("type", "");
  if (type == "BertPreTokenizer") return std::make_unique<BertPreTokenizer>();
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevel>(config.value("add_prefix_space", true), config.value("use_regex", true));
  }
  if (type == "Whitespace") return std::make_unique<Whitespace>();
  if (type == "WhitespaceSplit") {
    return std::make_unique<CharSplit>([](char32_t c) { return unicode::is_whitespace(c); }, SplitBehavior::kRemoved);
  }
  if (type == "Punctuation") {
    const SplitBehavior behavior =
        config.contains("behavior") ? parse_split_behavior(config.at("behavior"), where) : SplitBehavior::kIsolated;
    return std::make_unique<CharSplit>([](char32_t c) { return unicode::has(c, unicode::kPunctuation); }, behavior);
  }
  if (type == "Digits") {
    const bool individual = config.value("individual_digits", false);
    return std::make_unique<CharSplit>([](char32_t c) { return unicode::has(c, unicode::kNumeric); },
                                       individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
  }
  if (type == "CharDelimiterSplit") {
    const char32_t delimiter = single_char(config.at("delimiter"), where, "CharDelimiterSplit delimiter");
    return std::make_unique<CharSplit>([delimiter](char32_t c) { return c == delimiter; }, SplitBehavior::kRemoved);
  }
  if (type == "Metaspace") {
    const char32_t replacement =
        single_char(config.value("replacement", json("\u2581")), where, "Metaspace replacement");
    Metaspace::Prepend prepend = Metaspace::Prepend::kAlways;
    if (config.contains("prepend_scheme")) {
      const std::string scheme = config.at("prepend_scheme").get<std::string>();
      if (scheme == "first") {
        prepend = Metaspace::Prepend::kFirst;
      } else if (scheme == "never") {
        prepend = Metaspace::Prepend::kNever;
      } else {
        FT_CHECK(scheme == "always", where, ": Metaspace prepend_scheme \"", scheme,
                 "\" is not one of always, first, never");
      }
    } else if (!config.value("add_prefix_space", true)) {
      prepend = Metaspace::Prepend::kNever;
    }
    return std::make_unique<Metaspace>(replacement, prepend, config.value("split", true));
  }
  if (type == "Split") {
    const json& pattern = config.at("pattern");
    const SplitBehavior behavior = parse_split_behavior(config.at("behavior"), where);
    const bool invert = config.value("invert", false);
    if (pattern.contains("String")) {
      return std::make_unique<Split>(pattern.at("String").get<std::string>(), Split::Regex::kNone, behavior, invert);
    }
    if (pattern.contains("Regex") && pattern.at("Regex").is_string()) {
      const std::string regex = pattern.at("Regex").get<std::string>();
      if (regex == kGpt2Pattern) return std::make_unique<Split>("", Split::Regex::kGpt2, behavior, invert);
      if (regex == kLlama3Pattern) return std::make_unique<Split>("", Split::Regex::kLlama3, behavior, invert);
      if (regex == kQwen2Pattern) return std::make_unique<Split>("", Split::Regex::kQwen2, behavior, invert);
    }
    throw Error(str(where, ": Split pre-tokenizer pattern ", pattern.dump(),
                    " is not supported (string patterns and the regexes of GPT-2, Llama 3 and Qwen2 are)"));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const json& step : config.at("pretokenizers")) {
      if (auto pre_tokenizer = make_pre_tokenizer(step, where)) steps.push_back(std::move(pre_tokenizer));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  throw Error(str(where, ": pre_tokenizer type \"", type,
                  "\" is not supported (supported: BertPreTokenizer, ByteLevel, Whitespace, WhitespaceSplit, "
                  "Punctuation, Digits, CharDelimiterSplit, Metaspace, Split, Sequence)"));
}

}  // namespace fusetrain::data::detail
