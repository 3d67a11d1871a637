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
  explicit Error(const std::string& message) : std::runtime_error(message) {}
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
