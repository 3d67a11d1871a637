// Table readers: TSV (GLUE style, no quoting), CSV (RFC 4180), JSON Lines and plain text, with UTF-8 validation.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "fusetrain/core/error.h"
#include "fusetrain/io/json_fields.h"
#include "fusetrain/data/dataset.h"

namespace fusetrain::data {
namespace {

namespace fs = std::filesystem;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Splits content into lines without their "\n" or "\r\n"; a final newline does not start another line.
std::vector<std::string_view> split_lines(std::string_view content) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start < content.size()) {
    size_t end = content.find('\n', start);
    if (end == std::string_view::npos) end = content.size();
    std::string_view line = content.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    start = end + 1;
  }
  return lines;
}

std::vector<std::string> split_tabs(std::string_view line) {
  std::vector<std::string> fields;
  size_t start = 0;
  while (true) {
    size_t tab = line.find('\t', start);
    if (tab == std::string_view::npos) {
      fields.emplace_back(line.substr(start));
      return fields;
    }
    fields.emplace_back(line.substr(start, tab - start));
    start = tab + 1;
  }
}

void set_header(Table& table, std::vector<std::string> columns, int64_t line) {
  std::set<std::string> seen;
  for (const auto& name : columns)
    FT_CHECK(seen.insert(name).second, table.source, ":", line, ": duplicate column \"", name, "\"");
  table.columns = std::move(columns);
}

void add_row(Table& table, std::vector<std::string> fields, int64_t line) {
  FT_CHECK(fields.size() == table.columns.size(), table.source, ":", line, ": expected ", table.columns.size(),
           " fields, found ", fields.size());
  table.rows.push_back(std::move(fields));
  table.row_lines.push_back(line);
}

void parse_tsv(Table& table, std::string_view content) {
  std::vector<std::string_view> lines = split_lines(content);
  size_t first = 0;
  while (is_blank(lines[first])) ++first;  // content is not blank, so a header line exists
  set_header(table, split_tabs(lines[first]), static_cast<int64_t>(first) + 1);
  for (size_t i = first + 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    add_row(table, split_tabs(lines[i]), static_cast<int64_t>(i) + 1);
  }
}

// RFC 4180: fields separated by commas, records by CRLF or LF; a field in double quotes may hold commas, newlines
// and doubled quotes (""). A quote inside an unquoted field is kept literally, as Python's csv module does.
void parse_csv(Table& table, std::string_view content) {
  int64_t line = 1;
  size_t i = 0;
  bool header_done = false;
  while (i < content.size()) {
    int64_t record_line = line;
    std::vector<std::string> fields;
    std::string field;
    bool record_is_empty = true;  // a record that is one empty unquoted field: a blank line, skipped
    while (true) {
      if (i < content.size() && content[i] == '"') {  // quoted field
        record_is_empty = false;
        int64_t quote_line = line;
        ++i;
        while (true) {
          FT_CHECK(i < content.size(), table.source, ":", quote_line, ": unterminated quoted field");
          char c = content[i++];
          if (c == '"') {
            if (i < content.size() && content[i] == '"') {
              field += '"';
              ++i;
            } else {
              break;
            }
          } else {
            if (c == '\n') ++line;
            field += c;
          }
        }
        bool at_end = i == content.size() || content[i] == ',' || content[i] == '\n' ||
                      (content[i] == '\r' && (i + 1 == content.size() || content[i + 1] == '\n'));
        FT_CHECK(at_end, table.source, ":", line, ": unexpected character '", content[i],
                 "' after a closing quote (a quote inside a quoted field is written \"\")");
      } else {  // unquoted field
        while (i < content.size() && content[i] != ',' && content[i] != '\n') field += content[i++];
        if (!field.empty() && field.back() == '\r' && (i == content.size() || content[i] == '\n')) field.pop_back();
        if (!field.empty()) record_is_empty = false;
      }
      fields.push_back(std::move(field));
      field.clear();
      if (i < content.size() && content[i] == ',') {
        record_is_empty = false;
        ++i;
        continue;
      }
      if (i < content.size() && content[i] == '\r') ++i;  // CR of a CRLF after a quoted field
      if (i < content.size() && content[i] == '\n') {
        ++i;
        ++line;
      }
      break;
    }
    if (record_is_empty) continue;
    if (!header_done) {
      set_header(table, std::move(fields), record_line);
      header_done = true;
    } else {
      add_row(table, std::move(fields), record_line);
    }
  }
}

