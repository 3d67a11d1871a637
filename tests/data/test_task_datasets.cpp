// Token-classification and question-answering datasets with the fake tokenizer: tag alignment to first sub-tokens,
// truncation, windows over long contexts with answer spans, decoding logits back to answers, SQuAD metrics, and
// the bad-input messages.
#include <gtest/gtest.h>

#include "fusetrain/data/collator.h"
#include "fusetrain/data/dataset.h"
#include "fusetrain/data/qa.h"

#include "support/fake_tokenizer.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using namespace fusetrain::data;
using Ids = std::vector<int64_t>;

constexpr int64_t kIgnore = kIgnoreIndex;

Ids to_vector(std::span<const int64_t> s) { return {s.begin(), s.end()}; }

Table jsonl(const std::string& content) { return parse_table(content, "x.jsonl"); }

// ---------------------------------------------------------------------------------------------- token classification

const char* kNer =
    "{\"tokens\": [\"John\", \"lives\", \"in\", \"Berlin\"], \"ner_tags\": [\"B-PER\", \"O\", \"O\", \"B-LOC\"]}\n"
    "{\"tokens\": [\"in\"], \"ner_tags\": [\"O\"]}\n";

TEST(DataTokenClassification, TagsGoToTheFirstSubTokenOfEachWord) {
  // [CLS] John live·s in Berl·in [SEP]; label names sorted: B-LOC 0, B-PER 1, O 2.
  TokenClassificationDataset dataset(jsonl(kNer), {}, fake(Style::Bert, /*split_long=*/true));
  EXPECT_EQ(dataset.label_names(), (std::vector<std::string>{"B-LOC", "B-PER", "O"}));
  EXPECT_EQ(dataset.num_labels(), 3);
  EXPECT_EQ(dataset.label_kind(), LabelKind::TokenClasses);
  EXPECT_EQ(to_vector(dataset.ids(0)), (Ids{kCls, 104, 104, 101, 102, 104, 102, kSep}));
  EXPECT_EQ(to_vector(dataset.token_labels(0)), (Ids{kIgnore, 1, 2, kIgnore, 2, 0, kIgnore, kIgnore}));
  EXPECT_EQ(to_vector(dataset.word_ids(0)), (Ids{-1, 0, 1, 1, 2, 3, 3, -1}));
  EXPECT_EQ(to_vector(dataset.token_labels(1)), (Ids{kIgnore, 2, kIgnore}));

  TokenDatasetOptions all;
  all.label_all_tokens = true;
  TokenClassificationDataset every(jsonl(kNer), {}, fake(Style::Bert, true), all);
  EXPECT_EQ(to_vector(every.token_labels(0)), (Ids{kIgnore, 1, 2, 2, 2, 0, 0, kIgnore}));
  all.label_names = {"B-LOC", "B-PER", "O", "I-LOC"};  // Berl·in: B-LOC, then I-LOC
  TokenClassificationDataset inside(jsonl(kNer), {}, fake(Style::Bert, true), all);
  EXPECT_EQ(to_vector(inside.token_labels(0)), (Ids{kIgnore, 1, 2, 2, 2, 0, 3, kIgnore}));
}

TEST(DataTokenClassification, TruncationKeepsLabelsInStepAndCollationPads) {
  TokenDatasetOptions options;
  options.max_length = 4;
  TokenClassificationDataset dataset(jsonl(kNer), {}, fake(Style::Bert, true), options);
  EXPECT_EQ(to_vector(dataset.ids(0)), (Ids{kCls, 104, 104, kSep}));
  EXPECT_EQ(to_vector(dataset.token_labels(0)), (Ids{kIgnore, 1, 2, kIgnore}));

  TokenClassificationDataset full(jsonl(kNer), {}, fake(Style::Bert, true));
  const Ids indices{1, 0};
  Batch batch = collate_padded(full, indices, 8, 0);
  ASSERT_EQ(batch.seq_len, 8);
  EXPECT_EQ(Ids(batch.labels.begin(), batch.labels.begin() + 8),
            (Ids{kIgnore, 2, kIgnore, kIgnore, kIgnore, kIgnore, kIgnore, kIgnore}));
  EXPECT_EQ(Ids(batch.labels.begin() + 8, batch.labels.end()), to_vector(full.token_labels(0)));
}

