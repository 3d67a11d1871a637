// Datasets: tables read from TSV, CSV, JSON Lines or plain text, and tokenized examples kept in flat buffers.
//
//   Table table = read_table("sst2/train.tsv");                        // columns "label", "sentence"
//   TextDataset train(table, {.text = "sentence", .label = "label"}, tokenize_with(tokenizer),
//                     {.max_length = 128, .num_labels = 2});
//   train.ids(0);                                                      // [CLS] ... [SEP], at most 128 ids
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fusetrain::data {

/// File formats read_table understands.
enum class Format {
  Auto,       ///< chosen from the extension: .tsv, .csv, .jsonl or .json, .txt
  Tsv,        ///< tab-separated with a header row and no quoting, as GLUE writes it
  Csv,        ///< comma-separated with a header row, RFC 4180 quoting (embedded commas, quotes, newlines)
  JsonLines,  ///< one JSON object per line; its keys are the columns
  Text,       ///< plain text: one column "text", one row per line
};

/// Options for read_table and parse_table.
struct ReadOptions {
  /// Text format only: keep empty lines as rows with an empty "text" (as Hugging Face datasets' text loader does)
  /// instead of skipping them.
  bool keep_empty_lines = false;
};

/// A table of strings: the column names and rows with exactly one field per column. Numbers and booleans read
/// from JSON are kept as their text ("3", "0.5", "true"), null as an empty string, arrays and objects as their
/// JSON text (`["EU", "rejects"]`, the words of a token-classification row; `{"text": [...], ...}`, SQuAD's
/// answers).
struct Table {
  /// Where the table came from (the path given to read_table), used to prefix error messages.
  std::string source = "table";
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
  /// The 1-based line of the file where each row starts. May be left empty for tables built by hand; row i is
  /// then reported as line i + 2 (after a header line).
  std::vector<int64_t> row_lines;
  /// JSON Lines only: per row, the JSON kind of each field, one character per column ('s' string, '0' null, '#'
  /// number, 'b' boolean, '[' array, '{' object). Empty for the other formats, whose fields are all text.
  std::vector<std::string> kinds;

  /// Throws Error `<source>:<line>: "prompt" is null; expected a string` when field `column` of row `row` was not a
  /// JSON string (text is never made from null, a number or a list); a list of chat messages is named as such.
  void require_text(size_t row, size_t column) const;
  /// Position of the column named `name`; throws Error `<source>: no column "x" (columns: sentence, label)`.
  size_t column(const std::string& name) const;
  /// Number of rows (the header is not a row).
  size_t num_rows() const { return rows.size(); }
  /// The 1-based line in the source file where row `row` starts.
  int64_t line_of(size_t row) const;
  /// "<source>:<line>" of row `row`, the prefix of errors about that row.
  std::string where(size_t row) const;
};

/// Reads a table from `path`, validating UTF-8 (a UTF-8 byte-order mark at the start is skipped). The format comes
/// from the extension unless given. Throws Error, one clear line each, on: a missing or unreadable file; an empty
/// file (`<path>: empty`); invalid UTF-8 (`<path>:<line>: invalid UTF-8 at byte N`, N the 0-based offset in the
/// file); a row with the wrong number of fields (`<path>:<line>: expected 2 fields, found 3`); malformed CSV
/// quoting; a JSON line that is not an object, or lacks or adds a key; duplicate column names.
/// Blank lines between TSV, CSV and JSON Lines rows are skipped.
Table read_table(const std::string& path, Format format = Format::Auto, const ReadOptions& options = {});

/// The same as read_table, for a file's content already in memory; `source` names it in errors and chooses the
/// format when `format` is Auto.
Table parse_table(std::string_view content, const std::string& source, Format format = Format::Auto,
                  const ReadOptions& options = {});

/// The format an extension stands for (".tsv" -> Tsv, ".csv" -> Csv, ".jsonl"/".json" -> JsonLines,
/// ".txt" -> Text); throws Error naming `path` for any other.
Format format_from_extension(const std::string& path);

/// Byte offset of the first invalid UTF-8 sequence in `bytes` (overlong forms, surrogates, code points above
/// U+10FFFF and truncated sequences are invalid), or nullopt if it is all valid.
std::optional<size_t> find_invalid_utf8(std::string_view bytes);

/// Label value the losses ignore (PyTorch's and transformers' ignore_index).
constexpr int64_t kIgnoreIndex = -100;

/// One example as a tokenizer returns it: ids including the special tokens the tokenizer adds, their segment
/// (token type) ids, 1 where a position holds a special token, and each token's byte span in the text it came
/// from (the first or the second text of a pair). type_ids and special_tokens_mask may be left empty, meaning all
/// 0; offsets may be left empty where nothing needs them (token classification and question answering do).
struct TokenizedText {
  std::vector<int64_t> ids = {};
  std::vector<int64_t> type_ids = {};
  std::vector<uint8_t> special_tokens_mask = {};
  std::vector<std::pair<int64_t, int64_t>> offsets = {};
};

/// The tokenization step datasets use: `text`, and `pair` for sentence-pair datasets, to tokens with the special
/// tokens added and without truncation (datasets truncate, see truncate_tokens). It is called from several threads
/// at once, so it must be safe to call concurrently. Tests pass a fake; real code passes tokenize_with(tokenizer).
using TokenizeFn = std::function<TokenizedText(std::string_view text, std::optional<std::string_view> pair)>;

/// Adapts a data::Tokenizer (anything with `encode(text, add_special_tokens)` and
/// `encode_pair(first, second, add_special_tokens)` returning an Encoding with ids, type_ids and
/// special_tokens_mask) to a TokenizeFn. The tokenizer is held by reference and must outlive the function; leave
/// its own truncation off, since grouped language-modelling data must not be truncated per line.
template <typename TokenizerT>
TokenizeFn tokenize_with(const TokenizerT& tokenizer, bool add_special_tokens = true) {
  return [&tokenizer, add_special_tokens](std::string_view text, std::optional<std::string_view> pair) {
    auto encoding =
        pair ? tokenizer.encode_pair(text, *pair, add_special_tokens) : tokenizer.encode(text, add_special_tokens);
    return TokenizedText{std::move(encoding.ids), std::move(encoding.type_ids), std::move(encoding.special_tokens_mask),
                         std::move(encoding.offsets)};
  };
}

/// Truncates `tokens` to at most `max_length` ids as transformers does with truncation=True: special tokens stay,
/// content tokens are removed from the end. A pair (two runs of content, told apart by their type ids or by the
/// special tokens between them) is truncated "longest_first": the longer side is cut first, both sides end up
/// within one token of each other when both are long. Without special tokens to separate a pair, the content is
/// cut from the end. Offsets, when present, are cut with their tokens. Throws Error if `max_length` cannot hold the
/// special tokens alone.
void truncate_tokens(TokenizedText& tokens, int64_t max_length);

/// Which text of a pair each token came from: 0 (first), 1 (second), or -1 for special tokens. The second text is
/// told apart by its type ids (BERT) or, where type ids are all 0 (RoBERTa), as the second run of content tokens.
std::vector<int8_t> sequence_ids(const TokenizedText& tokens);

/// What a dataset's labels are.
enum class LabelKind {
  None,        ///< no labels
  Class,       ///< one integer class per example
  Regression,  ///< one float per example
  Tokens,      ///< language modelling: the labels are the input ids themselves (collators derive them)
  TokenClasses,  ///< token classification: one class per token, kIgnoreIndex where a token has none
  Spans,         ///< question answering: the answer's start and end token per example
  Targets,       ///< sequence to sequence: each example's target token sequence (its labels; the decoder's
                 ///< inputs are them shifted right)
};

/// Tokenized examples handed over as flat arrays (by the Python Trainer): example i is ids[offsets[i], offsets[i+1]).
struct FlatExamples {
  std::vector<int64_t> offsets = {0};  ///< N + 1 entries: 0, non-decreasing, ending at ids.size()
  std::vector<int64_t> ids = {};
  std::vector<int64_t> type_ids = {};  ///< empty (all 0) or one per id
  LabelKind label_kind = LabelKind::None;
  /// Class: N class ids; TokenClasses: one class (or kIgnoreIndex) per id; Spans: start and end of each example.
  std::vector<int64_t> labels = {};
  std::vector<float> float_labels = {};  ///< Regression: N targets
  /// When > 0, Class and TokenClasses labels must lie in [0, num_labels) (kIgnoreIndex allowed for tokens).
  int64_t num_labels = 0;
  /// When > 0, every id must lie in [0, vocab_size).
  int64_t vocab_size = 0;
  /// Examples whose inputs are not tokens (images): none holds an id, and a Python collator gives each batch's
  /// inputs (pixel_values); the dataset holds their labels.
  bool without_tokens = false;
};

/// Tokenized examples in flat buffers: example i is ids()[offsets[i], offsets[i+1]). The base of TextDataset and
/// LmDataset, and what collators read.
class TokenizedDataset {
 public:
  TokenizedDataset() = default;
  TokenizedDataset(const TokenizedDataset&) = default;
  TokenizedDataset(TokenizedDataset&&) = default;
  TokenizedDataset& operator=(const TokenizedDataset&) = default;
  TokenizedDataset& operator=(TokenizedDataset&&) = default;
  virtual ~TokenizedDataset() = default;
  /// Number of examples.
  int64_t size() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  /// Token ids of example i (special tokens included).
  std::span<const int64_t> ids(int64_t i) const;
  /// Token type ids of example i; empty when every type id in the dataset is 0.
  std::span<const int64_t> type_ids(int64_t i) const;
  /// Number of tokens in example i.
  int64_t length(int64_t i) const;
  /// Length of the longest example (0 for an empty dataset).
  int64_t longest() const { return longest_; }
  /// Total tokens over all examples.
  int64_t num_tokens() const { return static_cast<int64_t>(ids_.size()); }
  /// The offsets array: size() + 1 entries, offsets()[i] the first token of example i.
  const std::vector<int64_t>& offsets() const { return offsets_; }
  /// What the labels are.
  LabelKind label_kind() const { return label_kind_; }
  /// The class of example i (LabelKind::Class only).
  int64_t label(int64_t i) const;
  /// The regression target of example i (LabelKind::Regression only).
  float float_label(int64_t i) const;
  /// The per-token classes of example i, one per id (LabelKind::TokenClasses only).
  std::span<const int64_t> token_labels(int64_t i) const;
  /// The answer's first and last token of example i (LabelKind::Spans only).
  std::pair<int64_t, int64_t> span(int64_t i) const;
  /// The target token ids of example i (LabelKind::Targets only), special tokens included.
  std::span<const int64_t> target(int64_t i) const;
  /// A 64-bit hash of everything a step reads (example boundaries, ids, type ids, labels): the ranks of a
  /// data-parallel job compare it, so files of the same length but other content are refused.
  uint64_t fingerprint() const;

  /// A dataset over `examples`. Throws Error naming the first inconsistency: offsets that do not start at 0, go
  /// down or miss the end of ids; an empty example; type ids or labels of the wrong length; an id or label out of
  /// range.
  static TokenizedDataset from_flat(FlatExamples examples);

 protected:
  /// Appends one example; type ids are materialised only once a non-zero one appears.
  void append(std::span<const int64_t> ids, std::span<const int64_t> type_ids);
  void check_index(int64_t i) const;

  std::vector<int64_t> offsets_{0};
  std::vector<int64_t> ids_;
  std::vector<int64_t> type_ids_;  // empty, or one per entry of ids_
  std::vector<int64_t> labels_;
  std::vector<float> float_labels_;
  std::vector<int64_t> token_labels_;  // TokenClasses: one per entry of ids_; Spans: two per example; Targets: each
                                       // example's target ids, example i at target_offsets_[i, i + 1)
  std::vector<int64_t> target_offsets_{0};
  LabelKind label_kind_ = LabelKind::None;
  int64_t longest_ = 0;
};

/// Which columns of a table a TextDataset reads.
struct TextColumns {
  std::string text = {};       ///< the text (first sentence)
  std::string text_pair = {};  ///< the second sentence of a pair task; empty for single-sentence tasks
  std::string label = {};      ///< the label; empty for unlabelled data (prediction)
};

/// Options for TextDataset.
struct TextDatasetOptions {
  /// Examples longer than this are truncated (special tokens kept), never rejected.
  int64_t max_length = 128;
  /// When > 0, class labels must lie in [0, num_labels).
  int64_t num_labels = 0;
  /// Float labels (regression, e.g. STS-B) instead of integer classes.
  bool regression = false;
  /// Threads tokenizing at once; 0 uses every hardware thread.
  int num_threads = 0;
};

/// A text classification (or regression) dataset: one example per table row, tokenized in parallel and truncated
/// to max_length. Labels are parsed before tokenizing; errors name the row's line: `<file>:<line>: label "pos" is
/// not an integer`, `<file>:<line>: label 3 is out of range [0, 2)`, `<file>:<line>: label "x" is not a number`.
class TextDataset : public TokenizedDataset {
 public:
  TextDataset(const Table& table, const TextColumns& columns, const TokenizeFn& tokenize,
              const TextDatasetOptions& options = {});
  /// num_labels as given, else the largest class label + 1 (0 without class labels).
  int64_t num_labels() const { return num_labels_; }

 private:
  int64_t num_labels_ = 0;
};

/// Which columns of a table a Seq2SeqDataset reads.
struct Seq2SeqColumns {
  std::string source = "source";  ///< the input text
  std::string target = "target";  ///< the target text; empty for unlabelled data
};

/// Options for Seq2SeqDataset.
struct Seq2SeqDatasetOptions {
  int64_t max_length = 128;         ///< sources longer than this are truncated (special tokens kept)
  int64_t max_target_length = 128;  ///< targets likewise (run_translation.py's max_target_length)
  int num_threads = 0;              ///< threads tokenizing at once; 0 uses every hardware thread
};

/// A sequence-to-sequence dataset (translation, summarisation): one example per row, its source and its target
/// each tokenized with the special tokens (T5's and Marian's end of sequence) and truncated, as run_translation.py's
/// `tokenizer(inputs, text_target=targets, truncation=True)` does with one tokenizer.
class Seq2SeqDataset : public TokenizedDataset {
 public:
  Seq2SeqDataset(const Table& table, const Seq2SeqColumns& columns, const TokenizeFn& tokenize,
                 const Seq2SeqDatasetOptions& options = {});
};

/// Options for LmDataset.
struct LmDatasetOptions {
  /// One example per non-blank line, truncated to max_length (run_mlm's --line_by_line). Otherwise all lines are
  /// tokenized, concatenated and cut into blocks of block_size, dropping the remainder (group_texts).
  bool line_by_line = false;
  /// Block length when grouping.
  int64_t block_size = 128;
  /// Example length limit when line by line.
  int64_t max_length = 128;
  /// Grouping only: lines concatenated together before the remainder is dropped; 0 groups all lines at once.
  /// 1000 reproduces transformers' scripts exactly (group_texts runs per datasets.map batch of 1000 lines).
  int64_t lines_per_group = 0;
  /// Threads tokenizing at once; 0 uses every hardware thread.
  int num_threads = 0;
};

/// A language-modelling dataset (causal or masked) from a text column, e.g. read_table("input.txt")'s "text".
/// Every line is tokenized as the tokenizer does it (BERT adds [CLS] ... [SEP] per line, GPT-2 adds nothing).
/// label_kind() is Tokens: collate_padded sets labels to the ids, apply_mlm_mask replaces them for MLM.
class LmDataset : public TokenizedDataset {
 public:
  LmDataset(const Table& table, const std::string& text_column, const TokenizeFn& tokenize,
            const LmDatasetOptions& options = {});
};

/// Which columns of a table a PromptResponseDataset reads.
struct PromptColumns {
  std::string prompt = "prompt";
  std::string response = "response";
};

/// Options for PromptResponseDataset.
struct PromptResponseOptions {
  /// Examples longer than this lose the end of their response.
  int64_t max_length = 128;
  /// Appended to every response (and labelled) when >= 0: the end-of-sequence token the model learns to stop with.
  int64_t eos_id = -1;
  /// Threads tokenizing at once; 0 uses every hardware thread.
  int num_threads = 0;
};

/// Instruction data for a causal LM: each row's prompt tokenized with the tokenizer's special tokens (Llama's <s>),
/// then its response tokenized without them, then eos_id. Only the response and eos carry labels; the prompt's are
/// -100, so the loss is the response's alone. label_kind() is TokenClasses (per-token labels, padded with -100 by
/// the collator). A row whose prompt alone fills max_length leaves nothing to learn: an Error naming the row.
class PromptResponseDataset : public TokenizedDataset {
 public:
  PromptResponseDataset(const Table& table, const PromptColumns& columns, const TokenizeFn& tokenize_prompt,
                        const TokenizeFn& tokenize_response, const PromptResponseOptions& options = {});
};

/// Which columns of a table a TokenClassificationDataset reads: JSON arrays, as run_ner's JSON files hold them.
struct TokenColumns {
  std::string words = "tokens";  ///< the words, e.g. ["EU", "rejects", "German", "call"]
  std::string tags = "ner_tags";  ///< one tag per word, integers or names; empty for unlabelled data
};

/// Options for TokenClassificationDataset.
struct TokenDatasetOptions {
  /// Examples longer than this are truncated (special tokens kept).
  int64_t max_length = 128;
  /// Class names, position = class id: tags given as names must be one of them. Empty: the sorted distinct names
  /// of this table (collect_tag_names), as run_ner builds its label list.
  std::vector<std::string> label_names = {};
  /// When > 0, integer tags must lie in [0, num_labels).
  int64_t num_labels = 0;
  /// Label every sub-token of a word, later ones with I-X where the word's tag is B-X and I-X is a label
  /// (run_ner's --label_all_tokens); otherwise only the first sub-token, the rest ignored.
  bool label_all_tokens = false;
  /// Threads tokenizing at once; 0 uses every hardware thread.
  int num_threads = 0;
};

/// A token-classification (NER, POS) dataset: each row's words, each after one space, are tokenized as one text
/// with offsets (for byte-level BPE this matches transformers' is_split_into_words with add_prefix_space); a word's tag goes to its first token (or all of them), special tokens and the other sub-tokens get
/// kIgnoreIndex, as transformers' run_ner aligns them. The tokenizer must return offsets. Errors name the row:
/// `<file>:<line>: "tokens" is not a JSON array of strings`, `<file>:<line>: 5 words but 4 tags`,
/// `<file>:<line>: tag "B-XYZ" is not one of the labels (O, B-PER, I-PER)`, `<file>:<line>: tag 9 is out of
/// range [0, 5)`.
class TokenClassificationDataset : public TokenizedDataset {
 public:
  TokenClassificationDataset(const Table& table, const TokenColumns& columns, const TokenizeFn& tokenize,
                             const TokenDatasetOptions& options = {});
  /// Number of classes: label_names' size when tags are names, else num_labels or the largest tag + 1.
  int64_t num_labels() const { return num_labels_; }
  /// The class names when tags were names (or given), else empty.
  const std::vector<std::string>& label_names() const { return label_names_; }
  /// The word each token of example i belongs to (0-based), -1 for special tokens.
  std::span<const int64_t> word_ids(int64_t i) const;

 private:
  int64_t num_labels_ = 0;
  std::vector<std::string> label_names_;
  std::vector<int64_t> word_ids_;  // one per entry of ids_
};

/// The sorted distinct tag names in `tags_column` (rows whose tags are integers contribute nothing).
std::vector<std::string> collect_tag_names(const Table& table, const std::string& tags_column);

}  // namespace fusetrain::data