char json_kind(const nlohmann::ordered_json& value) {
  if (value.is_string()) return 's';
  if (value.is_null()) return '0';
  if (value.is_number()) return '#';
  if (value.is_boolean()) return 'b';
  return value.is_array() ? '[' : '{';
}

std::string field_text(const nlohmann::ordered_json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_null()) return "";
  return value.dump();  // numbers as JSON writes them (3, 0.5, 1e+20), booleans as true/false, arrays and objects
}

void parse_json_lines(Table& table, std::string_view content) {
  std::vector<std::string_view> lines = split_lines(content);
  for (size_t i = 0; i < lines.size(); ++i) {
    if (is_blank(lines[i])) continue;
    int64_t line = static_cast<int64_t>(i) + 1;
    size_t start = lines[i].find_first_not_of(" \t");
    FT_CHECK(table.columns.size() > 0 || lines[i][start] != '[', table.source, ":", line,
             ": expected one JSON object per line (JSON Lines), found the start of an array");
    nlohmann::ordered_json object;
    try {
      object = nlohmann::ordered_json::parse(lines[i]);
    } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers too large for a double (406)
      throw Error(str(table.source, ":", line, ": invalid JSON: ", io::json_error_text(e)));
    }
    FT_CHECK(object.is_object(), table.source, ":", line, ": expected a JSON object, found ", object.type_name());
    if (table.columns.empty()) {
      std::vector<std::string> columns;
      for (const auto& [key, value] : object.items()) columns.push_back(key);
      FT_CHECK(!columns.empty(), table.source, ":", line, ": the first object has no keys");
      set_header(table, std::move(columns), line);
    }
    std::vector<std::string> fields;
    fields.reserve(table.columns.size());
    std::string kinds;
    for (const auto& name : table.columns) {
      auto it = object.find(name);
      if (it == object.end()) {
        std::vector<std::string> keys;
        for (const auto& [key, value] : object.items()) keys.push_back(key);
        throw Error(str(table.source, ":", line, ": no key \"", name, "\", which the first object (line ",
                        table.row_lines.empty() ? line : table.row_lines[0],
                        ") has; every line needs the same keys (this line's: ",
                        keys.empty() ? std::string("none") : join(keys), ")"));
      }
      fields.push_back(field_text(*it));
      kinds += json_kind(*it);
    }
    for (const auto& [key, value] : object.items())
      FT_CHECK(std::find(table.columns.begin(), table.columns.end(), key) != table.columns.end(), table.source, ":",
               line, ": unexpected key \"", key, "\" (keys of the first object: ", join(table.columns), ")");
    add_row(table, std::move(fields), line);
    table.kinds.push_back(std::move(kinds));
  }
}

void parse_text(Table& table, std::string_view content, const ReadOptions& options) {
  table.columns = {"text"};
  std::vector<std::string_view> lines = split_lines(content);
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty() && !options.keep_empty_lines) continue;
    table.rows.push_back({std::string(lines[i])});
    table.row_lines.push_back(static_cast<int64_t>(i) + 1);
  }
}

}  // namespace

size_t Table::column(const std::string& name) const {
  auto it = std::find(columns.begin(), columns.end(), name);
  FT_CHECK(it != columns.end(), source, ": no column \"", name, "\" (columns: ", join(columns), ")");
  return static_cast<size_t>(it - columns.begin());
}

