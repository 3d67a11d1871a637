// A training data file: data::parse_table, then the dataset builder of one task, its collator, and for question
// answering the answer decoding and SQuAD metrics. Three header bytes, then the file:
//   byte 0  format  ('0' + k, k % 4): 0 TSV, 1 CSV, 2 JSON Lines, 3 plain text
//   byte 1  task    ('0' + k, k % 5): 0 seq-cls, 1 token-cls, 2 qa, 3 mlm, 4 clm
//   byte 2  options (bits): 1 byte-level BPE tokenizer (else WordPiece); 2 the task's variant (regression,
//           label_all_tokens, line_by_line); 4 short sequences (max_length 8, for question answering 24 with
//           doc_stride 2, and language-model groups of 2 lines); 8 num_labels 3; 16 keep empty lines (text)
// Columns are taken by the task's usual names when the table has them ("label", "ner_tags", "question", ...),
// otherwise by position, so a mutated header still reaches the builders.
#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "fusetrain/data/collator.h"
#include "fusetrain/data/dataset.h"
#include "fusetrain/data/qa.h"
#include "fusetrain/data/tokenizer.h"

namespace {

namespace data = fusetrain::data;
namespace fuzz = fusetrain::fuzz;

struct Tokenizers {
  std::unique_ptr<data::Tokenizer> wordpiece, byte_level;
};

Tokenizers make_tokenizers() {
  const std::filesystem::path wordpiece = fuzz::scratch_dir() / "wordpiece", byte_level = fuzz::scratch_dir() / "bpe";
  std::filesystem::create_directories(wordpiece);
  std::filesystem::create_directories(byte_level);
  fuzz::write_wordpiece_files(wordpiece);
  fuzz::write_byte_level_files(byte_level);
  return {data::Tokenizer::from_pretrained(wordpiece.string()), data::Tokenizer::from_pretrained(byte_level.string())};
}

bool has(const data::Table& table, const std::string& name) {
  return std::find(table.columns.begin(), table.columns.end(), name) != table.columns.end();
}

// The column called `name`, else the table's column `position`, else "" (the builder then reports it missing).
std::string column(const data::Table& table, const std::string& name, size_t position) {
  if (has(table, name)) return name;
  return position < table.columns.size() ? table.columns[position] : "";
}

// Reads every accessor of every example, so an inconsistent dataset shows up as an Error or under ASan.
void read_all(const data::TokenizedDataset& dataset) {
  for (int64_t i = 0; i < dataset.size(); ++i) {
    fuzz::sink = fuzz::sink + dataset.ids(i).size() + dataset.type_ids(i).size() + dataset.length(i);
    switch (dataset.label_kind()) {
      case data::LabelKind::Class:
        fuzz::sink = fuzz::sink + dataset.label(i);
        break;
      case data::LabelKind::Regression:
        fuzz::sink = fuzz::sink + (dataset.float_label(i) > 0);
        break;
      case data::LabelKind::TokenClasses:
        fuzz::sink = fuzz::sink + dataset.token_labels(i).size();
        break;
      case data::LabelKind::Spans:
        fuzz::sink = fuzz::sink + dataset.span(i).first + dataset.span(i).second;
        break;
      case data::LabelKind::None:
      case data::LabelKind::Tokens:
        break;
    }
  }
}

// Collates every example (in batches of up to 8) as the Trainer would for `task`.
void collate(const data::TokenizedDataset& dataset, const data::Tokenizer& tokenizer, int task) {
  std::vector<int64_t> indices(static_cast<size_t>(dataset.size()));
  std::iota(indices.begin(), indices.end(), 0);
  for (size_t first = 0; first < indices.size(); first += 8) {
    const std::span<const int64_t> batch_indices(indices.data() + first, std::min<size_t>(8, indices.size() - first));
    data::Batch batch = data::collate_padded(dataset, batch_indices, 8, std::max<int64_t>(tokenizer.pad_id(), 0));
    if (task == 3) data::apply_mlm_mask(batch, data::mask_spec(tokenizer), 42, first);
    if (task == 4) data::apply_clm_labels(batch);
    fuzz::sink = fuzz::sink + batch.input_ids.size() + batch.labels.size();
  }
}

// Question answering's second half: answers from made-up logits, and SQuAD metrics when the data has answers.
void decode(const data::QuestionAnsweringDataset& dataset, bool labelled) {
  std::vector<int64_t> feature_offsets = {0};
  for (int64_t f = 0; f < dataset.size(); ++f) {
    feature_offsets.push_back(feature_offsets.back() + dataset.length(f));
    fuzz::sink = fuzz::sink + dataset.example_of(f) + dataset.context_offsets(f).size();
  }
  std::vector<float> start(static_cast<size_t>(feature_offsets.back())), end(start.size());
  for (size_t i = 0; i < start.size(); ++i) {
    start[i] = static_cast<float>((i * 7919) % 13);
    end[i] = static_cast<float>((i * 104729) % 11);
  }
  const std::vector<std::string> answers =
      data::decode_answers(dataset, start, end, feature_offsets, {.n_best = 3, .max_answer_length = 5});
  if (labelled) fuzz::sink = fuzz::sink + data::squad_metrics(answers, dataset).size();
  for (int64_t e = 0; e < dataset.num_examples(); ++e)
    fuzz::sink = fuzz::sink + dataset.context(e).size() + dataset.answers(e).size();
}

void build(const data::Table& table, const data::Tokenizer& tokenizer, int task, int options) {
  const bool variant = options & 2, short_sequences = options & 4;
  const int64_t max_length = short_sequences ? 8 : 64, num_labels = (options & 8) ? 3 : 0;
  const data::TokenizeFn tokenize = data::tokenize_with(tokenizer);
  std::unique_ptr<data::TokenizedDataset> dataset;
  switch (task) {
    case 0: {  // seq-cls: the text, a second text when there is another column, and "label"
      const std::string label = has(table, "label") ? "label" : "";
      std::vector<std::string> texts;
      for (const std::string& c : table.columns)
        if (c != label) texts.push_back(c);
      data::TextColumns columns{texts.empty() ? "" : texts[0], texts.size() > 1 ? texts[1] : "", label};
      dataset = std::make_unique<data::TextDataset>(
          table, columns, tokenize,
          data::TextDatasetOptions{.max_length = max_length, .num_labels = num_labels, .regression = variant,
                                   .num_threads = 1});
      break;
    }
    case 1: {  // token-cls: a JSON list of words and one of tags
      data::TokenColumns columns{column(table, "tokens", 0), has(table, "ner_tags") ? "ner_tags" : ""};
      auto tokens = std::make_unique<data::TokenClassificationDataset>(
          table, columns, tokenize,
          data::TokenDatasetOptions{.max_length = max_length, .num_labels = num_labels,
                                    .label_all_tokens = variant, .num_threads = 1});
      for (int64_t i = 0; i < tokens->size(); ++i) fuzz::sink = fuzz::sink + tokens->word_ids(i).size();
      dataset = std::move(tokens);
      break;
    }
    case 2: {  // qa: question, context and SQuAD's answers object
      const bool labelled = has(table, "answers");
      data::QaColumns columns{column(table, "question", 0), column(table, "context", 1), labelled ? "answers" : ""};
      auto qa = std::make_unique<data::QuestionAnsweringDataset>(
          table, columns, tokenize,
          data::QaDatasetOptions{.max_length = short_sequences ? 24 : 64, .doc_stride = short_sequences ? 2 : 16,
                                 .num_threads = 1});
      decode(*qa, labelled);
      dataset = std::move(qa);
      break;
    }
    default: {  // mlm, clm: one text column, line by line or grouped into blocks
      dataset = std::make_unique<data::LmDataset>(
          table, column(table, "text", 0), tokenize,
          data::LmDatasetOptions{.line_by_line = variant, .block_size = max_length, .max_length = max_length,
                                 .lines_per_group = short_sequences ? 2 : 0, .num_threads = 1});
      break;
    }
  }
  read_all(*dataset);
  collate(*dataset, tokenizer, task);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t size) {
  static const Tokenizers tokenizers = make_tokenizers();
  if (size < 3) return 0;
  constexpr data::Format kFormats[] = {data::Format::Tsv, data::Format::Csv, data::Format::JsonLines,
                                       data::Format::Text};
  const data::Format format = kFormats[static_cast<uint8_t>(input[0] - '0') % 4];
  const int task = static_cast<uint8_t>(input[1] - '0') % 5, options = input[2];
  const data::Tokenizer& tokenizer = (options & 1) ? *tokenizers.byte_level : *tokenizers.wordpiece;
  fuzz::parses("dataset", [&] {
    data::Table table = data::parse_table(fuzz::as_text(input + 3, size - 3), "input", format,
                                          {.keep_empty_lines = (options & 16) != 0});
    build(table, tokenizer, task, options);
  });
  return 0;
}
