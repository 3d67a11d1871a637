// Tokenizers read from Hugging Face tokenizer.json files (or a model directory's vocab files), encoding text to
// the same ids and offsets as the `tokenizers` library.
//
// Supported components (anything else is an Error naming the component and the file):
//   normalizers      BertNormalizer, Lowercase, NFD, NFC, NFKD, NFKC, StripAccents, Strip, Replace (string
//                    pattern), Prepend, Sequence
//   pre_tokenizers   BertPreTokenizer, ByteLevel, Whitespace, WhitespaceSplit, Punctuation, Digits, Metaspace,
//                    Split (string pattern, or GPT-2's regex), Sequence
//   models           WordPiece, BPE (no dropout), WordLevel
//   post_processors  BertProcessing, RobertaProcessing, ByteLevel, TemplateProcessing, Sequence
//   decoders         WordPiece, ByteLevel, Metaspace, BPEDecoder, Replace (string), ByteFallback, Fuse, Strip,
//                    Sequence
//   added_tokens     special and not, with single_word / lstrip / rstrip / normalized
// Unicode data comes from src/data/unicode_tables.inc (scripts/gen_unicode_tables.py), measured on `tokenizers`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fusetrain::data {

/// One encoded sequence (or pair), as the tokenizers library returns it.
struct Encoding {
  std::vector<int64_t> ids;
  std::vector<int64_t> type_ids;
  std::vector<uint8_t> special_tokens_mask;
  std::vector<std::pair<int64_t, int64_t>> offsets;  ///< byte offsets into the input (UTF-8)
};

namespace detail {
struct TokenizerParts;
}

/// A text tokenizer: normalizer, pre-tokenizer, model (WordPiece / BPE / WordLevel), post-processor and decoder,
/// configured from a tokenizer.json. encode, encode_pair, encode_batch and decode may run from many threads at once
/// (set_truncation must not run concurrently with them).
class Tokenizer {
 public:
  /// Reads a tokenizer.json (Hugging Face tokenizers format). Throws Error naming the file and the component
  /// at fault.
  static std::unique_ptr<Tokenizer> from_file(const std::string& tokenizer_json_path);

  /// A model directory: tokenizer.json, else vocab.txt (BERT WordPiece, lower-casing per tokenizer_config.json
  /// "do_lower_case", default true), else vocab.json + merges.txt (GPT-2/RoBERTa byte-level BPE; RoBERTa-style
  /// <s> </s> template when config.json says model_type roberta). Special-token roles are taken from
  /// special_tokens_map.json / tokenizer_config.json when present.
  static std::unique_ptr<Tokenizer> from_pretrained(const std::string& model_dir);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  /// Encodes one text. Throws Error when the text is not valid UTF-8.
  Encoding encode(std::string_view text, bool add_special_tokens = true) const;

  /// Encodes a pair of texts (first gets type id 0, second 1, as the post-processor says).
  Encoding encode_pair(std::string_view first, std::string_view second, bool add_special_tokens = true) const;

  /// Truncation to max_length tokens including special tokens; pairs use "longest_first" as the tokenizers
  /// library. 0 disables. (The tokenizer.json's own "truncation" and "padding" sections are ignored, as
  /// transformers' fast tokenizers do when called without truncation arguments; see file_truncation().)
  void set_truncation(int64_t max_length);
  int64_t truncation() const;

  /// The tokenizer.json's "truncation" max_length, 0 when it has none (reported only, never applied).
  int64_t file_truncation() const;

  /// Encodes texts on `num_threads` threads (results in input order). Threads are started per call, each with
  /// its own BPE word cache: worth it for large batches (thousands of texts), not for a handful.
  std::vector<Encoding> encode_batch(const std::vector<std::string>& texts, int num_threads = 1) const;

  /// Decodes ids to text through the decoder (ids unknown to the vocabulary are skipped).
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const;

  int64_t token_to_id(std::string_view token) const;  ///< -1 if absent
  std::string id_to_token(int64_t id) const;          ///< "" if absent
  int64_t vocab_size() const;                         ///< including added tokens

  /// Special tokens by role, -1 when the tokenizer has none.
  int64_t pad_id() const;
  int64_t unk_id() const;
  int64_t cls_id() const;
  int64_t sep_id() const;
  int64_t mask_id() const;
  int64_t bos_id() const;
  int64_t eos_id() const;

  /// Ids of all special tokens (never masked by MLM collators), ascending.
  const std::vector<int64_t>& special_ids() const;

 private:
  explicit Tokenizer(std::unique_ptr<detail::TokenizerParts> parts);
  std::unique_ptr<detail::TokenizerParts> parts_;
};

}  // namespace fusetrain::data
