// Typed, range-checked reads of the fields of a JSON object read from a file, so that a wrong type or value in
// any JSON input is an Error naming the file, the field, what was expected and what was found.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace fusetrain::io {

/// The parser's explanation ("parse error at line 3, column 7: ...") without nlohmann's "[json.exception...] " tag,
/// for errors that name the file themselves.
std::string json_error_text(const nlohmann::json::exception& e);

/// The fields of one JSON object, with the name of the file it came from for errors. Holds a reference: `json`
/// must outlive it.
class JsonFields {
 public:
  /// Throws Error "<file>: expected a JSON object, found a JSON array" when `json` is not an object.
  JsonFields(const nlohmann::json& json, std::string file);

  /// True when the field is present and not null.
  bool has(const std::string& key) const;
  /// A required integer in [min, max] (an integral float such as 3.0 counts).
  int64_t integer(const std::string& key, int64_t min = std::numeric_limits<int64_t>::min(),
                  int64_t max = std::numeric_limits<int64_t>::max()) const;
  /// An optional integer in [min, max]: nullopt when absent or null.
  std::optional<int64_t> optional_integer(const std::string& key, int64_t min = std::numeric_limits<int64_t>::min(),
                                          int64_t max = std::numeric_limits<int64_t>::max()) const;
  /// An optional finite number in [min, max]: nullopt when absent or null.
  std::optional<double> optional_number(const std::string& key, double min = -std::numeric_limits<double>::max(),
                                        double max = std::numeric_limits<double>::max()) const;
  /// An optional string: nullopt when absent or null.
  std::optional<std::string> optional_string(const std::string& key) const;

 private:
  const nlohmann::json& json_;
  std::string file_;
  const nlohmann::json& field(const std::string& key) const;
};

}  // namespace fusetrain::io
