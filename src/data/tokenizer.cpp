// Tokenizer: loading (tokenizer.json or a model directory's vocab files), the encode pipeline, truncation,
// post-processing, batches and decoding.
#include "fusetrain/data/tokenizer.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data {
namespace detail {

using nlohmann::json;

struct TokenizerParts {
  std::string where;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Model> model;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;
  AddedVocabulary added;
  int64_t truncation = 0;
  int64_t file_truncation = 0;
  std::string file_pad_token;
  bool trims_offsets = false;
  std::vector<std::pair<uint16_t, uint16_t>> model_token_whitespace;  // by id, when trims_offsets
  int64_t pad = -1, unk = -1, cls = -1, sep = -1, mask = -1, bos = -1, eos = -1;
  std::vector<int64_t> special_ids;
  int64_t vocab_size = 0;

  int64_t find(std::string_view token) const {
    if (const AddedToken* added_token = added.find(token)) return added_token->id;
    return model->token_to_id(token);
  }
};

namespace {

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in, path, ": cannot open ", what);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

json parse_json(const std::string& text, const std::string& path) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(str(path, ": not valid JSON (", e.what(), ")"));
  }
}

}  // namespace

int64_t json_integer(const json& value, const std::string& what, int64_t min, int64_t max) {
  const bool fits = value.is_number_unsigned() ? value.get<uint64_t>() <= static_cast<uint64_t>(max)
                                               : value.is_number_integer();
  const int64_t v = fits ? value.get<int64_t>() : 0;
  FT_CHECK(fits && v >= min && v <= max, what, " should be an integer in [", min, ", ", max, "], found ",
           value.dump());
  return v;
}

int64_t integer_field(const json& config, const char* key, int64_t fallback, const std::string& what, int64_t min,
                      int64_t max) {
  auto it = config.find(key);
  return it == config.end() || it->is_null() ? fallback : json_integer(*it, str(what, " \"", key, "\""), min, max);
}

