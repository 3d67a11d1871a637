// The Unigram model (SentencePiece's default, and what tokenizers converts SentencePiece unigram models to):
// the segmentation of a piece with the highest total log-probability, found by Viterbi over every vocabulary token
// that starts at each character (a byte trie's common-prefix search). A character no token starts with costs the
// unknown score, min(scores) - 10; consecutive unknown characters are fused into one unknown token, which byte
// fallback (when on) spells as <0xXX> tokens instead. Ties keep the first path found, as tokenizers does.
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

using nlohmann::json;

constexpr double kUnknownPenalty = 10.0;

// Length in bytes of the UTF-8 character that starts with byte c (1 for a stray continuation byte).
size_t char_length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

class Unigram final : public Model {
 public:
  Unigram(std::vector<std::pair<std::string, double>> vocab, int64_t unk_id, bool byte_fallback,
          const std::string& where)
      : vocab_(std::move(vocab)), unk_id_(unk_id), byte_fallback_(byte_fallback) {
    FT_CHECK(unk_id_ < static_cast<int64_t>(vocab_.size()), where, ": Unigram unk_id ", unk_id_,
             " is outside its vocabulary of ", vocab_.size());
    nodes_.push_back(-1);
    for (size_t id = 0; id < vocab_.size(); ++id) {
      const auto& [token, score] = vocab_[id];
      FT_CHECK(std::isfinite(score), where, ": Unigram score of \"", token, "\" is not a finite number");
      by_token_[token] = static_cast<int64_t>(id);  // a repeated token: its last id, as tokenizers keeps it
      min_score_ = std::min(min_score_, score);
      int32_t node = 0;
      for (unsigned char c : token) {
        const uint64_t key = (uint64_t(uint32_t(node)) << 8) | c;
        auto it = children_.find(key);
        if (it == children_.end()) {
          it = children_.emplace(key, static_cast<int32_t>(nodes_.size())).first;
          nodes_.push_back(-1);
        }
        node = it->second;
      }
      if (!token.empty()) nodes_[size_t(node)] = 0;  // a token ends here (its id is looked up by string)
    }
    if (byte_fallback_)
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        auto it = by_token_.find(std::string_view(name));
        byte_ids_[b] = it == by_token_.end() ? -1 : it->second;
      }
    where_ = where;
  }

  void tokenize(std::string_view piece, std::vector<Token>& out) const override {
    const size_t n = piece.size();
    struct Node {
      double score = 0.0;
      int64_t starts_at = -1;
      int64_t id = 0;
    };
    thread_local std::vector<Node> best;
    best.assign(n + 1, Node{});
    const double unk_score = min_score_ - kUnknownPenalty;
    for (size_t at = 0; at < n;) {
      const double here = best[at].score;
      const size_t mblen = std::min(char_length(static_cast<unsigned char>(piece[at])), n - at);
      bool single = false;
      int32_t node = 0;
      for (size_t end = at; end < n; ++end) {
        auto it = children_.find((uint64_t(uint32_t(node)) << 8) | static_cast<unsigned char>(piece[end]));
        if (it == children_.end()) break;
        node = it->second;
        if (nodes_[size_t(node)] < 0) continue;
        const size_t key = end + 1;
        const int64_t id = by_token_.find(piece.substr(at, key - at))->second;
        const double candidate = vocab_[size_t(id)].second + here;
        Node& target = best[key];
        if (target.starts_at < 0 || candidate > target.score) target = Node{candidate, int64_t(at), id};
        if (key - at == mblen) single = true;
      }
      if (!single) {
        Node& target = best[at + mblen];
        const double candidate = unk_score + here;
        if (target.starts_at < 0 || candidate > target.score) target = Node{candidate, int64_t(at), unk_id_};
      }
      at += mblen;
    }
    // Back from the end: (begin, end, id) per token, unknown runs fused.
    thread_local std::vector<std::pair<size_t, size_t>> spans;
    thread_local std::vector<int64_t> ids;
    spans.clear();
    ids.clear();
    for (size_t end = n; end > 0;) {
      const Node& node = best[end];
      const size_t begin = static_cast<size_t>(node.starts_at);
      if (unk_id_ >= 0 && node.id == unk_id_ && !ids.empty() && ids.back() == unk_id_ && spans.back().first == end)
        spans.back().first = begin;  // fuse with the unknown token after it
      else
        spans.emplace_back(begin, end), ids.push_back(node.id);
      end = begin;
    }
    for (size_t k = spans.size(); k-- > 0;) {
      const auto [begin, end] = spans[k];
      const std::string_view text = piece.substr(begin, end - begin);
      auto it = by_token_.find(text);
      if (it != by_token_.end()) {
        out.push_back(Token{static_cast<int32_t>(it->second), uint32_t(begin), uint32_t(end)});
        continue;
      }
      if (byte_fallback_) {
        bool all = true;
        for (char b : text) all = all && byte_ids_[static_cast<unsigned char>(b)] >= 0;
        if (all) {
          for (char b : text)
            out.push_back(Token{static_cast<int32_t>(byte_ids_[static_cast<unsigned char>(b)]), uint32_t(begin),
                                uint32_t(end)});
          continue;
        }
      }
      FT_CHECK(unk_id_ >= 0, where_, ": the Unigram model has no unk_id, and \"", std::string(text),
               "\" is not in its vocabulary");
      out.push_back(Token{static_cast<int32_t>(unk_id_), uint32_t(begin), uint32_t(end)});
    }
  }

  int64_t token_to_id(std::string_view token) const override {
    auto it = by_token_.find(token);
    return it == by_token_.end() ? -1 : it->second;
  }
  const std::string* id_to_token(int64_t id) const override {
    return id >= 0 && id < static_cast<int64_t>(vocab_.size()) ? &vocab_[size_t(id)].first : nullptr;
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(vocab_.size()); }
  void for_each_token(const std::function<void(const std::string&, int64_t)>& visit) const override {
    for (size_t id = 0; id < vocab_.size(); ++id) visit(vocab_[id].first, static_cast<int64_t>(id));
  }
  std::string unk_token() const override { return unk_id_ >= 0 ? vocab_[size_t(unk_id_)].first : std::string(); }

 private:
  std::vector<std::pair<std::string, double>> vocab_;
  StringMap<int64_t> by_token_;
  std::unordered_map<uint64_t, int32_t> children_;  // (node << 8 | byte) -> child node
  std::vector<int32_t> nodes_;                      // per trie node: 0 where a token ends, else -1
  double min_score_ = std::numeric_limits<double>::infinity();
  int64_t unk_id_ = -1;
  bool byte_fallback_ = false;
  int64_t byte_ids_[256] = {};
  std::string where_;
};

}  // namespace

std::unique_ptr<Model> make_unigram(const json& config, const std::string& where) {
  const json& vocab = config.contains("vocab") ? config.at("vocab") : json();
  FT_CHECK(vocab.is_array(), where, ": Unigram \"vocab\" must be a list of [token, score] pairs");
  std::vector<std::pair<std::string, double>> entries;
  entries.reserve(vocab.size());
  for (const json& entry : vocab) {
    FT_CHECK(entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_number(), where,
             ": Unigram vocabulary entry ", entry.dump(), " is not [token, score]");
    entries.emplace_back(entry[0].get<std::string>(), entry[1].get<double>());
  }
  FT_CHECK(static_cast<int64_t>(entries.size()) <= kMaxTokenId, where, ": Unigram vocabulary too large");
  const int64_t unk_id = integer_field(config, "unk_id", -1, str(where, ": Unigram model"), 0, kMaxTokenId);
  return std::make_unique<Unigram>(std::move(entries), unk_id, config.value("byte_fallback", false), where);
}

}  // namespace fusetrain::data::detail
