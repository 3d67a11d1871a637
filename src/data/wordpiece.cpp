// Models: WordPiece and WordLevel, and the model factory make_model (BPE lives in bpe.cpp, Unigram in unigram.cpp).
#include <algorithm>
#include <nlohmann/json.hpp>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

using nlohmann::json;

inline bool is_continuation_byte(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// Vocabulary shared by the models: token -> id and id -> token.
class Vocabulary {
 public:
  Vocabulary(StringMap<int64_t> vocab, const std::string& where, const char* model) : by_token_(std::move(vocab)) {
    by_id_.resize(static_cast<size_t>(checked_max_id(by_token_, where, model) + 1));
    present_.resize(by_id_.size(), 0);
    for (const auto& [token, id] : by_token_) by_id_[id] = token, present_[id] = 1;
  }
  int64_t find(std::string_view token) const {
    auto it = by_token_.find(token);
    return it == by_token_.end() ? -1 : it->second;
  }
  const std::string* token(int64_t id) const {
    return (id >= 0 && id < static_cast<int64_t>(by_id_.size()) && present_[id]) ? &by_id_[id] : nullptr;
  }
  int64_t size() const { return static_cast<int64_t>(by_token_.size()); }
  const StringMap<int64_t>& map() const { return by_token_; }

 private:
  StringMap<int64_t> by_token_;
  std::vector<std::string> by_id_;
  std::vector<uint8_t> present_;
};

// Greedy longest-match-first subwords; a word with no full cover (or too long) becomes the unknown token.
class WordPiece final : public Model {
 public:
  WordPiece(StringMap<int64_t> vocab, std::string unk, std::string prefix, int64_t max_chars, const std::string& where)
      : vocab_(std::move(vocab), where, "WordPiece"), unk_(std::move(unk)), prefix_(std::move(prefix)),
        max_chars_(max_chars) {
    unk_id_ = vocab_.find(unk_);
    for (const auto& [token, id] : vocab_.map()) {
      max_word_bytes_ = std::max(max_word_bytes_, token.size());
      if (token.compare(0, prefix_.size(), prefix_) == 0) {
        const std::string rest = token.substr(prefix_.size());
        max_rest_bytes_ = std::max(max_rest_bytes_, rest.size());
        continuation_.emplace(rest, static_cast<int32_t>(id));
      }
    }
    where_ = where;
  }

  void tokenize(std::string_view word, std::vector<Token>& out) const override {
    const size_t n = word.size();
    size_t chars = 0;
    for (char c : word) chars += is_continuation_byte(c) ? 0 : 1;
    const size_t first = out.size();
    if (static_cast<int64_t>(chars) <= max_chars_) {
      size_t start = 0;
      while (start < n) {
        size_t end = std::min(n, start + (start == 0 ? max_word_bytes_ : max_rest_bytes_));
        while (end < n && is_continuation_byte(word[end])) --end;
        int64_t id = -1;
        while (end > start) {
          const std::string_view piece = word.substr(start, end - start);
          if (start == 0) {
            id = vocab_.find(piece);
          } else {
            auto it = continuation_.find(piece);
            id = it == continuation_.end() ? -1 : it->second;
          }
          if (id >= 0) break;
          --end;
          while (end > start && is_continuation_byte(word[end])) --end;
        }
        if (id < 0) break;
        out.push_back(Token{static_cast<int32_t>(id), static_cast<uint32_t>(start), static_cast<uint32_t>(end)});
        start = end;
      }
      if (start == n) return;
    }
    out.resize(first);
    FT_CHECK(unk_id_ >= 0, where_, ": WordPiece unknown token \"", unk_, "\" is missing from the vocabulary");
    out.push_back(Token{static_cast<int32_t>(unk_id_), 0, static_cast<uint32_t>(n)});
  }

  int64_t token_to_id(std::string_view token) const override { return vocab_.find(token); }
  const std::string* id_to_token(int64_t id) const override { return vocab_.token(id); }
  int64_t vocab_size() const override { return vocab_.size(); }
  void for_each_token(const std::function<void(const std::string&, int64_t)>& visit) const override {
    for (const auto& [token, id] : vocab_.map()) visit(token, id);
  }
  std::string unk_token() const override { return unk_; }

 private:
  Vocabulary vocab_;
  StringMap<int32_t> continuation_;  // tokens that carry the prefix, keyed without it
  std::string unk_, prefix_, where_;
  int64_t max_chars_;
  int64_t unk_id_ = -1;
  size_t max_word_bytes_ = 0, max_rest_bytes_ = 0;
};

// A word is a token or the unknown token.
class WordLevel final : public Model {
 public:
  WordLevel(StringMap<int64_t> vocab, std::string unk, const std::string& where)
      : vocab_(std::move(vocab), where, "WordLevel"), unk_(std::move(unk)), where_(where) {
    unk_id_ = vocab_.find(unk_);
  }
  void tokenize(std::string_view word, std::vector<Token>& out) const override {
    int64_t id = vocab_.find(word);
    if (id < 0) {
      FT_CHECK(unk_id_ >= 0, where_, ": WordLevel unknown token \"", unk_, "\" is missing from the vocabulary");
      id = unk_id_;
    }
    out.push_back(Token{static_cast<int32_t>(id), 0, static_cast<uint32_t>(word.size())});
  }
  int64_t token_to_id(std::string_view token) const override { return vocab_.find(token); }
  const std::string* id_to_token(int64_t id) const override { return vocab_.token(id); }
  int64_t vocab_size() const override { return vocab_.size(); }
  void for_each_token(const std::function<void(const std::string&, int64_t)>& visit) const override {
    for (const auto& [token, id] : vocab_.map()) visit(token, id);
  }
  std::string unk_token() const override { return unk_; }

 private:
  Vocabulary vocab_;
  std::string unk_, where_;
  int64_t unk_id_ = -1;
};

StringMap<int64_t> read_vocab(const json& config, const std::string& where, const char* model) {
  const auto it = config.find("vocab");
  FT_CHECK(it != config.end() && it->is_object(), where, ": ", model, " model has no \"vocab\" object");
  StringMap<int64_t> vocab;
  vocab.reserve(it->size());
  for (const auto& [token, id] : it->items()) {
    FT_CHECK(id.is_number_integer(), where, ": ", model, " vocab entry \"", token, "\" has id ", id.dump(),
             ", expected an integer");
    vocab.emplace(token, id.get<int64_t>());
  }
  return vocab;
}

std::string optional_string(const json& config, const char* key) {
  auto it = config.find(key);
  return (it == config.end() || it->is_null()) ? std::string() : it->get<std::string>();
}

}  // namespace