namespace {

std::vector<AddedToken> read_added_tokens(const json& config, const std::string& where) {
  std::vector<AddedToken> tokens;
  auto it = config.find("added_tokens");
  if (it == config.end() || it->is_null()) return tokens;
  FT_CHECK(it->is_array(), where, ": \"added_tokens\" is not a list");
  for (const json& entry : *it) {
    AddedToken token;
    FT_CHECK(entry.contains("id") && entry.contains("content"), where, ": added token ", entry.dump(),
             " needs \"id\" and \"content\"");
    token.id = json_integer(entry.at("id"), str(where, ": added token ", entry.dump(), ": \"id\""), 0, kMaxTokenId);
    token.content = entry.at("content").get<std::string>();
    token.special = entry.value("special", false);
    token.single_word = entry.value("single_word", false);
    token.lstrip = entry.value("lstrip", false);
    token.rstrip = entry.value("rstrip", false);
    token.normalized = entry.value("normalized", !token.special);
    if (!token.content.empty()) tokens.push_back(std::move(token));
  }
  return tokens;
}

// Role of special tokens: from the post-processor and well-known names; from_pretrained may override them.
void assign_roles(TokenizerParts& parts) {
  auto first_of = [&](std::initializer_list<const char*> names) -> int64_t {
    for (const char* name : names) {
      const int64_t id = parts.find(name);
      if (id >= 0) return id;
    }
    return -1;
  };
  const std::string unk = parts.model->unk_token();
  parts.unk = unk.empty() ? first_of({"[UNK]", "<unk>", "<|unk|>"}) : parts.find(unk);
  parts.pad = parts.file_pad_token.empty() ? -1 : parts.find(parts.file_pad_token);
  if (parts.pad < 0) parts.pad = first_of({"[PAD]", "<pad>", "<|pad|>", "<|padding|>"});
  parts.mask = first_of({"[MASK]", "<mask>", "<|mask|>"});
  std::vector<std::string> around;
  if (parts.post_processor) around = parts.post_processor->single_special_tokens();
  parts.cls = around.size() >= 1 ? parts.find(around.front()) : -1;
  parts.sep = around.size() >= 2 ? parts.find(around.back()) : -1;
  if (parts.cls < 0) parts.cls = first_of({"[CLS]", "<s>"});
  if (parts.sep < 0) parts.sep = first_of({"[SEP]", "</s>"});
  parts.bos = first_of({"<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>", "<bos>"});
  parts.eos = first_of({"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"});
  if (parts.bos < 0) parts.bos = parts.cls;
  if (parts.eos < 0) parts.eos = parts.sep;
}

std::unique_ptr<TokenizerParts> load(const json& config, const std::string& where) {
  FT_CHECK(config.is_object(), where, ": expected a JSON object at the top level");
  if (auto version = config.find("version"); version != config.end() && version->is_string()) {
    FT_CHECK(version->get<std::string>() == "1.0", where, ": tokenizer.json version \"", version->get<std::string>(),
             "\" is not supported (expected \"1.0\")");
  }
  auto parts = std::make_unique<TokenizerParts>();
  parts->where = where;
  auto section = [&](const char* key) -> const json& {
    static const json null_value;
    auto it = config.find(key);
    return it == config.end() ? null_value : *it;
  };
  parts->normalizer = make_normalizer(section("normalizer"), where);
  parts->pre_tokenizer = make_pre_tokenizer(section("pre_tokenizer"), where);
  parts->model = make_model(section("model"), where);
  parts->post_processor = make_post_processor(section("post_processor"), where);
  parts->decoder = make_decoder(section("decoder"), where);
  if (const json& truncation = section("truncation"); truncation.is_object()) {
    parts->file_truncation = integer_field(truncation, "max_length", 0, str(where, ": \"truncation\""), 0,
                                           std::numeric_limits<int64_t>::max());
  }
  if (const json& padding = section("padding"); padding.is_object()) {
    parts->file_pad_token = padding.value("pad_token", std::string());
  }
  parts->added.build(read_added_tokens(config, where), parts->normalizer.get());

  parts->trims_offsets = parts->post_processor && parts->post_processor->trims_offsets();
  if (parts->trims_offsets) {
    parts->model->for_each_token([&](const std::string& token, int64_t id) {
      if (static_cast<size_t>(id) >= parts->model_token_whitespace.size()) {
        parts->model_token_whitespace.resize(static_cast<size_t>(id) + 1);
      }
      parts->model_token_whitespace[id] = whitespace_ends(token);
    });
  }
  // Vocabulary size with added tokens: the union of the two vocabularies (by token).
  parts->vocab_size = parts->model->vocab_size();
  std::set<int64_t> special;
  for (const AddedToken& token : parts->added.tokens()) {
    if (parts->model->token_to_id(token.content) < 0) ++parts->vocab_size;
    if (token.special) special.insert(token.id);
  }
  assign_roles(*parts);
  if (parts->post_processor) {
    for (const std::string& token : parts->post_processor->single_special_tokens()) {
      const int64_t id = parts->find(token);
      if (id >= 0) special.insert(id);
    }
  }
  parts->special_ids.assign(special.begin(), special.end());
  return parts;
}

// Encodes one sequence up to (not including) post-processing, into `segment`.
void encode_sequence(const TokenizerParts& parts, std::string_view text, int64_t type_id, Segment& segment) {
  const size_t invalid = unicode::find_invalid_utf8(text);
  FT_CHECK(invalid == std::string_view::npos, "tokenizer (", parts.where, "): input text is not valid UTF-8 at byte ",
           invalid);
  FT_CHECK(text.size() < (size_t{1} << 31), "tokenizer (", parts.where, "): input text of ", text.size(),
           " bytes is too long (2 GiB at most)");
  thread_local PreTokenized pieces;
  thread_local std::vector<Token> tokens;
  pieces.reset(text);
  if (!parts.added.empty()) parts.added.split_raw(pieces);
  if (parts.normalizer) parts.normalizer->normalize(pieces);
  if (!parts.added.empty()) parts.added.split_normalized(pieces);
  if (parts.pre_tokenizer) parts.pre_tokenizer->pre_tokenize(pieces);

  segment.clear();
  segment.text = text;
  const bool trims = parts.trims_offsets;
  auto push = [&](int64_t id, std::pair<int64_t, int64_t> offsets, std::pair<uint16_t, uint16_t> ends) {
    segment.ids.push_back(id);
    segment.type_ids.push_back(type_id);
    segment.offsets.push_back(offsets);
    if (trims) segment.leading.push_back(ends.first), segment.trailing.push_back(ends.second);
  };
  for (const Piece& piece : pieces.pieces) {
    if (piece.added_id >= 0) {
      push(piece.added_id, pieces.original(piece.begin, piece.end),
           trims ? whitespace_ends(pieces.view(piece)) : std::pair<uint16_t, uint16_t>{0, 0});
      continue;
    }
    tokens.clear();
    parts.model->tokenize(pieces.view(piece), tokens);
    for (const Token& token : tokens) {
      std::pair<uint16_t, uint16_t> ends{0, 0};
      if (trims && static_cast<size_t>(token.id) < parts.model_token_whitespace.size()) {
        ends = parts.model_token_whitespace[token.id];
      }
      push(token.id, pieces.original(piece.begin + token.begin, piece.begin + token.end), ends);
    }
  }
}

// tokenizers' truncate_encodings with the longest_first strategy (stride 0, from the right).
void truncate(std::vector<Segment>& segments, int64_t max_length) {
  size_t total = 0;
  for (const Segment& s : segments) total += s.size();
  const auto limit = static_cast<size_t>(std::max<int64_t>(max_length, 0));
  if (total <= limit) return;
  if (segments.size() == 1) {
    segments[0].truncate(limit);
    return;
  }
  size_t n1 = segments[0].size(), n2 = segments[1].size();
  const bool swap = n1 > n2;
  if (swap) std::swap(n1, n2);
  n2 = n1 > limit ? n1 : std::max(n1, limit - n1);
  if (n1 + n2 > limit) {
    n1 = limit / 2;
    n2 = n1 + limit % 2;
  }
  if (swap) std::swap(n1, n2);
  segments[0].truncate(n1);
  segments[1].truncate(n2);
}

// Encodes one text or a pair: sequences, truncation, post-processing, and the final layout.
Encoding encode_texts(const TokenizerParts& parts, std::string_view first, const std::string_view* second,
                      bool add_special_tokens) {
  thread_local std::vector<Segment> segments(2);
  thread_local std::vector<Part> layout;
  segments.resize(second ? 2 : 1);
  encode_sequence(parts, first, 0, segments[0]);
  if (second) encode_sequence(parts, *second, 1, segments[1]);
  if (parts.truncation > 0) {
    const size_t added =
        (add_special_tokens && parts.post_processor) ? parts.post_processor->added_tokens(second != nullptr) : 0;
    truncate(segments, parts.truncation - static_cast<int64_t>(added));
  }
  layout.clear();
  for (size_t k = 0; k < segments.size(); ++k) {
    Part part;
    part.sequence = static_cast<int>(k);
    layout.push_back(part);
  }
  if (parts.post_processor) parts.post_processor->process(segments, layout, add_special_tokens);

  size_t total = 0;
  for (const Part& part : layout) {
    total += part.sequence >= 0 ? segments[part.sequence].size() : part.ids ? part.ids->size() : 1;
  }
  Encoding out;
  out.ids.reserve(total), out.type_ids.reserve(total), out.special_tokens_mask.reserve(total);
  out.offsets.reserve(total);
  for (const Part& part : layout) {
    if (part.sequence >= 0) {
      const Segment& s = segments[part.sequence];
      out.ids.insert(out.ids.end(), s.ids.begin(), s.ids.end());
      if (part.type_id < 0) {
        out.type_ids.insert(out.type_ids.end(), s.type_ids.begin(), s.type_ids.end());
      } else {
        out.type_ids.insert(out.type_ids.end(), s.size(), part.type_id);
      }
      out.special_tokens_mask.insert(out.special_tokens_mask.end(), s.size(), 0);
      out.offsets.insert(out.offsets.end(), s.offsets.begin(), s.offsets.end());
      continue;
    }
    const size_t n = part.ids ? part.ids->size() : 1;
    for (size_t k = 0; k < n; ++k) out.ids.push_back(part.ids ? (*part.ids)[k] : part.id);
    out.type_ids.insert(out.type_ids.end(), n, part.type_id);
    out.special_tokens_mask.insert(out.special_tokens_mask.end(), n, 1);
    out.offsets.insert(out.offsets.end(), n, {0, 0});
  }
  return out;
}

// ---- from_pretrained without tokenizer.json: the configuration transformers' converters would write --------

json read_json_if_exists(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) return json();
  return parse_json(read_text_file(path.string(), "JSON file"), path.string());
}

