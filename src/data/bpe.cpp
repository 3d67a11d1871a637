// BPE: characters (or byte fallbacks, or the unknown token) merged by rank, lowest first, leftmost on ties, as
// tokenizers' Word::merge_all does. Results are cached per thread and model.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>

#include "data/tokenizer_impl.h"
#include "data/unicode.h"
#include "fusetrain/core/error.h"

namespace fusetrain::data::detail {
namespace {

struct Symbol {
  int32_t id;
  int32_t prev, next;  // linked list over the word's symbols; -1 at the ends
  uint32_t length;     // bytes of the word; 0 once merged into its left neighbour
};

struct Merge {
  uint32_t rank, new_id;
};

struct QueueEntry {
  uint32_t rank, position, new_id;
  bool operator>(const QueueEntry& other) const {
    return rank != other.rank ? rank > other.rank : position > other.position;
  }
};

// A cached word: its final symbols as (id, byte length).
using CachedWord = std::vector<std::pair<int32_t, uint32_t>>;

constexpr size_t kCacheCapacity = 10000;  // words per model and thread, as tokenizers' default
constexpr size_t kCacheMaxWordBytes = 256;

std::atomic<uint64_t> next_instance{1};

class Bpe final : public Model {
 public:
  Bpe(StringMap<int64_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
      const std::string& where)
      : vocab_(std::move(vocab)), options_(std::move(options)), where_(where), instance_(next_instance++) {
    by_id_.resize(static_cast<size_t>(checked_max_id(vocab_, where, "BPE") + 1));
    present_.resize(by_id_.size(), 0);
    for (const auto& [token, id] : vocab_) by_id_[id] = token, present_[id] = 1;
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const auto& [a, b] = merges[rank];
      const int64_t a_id = find(a), b_id = find(b);
      FT_CHECK(a_id >= 0, where, ": BPE merge \"", a, " ", b, "\" uses \"", a, "\", which is not in the vocabulary");
      FT_CHECK(b_id >= 0, where, ": BPE merge \"", a, " ", b, "\" uses \"", b, "\", which is not in the vocabulary");
      FT_CHECK(b.size() >= options_.prefix.size(), where, ": BPE merge \"", a, " ", b, "\": \"", b,
               "\" is shorter than the continuing subword prefix");
      const std::string merged = a + b.substr(options_.prefix.size());
      const int64_t new_id = find(merged);
      FT_CHECK(new_id >= 0, where, ": BPE merge \"", a, " ", b, "\" makes \"", merged,
               "\", which is not in the vocabulary");
      merges_[pair_key(static_cast<int32_t>(a_id), static_cast<int32_t>(b_id))] =
          Merge{static_cast<uint32_t>(rank), static_cast<uint32_t>(new_id)};
    }
    if (!options_.unk_token.empty()) unk_id_ = find(options_.unk_token);
    if (options_.byte_fallback) {
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        byte_ids_[b] = static_cast<int32_t>(find(name));
      }
    }
  }

  void tokenize(std::string_view word, std::vector<Token>& out) const override {
    if (options_.ignore_merges) {
      const int64_t id = find(word);
      if (id >= 0) {
        out.push_back(Token{static_cast<int32_t>(id), 0, static_cast<uint32_t>(word.size())});
        return;
      }
    }
    auto& cache = thread_cache();
    if (auto it = cache.find(word); it != cache.end()) {
      emit(it->second, out);
      return;
    }
    thread_local CachedWord result;
    merge_word(word, result);
    emit(result, out);
    if (word.size() < kCacheMaxWordBytes && cache.size() < kCacheCapacity) cache.emplace(std::string(word), result);
  }

  int64_t token_to_id(std::string_view token) const override { return find(token); }
  const std::string* id_to_token(int64_t id) const override {
    return (id >= 0 && id < static_cast<int64_t>(by_id_.size()) && present_[id]) ? &by_id_[id] : nullptr;
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(vocab_.size()); }
  void for_each_token(const std::function<void(const std::string&, int64_t)>& visit) const override {
    for (const auto& [token, id] : vocab_) visit(token, id);
  }
  std::string unk_token() const override { return options_.unk_token; }

 private:
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  int64_t find(std::string_view token) const {
    auto it = vocab_.find(token);
    return it == vocab_.end() ? -1 : it->second;
  }

  static void emit(const CachedWord& symbols, std::vector<Token>& out) {
    uint32_t at = 0;
    for (const auto& [id, length] : symbols) {
      out.push_back(Token{id, at, at + length});
      at += length;
    }
  }

  StringMap<CachedWord>& thread_cache() const {
    // Keyed by a never-reused instance number, so a new model never sees an old model's words.
    thread_local std::unordered_map<uint64_t, StringMap<CachedWord>> caches;
    thread_local uint64_t last_instance = 0;
    thread_local StringMap<CachedWord>* last_cache = nullptr;
    if (last_instance == instance_) return *last_cache;
    if (caches.size() > 16 && !caches.count(instance_)) caches.clear();
    last_instance = instance_;
    last_cache = &caches[instance_];
    return *last_cache;
  }