int64_t checked_max_id(const StringMap<int64_t>& vocab, const std::string& where, const char* model) {
  const int64_t limit = std::min(std::max<int64_t>(2 * static_cast<int64_t>(vocab.size()), 256), int64_t{1} << 31);
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab) {
    FT_CHECK(id >= 0 && id < limit, where, ": ", model, " vocabulary id ", id, " of token \"", token,
             "\" is out of range: ids number the ", vocab.size(), " tokens from 0 (accepted: below ", limit, ")");
    max_id = std::max(max_id, id);
  }
  return max_id;
}

std::unique_ptr<Model> make_wordpiece(StringMap<int64_t> vocab, std::string unk_token, std::string prefix,
                                      int64_t max_input_chars_per_word, const std::string& where) {
  return std::make_unique<WordPiece>(std::move(vocab), std::move(unk_token), std::move(prefix),
                                     max_input_chars_per_word, where);
}

std::unique_ptr<Model> make_model(const json& config, const std::string& where) {
  FT_CHECK(config.is_object(), where, ": \"model\" is missing or not an object");
  std::string type = config.value("type", "");
  if (type.empty()) {
    // Old files leave the type out; tell the models apart by their fields.
    if (config.contains("merges")) {
      type = "BPE";
    } else if (config.contains("continuing_subword_prefix") || config.contains("max_input_chars_per_word")) {
      type = "WordPiece";
    } else if (config.contains("vocab") && config.at("vocab").is_object()) {
      type = "WordLevel";
    } else if (config.contains("vocab") && config.at("vocab").is_array()) {
      type = "Unigram";
    }
  }
  if (type == "Unigram") return make_unigram(config, where);
  if (type == "WordPiece") {
    return make_wordpiece(
        read_vocab(config, where, "WordPiece"), config.value("unk_token", std::string("[UNK]")),
        config.contains("continuing_subword_prefix") && !config.at("continuing_subword_prefix").is_null()
            ? config.at("continuing_subword_prefix").get<std::string>()
            : std::string("##"),
        integer_field(config, "max_input_chars_per_word", 100, str(where, ": WordPiece model"), 0, kMaxTokenId), where);
  }
  if (type == "WordLevel") {
    return std::make_unique<WordLevel>(read_vocab(config, where, "WordLevel"), optional_string(config, "unk_token"),
                                       where);
  }
  if (type == "BPE") {
    auto dropout = config.find("dropout");
    FT_CHECK(dropout == config.end() || dropout->is_null() || dropout->get<double>() == 0.0, where, ": BPE dropout is ",
             dropout->dump(), "; only null (no dropout) is supported");
    std::vector<std::pair<std::string, std::string>> merges;
    if (auto it = config.find("merges"); it != config.end() && !it->is_null()) {
      merges.reserve(it->size());
      for (const json& merge : *it) {
        if (merge.is_string()) {
          const std::string line = merge.get<std::string>();
          const size_t space = line.find(' ');
          FT_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos, where,
                   ": BPE merge \"", line, "\" is not two tokens separated by one space");
          merges.emplace_back(line.substr(0, space), line.substr(space + 1));
        } else {
          FT_CHECK(merge.is_array() && merge.size() == 2, where, ": BPE merge ", merge.dump(),
                   " is neither \"a b\" nor [a, b]");
          merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
        }
      }
    }
    BpeOptions options;
    options.unk_token = optional_string(config, "unk_token");
    options.prefix = optional_string(config, "continuing_subword_prefix");
    options.suffix = optional_string(config, "end_of_word_suffix");
    options.fuse_unk = config.value("fuse_unk", false);
    options.byte_fallback = config.value("byte_fallback", false);
    options.ignore_merges = config.value("ignore_merges", false);
    return make_bpe(read_vocab(config, where, "BPE"), merges, options, where);
  }
  throw Error(str(where, ": model type \"", type, "\" is not supported (supported: WordPiece, BPE, WordLevel, Unigram)"));
}

}  // namespace fusetrain::data::detail
