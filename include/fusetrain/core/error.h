// Errors carry context: what was expected, what was found, and where.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fusetrain {

/// The one exception type the engine throws on bad input or misuse. Its message
/// names the place (file, op, tensor) and what was expected versus found.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(printable(message)) {}

  /// `text` with every control character other than newline and tab written as \xNN: a NUL byte or an escape
  /// sequence read from a file can neither cut the message short nor reach the terminal.
  static std::string printable(const std::string& text) {
    static const char kHex[] = "0123456789abcdef";
    std::string out;
    out.reserve(text.size());
    for (const char c : text) {
      const auto u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) {
        out += "\\x";
        out += kHex[u >> 4];
        out += kHex[u & 15];
      } else {
        out += c;
      }
    }
    return out;
  }
};

/// Concatenates any streamable values into a string: str("x has ", n, " dims").
template <typename... Args>
std::string str(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

/// The items separated by ", ", for lists in messages: "(supported: bert, gpt2)".
inline std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

/// Throws fusetrain::Error with the streamed message when `cond` is false.
#define FT_CHECK(cond, ...)                                               \
  do {                                                                    \
    if (!(cond)) throw ::fusetrain::Error(::fusetrain::str(__VA_ARGS__)); \
  } while (0)

}  // namespace fusetrain

namespace ft = fusetrain;