// An option of tokenizer_config.json, special_tokens_map.json or config.json (`options`, read from `file`): null
// when the file or the option is absent. The typed readers throw an Error naming the file and the option.
json option(const json& options, const char* key) {
  auto it = options.is_object() ? options.find(key) : options.end();
  return it == options.end() ? json() : *it;
}

bool bool_option(const json& options, const char* key, bool fallback, const std::string& file) {
  const json value = option(options, key);
  FT_CHECK(value.is_null() || value.is_boolean(), file, ": \"", key, "\" should be true or false, found ",
           value.dump());
  return value.is_null() ? fallback : value.get<bool>();
}

std::string string_option(const json& options, const char* key, const std::string& file) {
  const json value = option(options, key);
  FT_CHECK(value.is_null() || value.is_string(), file, ": \"", key, "\" should be a string, found ", value.dump());
  return value.is_null() ? std::string() : value.get<std::string>();
}

// A special token's content: a string or {"content": "..."}; "" when absent or of another kind.
std::string token_content(const json& options, const char* key, const std::string& file) {
  const json value = option(options, key);
  if (value.is_string()) return value.get<std::string>();
  if (!value.is_object() || !value.contains("content")) return "";
  FT_CHECK(value["content"].is_string(), file, ": \"", key, "\" has a \"content\" that should be a string, found ",
           value["content"].dump());
  return value["content"].get<std::string>();
}

