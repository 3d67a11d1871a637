// The tokenizer's pipeline, shared by the files under src/data/ that implement its stages:
//   added tokens (raw) -> normalizer -> added tokens (normalized) -> pre-tokenizer -> model -> post-processor
// as Hugging Face `tokenizers` runs it, with the same offsets.
//
// Text lives in one buffer per encode call (PreTokenized), cut into pieces. Every byte of the (normalized) text
// carries the byte range of the original input it came from; normalizers and pre-tokenizers rewrite pieces
// through a Rewriter that assigns those ranges by the library's rules, so token offsets match it exactly.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fusetrain/data/tokenizer.h"

namespace fusetrain::data::detail {

/// A string-keyed map that looks up by std::string_view without allocating.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

/// Byte range [start, end) of the original input.
struct Align {
  uint32_t start = 0, end = 0;
};

/// A run of PreTokenized::text: either text still to tokenize, or an added token already matched.
struct Piece {
  uint32_t begin = 0, end = 0;  ///< bytes of PreTokenized::text
  uint32_t origin = 0;          ///< original offset where the piece began when it was cut
  int32_t added_id = -1;        ///< >= 0: the id of the added token this piece is
};

/// Writes a rewritten piece, one character at a time, following `tokenizers`' NormalizedString::transform:
/// change 0 replaces the next source character, -n replaces it and drops n more, +1 inserts a character
/// (which takes the alignment of the source byte just before the read position).
class Rewriter {
 public:
  Rewriter(std::string_view source, const Align* source_align, uint32_t origin, std::string& out,
           std::vector<Align>& out_align)
      : source_(source), source_align_(source_align), origin_(origin), out_(out), out_align_(out_align) {}

  /// Drops `n` characters at the read position (the library's "initial offset").
  void skip(size_t n);
  /// Emits `c` with the given change (see above).
  void emit(char32_t c, int change);
  /// Copies the next source character unchanged (same as emit(c, 0) for the character that is there).
  void keep();
  /// Copies all remaining source characters unchanged.
  void keep_rest();
  /// Copies the next n source bytes (whole characters) unchanged.
  void keep_bytes(size_t n) {
    out_.append(source_.data() + read_, n);
    out_align_.insert(out_align_.end(), source_align_ + read_, source_align_ + read_ + n);
    read_ += n;
  }
  /// Replaces the next source byte (an ASCII character) by the ASCII character c.
  void replace_ascii(char c) {
    out_.push_back(c);
    out_align_.push_back(source_align_[read_++]);
  }
  /// Writes bytes that all take alignment `align` (for rewrites that compute alignments themselves).
  void write(std::string_view bytes, Align align) {
    out_.append(bytes);
    for (size_t k = 0; k < bytes.size(); ++k) out_align_.push_back(align);
  }
  /// Moves the read position over n source bytes (after write()).
  void consume(size_t n) { read_ += n; }
  Align source_align(size_t at) const { return source_align_[at]; }
  size_t position() const { return read_; }
  std::string_view source() const { return source_; }

 private:
  std::string_view source_;
  const Align* source_align_;
  uint32_t origin_;
  std::string& out_;
  std::vector<Align>& out_align_;
  size_t read_ = 0;
};

/// How a split treats the delimiters it finds (tokenizers' SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
SplitBehavior parse_split_behavior(const nlohmann::json& value, const std::string& where);

/// One stretch of a piece found by a pattern: [begin, end) bytes, and whether it is a match (a delimiter).
struct Match {
  uint32_t begin, end;
  bool is_match;
};

/// The text of one encode call and its pieces.
class PreTokenized {
 public:
  /// Starts over with `input` as a single piece (none when it is empty).
  void reset(std::string_view input);

  std::string_view view(const Piece& piece) const {
    return std::string_view(text).substr(piece.begin, piece.end - piece.begin);
  }

  /// Replaces each piece still to tokenize by the pieces `cut(text, out)` reports through out.add(begin, end[,
  /// added_id]), in bytes of that piece. Empty pieces are dropped.
  class Cuts {
   public:
    void add(uint32_t begin, uint32_t end, int32_t added_id = -1);
    /// Adds the pieces a behavior keeps from `matches`, which must cover the piece in order.
    void add_matches(const std::vector<Match>& matches, SplitBehavior behavior);