TEST(DataTokenClassification, IntegerTagsAndGivenNames) {
  TokenDatasetOptions options;
  options.num_labels = 5;
  TokenClassificationDataset ints(jsonl("{\"tokens\": [\"a\", \"bb\"], \"ner_tags\": [4, 0]}\n"), {}, fake(), options);
  EXPECT_EQ(to_vector(ints.token_labels(0)), (Ids{kIgnore, 4, 0, kIgnore}));
  EXPECT_EQ(ints.num_labels(), 5);
  EXPECT_TRUE(ints.label_names().empty());

  TokenDatasetOptions named;
  named.label_names = {"O", "B-PER", "I-PER", "B-LOC"};  // the training set's order, not this file's
  TokenClassificationDataset dev(jsonl(kNer), {}, fake(), named);
  EXPECT_EQ(to_vector(dev.token_labels(0)), (Ids{kIgnore, 1, 0, 0, 3, kIgnore}));
  EXPECT_EQ(dev.num_labels(), 4);

  TokenClassificationDataset unlabelled(jsonl(kNer), {"tokens", ""}, fake());
  EXPECT_EQ(unlabelled.label_kind(), LabelKind::None);
  EXPECT_EQ(to_vector(unlabelled.word_ids(0)), (Ids{-1, 0, 1, 2, 3, -1}));
}

TEST(DataTokenClassification, BadRowsNameTheLine) {
  auto build = [](const std::string& content, TokenDatasetOptions options = {}) {
    return [content, options] { TokenClassificationDataset(jsonl(content), {}, fake(), options); };
  };
  EXPECT_EQ(error_of(build("{\"tokens\": [\"a\", \"b\"], \"ner_tags\": [\"O\"]}\n")), "x.jsonl:1: 2 words but 1 tags");
  TokenDatasetOptions named;
  named.label_names = {"O"};
  EXPECT_EQ(error_of(build("{\"tokens\": [\"a\"], \"ner_tags\": [\"B-X\"]}\n", named)),
            "x.jsonl:1: tag \"B-X\" is not one of the labels (O)");
  TokenDatasetOptions three;
  three.num_labels = 3;
  EXPECT_EQ(error_of(build("{\"tokens\": [\"a\"], \"ner_tags\": [0]}\n{\"tokens\": [\"a\"], \"ner_tags\": [5]}\n", three)),
            "x.jsonl:2: tag 5 is out of range [0, 3)");
  EXPECT_EQ(error_of(build("{\"tokens\": \"a b\", \"ner_tags\": [0]}\n")),
            "x.jsonl:1: \"tokens\" is not a JSON array (found a b)");
  EXPECT_EQ(error_of(build("{\"tokens\": [1, 2], \"ner_tags\": [0, 0]}\n")),
            "x.jsonl:1: \"tokens\" is not a JSON array of strings");
  EXPECT_EQ(error_of([] { TokenClassificationDataset(jsonl(kNer), {"words", "ner_tags"}, fake()); }),
            "x.jsonl: no column \"words\" (columns: tokens, ner_tags)");
  TokenizeFn no_offsets = [](std::string_view, std::optional<std::string_view>) { return TokenizedText{{1, 2}}; };
  EXPECT_EQ(error_of([&] { TokenClassificationDataset(jsonl(kNer), {}, no_offsets); }),
            "x.jsonl:1: the tokenizer returned no token offsets; token classification needs them");
}

// ---------------------------------------------------------------------------------------------- question answering

// Context words 10..19 (ids = the numbers), each 2 bytes and a space: word k starts at byte and character 3k.
const std::string kContext = "10 11 12 13 14 15 16 17 18 19";