// vocab.json's id of `token`, -1 when absent.
int64_t vocab_id(const json& vocab, const char* token, const std::string& file) {
  return vocab.contains(token) ? json_integer(vocab[token], str(file, ": the id of \"", token, "\""), 0, kMaxTokenId)
                                : -1;
}

json added_token_json(int64_t id, const std::string& content, bool lstrip = false) {
  return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", lstrip},
              {"rstrip", false}, {"normalized", false}, {"special", true}};
}

json wordpiece_config(const std::filesystem::path& dir, const json& tokenizer_config) {
  const std::string path = (dir / "vocab.txt").string();
  std::istringstream lines(read_text_file(path, "vocab.txt"));
  json vocab = json::object();
  std::string line;
  int64_t id = 0;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!vocab.contains(line)) vocab[line] = id;
    ++id;
  }
  const std::string options_file = (dir / "tokenizer_config.json").string();
  const bool lowercase = bool_option(tokenizer_config, "do_lower_case", true, options_file);
  const bool chinese_chars = bool_option(tokenizer_config, "tokenize_chinese_chars", true, options_file);
  const json strip_accents = option(tokenizer_config, "strip_accents");  // null: as lowercase
  FT_CHECK(strip_accents.is_null() || strip_accents.is_boolean(), options_file,
           ": \"strip_accents\" should be true, false or null, found ", strip_accents.dump());
  auto role = [&](const char* key, const char* fallback) {
    std::string content = token_content(tokenizer_config, key, options_file);
    return content.empty() ? std::string(fallback) : content;
  };
  const std::string unk = role("unk_token", "[UNK]"), cls = role("cls_token", "[CLS]"),
                    sep = role("sep_token", "[SEP]");
  const std::string pad = role("pad_token", "[PAD]"), mask = role("mask_token", "[MASK]");
  json added = json::array();
  std::set<int64_t> seen;
  for (const std::string& token : {pad, unk, cls, sep, mask}) {
    if (vocab.contains(token) && seen.insert(vocab[token].get<int64_t>()).second) {
      added.push_back(added_token_json(vocab[token].get<int64_t>(), token));
    }
  }
  FT_CHECK(vocab.contains(cls) && vocab.contains(sep), path, ": vocabulary lacks \"", cls, "\" or \"", sep, "\"");
  json template_single = json::array({{{"SpecialToken", {{"id", cls}, {"type_id", 0}}}},
                                      {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                      {{"SpecialToken", {{"id", sep}, {"type_id", 0}}}}});
  json template_pair = template_single;
  template_pair.push_back({{"Sequence", {{"id", "B"}, {"type_id", 1}}}});
  template_pair.push_back({{"SpecialToken", {{"id", sep}, {"type_id", 1}}}});
  return json{{"version", "1.0"},
              {"added_tokens", added},
              {"normalizer",
               {{"type", "BertNormalizer"},
                {"clean_text", true},
                {"handle_chinese_chars", chinese_chars},
                {"strip_accents", strip_accents},
                {"lowercase", lowercase}}},
              {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
              {"post_processor",
               {{"type", "TemplateProcessing"},
                {"single", template_single},
                {"pair", template_pair},
                {"special_tokens",
                 {{cls, {{"id", cls}, {"ids", {vocab[cls]}}, {"tokens", {cls}}}},
                  {sep, {{"id", sep}, {"ids", {vocab[sep]}}, {"tokens", {sep}}}}}}}},
              {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}}},
              {"model",
               {{"type", "WordPiece"},
                {"unk_token", unk},
                {"continuing_subword_prefix", "##"},
                {"max_input_chars_per_word", 100},
                {"vocab", vocab}}}};
}