   private:
    friend class PreTokenized;
    PreTokenized* owner_ = nullptr;
    const Piece* piece_ = nullptr;
  };
  template <typename Cut>
  void split(Cut&& cut) {
    next_pieces_.clear();
    Cuts cuts;
    cuts.owner_ = this;
    for (const Piece& piece : pieces) {
      if (piece.added_id >= 0) {
        next_pieces_.push_back(piece);
        continue;
      }
      cuts.piece_ = &piece;
      cut(view(piece), cuts);
    }
    pieces.swap(next_pieces_);
  }

  /// Rewrites each piece still to tokenize through `rewrite(Rewriter&)`; pieces left empty are dropped.
  template <typename Rewrite>
  void rewrite(Rewrite&& rewrite) {
    next_text_.clear();
    next_align_.clear();
    next_pieces_.clear();
    for (const Piece& piece : pieces) {
      const auto begin = static_cast<uint32_t>(next_text_.size());
      if (piece.added_id >= 0) {
        next_text_.append(text, piece.begin, piece.end - piece.begin);
        next_align_.insert(next_align_.end(), align.begin() + piece.begin, align.begin() + piece.end);
      } else {
        Rewriter writer(view(piece), align.data() + piece.begin, piece.origin, next_text_, next_align_);
        rewrite(writer);
      }
      const auto end = static_cast<uint32_t>(next_text_.size());
      if (end > begin) next_pieces_.push_back(Piece{begin, end, piece.origin, piece.added_id});
    }
    text.swap(next_text_);
    align.swap(next_align_);
    pieces.swap(next_pieces_);
  }

  /// Original byte range of [begin, end) of the text (tokenizers' expand_alignments).
  std::pair<int64_t, int64_t> original(uint32_t begin, uint32_t end) const {
    return {align[begin].start, align[end - 1].end};
  }

  std::string text;
  std::vector<Align> align;  ///< one per byte of text
  std::vector<Piece> pieces;

 private:
  std::string next_text_;
  std::vector<Align> next_align_;
  std::vector<Piece> next_pieces_;
};

// ---- stages -----------------------------------------------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  /// Normalizes every piece still to tokenize.
  virtual void normalize(PreTokenized& text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void pre_tokenize(PreTokenized& text) const = 0;
};

/// A token a model found in a piece: its id and byte range in the piece.
struct Token {
  int32_t id;
  uint32_t begin, end;
};

class Model {
 public:
  virtual ~Model() = default;
  /// Appends the tokens of one piece (never empty) to `out`.
  virtual void tokenize(std::string_view piece, std::vector<Token>& out) const = 0;
  virtual int64_t token_to_id(std::string_view token) const = 0;
  /// The token of an id, nullptr if absent.
  virtual const std::string* id_to_token(int64_t id) const = 0;
  virtual int64_t vocab_size() const = 0;
  /// Every (token, id) of the vocabulary.
  virtual void for_each_token(const std::function<void(const std::string&, int64_t)>& visit) const = 0;
  /// The unknown token, "" if none.
  virtual std::string unk_token() const { return ""; }
};

/// One sequence's tokens while they are post-processed. With offset trimming, `leading` / `trailing` count the
/// whitespace characters (or byte-level "Ġ") at each end of each token's string, and offsets move by characters
/// of `text`, the sequence's input.
struct Segment {
  std::vector<int64_t> ids;
  std::vector<int64_t> type_ids;
  std::vector<std::pair<int64_t, int64_t>> offsets;
  std::vector<uint16_t> leading, trailing;  // empty unless offsets are trimmed
  std::string_view text;
  size_t size() const { return ids.size(); }
  void clear() { ids.clear(), type_ids.clear(), offsets.clear(), leading.clear(), trailing.clear(), text = {}; }
  void truncate(size_t length);
};

/// One run of the final encoding: a sequence (segments[sequence]) or special tokens.
struct Part {
  int sequence = -1;                          ///< >= 0: a sequence
  const std::vector<int64_t>* ids = nullptr;  ///< special tokens, when not a sequence (else `id`)
  int64_t id = -1;
  int64_t type_id = -1;  ///< for a sequence, -1 keeps its own type ids
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  /// How many special tokens process() adds to a single sequence or a pair.
  virtual size_t added_tokens(bool is_pair) const = 0;
  /// Adjusts the sequences (offsets, type ids) and lays out the final encoding; `parts` holds the sequences in
  /// order on entry.
  virtual void process(std::vector<Segment>& segments, std::vector<Part>& parts, bool add_special_tokens) const = 0;
  /// Whether offsets need the leading / trailing whitespace counts.
  virtual bool trims_offsets() const { return false; }
  /// The token strings of the special tokens it adds, in order of appearance for a single sequence.
  virtual std::vector<std::string> single_special_tokens() const { return {}; }
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  /// Transforms the token strings (tokenizers' decode_chain); the result is concatenated.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

// ---- added tokens -----------------------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  std::string decoded;  ///< what id_to_token / decode give: the content, normalized when `normalized`
  int64_t id = -1;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = true;
};

/// Tokens matched in the text before the model sees it: those with normalized=false on the raw text, the others
/// on the normalized text (longest match at the leftmost position, as tokenizers' Aho-Corasick search).
class AddedVocabulary {
 public:
  /// Builds the matchers; normalized tokens are matched in their normalized form.
  void build(std::vector<AddedToken> tokens, const Normalizer* normalizer);
  void split_raw(PreTokenized& text) const { split(text, raw_); }
  void split_normalized(PreTokenized& text) const { split(text, normalized_); }
  const std::vector<AddedToken>& tokens() const { return tokens_; }
  const AddedToken* find(std::string_view content) const;
  const AddedToken* find(int64_t id) const;
  bool empty() const { return tokens_.empty(); }