int64_t Table::line_of(size_t row) const {
  return row < row_lines.size() ? row_lines[row] : static_cast<int64_t>(row) + 2;
}

std::string Table::where(size_t row) const { return str(source, ":", line_of(row)); }

void Table::require_text(size_t row, size_t column) const {
  if (row >= kinds.size() || column >= kinds[row].size() || kinds[row][column] == 's') return;
  const char kind = kinds[row][column];
  const std::string& name = columns[column];
  if (kind == '[' && rows[row][column].find("\"role\"") != std::string::npos)
    throw Error(str(where(row), ": \"", name, "\" is a list of chat messages; expected a string. Format the "
                    "conversation into text first (the tokenizer's chat template: tokenizer.apply_chat_template(messages, "
                    "tokenize=False)) and train on that"));
  const char* what = kind == '0' ? "null" : kind == '#' ? "a number" : kind == 'b' ? "a boolean"
                     : kind == '[' ? "a JSON array" : "a JSON object";
  throw Error(str(where(row), ": \"", name, "\" is ", what, "; expected a string (text is never made from ",
                  kind == '0' ? "null: an absent text is refused, not read as empty)" : "another JSON value)"));
}

std::optional<size_t> find_invalid_utf8(std::string_view bytes) {
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    unsigned char low = 0x80, high = 0xBF;  // allowed range of the second byte (Unicode 15, table 3-7)
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) low = 0xA0;   // no overlong forms
      if (c == 0xED) high = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) low = 0x90;   // no overlong forms
      if (c == 0xF4) high = 0x8F;  // nothing above U+10FFFF
    } else {
      return i;
    }
    if (i + 1 >= n || s[i + 1] < low || s[i + 1] > high) return i;
    for (size_t k = 2; k < length; ++k)
      if (i + k >= n || (s[i + k] & 0xC0) != 0x80) return i;
    i += length;
  }
  return std::nullopt;
}

Format format_from_extension(const std::string& path) {
  std::string extension = lower(fs::path(path).extension().string());
  if (extension == ".tsv") return Format::Tsv;
  if (extension == ".csv") return Format::Csv;
  if (extension == ".jsonl" || extension == ".json") return Format::JsonLines;
  if (extension == ".txt") return Format::Text;
  throw Error(str(path, ": cannot tell the format from the extension \"", extension,
                  "\" (expected .tsv, .csv, .jsonl, .json or .txt); pass the format explicitly"));
}

Table parse_table(std::string_view content, const std::string& source, Format format, const ReadOptions& options) {
  if (format == Format::Auto) format = format_from_extension(source);
  if (content.substr(0, 3) == "\xEF\xBB\xBF") content.remove_prefix(3);  // byte-order mark
  if (auto bad = find_invalid_utf8(content)) {
    int64_t line = 1 + std::count(content.begin(), content.begin() + static_cast<std::ptrdiff_t>(*bad), '\n');
    throw Error(str(source, ":", line, ": invalid UTF-8 at byte ", *bad));
  }
  FT_CHECK(!is_blank(content), source, ": empty");
  Table table;
  table.source = source;
  switch (format) {
    case Format::Tsv:
      parse_tsv(table, content);
      break;
    case Format::Csv:
      parse_csv(table, content);
      break;
    case Format::JsonLines:
      parse_json_lines(table, content);
      break;
    case Format::Text:
      parse_text(table, content, options);
      break;
    case Format::Auto:
      break;  // resolved above
  }
  return table;
}

Table read_table(const std::string& path, Format format, const ReadOptions& options) {
  if (format == Format::Auto) format = format_from_extension(path);
  std::error_code error;
  fs::file_status status = fs::status(path, error);
  FT_CHECK(fs::exists(status), path, ": no such file");
  FT_CHECK(!fs::is_directory(status), path, ": is a directory, expected a file");
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in, path, ": cannot open for reading");
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FT_CHECK(!in.bad(), path, ": read failed");
  return parse_table(content, path, format, options);
}

}  // namespace fusetrain::data