json byte_level_bpe_config(const std::filesystem::path& dir, const json& tokenizer_config, bool roberta) {
  const std::string vocab_path = (dir / "vocab.json").string();
  const std::string merges_path = (dir / "merges.txt").string();
  json vocab = parse_json(read_text_file(vocab_path, "vocab.json"), vocab_path);
  FT_CHECK(vocab.is_object(), vocab_path, ": expected an object of token -> id");
  std::istringstream lines(read_text_file(merges_path, "merges.txt"));
  json merges = json::array();
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    merges.push_back(line);
  }
  const std::string options_file = (dir / "tokenizer_config.json").string();
  const bool add_prefix_space = bool_option(tokenizer_config, "add_prefix_space", false, options_file);
  json added = json::array();
  json post;
  if (roberta) {
    std::set<int64_t> seen;
    for (const char* token : {"<s>", "<pad>", "</s>", "<unk>", "<mask>"}) {
      const int64_t id = vocab_id(vocab, token, vocab_path);
      if (id >= 0 && seen.insert(id).second)
        added.push_back(added_token_json(id, token, std::string(token) == "<mask>"));
    }
    FT_CHECK(vocab.contains("<s>") && vocab.contains("</s>"), vocab_path, ": a RoBERTa vocabulary needs <s> and </s>");
    post = {{"type", "RobertaProcessing"},
            {"sep", {"</s>", vocab["</s>"]}},
            {"cls", {"<s>", vocab["<s>"]}},
            {"trim_offsets", bool_option(tokenizer_config, "trim_offsets", true, options_file)},
            {"add_prefix_space", add_prefix_space}};
  } else {
    if (const int64_t id = vocab_id(vocab, "<|endoftext|>", vocab_path); id >= 0)
      added.push_back(added_token_json(id, "<|endoftext|>"));
    post = {{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"trim_offsets", false}};
  }
  return json{{"version", "1.0"},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"use_regex", true}}},
              {"post_processor", post},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"vocab", vocab}, {"merges", merges}}}};
}

