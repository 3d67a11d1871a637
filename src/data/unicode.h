// Unicode support for the tokenizer: UTF-8, character classes, lower-casing, decompositions and compositions.
//
// The classes are the ones Hugging Face `tokenizers` uses, measured on it by scripts/gen_unicode_tables.py (the
// library takes them from several Rust crates, each with its own Unicode version), so fusetrain splits text
// exactly as the library does.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fusetrain::data::unicode {

/// Character classes, one bit each (see scripts/gen_unicode_tables.py for where each comes from).
enum Flag : uint16_t {
  kLetter = 1 << 0,          ///< \p{L} in GPT-2's pre-tokenization pattern
  kNumber = 1 << 1,          ///< \p{N} in the same pattern
  kWhitespace = 1 << 2,      ///< White_Space (Rust's char::is_whitespace, the pattern's \s)
  kControl = 1 << 3,         ///< removed by BertNormalizer's clean_text (besides NUL and U+FFFD)
  kPunctuation = 1 << 4,     ///< BertPreTokenizer / Punctuation: ASCII punctuation or Unicode P*
  kMarkNonspacing = 1 << 5,  ///< removed by BertNormalizer's strip_accents (after NFD)
  kWord = 1 << 6,            ///< \w of the Whitespace pre-tokenizer
  kNumeric = 1 << 7,         ///< char::is_numeric (Digits pre-tokenizer)
  kCjk = 1 << 8,             ///< BertNormalizer's "Chinese characters"
  kCombiningMark = 1 << 9,   ///< removed by the StripAccents normalizer
};

namespace detail {
extern const std::array<uint16_t, 0x10000> kBmpFlags;  // constant-initialized in unicode.cpp
uint16_t flags_slow(char32_t cp);
}  // namespace detail

/// The class bits of a code point.
inline uint16_t flags(char32_t cp) { return cp < 0x10000 ? detail::kBmpFlags[cp] : detail::flags_slow(cp); }
inline bool has(char32_t cp, uint16_t flag) { return (flags(cp) & flag) != 0; }
inline bool is_whitespace(char32_t cp) { return has(cp, kWhitespace); }

/// Decodes the UTF-8 character starting at s[i] (which must be a valid boundary of valid UTF-8) and advances i.
inline char32_t next_char(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  if (b0 < 0xE0) {
    char32_t c = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
    i += 2;
    return c;
  }
  if (b0 < 0xF0) {
    char32_t c = ((b0 & 0x0Fu) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) |
                 (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
    i += 3;
    return c;
  }
  char32_t c = ((b0 & 0x07u) << 18) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 12) |
               ((static_cast<unsigned char>(s[i + 2]) & 0x3Fu) << 6) | (static_cast<unsigned char>(s[i + 3]) & 0x3Fu);
  i += 4;
  return c;
}

/// Byte length of the UTF-8 character whose first byte is `lead`.
inline size_t char_length(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

/// Byte length of a code point in UTF-8.
inline size_t utf8_length(char32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

/// Writes cp as UTF-8 into out (room for 4 bytes); returns the number of bytes.
size_t encode_utf8(char32_t cp, char* out);

/// Appends cp as UTF-8.
void append_utf8(std::string& out, char32_t cp);

/// Returns the byte offset of the first invalid UTF-8 sequence in s, or npos when s is valid.
size_t find_invalid_utf8(std::string_view s);

/// Lower-cases cp (Rust's char::to_lowercase): writes 1 to 3 code points to out and returns how many.
int to_lower(char32_t cp, char32_t out[3]);

/// The full decomposition of cp (canonical, or compatibility when `compat`), written to out (room for 18 code
/// points); returns 0 when cp does not decompose. Hangul syllables decompose algorithmically.
int decompose(char32_t cp, bool compat, char32_t* out);

/// Canonical combining class (0 for starters).
uint8_t combining_class(char32_t cp);

/// The primary composite of (first, second), or 0 when the pair does not compose.
char32_t compose(char32_t first, char32_t second);

}  // namespace fusetrain::data::unicode
