#include "fusetrain/io/json_fields.h"

#include <cmath>

#include "fusetrain/core/error.h"

namespace fusetrain::io {

std::string json_error_text(const nlohmann::json::exception& e) {
  std::string s = e.what();
  if (!s.empty() && s[0] == '[') {
    size_t close = s.find("] ");
    if (close != std::string::npos) s = s.substr(close + 2);
  }
  return s;
}

JsonFields::JsonFields(const nlohmann::json& json, std::string file) : json_(json), file_(std::move(file)) {
  FT_CHECK(json_.is_object(), file_, ": expected a JSON object, found a JSON ", json_.type_name());
}

bool JsonFields::has(const std::string& key) const { return json_.contains(key) && !json_[key].is_null(); }

const nlohmann::json& JsonFields::field(const std::string& key) const {
  FT_CHECK(has(key), file_, ": missing the field \"", key, "\"");
  return json_[key];
}

int64_t JsonFields::integer(const std::string& key, int64_t min, int64_t max) const {
  const nlohmann::json& v = field(key);
  std::optional<int64_t> value;
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) value = v.get<int64_t>();
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) value = static_cast<int64_t>(d);
  }
  FT_CHECK(value, file_, ": \"", key, "\" should be an integer, found ", v.dump());
  const bool unbounded = max == std::numeric_limits<int64_t>::max();
  FT_CHECK(*value >= min && *value <= max, file_, ": \"", key, "\" is ", *value, ", expected ",
           unbounded ? str("at least ", min) : str("a value in [", min, ", ", max, "]"));
  return *value;
}

std::optional<int64_t> JsonFields::optional_integer(const std::string& key, int64_t min, int64_t max) const {
  if (!has(key)) return std::nullopt;
  return integer(key, min, max);
}

std::optional<double> JsonFields::optional_number(const std::string& key, double min, double max) const {
  if (!has(key)) return std::nullopt;
  const nlohmann::json& v = json_[key];
  FT_CHECK(v.is_number(), file_, ": \"", key, "\" should be a number, found ", v.dump());
  const double d = v.get<double>();
  FT_CHECK(std::isfinite(d) && d >= min && d <= max, file_, ": \"", key, "\" is ", d, ", expected ",
           max == std::numeric_limits<double>::max() ? str("a finite number of at least ", min)
                                                     : str("a number in [", min, ", ", max, "]"));
  return d;
}

std::optional<std::string> JsonFields::optional_string(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  const nlohmann::json& v = json_[key];
  FT_CHECK(v.is_string(), file_, ": \"", key, "\" should be a string, found ", v.dump());
  return v.get<std::string>();
}

}  // namespace fusetrain::io