 private:
  struct Trie {
    struct Node {
      std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
      int32_t token = -1;                                       // index into tokens_
    };
    std::vector<Node> nodes;
    bool first_byte[256] = {};
    void insert(std::string_view pattern, int32_t token);
    /// Longest pattern starting at text[at]: its length and token, or {0, -1}.
    std::pair<size_t, int32_t> longest(std::string_view text, size_t at) const;
  };
  void split(PreTokenized& text, const Trie& trie) const;

  std::vector<AddedToken> tokens_;
  StringMap<size_t> by_content_;
  std::unordered_map<int64_t, size_t> by_id_;
  Trie raw_, normalized_;
};

// ---- factories (src/data/<stage>.cpp); `where` names the file for errors -----------------------------------

/// The largest token or type id a tokenizer.json may hold (ids are 32-bit in the tokenizers library).
constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 1;

/// `value` as an integer in [min, max]; otherwise an Error "<what> should be an integer in [min, max], found <value>".
/// Floats are refused however integral they look: converting one outside int64_t's range would be undefined.
int64_t json_integer(const nlohmann::json& value, const std::string& what, int64_t min, int64_t max);

/// json_integer of config[key] (what: "<what> \"<key>\""), or `fallback` when the key is absent or null.
int64_t integer_field(const nlohmann::json& config, const char* key, int64_t fallback, const std::string& what,
                      int64_t min, int64_t max);

std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& config, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& config, const std::string& where);
std::unique_ptr<Model> make_model(const nlohmann::json& config, const std::string& where);
std::unique_ptr<PostProcessor> make_post_processor(const nlohmann::json& config, const std::string& where);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& config, const std::string& where);

/// The Unigram model of a tokenizer.json "model" section (src/data/unigram.cpp).
std::unique_ptr<Model> make_unigram(const nlohmann::json& config, const std::string& where);
/// Building blocks for from_pretrained (a model directory without tokenizer.json).
std::unique_ptr<Model> make_wordpiece(StringMap<int64_t> vocab, std::string unk_token, std::string prefix,
                                      int64_t max_input_chars_per_word, const std::string& where);
/// Checks the ids of a model's vocabulary and returns the largest (-1 when empty). Models keep an id -> token table
/// sized by the largest id (and BPE stores ids in 32 bits), so ids must be non-negative and below max(2 * size, 256)
/// and 2^31: numbered from 0, with room for gaps but not for an id that would size the table far beyond the
/// vocabulary. `model` names it in errors ("BPE").
int64_t checked_max_id(const StringMap<int64_t>& vocab, const std::string& where, const char* model);
struct BpeOptions {
  std::string unk_token, prefix, suffix;  ///< "" when absent
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
};
std::unique_ptr<Model> make_bpe(StringMap<int64_t> vocab,
                                const std::vector<std::pair<std::string, std::string>>& merges,
                                const BpeOptions& options, const std::string& where);

/// GPT-2's byte-to-character map (printable stand-ins for all 256 bytes) and its inverse (-1: not a byte char).
const std::array<char32_t, 256>& byte_to_char();
int byte_of_char(char32_t c);

/// Counts the whitespace characters (and byte-level "Ġ", standing for a space) at the start and at the end of a
/// token's string (tokenizers' process_offsets; a token of spaces counts at both ends).
std::pair<uint16_t, uint16_t> whitespace_ends(std::string_view token);

}  // namespace fusetrain::data::detail