// Explicit roles from special_tokens_map.json / tokenizer_config.json win over the guesses.
void apply_role_files(TokenizerParts& parts, const std::filesystem::path& dir, const json& special_tokens_map,
                      const json& tokenizer_config) {
  const std::pair<const json*, std::string> sources[] = {
      {&special_tokens_map, (dir / "special_tokens_map.json").string()},
      {&tokenizer_config, (dir / "tokenizer_config.json").string()}};
  auto role = [&](const char* key, int64_t& id) {
    for (const auto& [source, file] : sources) {
      const std::string content = token_content(*source, key, file);
      if (content.empty()) continue;
      const int64_t found = parts.find(content);
      if (found >= 0) {
        id = found;
        return;
      }
    }
  };
  role("pad_token", parts.pad);
  role("unk_token", parts.unk);
  role("cls_token", parts.cls);
  role("sep_token", parts.sep);
  role("mask_token", parts.mask);
  role("bos_token", parts.bos);
  role("eos_token", parts.eos);
  std::set<int64_t> special(parts.special_ids.begin(), parts.special_ids.end());
  for (int64_t id : {parts.pad, parts.unk, parts.cls, parts.sep, parts.mask, parts.bos, parts.eos}) {
    if (id >= 0) special.insert(id);
  }
  parts.special_ids.assign(special.begin(), special.end());
}

}  // namespace
}  // namespace detail

Tokenizer::Tokenizer(std::unique_ptr<detail::TokenizerParts> parts) : parts_(std::move(parts)) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_file(const std::string& tokenizer_json_path) {
  const std::string text = detail::read_text_file(tokenizer_json_path, "tokenizer file");
  const auto config = detail::parse_json(text, tokenizer_json_path);
  try {
    return std::unique_ptr<Tokenizer>(new Tokenizer(detail::load(config, tokenizer_json_path)));
  } catch (const nlohmann::json::exception& e) {
    throw Error(str(tokenizer_json_path, ": unexpected tokenizer.json content (", e.what(), ")"));
  }
}

std::unique_ptr<Tokenizer> Tokenizer::from_pretrained(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path dir(model_dir);
  FT_CHECK(fs::is_directory(dir), model_dir, ": not a directory");
  const auto tokenizer_config = detail::read_json_if_exists(dir / "tokenizer_config.json");
  const auto special_tokens_map = detail::read_json_if_exists(dir / "special_tokens_map.json");
  std::unique_ptr<Tokenizer> tokenizer;
  if (fs::exists(dir / "tokenizer.json")) {
    tokenizer = from_file((dir / "tokenizer.json").string());
  } else {
    nlohmann::json config;
    std::string where;
    if (fs::exists(dir / "vocab.txt")) {
      where = (dir / "vocab.txt").string();
      config =
          detail::wordpiece_config(dir, tokenizer_config.is_object() ? tokenizer_config : nlohmann::json::object());
    } else if (fs::exists(dir / "vocab.json") && fs::exists(dir / "merges.txt")) {
      where = (dir / "vocab.json").string();
      const auto model_config = detail::read_json_if_exists(dir / "config.json");
      const std::string model_type = detail::string_option(model_config, "model_type", (dir / "config.json").string());
      const std::string tokenizer_class =
          detail::string_option(tokenizer_config, "tokenizer_class", (dir / "tokenizer_config.json").string());
      const bool roberta = model_type == "roberta" || tokenizer_class.find("Roberta") != std::string::npos;
      config = detail::byte_level_bpe_config(
          dir, tokenizer_config.is_object() ? tokenizer_config : nlohmann::json::object(), roberta);
    } else {
      throw Error(
          str(model_dir, ": no tokenizer found (expected tokenizer.json, vocab.txt, or vocab.json with merges.txt)"));
    }
    try {
      tokenizer = std::unique_ptr<Tokenizer>(new Tokenizer(detail::load(config, where)));
    } catch (const nlohmann::json::exception& e) {
      throw Error(str(where, ": unexpected content (", e.what(), ")"));
    }
  }
  detail::apply_role_files(*tokenizer->parts_, dir, special_tokens_map, tokenizer_config);
  return tokenizer;
}

