#include "data/unicode.h"

#include <algorithm>
#include <array>

namespace fusetrain::data::unicode {
namespace {

struct FlagRun {
  char32_t first;
  uint16_t flags;
};
struct CaseRun {
  char32_t first;
  uint32_t count;
  int32_t delta;
  uint32_t stride;
};
struct Decomposition {
  char32_t cp;
  uint32_t offset;  // into kDecompPool
  uint32_t length;
};
struct CccRun {
  char32_t first, last;
  uint8_t ccc;
};
struct Composition {
  char32_t first, second, composite;
};

#include "data/unicode_tables.inc"

constexpr char32_t kHangulFirst = 0xAC00, kHangulLast = 0xD7A3;
constexpr char32_t kLeadFirst = 0x1100, kVowelFirst = 0x1161, kTrailFirst = 0x11A7;
constexpr int kVowelCount = 21, kTrailCount = 28, kSyllablesPerLead = kVowelCount * kTrailCount;

// Flags of every BMP code point, expanded from the runs at compile time (constant-initialized, so usable from
// any static initializer).
constexpr std::array<uint16_t, 0x10000> expand_bmp_flags() {
  std::array<uint16_t, 0x10000> table{};
  const size_t runs = std::size(kFlagRuns);
  for (size_t r = 0; r < runs && kFlagRuns[r].first < 0x10000; ++r) {
    const char32_t end = r + 1 < runs ? std::min<char32_t>(kFlagRuns[r + 1].first, 0x10000) : 0x10000;
    for (char32_t cp = kFlagRuns[r].first; cp < end; ++cp) table[cp] = kFlagRuns[r].flags;
  }
  return table;
}
}  // namespace

namespace detail {
constexpr std::array<uint16_t, 0x10000> kBmpFlags = expand_bmp_flags();

uint16_t flags_slow(char32_t cp) {
  if (cp > 0x10FFFF) return 0;
  auto it = std::upper_bound(std::begin(kFlagRuns), std::end(kFlagRuns), cp,
                             [](char32_t value, const FlagRun& run) { return value < run.first; });
  return std::prev(it)->flags;
}
}  // namespace detail

size_t encode_utf8(char32_t cp, char* out) {
  if (cp < 0x80) {
    out[0] = static_cast<char>(cp);
    return 1;
  }
  if (cp < 0x800) {
    out[0] = static_cast<char>(0xC0 | (cp >> 6));
    out[1] = static_cast<char>(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = static_cast<char>(0xE0 | (cp >> 12));
    out[1] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out[2] = static_cast<char>(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = static_cast<char>(0xF0 | (cp >> 18));
  out[1] = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
  out[2] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
  out[3] = static_cast<char>(0x80 | (cp & 0x3F));
  return 4;
}

void append_utf8(std::string& out, char32_t cp) {
  char buffer[4];
  out.append(buffer, encode_utf8(cp, buffer));
}

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    char32_t minimum;
    char32_t cp;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      length = 2, minimum = 0x80, cp = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      length = 3, minimum = 0x800, cp = b0 & 0x0F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      length = 4, minimum = 0x10000, cp = b0 & 0x07;
    } else {
      return i;
    }
    if (i + length > n) return i;
    for (size_t k = 1; k < length; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    if (cp < minimum || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += length;
  }
  return std::string_view::npos;
}

int to_lower(char32_t cp, char32_t out[3]) {
  if (cp < 0x80) {
    out[0] = (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
    return 1;
  }
  auto special = std::lower_bound(std::begin(kLowerSpecial), std::end(kLowerSpecial), cp,
                                  [](const char32_t(&row)[4], char32_t value) { return row[0] < value; });
  if (special != std::end(kLowerSpecial) && (*special)[0] == cp) {
    int n = 0;
    for (int k = 1; k < 4 && (*special)[k] != 0; ++k) out[n++] = (*special)[k];
    return n;
  }
  auto it = std::upper_bound(std::begin(kLowerRuns), std::end(kLowerRuns), cp,
                             [](char32_t value, const CaseRun& run) { return value < run.first; });
  out[0] = cp;
  if (it == std::begin(kLowerRuns)) return 1;
  const CaseRun& run = *std::prev(it);
  const char32_t distance = cp - run.first;
  if (distance % run.stride == 0 && distance / run.stride < run.count) {
    out[0] = static_cast<char32_t>(static_cast<int64_t>(cp) + run.delta);
  }
  return 1;
}

namespace {
const Decomposition* find_decomposition(const Decomposition* begin, const Decomposition* end, char32_t cp) {
  auto it = std::lower_bound(begin, end, cp, [](const Decomposition& d, char32_t value) { return d.cp < value; });
  return (it != end && it->cp == cp) ? it : nullptr;
}
}  // namespace

int decompose(char32_t cp, bool compat, char32_t* out) {
  if (cp < 0xC0) {
    if (!compat || cp < 0xA0) return 0;
  }
  if (cp >= kHangulFirst && cp <= kHangulLast) {
    const int index = static_cast<int>(cp - kHangulFirst);
    out[0] = kLeadFirst + index / kSyllablesPerLead;
    out[1] = kVowelFirst + (index % kSyllablesPerLead) / kTrailCount;
    const int trail = index % kTrailCount;
    if (trail == 0) return 2;
    out[2] = kTrailFirst + trail;
    return 3;
  }
  const Decomposition* d = nullptr;
  if (compat) d = find_decomposition(std::begin(kDecompCompat), std::end(kDecompCompat), cp);
  if (d == nullptr) d = find_decomposition(std::begin(kDecompCanonical), std::end(kDecompCanonical), cp);
  if (d == nullptr) return 0;
  std::copy(kDecompPool + d->offset, kDecompPool + d->offset + d->length, out);
  return static_cast<int>(d->length);
}

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  auto it = std::upper_bound(std::begin(kCccRuns), std::end(kCccRuns), cp,
                             [](char32_t value, const CccRun& run) { return value < run.first; });
  if (it == std::begin(kCccRuns)) return 0;
  const CccRun& run = *std::prev(it);
  return cp <= run.last ? run.ccc : 0;
}

char32_t compose(char32_t first, char32_t second) {
  // Hangul: leading consonant + vowel, then (LV syllable) + trailing consonant.
  if (first >= kLeadFirst && first < kLeadFirst + 19 && second >= kVowelFirst && second < kVowelFirst + kVowelCount) {
    return kHangulFirst + ((first - kLeadFirst) * kVowelCount + (second - kVowelFirst)) * kTrailCount;
  }
  if (first >= kHangulFirst && first <= kHangulLast && (first - kHangulFirst) % kTrailCount == 0 &&
      second > kTrailFirst && second < kTrailFirst + kTrailCount) {
    return first + (second - kTrailFirst);
  }
  auto it = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::make_pair(first, second),
                             [](const Composition& c, const std::pair<char32_t, char32_t>& value) {
                               return std::make_pair(c.first, c.second) < value;
                             });
  if (it != std::end(kCompositions) && it->first == first && it->second == second) return it->composite;
  return 0;
}

}  // namespace fusetrain::data::unicode