  void merge_word(std::string_view word, CachedWord& result) const {
    thread_local std::vector<Symbol> symbols;
    thread_local std::string buffer;
    symbols.clear();
    auto add = [&](int32_t id, uint32_t length) {
      const auto index = static_cast<int32_t>(symbols.size());
      if (!symbols.empty()) symbols.back().next = index;
      symbols.push_back(Symbol{id, index - 1, -1, length});
    };
    int32_t pending_unk = -1;  // a run of unknown characters not yet added
    uint32_t pending_length = 0;
    const bool affixes = !options_.prefix.empty() || !options_.suffix.empty();
    size_t i = 0;
    while (i < word.size()) {
      const size_t at = i;
      i += unicode::char_length(static_cast<unsigned char>(word[at]));
      const std::string_view piece = word.substr(at, i - at);
      std::string_view symbol = piece;
      if (affixes && (at > 0 || i == word.size())) {
        buffer.clear();
        if (at > 0) buffer += options_.prefix;
        buffer += piece;
        if (i == word.size()) buffer += options_.suffix;
        symbol = buffer;
      }
      const int64_t id = find(symbol);
      if (id >= 0) {
        if (pending_unk >= 0) add(pending_unk, pending_length), pending_unk = -1;
        add(static_cast<int32_t>(id), static_cast<uint32_t>(piece.size()));
        continue;
      }
      if (options_.byte_fallback) {
        bool all = true;
        for (char b : symbol) all = all && byte_ids_[static_cast<unsigned char>(b)] >= 0;
        if (all) {  // (a pending unknown run stays pending here, as in tokenizers)
          for (char b : symbol) add(byte_ids_[static_cast<unsigned char>(b)], 1);
          continue;
        }
      }
      if (!options_.unk_token.empty()) {
        FT_CHECK(unk_id_ >= 0, where_, ": BPE unknown token \"", options_.unk_token,
                 "\" is missing from the vocabulary");
        if (pending_unk >= 0 && options_.fuse_unk) {
          pending_length += static_cast<uint32_t>(piece.size());
        } else {
          if (pending_unk >= 0) add(pending_unk, pending_length);
          pending_unk = static_cast<int32_t>(unk_id_), pending_length = static_cast<uint32_t>(piece.size());
        }
      }
    }
    if (pending_unk >= 0) add(pending_unk, pending_length);
    merge_all(symbols);
    result.clear();
    for (const Symbol& s : symbols) {
      if (s.length != 0) result.emplace_back(s.id, s.length);
    }
  }

  void merge_all(std::vector<Symbol>& symbols) const {
    thread_local std::vector<QueueEntry> queue;  // a min-heap on (rank, position)
    queue.clear();
    const std::greater<> later;
    auto push = [&](QueueEntry entry) {
      queue.push_back(entry);
      std::push_heap(queue.begin(), queue.end(), later);
    };
    auto lookup = [&](int32_t a, int32_t b) -> const Merge* {
      auto it = merges_.find(pair_key(a, b));
      return it == merges_.end() ? nullptr : &it->second;
    };
    for (size_t k = 0; k + 1 < symbols.size(); ++k) {
      if (const Merge* m = lookup(symbols[k].id, symbols[k + 1].id)) {
        push(QueueEntry{m->rank, static_cast<uint32_t>(k), m->new_id});
      }
    }
    while (!queue.empty()) {
      std::pop_heap(queue.begin(), queue.end(), later);
      const QueueEntry top = queue.back();
      queue.pop_back();
      Symbol& left = symbols[top.position];
      if (left.length == 0 || left.next < 0) continue;
      const Symbol right = symbols[left.next];
      const Merge* current = lookup(left.id, right.id);
      if (current == nullptr || current->new_id != top.new_id) continue;  // an expired entry
      const int32_t right_index = left.next;
      left.id = static_cast<int32_t>(top.new_id);
      left.length += right.length;
      left.next = right.next;
      symbols[right_index].length = 0;
      if (right.next >= 0) symbols[right.next].prev = static_cast<int32_t>(top.position);
      if (left.prev >= 0) {
        if (const Merge* m = lookup(symbols[left.prev].id, left.id)) {
          push(QueueEntry{m->rank, static_cast<uint32_t>(left.prev), m->new_id});
        }
      }
      if (left.next >= 0) {
        if (const Merge* m = lookup(left.id, symbols[left.next].id)) {
          push(QueueEntry{m->rank, top.position, m->new_id});
        }
      }
    }
  }

  StringMap<int64_t> vocab_;
  std::vector<std::string> by_id_;
  std::vector<uint8_t> present_;
  std::unordered_map<uint64_t, Merge> merges_;
  BpeOptions options_;
  std::string where_;
  uint64_t instance_;
  int64_t unk_id_ = -1;
  int32_t byte_ids_[256] = {};
};

}  // namespace

std::unique_ptr<Model> make_bpe(StringMap<int64_t> vocab,
                                const std::vector<std::pair<std::string, std::string>>& merges,
                                const BpeOptions& options, const std::string& where) {
  return std::make_unique<Bpe>(std::move(vocab), merges, options, where);
}

}  // namespace fusetrain::data::detail