std::string qa_row(const std::string& question, const std::string& context, const std::string& answers) {
  return "{\"question\": \"" + question + "\", \"context\": \"" + context + "\", \"answers\": " + answers + "}\n";
}

TEST(DataQuestionAnswering, WindowsOverlapByDocStrideAndCarryAnswerSpans) {
  // [CLS] 7 8 [SEP] + 4 context tokens + [SEP] = max_length 9; windows start at context words 0, 2, 4, 6.
  Table table = jsonl(qa_row("  7 8", kContext, "{\"text\": [\"15\"], \"answer_start\": [15]}") +
                      qa_row("7 8", kContext, "{\"text\": [\"14 15\"], \"answer_start\": [12]}"));
  QaDatasetOptions options;
  options.max_length = 9;
  options.doc_stride = 2;
  QuestionAnsweringDataset dataset(table, {}, fake(Style::Bert), options);
  ASSERT_EQ(dataset.size(), 8);
  ASSERT_EQ(dataset.num_examples(), 2);
  EXPECT_EQ(to_vector(dataset.ids(0)), (Ids{kCls, 7, 8, kSep, 10, 11, 12, 13, kSep}));
  EXPECT_EQ(to_vector(dataset.ids(1)), (Ids{kCls, 7, 8, kSep, 12, 13, 14, 15, kSep}));
  EXPECT_EQ(to_vector(dataset.ids(3)), (Ids{kCls, 7, 8, kSep, 16, 17, 18, 19, kSep}));
  EXPECT_EQ(to_vector(dataset.type_ids(1)), (Ids{0, 0, 0, 0, 1, 1, 1, 1, 1}));
  const std::vector<std::pair<int64_t, int64_t>> spans{{0, 0}, {7, 7}, {5, 5}, {0, 0},   // "15"
                                                       {0, 0}, {6, 7}, {4, 5}, {0, 0}};  // "14 15"
  for (int64_t f = 0; f < dataset.size(); ++f) {
    EXPECT_EQ(dataset.span(f), spans[static_cast<size_t>(f)]) << "feature " << f;
    EXPECT_EQ(dataset.example_of(f), f / 4);
  }
  auto offsets = dataset.context_offsets(1);
  EXPECT_EQ((std::vector<std::pair<int64_t, int64_t>>(offsets.begin(), offsets.end())),
            (std::vector<std::pair<int64_t, int64_t>>{
                {-1, -1}, {-1, -1}, {-1, -1}, {-1, -1}, {6, 8}, {9, 11}, {12, 14}, {15, 17}, {-1, -1}}));
  EXPECT_EQ(dataset.answers(1), (std::vector<std::string>{"14 15"}));

  // RoBERTa: <s> 7 8 </s></s> context </s>, all type ids 0; the context is the second run of content.
  options.max_length = 10;
  QuestionAnsweringDataset roberta(table, {}, fake(Style::Roberta), options);
  ASSERT_EQ(roberta.size(), 8);
  EXPECT_EQ(to_vector(roberta.ids(2)), (Ids{kCls, 7, 8, kSep, kSep, 14, 15, 16, 17, kSep}));
  EXPECT_EQ(roberta.span(1), (std::pair<int64_t, int64_t>{8, 8}));
  EXPECT_EQ(roberta.span(2), (std::pair<int64_t, int64_t>{6, 6}));
}

TEST(DataQuestionAnswering, AnswerStartCountsCharactersNotBytes) {
  // "é" is one character and two bytes: "11" starts at character 5, byte 6.
  QuestionAnsweringDataset dataset(jsonl(qa_row("7", "\u00e9 10 11", "{\"text\": [\"11\"], \"answer_start\": [5]}")),
                                   {}, fake(Style::Bert));
  EXPECT_EQ(to_vector(dataset.ids(0)), (Ids{kCls, 7, kSep, 102, 10, 11, kSep}));
  EXPECT_EQ(dataset.span(0), (std::pair<int64_t, int64_t>{5, 5}));
}

