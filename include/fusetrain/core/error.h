// Errors carry context: what was expected, what was found, and where.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

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

/// Throws fusetrain::Error with the streamed message when `cond` is false.
#define FT_CHECK(cond, ...)                                               \
  do {                                                                    \
    if (!(cond)) throw ::fusetrain::Error(::fusetrain::str(__VA_ARGS__)); \
  } while (0)

}  // namespace fusetrain

namespace ft = fusetrain;
