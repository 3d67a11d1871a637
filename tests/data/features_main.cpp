// fusetrain_features: prints the features fusetrain's token-classification or question-answering datasets make from
// a JSON Lines file, one JSON object per feature, for the parity tests against transformers' run_ner / run_qa
// preprocessing (tests/python/test_task_parity.py).
//
//   fusetrain_features token-cls MODEL_DIR FILE [--max-length N] [--label-all-tokens]
//       {"input_ids": [...], "token_type_ids": [...], "labels": [...], "word_ids": [...]}
//       (columns "tokens" and "ner_tags")
//   fusetrain_features qa MODEL_DIR FILE [--max-length N] [--doc-stride S]
//       {"example": k, "input_ids": [...], "token_type_ids": [...], "start_position": s, "end_position": e}
//       (columns "question", "context", "answers")
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/data/dataset.h"
#include "fusetrain/data/qa.h"
#include "fusetrain/data/tokenizer.h"

namespace {

using namespace fusetrain::data;

nlohmann::json ids_and_types(const TokenizedDataset& dataset, int64_t i) {
  std::span<const int64_t> ids = dataset.ids(i), types = dataset.type_ids(i);
  nlohmann::json out{{"input_ids", std::vector<int64_t>(ids.begin(), ids.end())}};
  out["token_type_ids"] = types.empty() ? std::vector<int64_t>(ids.size(), 0)
                                        : std::vector<int64_t>(types.begin(), types.end());
  return out;
}

int run(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: fusetrain_features token-cls|qa MODEL_DIR FILE [--max-length N] [--doc-stride S] "
                 "[--label-all-tokens]\n");
    return 2;
  }
  const std::string task = argv[1];
  int64_t max_length = task == "qa" ? 384 : 128, doc_stride = 128;
  bool label_all_tokens = false;
  for (int i = 4; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--max-length") && i + 1 < argc)
      max_length = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--doc-stride") && i + 1 < argc)
      doc_stride = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--label-all-tokens"))
      label_all_tokens = true;
    else
      throw fusetrain::Error(fusetrain::str("unknown argument ", argv[i]));
  }
  auto tokenizer = Tokenizer::from_pretrained(argv[2]);
  Table table = read_table(argv[3]);
  if (task == "token-cls") {
    TokenDatasetOptions options;
    options.max_length = max_length;
    options.label_all_tokens = label_all_tokens;
    TokenClassificationDataset dataset(table, {}, tokenize_with(*tokenizer), options);
    for (int64_t i = 0; i < dataset.size(); ++i) {
      nlohmann::json out = ids_and_types(dataset, i);
      std::span<const int64_t> labels = dataset.token_labels(i), words = dataset.word_ids(i);
      out["labels"] = std::vector<int64_t>(labels.begin(), labels.end());
      out["word_ids"] = std::vector<int64_t>(words.begin(), words.end());
      std::printf("%s\n", out.dump().c_str());
    }
  } else if (task == "qa") {
    QaDatasetOptions options;
    options.max_length = max_length;
    options.doc_stride = doc_stride;
    QuestionAnsweringDataset dataset(table, {}, tokenize_with(*tokenizer), options);
    for (int64_t i = 0; i < dataset.size(); ++i) {
      nlohmann::json out = ids_and_types(dataset, i);
      out["example"] = dataset.example_of(i);
      auto [start, end] = dataset.span(i);
      out["start_position"] = start;
      out["end_position"] = end;
      std::printf("%s\n", out.dump().c_str());
    }
  } else {
    throw fusetrain::Error("task must be token-cls or qa, got " + task);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusetrain_features: %s\n", e.what());
    return 1;
  }
}