TEST(DataQuestionAnswering, DecodePicksTheBestValidContextSpan) {
  QaDatasetOptions options;
  options.max_length = 9;
  options.doc_stride = 2;
  QuestionAnsweringDataset dataset(jsonl(qa_row("7 8", kContext, "{\"text\": [\"15\"], \"answer_start\": [15]}")), {},
                                   fake(Style::Bert), options);
  ASSERT_EQ(dataset.size(), 4);
  std::vector<float> start(36, 0.0f), end(36, 0.0f);
  const Ids offsets{0, 9, 18, 27, 36};
  start[0] = end[0] = 100;              // feature 0: [CLS] is not in the context
  start[9 + 6] = end[9 + 7] = 4;        // feature 1: "14 15", score 8
  start[18 + 5] = end[18 + 5] = 5;      // feature 2: "15", score 10
  start[27 + 7] = end[27 + 5] = 9;      // feature 3: end before start
  EXPECT_EQ(decode_answers(dataset, start, end, offsets), (std::vector<std::string>{"15"}));
  start[9 + 4] = end[9 + 7] = 50;       // feature 1: "12 13 14 15", 4 tokens, score 100
  EXPECT_EQ(decode_answers(dataset, start, end, offsets), (std::vector<std::string>{"12 13 14 15"}));
  QaDecodeOptions short_answers;        // at most 3 tokens: "14 15" scores 4 + 50
  short_answers.max_answer_length = 3;
  EXPECT_EQ(decode_answers(dataset, start, end, offsets, short_answers), (std::vector<std::string>{"14 15"}));
  EXPECT_EQ(error_of([&] { decode_answers(dataset, start, end, Ids{0, 9, 18, 36}); }),
            "decode_answers: 4 feature offsets for 4 features (expected one more)");
}

TEST(DataQuestionAnswering, SquadMetricsNormaliseAndTakeTheBestReference) {
  const std::string answers = "{\"text\": [\"Denver Broncos\", \"the Denver Broncos\"], \"answer_start\": [4, 0]}";
  Table table = jsonl(qa_row("7", "the Denver Broncos, won", answers) + qa_row("7", "the Denver Broncos, won", answers));
  QuestionAnsweringDataset dataset(table, {}, fake(Style::Bert));
  auto metrics = squad_metrics({"The  Denver Broncos,", "Denver"}, dataset);
  EXPECT_DOUBLE_EQ(metrics["exact_match"], 50.0);
  EXPECT_NEAR(metrics["f1"], 100 * (1.0 + 2.0 / 3.0) / 2, 1e-9);
}

TEST(DataQuestionAnswering, BadRowsNameTheLine) {
  auto build = [](const std::string& content, int64_t max_length = 384) {
    return [content, max_length] {
      QaDatasetOptions options;
      options.max_length = max_length;
      options.doc_stride = 2;
      QuestionAnsweringDataset(jsonl(content), {}, fake(Style::Bert), options);
    };
  };
  EXPECT_EQ(error_of(build(qa_row("7", "10 11", "{\"text\": [\"11\"], \"answer_start\": [4]}"))),
            "x.jsonl:1: the answer \"11\" is not at character 4 of the context");
  EXPECT_EQ(error_of(build(qa_row("7", "10 11", "[1]"))),
            "x.jsonl:1: \"answers\" is not an object with \"text\" and \"answer_start\" lists of one length (found [1])");
  EXPECT_EQ(error_of(build(qa_row("7 8", "10 11", "{\"text\": [], \"answer_start\": []}"), 6)),
            "x.jsonl:1: the question takes 5 of max_length 6 tokens (special tokens included), leaving 1 for the "
            "context (needs more than doc_stride 2)");
  EXPECT_EQ(error_of(build(qa_row("7", "", "{\"text\": [], \"answer_start\": []}"))),
            "x.jsonl:1: the context has no tokens");
}

}  // namespace
}  // namespace fusetrain::testing
