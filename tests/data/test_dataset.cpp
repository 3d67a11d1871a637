// Table readers (every format, quoting, bad-input messages, UTF-8 validation) and tokenized datasets (truncation as
// transformers does it, label parsing and range errors, group_texts block counts), with a fake whitespace tokenizer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "fusetrain/core/error.h"
#include "fusetrain/data/dataset.h"

#include "support/fake_tokenizer.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

namespace fs = std::filesystem;
using namespace fusetrain::data;

// "10 11 12 ..." : n numbered words starting at `first`.
std::string numbered(int64_t first, int64_t n) {
  std::string out;
  for (int64_t i = 0; i < n; ++i) out += (i ? " " : "") + std::to_string(first + i);
  return out;
}

std::vector<int64_t> to_vector(std::span<const int64_t> s) { return {s.begin(), s.end()}; }

Table parse(const std::string& content, const std::string& name, const ReadOptions& options = {}) {
  return parse_table(content, name, Format::Auto, options);
}

// ---------------------------------------------------------------------------------------------- readers

TEST(DataReaders, TsvAsGlueWritesIt) {
  TempDir dir;
  // Quotes are literal in GLUE's TSV; CRLF line ends are accepted; blank lines are skipped.
  std::string path = dir.write("train.tsv", "label\tsentence\r\n1\ta \"quoted\" film , it 's\r\n\r\n0\t\r\n");
  Table table = read_table(path);
  EXPECT_EQ(table.source, path);
  EXPECT_EQ(table.columns, (std::vector<std::string>{"label", "sentence"}));
  ASSERT_EQ(table.num_rows(), 2u);
  EXPECT_EQ(table.rows[0], (std::vector<std::string>{"1", "a \"quoted\" film , it 's"}));
  EXPECT_EQ(table.rows[1], (std::vector<std::string>{"0", ""}));
  EXPECT_EQ(table.row_lines, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(table.column("sentence"), 1u);
  EXPECT_EQ(table.where(1), path + ":4");
}

TEST(DataReaders, TsvWrongFieldCountNamesTheLine) {
  EXPECT_EQ(error_of([] { parse("sentence\tlabel\na\t1\nb\t0\textra\n", "dev.tsv"); }),
            "dev.tsv:3: expected 2 fields, found 3");
  EXPECT_EQ(error_of([] { parse("sentence\tlabel\nno label here\n", "dev.tsv"); }),
            "dev.tsv:2: expected 2 fields, found 1");
}

TEST(DataReaders, CsvQuotingAsRfc4180) {
  const std::string csv =
      "id,text,label\r\n"
      "1,\"hello, world\",0\r\n"
      "2,\"she said \"\"hi\"\"\",1\r\n"
      "3,\"two\nlines\",\"\"\n"
      "\n"
      "4,plain \"inner\" quote,1";  // no final newline
  Table table = parse(csv, "x.csv");
  EXPECT_EQ(table.columns, (std::vector<std::string>{"id", "text", "label"}));
  ASSERT_EQ(table.num_rows(), 4u);
  EXPECT_EQ(table.rows[0][1], "hello, world");
  EXPECT_EQ(table.rows[1][1], "she said \"hi\"");
  EXPECT_EQ(table.rows[2][1], "two\nlines");
  EXPECT_EQ(table.rows[2][2], "");
  EXPECT_EQ(table.rows[3][1], "plain \"inner\" quote");
  EXPECT_EQ(table.rows[3][2], "1");
  EXPECT_EQ(table.row_lines, (std::vector<int64_t>{2, 3, 4, 7}));  // the embedded newline counts as a line
}

TEST(DataReaders, CsvErrors) {
  EXPECT_EQ(error_of([] { parse("a,b\n1,\"open\n2,3\n", "x.csv"); }), "x.csv:2: unterminated quoted field");
  EXPECT_EQ(error_of([] { parse("a,b\n1,\"x\"y\n", "x.csv"); }),
            "x.csv:2: unexpected character 'y' after a closing quote (a quote inside a quoted field is written \"\")");
  EXPECT_EQ(error_of([] { parse("a,b\n1,\"x\ny\",3\n4,5\n", "x.csv"); }), "x.csv:2: expected 2 fields, found 3");
  EXPECT_EQ(error_of([] { parse("a,a\n1,2\n", "x.csv"); }), "x.csv:1: duplicate column \"a\"");
}

TEST(DataReaders, JsonLinesScalarsBecomeStrings) {
  const std::string jsonl =
      "{\"sentence\": \"caf\u00e9 \\\"ok\\\"\", \"label\": 1, \"score\": 0.5, \"gold\": true, \"note\": null}\n"
      "\n"
      "{\"label\": -2, \"sentence\": \"\\u4e2d\", \"gold\": false, \"score\": 3, \"note\": \"n\"}\n";
  Table table = parse(jsonl, "x.jsonl");
  EXPECT_EQ(table.columns, (std::vector<std::string>{"sentence", "label", "score", "gold", "note"}));
  ASSERT_EQ(table.num_rows(), 2u);
  EXPECT_EQ(table.rows[0], (std::vector<std::string>{"caf\u00e9 \"ok\"", "1", "0.5", "true", ""}));
  EXPECT_EQ(table.rows[1], (std::vector<std::string>{"\u4e2d", "-2", "3", "false", "n"}));  // by key, not position
  EXPECT_EQ(table.row_lines, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(parse_table("{\"a\": 1}\n", "data.json").rows[0][0], "1");  // .json is read as JSON Lines
}

TEST(DataReaders, JsonLinesKeepArraysAndObjectsAsJson) {
  Table table = parse("{\"tokens\": [\"EU\", \"rejects\"], \"answers\": {\"text\": [\"x\"], \"answer_start\": [3]}}\n",
                      "x.jsonl");
  EXPECT_EQ(table.rows[0], (std::vector<std::string>{"[\"EU\",\"rejects\"]", "{\"text\":[\"x\"],\"answer_start\":[3]}"}));
}

TEST(DataReaders, JsonLinesErrorsNameTheLine) {
  EXPECT_EQ(error_of([] { parse("{\"a\": 1, \"b\": 2}\n{\"a\": 3}\n", "x.jsonl"); }),
            "x.jsonl:2: no key \"b\", which the first object (line 1) has; every line needs the same keys (this "
            "line's: a)");
  EXPECT_EQ(error_of([] { parse("{\"a\": 1}\n{\"a\": 3, \"c\": 4}\n", "x.jsonl"); }),
            "x.jsonl:2: unexpected key \"c\" (keys of the first object: a)");
  EXPECT_EQ(error_of([] { parse("{\"a\": 1}\n\"just a string\"\n", "x.jsonl"); }),
            "x.jsonl:2: expected a JSON object, found string");
  EXPECT_EQ(error_of([] { parse("[\n{\"a\": 1}\n]\n", "x.json"); }),
            "x.json:1: expected one JSON object per line (JSON Lines), found the start of an array");
  std::string message = error_of([] { parse("{\"a\": 1}\n{\"a\": 1,}\n", "x.jsonl"); });
  EXPECT_EQ(message.rfind("x.jsonl:2: invalid JSON: ", 0), 0u) << message;
  // nlohmann reports a number beyond a double's range as out_of_range, not as a parse error.
  EXPECT_EQ(error_of([] { parse("{\"a\": 1}\n{\"a\": 1e999}\n", "x.jsonl"); }),
            "x.jsonl:2: invalid JSON: number overflow parsing '1e999'");
}

TEST(DataReaders, PlainTextOneRowPerLine) {
  const std::string text = "First Citizen:\r\nBefore we proceed\n\n  \nSpeak.\n";
  Table table = parse(text, "input.txt");
  EXPECT_EQ(table.columns, (std::vector<std::string>{"text"}));
  ASSERT_EQ(table.num_rows(), 4u);  // the whitespace-only line is not empty, so it stays
  EXPECT_EQ(table.rows[0][0], "First Citizen:");
  EXPECT_EQ(table.rows[2][0], "  ");
  EXPECT_EQ(table.row_lines, (std::vector<int64_t>{1, 2, 4, 5}));
  Table kept = parse(text, "input.txt", {.keep_empty_lines = true});
  ASSERT_EQ(kept.num_rows(), 5u);  // the final newline ends the last line; it does not start an empty one
  EXPECT_EQ(kept.rows[2][0], "");
}

TEST(DataReaders, FormatFromExtensionOrGiven) {
  EXPECT_EQ(format_from_extension("a/b.TSV"), Format::Tsv);
  EXPECT_EQ(format_from_extension("b.csv"), Format::Csv);
  EXPECT_EQ(format_from_extension("b.jsonl"), Format::JsonLines);
  EXPECT_EQ(format_from_extension("b.json"), Format::JsonLines);
  EXPECT_EQ(format_from_extension("b.txt"), Format::Text);
  EXPECT_EQ(error_of([] { read_table("data.parquet"); }),
            "data.parquet: cannot tell the format from the extension \".parquet\" (expected .tsv, .csv, .jsonl, "
            ".json or .txt); pass the format explicitly");
  // An explicit format wins over the extension.
  Table table = parse_table("a,b\n1,2\n", "data.dat", Format::Csv);
  EXPECT_EQ(table.columns, (std::vector<std::string>{"a", "b"}));
}

TEST(DataReaders, MissingEmptyAndDirectory) {
  TempDir dir;
  std::string missing = (dir.path / "nope.tsv").string();
  EXPECT_EQ(error_of([&] { read_table(missing); }), missing + ": no such file");
  std::string empty = dir.write("empty.csv", "");
  EXPECT_EQ(error_of([&] { read_table(empty); }), empty + ": empty");
  std::string blank = dir.write("blank.txt", "\n \r\n");
  EXPECT_EQ(error_of([&] { read_table(blank); }), blank + ": empty");
  fs::create_directories(dir.path / "folder.tsv");
  std::string folder = (dir.path / "folder.tsv").string();
  EXPECT_EQ(error_of([&] { read_table(folder); }), folder + ": is a directory, expected a file");
}

TEST(DataReaders, ColumnErrorListsTheColumns) {
  Table table = parse("sentence\tlabel\nx\t1\n", "train.tsv");
  EXPECT_EQ(error_of([&] { table.column("label_x"); }), "train.tsv: no column \"label_x\" (columns: sentence, label)");
}

TEST(DataReaders, Utf8IsValidatedOnRead) {
  // Valid: 2-, 3- and 4-byte sequences, the largest code point, and a byte-order mark (skipped).
  EXPECT_FALSE(find_invalid_utf8("caf\xC3\xA9 \xE4\xB8\xAD \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF"));
  Table table = parse("\xEF\xBB\xBFtext\tlabel\n\xC3\xA9\t1\n", "bom.tsv");
  EXPECT_EQ(table.columns[0], "text");
  EXPECT_EQ(table.rows[0][0], "\xC3\xA9");

  EXPECT_EQ(find_invalid_utf8("ab\x80"), 2u);              // lone continuation byte
  EXPECT_EQ(find_invalid_utf8("a\xC0\xAF"), 1u);           // overlong "/"
  EXPECT_EQ(find_invalid_utf8("a\xE0\x80\xAF"), 1u);       // overlong 3-byte
  EXPECT_EQ(find_invalid_utf8("\xED\xA0\x80"), 0u);        // UTF-16 surrogate
  EXPECT_EQ(find_invalid_utf8("x\xF4\x90\x80\x80"), 1u);   // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("xy\xF5\x80\x80\x80"), 2u);  // never a lead byte
  EXPECT_EQ(find_invalid_utf8("abc\xE4\xB8"), 3u);         // truncated at the end
  EXPECT_EQ(find_invalid_utf8("\xE4\xB8x"), 0u);           // truncated before ASCII
  EXPECT_EQ(find_invalid_utf8("\xFF"), 0u);

  TempDir dir;
  std::string path = dir.write("latin1.tsv", "sentence\tlabel\nok\t1\ncaf\xE9 au lait\t0\n");
  EXPECT_EQ(error_of([&] { read_table(path); }), path + ":3: invalid UTF-8 at byte 23");
  EXPECT_EQ(error_of([] { parse("{\"a\": \"\xC3\"}\n", "x.jsonl"); }), "x.jsonl:1: invalid UTF-8 at byte 7");
  EXPECT_EQ(error_of([] { parse("fine\nfine\n\xF0\x9F\x98\n", "x.txt"); }), "x.txt:3: invalid UTF-8 at byte 10");
}

TEST(DataReaders, ReadsSst2Dev) {
  fs::path path = fs::path(FUSETRAIN_SOURCE_DIR) / "../shared/datasets/sst2/dev.tsv";
  if (!fs::exists(path)) {
    if (std::getenv("CI")) FAIL() << "no SST-2 at " << path << " (CI must have ../shared beside the clone)";
    GTEST_SKIP() << "no SST-2 at " << path;
  }
  Table table = read_table(path.string());
  EXPECT_EQ(table.columns, (std::vector<std::string>{"label", "sentence"}));
  EXPECT_EQ(table.num_rows(), 872u);
  TextDataset dataset(table, {.text = "sentence", .label = "label"}, fake(), {.max_length = 16, .num_labels = 2});
  EXPECT_EQ(dataset.size(), 872);
  EXPECT_EQ(dataset.longest(), 16);
  EXPECT_EQ(dataset.num_labels(), 2);
}

// ---------------------------------------------------------------------------------------------- datasets

TEST(DataTextDataset, FlatBuffersAndTruncation) {
  Table table;
  table.source = "t.tsv";
  table.columns = {"sentence", "label"};
  table.rows = {{numbered(10, 3), "1"}, {numbered(20, 10), "0"}, {"", "2"}};
  TextDataset dataset(table, {.text = "sentence", .label = "label"}, fake(), {.max_length = 6});
  ASSERT_EQ(dataset.size(), 3);
  EXPECT_EQ(to_vector(dataset.ids(0)), (std::vector<int64_t>{kCls, 10, 11, 12, kSep}));
  EXPECT_EQ(to_vector(dataset.ids(1)), (std::vector<int64_t>{kCls, 20, 21, 22, 23, kSep}));  // truncated, [SEP] kept
  EXPECT_EQ(to_vector(dataset.ids(2)), (std::vector<int64_t>{kCls, kSep}));
  EXPECT_EQ(dataset.offsets(), (std::vector<int64_t>{0, 5, 11, 13}));
  EXPECT_EQ(dataset.num_tokens(), 13);
  EXPECT_EQ(dataset.longest(), 6);
  EXPECT_TRUE(dataset.type_ids(1).empty());  // all type ids 0: none stored
  EXPECT_EQ(dataset.label_kind(), LabelKind::Class);
  EXPECT_EQ(dataset.label(0), 1);
  EXPECT_EQ(dataset.label(2), 2);
  EXPECT_EQ(dataset.num_labels(), 3);  // inferred: largest + 1
  EXPECT_EQ(error_of([&] { dataset.ids(3); }), "example 3 is out of range: the dataset has 3 examples");
  EXPECT_EQ(error_of([&] { dataset.float_label(0); }), "the dataset has no regression labels");
}

TEST(DataTextDataset, PairTruncationMatchesTransformersLongestFirst) {
  // Expected values from Hugging Face tokenizers 0.23.3 (WordLevel on numbered words, BERT template,
  // enable_truncation(max_length)): {first length, second length, max_length} -> kept {first, second}.
  struct Case {
    int64_t a, b, max_length, keep_a, keep_b;
  };
  const Case cases[] = {{8, 3, 10, 4, 3},   {3, 8, 10, 3, 4}, {8, 9, 15, 6, 6}, {9, 8, 15, 6, 6}, {8, 9, 16, 6, 7},
                        {20, 20, 11, 4, 4}, {2, 2, 5, 1, 1},  {0, 5, 6, 0, 3},  {5, 0, 6, 3, 0},  {4, 4, 20, 4, 4}};
  for (Style style : {Style::Bert, Style::Roberta}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(str(c.a, "+", c.b, " to ", c.max_length, style == Style::Bert ? " bert" : " roberta"));
      TokenizedText tokens = FakeTokenizer{style}(numbered(10, c.a), numbered(50, c.b));
      int64_t max_length = c.max_length + (style == Style::Roberta ? 1 : 0);  // RoBERTa adds one more special
      truncate_tokens(tokens, max_length);
      TokenizedText expected = FakeTokenizer{style}(numbered(10, c.keep_a), numbered(50, c.keep_b));
      EXPECT_EQ(tokens.ids, expected.ids);
      EXPECT_EQ(tokens.type_ids, expected.type_ids);
      EXPECT_EQ(tokens.special_tokens_mask, expected.special_tokens_mask);
    }
  }
  // No special tokens to separate the pair (GPT-2): cut from the end. Too short for the specials: an error.
  TokenizedText gpt2 = FakeTokenizer{Style::Gpt2}(numbered(10, 5), numbered(50, 5));
  truncate_tokens(gpt2, 7);
  EXPECT_EQ(gpt2.ids, (std::vector<int64_t>{10, 11, 12, 13, 14, 50, 51}));
  TokenizedText bert = FakeTokenizer{Style::Bert}(numbered(10, 5), numbered(50, 5));
  EXPECT_EQ(error_of([&] { truncate_tokens(bert, 2); }),
            "max_length 2 cannot hold the 3 special tokens the tokenizer adds");
}

TEST(DataTextDataset, PairColumnsAndTypeIds) {
  Table table;
  table.columns = {"premise", "hypothesis", "label"};
  table.rows = {{numbered(10, 2), numbered(20, 1), "0"}, {numbered(10, 9), numbered(20, 9), "1"}};
  TextDataset dataset(table, {.text = "premise", .text_pair = "hypothesis", .label = "label"}, fake(),
                      {.max_length = 9, .num_labels = 2});
  EXPECT_EQ(to_vector(dataset.ids(0)), (std::vector<int64_t>{kCls, 10, 11, kSep, 20, kSep}));
  EXPECT_EQ(to_vector(dataset.type_ids(0)), (std::vector<int64_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(to_vector(dataset.ids(1)), (std::vector<int64_t>{kCls, 10, 11, 12, kSep, 20, 21, 22, kSep}));
  EXPECT_EQ(to_vector(dataset.type_ids(1)), (std::vector<int64_t>{0, 0, 0, 0, 0, 1, 1, 1, 1}));
}

TEST(DataTextDataset, LabelErrorsNameTheLine) {
  Table table = parse("sentence\tlabel\ngood\t1\nbad\tpos\n", "train.tsv");
  EXPECT_EQ(error_of([&] { TextDataset(table, {.text = "sentence", .label = "label"}, fake()); }),
            "train.tsv:3: label \"pos\" is not an integer");
  Table range = parse("sentence\tlabel\ngood\t1\n\nbad\t2\n", "train.tsv");
  EXPECT_EQ(error_of([&] { TextDataset(range, {.text = "sentence", .label = "label"}, fake(), {.num_labels = 2}); }),
            "train.tsv:4: label 2 is out of range [0, 2)");
  Table negative = parse("sentence\tlabel\nx\t-1\n", "test.tsv");
  EXPECT_EQ(error_of([&] { TextDataset(negative, {.text = "sentence", .label = "label"}, fake()); }),
            "test.tsv:2: label -1 is negative (class labels count from 0)");
  Table fraction = parse("sentence\tlabel\nx\t1.5\n", "sts.tsv");
  EXPECT_EQ(error_of([&] { TextDataset(fraction, {.text = "sentence", .label = "label"}, fake()); }),
            "sts.tsv:2: label \"1.5\" is not an integer");
  EXPECT_EQ(error_of([&] { TextDataset(table, {.text = "sentence", .label = "label_x"}, fake()); }),
            "train.tsv: no column \"label_x\" (columns: sentence, label)");
}

TEST(DataTextDataset, RegressionLabels) {
  Table table = parse("a\tb\tscore\nx y\tz\t4.25\nx\tz\t 0 \n", "sts.tsv");
  TextDataset dataset(table, {.text = "a", .text_pair = "b", .label = "score"}, fake(), {.regression = true});
  EXPECT_EQ(dataset.label_kind(), LabelKind::Regression);
  EXPECT_FLOAT_EQ(dataset.float_label(0), 4.25f);
  EXPECT_FLOAT_EQ(dataset.float_label(1), 0.0f);
  Table bad = parse("a\tscore\nx\tfive\n", "sts.tsv");
  EXPECT_EQ(error_of([&] { TextDataset(bad, {.text = "a", .label = "score"}, fake(), {.regression = true}); }),
            "sts.tsv:2: label \"five\" is not a number");
}

TEST(DataTextDataset, ParallelTokenizationMatchesSerialAndReportsErrors) {
  Table table;
  table.source = "big.tsv";
  table.columns = {"text"};
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i)  // more than one tokenizing round
    table.rows.push_back({numbered(static_cast<int64_t>(rng() % 1000), static_cast<int64_t>(rng() % 40))});
  TextDataset serial(table, {.text = "text"}, fake(), {.max_length = 32, .num_threads = 1});
  std::atomic<int> calls = 0;
  TokenizeFn counting = [&](std::string_view text, std::optional<std::string_view> pair) {
    ++calls;
    return FakeTokenizer{}(text, pair);
  };
  TextDataset parallel(table, {.text = "text"}, counting, {.max_length = 32, .num_threads = 4});
  EXPECT_EQ(calls.load(), 20000);
  EXPECT_EQ(serial.offsets(), parallel.offsets());
  for (int64_t i = 0; i < serial.size(); i += 997) EXPECT_EQ(to_vector(serial.ids(i)), to_vector(parallel.ids(i)));
  EXPECT_EQ(serial.label_kind(), LabelKind::None);

  TokenizeFn failing = [](std::string_view text, std::optional<std::string_view>) -> TokenizedText {
    if (text == "boom") throw std::runtime_error("cannot tokenize");
    return {{1}, {}, {}};
  };
  table.rows[12345] = {"boom"};
  EXPECT_EQ(error_of([&] { TextDataset(table, {.text = "text"}, failing, {.num_threads = 4}); }),
            "big.tsv:12347: cannot tokenize");
}

// ---------------------------------------------------------------------------------------------- language modelling

Table lines_table(const std::vector<std::string>& lines) {
  Table table;
  table.source = "input.txt";
  table.columns = {"text"};
  for (const auto& line : lines) table.rows.push_back({line});
  return table;
}

TEST(DataLmDataset, GroupTextsConcatenatesAndDropsTheRemainder) {
  // GPT-2 style (no specials): 3 + 5 + 0 + 7 = 15 tokens -> three blocks of 4, remainder 3 dropped.
  Table table = lines_table({numbered(10, 3), numbered(20, 5), "", numbered(30, 7)});
  LmDataset gpt2(table, "text", fake(Style::Gpt2), {.block_size = 4});
  ASSERT_EQ(gpt2.size(), 3);
  EXPECT_EQ(gpt2.label_kind(), LabelKind::Tokens);
  EXPECT_EQ(to_vector(gpt2.ids(0)), (std::vector<int64_t>{10, 11, 12, 20}));
  EXPECT_EQ(to_vector(gpt2.ids(1)), (std::vector<int64_t>{21, 22, 23, 24}));
  EXPECT_EQ(to_vector(gpt2.ids(2)), (std::vector<int64_t>{30, 31, 32, 33}));
  // BERT style: every line gets [CLS] ... [SEP] (the empty one too): 5 + 7 + 2 + 9 = 23 -> 2 blocks of 10.
  LmDataset bert(table, "text", fake(Style::Bert), {.block_size = 10});
  ASSERT_EQ(bert.size(), 2);
  EXPECT_EQ(to_vector(bert.ids(0)), (std::vector<int64_t>{kCls, 10, 11, 12, kSep, kCls, 20, 21, 22, 23}));
  EXPECT_EQ(to_vector(bert.ids(1)), (std::vector<int64_t>{24, kSep, kCls, kSep, kCls, 30, 31, 32, 33, 34}));
  // Too little text for one block: no examples.
  EXPECT_EQ(LmDataset(table, "text", fake(Style::Gpt2), {.block_size = 16}).size(), 0);
}

TEST(DataLmDataset, BlockCountsOnALargeCorpus) {
  std::vector<std::string> lines;
  int64_t total = 0;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 5000; ++i) {
    int64_t n = (i * 37) % 23;
    lengths.push_back(n);
    total += n;
    lines.push_back(numbered(i, n));
  }
  Table table = lines_table(lines);
  LmDataset all(table, "text", fake(Style::Gpt2), {.block_size = 128, .num_threads = 3});
  EXPECT_EQ(all.size(), total / 128);
  EXPECT_EQ(all.num_tokens(), total / 128 * 128);
  EXPECT_EQ(all.longest(), 128);
  // transformers' scripts group per datasets.map batch of 1000 lines, dropping each batch's remainder.
  int64_t expected_blocks = 0;
  for (int64_t start = 0; start < 5000; start += 1000) {
    int64_t group = 0;
    for (int64_t i = start; i < start + 1000; ++i) group += lengths[static_cast<size_t>(i)];
    expected_blocks += group / 128;
  }
  LmDataset grouped(table, "text", fake(Style::Gpt2), {.block_size = 128, .lines_per_group = 1000});
  EXPECT_EQ(grouped.size(), expected_blocks);
  EXPECT_LT(grouped.size(), all.size());
  EXPECT_EQ(error_of([&] { LmDataset(table, "text", fake(), {.block_size = 0}); }),
            "input.txt: block_size must be positive, got 0");
}

TEST(DataLmDataset, LineByLineSkipsBlankLinesAndTruncates) {
  Table table = lines_table({numbered(10, 3), "   ", "", numbered(20, 30)});
  LmDataset dataset(table, "text", fake(Style::Bert), {.line_by_line = true, .max_length = 8});
  ASSERT_EQ(dataset.size(), 2);
  EXPECT_EQ(to_vector(dataset.ids(0)), (std::vector<int64_t>{kCls, 10, 11, 12, kSep}));
  EXPECT_EQ(to_vector(dataset.ids(1)), (std::vector<int64_t>{kCls, 20, 21, 22, 23, 24, 25, kSep}));
}

TEST(DataFlatDataset, HoldsExamplesAndLabelsGivenAsFlatArrays) {
  TokenizedDataset d = TokenizedDataset::from_flat({.offsets = {0, 3, 5},
                                                    .ids = {1, 7, 2, 1, 2},
                                                    .type_ids = {0, 0, 0, 0, 1},
                                                    .label_kind = LabelKind::Class,
                                                    .labels = {1, 0},
                                                    .num_labels = 2,
                                                    .vocab_size = 8});
  ASSERT_EQ(d.size(), 2);
  EXPECT_EQ(to_vector(d.ids(0)), (std::vector<int64_t>{1, 7, 2}));
  EXPECT_EQ(to_vector(d.type_ids(1)), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(d.label(0), 1);
  EXPECT_EQ(d.longest(), 3);
  // All-zero type ids are not kept, as the tokenizing datasets do.
  TokenizedDataset tokens = TokenizedDataset::from_flat(
      {.offsets = {0, 2}, .ids = {4, 5}, .type_ids = {0, 0}, .label_kind = LabelKind::TokenClasses,
       .labels = {kIgnoreIndex, 2}, .num_labels = 3});
  EXPECT_TRUE(tokens.type_ids(0).empty());
  EXPECT_EQ(to_vector(tokens.token_labels(0)), (std::vector<int64_t>{kIgnoreIndex, 2}));
}

TEST(DataFlatDataset, RejectsInconsistentArraysWithOneClearError) {
  auto error = [](FlatExamples e) { return error_of([&] { TokenizedDataset::from_flat(std::move(e)); }); };
  EXPECT_EQ(error({.offsets = {0, 2}, .ids = {1, 2, 3}}), "offsets end at 2 but there are 3 ids");
  EXPECT_EQ(error({.offsets = {0, 2, 2}, .ids = {1, 2}}), "example 1 has no tokens (offsets 2 to 2)");
  EXPECT_EQ(error({.offsets = {0, 2}, .ids = {1, 9}, .vocab_size = 8}),
            "token id 9 of example 0 is outside the vocabulary [0, 8)");
  EXPECT_EQ(error({.offsets = {0, 1, 2}, .ids = {1, 2}, .label_kind = LabelKind::Class, .labels = {0, 2},
                   .num_labels = 2}),
            "label 2 (example 1) is out of range: the model has 2 labels, so labels must lie in [0, 2)");
  EXPECT_EQ(error({.offsets = {0, 1, 2}, .ids = {1, 2}, .label_kind = LabelKind::Class, .labels = {0}}),
            "expected 2 class labels (one per example), found 1");
  EXPECT_EQ(error({.offsets = {0, 2}, .ids = {1, 2}, .type_ids = {0}}),
            "expected 2 token type ids (one per id), found 1");
}

}  // namespace
}  // namespace fusetrain::testing