Encoding Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return detail::encode_texts(*parts_, text, nullptr, add_special_tokens);
}

Encoding Tokenizer::encode_pair(std::string_view first, std::string_view second, bool add_special_tokens) const {
  return detail::encode_texts(*parts_, first, &second, add_special_tokens);
}

void Tokenizer::set_truncation(int64_t max_length) {
  FT_CHECK(max_length >= 0, "Tokenizer::set_truncation: max_length is ", max_length, ", expected >= 0");
  parts_->truncation = max_length;
}
int64_t Tokenizer::truncation() const { return parts_->truncation; }
int64_t Tokenizer::file_truncation() const { return parts_->file_truncation; }

std::vector<Encoding> Tokenizer::encode_batch(const std::vector<std::string>& texts, int num_threads) const {
  std::vector<Encoding> out(texts.size());
  const size_t threads =
      std::clamp<size_t>(num_threads < 1 ? 1 : static_cast<size_t>(num_threads), 1, std::max<size_t>(texts.size(), 1));
  if (threads == 1) {
    for (size_t i = 0; i < texts.size(); ++i) out[i] = encode(texts[i]);
    return out;
  }
  // Contiguous blocks of texts per thread; the first error is rethrown after all threads finish.
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (size_t t = 0; t < threads; ++t) {
    const size_t begin = texts.size() * t / threads, end = texts.size() * (t + 1) / threads;
    workers.emplace_back([&, begin, end] {
      try {
        for (size_t i = begin; i < end; ++i) out[i] = encode(texts[i]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& worker : workers) worker.join();
  if (error) std::rethrow_exception(error);
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (const detail::AddedToken* added = parts_->added.find(id)) {
      if (!(skip_special_tokens && added->special)) tokens.push_back(added->decoded);
      continue;
    }
    const std::string* token = parts_->model->id_to_token(id);
    if (token == nullptr) continue;
    if (skip_special_tokens) {
      const detail::AddedToken* added_by_content = parts_->added.find(*token);
      if (added_by_content != nullptr && added_by_content->special) continue;
    }
    tokens.push_back(*token);
  }
  if (!parts_->decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  parts_->decoder->decode_chain(tokens);
  std::string joined;
  for (const std::string& token : tokens) joined += token;
  return joined;
}

int64_t Tokenizer::token_to_id(std::string_view token) const { return parts_->find(token); }

std::string Tokenizer::id_to_token(int64_t id) const {
  if (const detail::AddedToken* added = parts_->added.find(id)) return added->decoded;
  const std::string* token = parts_->model->id_to_token(id);
  return token ? *token : std::string();
}

int64_t Tokenizer::vocab_size() const { return parts_->vocab_size; }
int64_t Tokenizer::pad_id() const { return parts_->pad; }
int64_t Tokenizer::unk_id() const { return parts_->unk; }
int64_t Tokenizer::cls_id() const { return parts_->cls; }
int64_t Tokenizer::sep_id() const { return parts_->sep; }
int64_t Tokenizer::mask_id() const { return parts_->mask; }
int64_t Tokenizer::bos_id() const { return parts_->bos; }
int64_t Tokenizer::eos_id() const { return parts_->eos; }
const std::vector<int64_t>& Tokenizer::special_ids() const { return parts_->special_ids; }

}  // namespace fusetrain::data
