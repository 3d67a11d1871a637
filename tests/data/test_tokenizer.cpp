// Tokenizers from small hand-made tokenizer.json files, one component at a time. Every expected id, offset and
// decoded string was produced by Hugging Face `tokenizers` 0.23 on the same file (byte offsets here; the Python
// library reports characters). tests/python/test_tokenizer_parity.py checks real tokenizers on whole datasets.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/data/tokenizer.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

namespace fs = std::filesystem;
using data::Encoding;
using data::Tokenizer;
using nlohmann::json;
using Ids = std::vector<int64_t>;
using Offsets = std::vector<std::pair<int64_t, int64_t>>;

std::unique_ptr<Tokenizer> load(const json& config) {
  TempDir dir;
  return Tokenizer::from_file(dir.write("tokenizer.json", config.dump()));
}

json vocab_of(const std::vector<std::string>& tokens) {
  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
  return vocab;
}

json added_token(int64_t id, const std::string& content, bool special, bool single_word = false, bool lstrip = false,
                 bool rstrip = false, bool normalized = false) {
  return {{"id", id},         {"content", content},       {"single_word", single_word}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", normalized}, {"special", special}};
}

// ---- BERT: BertNormalizer, BertPreTokenizer, WordPiece, TemplateProcessing, WordPiece decoder ----------------

const std::vector<std::string> kBertVocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",",
                                             "world", "!",     "un",    "##aff", "##able", "cafe",  "北",
                                             "京",    "a",     "##b",   "##c",   "the"};

json bert_config() {
  json added = json::array();
  for (int i = 0; i < 5; ++i) added.push_back(added_token(i, kBertVocab[i], true));
  auto special = [](const char* id, int type) { return json{{"SpecialToken", {{"id", id}, {"type_id", type}}}}; };
  auto sequence = [](const char* id, int type) { return json{{"Sequence", {{"id", id}, {"type_id", type}}}}; };
  return {
      {"version", "1.0"},
      {"truncation", {{"max_length", 7}, {"strategy", "LongestFirst"}, {"stride", 0}}},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "BertNormalizer"},
        {"clean_text", true},
        {"handle_chinese_chars", true},
        {"strip_accents", nullptr},
        {"lowercase", true}}},
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {special("[CLS]", 0), sequence("A", 0), special("[SEP]", 0)}},
        {"pair", {special("[CLS]", 0), sequence("A", 0), special("[SEP]", 0), sequence("B", 1), special("[SEP]", 1)}},
        {"special_tokens",
         {{"[CLS]", {{"id", "[CLS]"}, {"ids", {2}}, {"tokens", {"[CLS]"}}}},
          {"[SEP]", {{"id", "[SEP]"}, {"ids", {3}}, {"tokens", {"[SEP]"}}}}}}}},
      {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}}},
      {"model",
       {{"type", "WordPiece"},
        {"unk_token", "[UNK]"},
        {"continuing_subword_prefix", "##"},
        {"max_input_chars_per_word", 8},
        {"vocab", vocab_of(kBertVocab)}}}};
}

TEST(Tokenizer, BertWordPieceIdsOffsetsAndMasks) {
  auto tokenizer = load(bert_config());
  Encoding e = tokenizer->encode("Hello, WORLD! Unaffable");
  EXPECT_EQ(e.ids, (Ids{2, 5, 6, 7, 8, 1, 3}));  // "unaffable" has 9 characters, over max_input_chars_per_word
  EXPECT_EQ(e.offsets, (Offsets{{0, 0}, {0, 5}, {5, 6}, {7, 12}, {12, 13}, {14, 23}, {0, 0}}));
  EXPECT_EQ(e.type_ids, (Ids{0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(e.special_tokens_mask, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0, 1}));
  EXPECT_EQ(tokenizer->decode(e.ids), "hello, world!");
  EXPECT_EQ(tokenizer->decode({2, 5, 6, 7, 8, 3}, /*skip_special_tokens=*/false), "[CLS] hello, world! [SEP]");

  e = tokenizer->encode("unaffableunaffable xyz");
  EXPECT_EQ(e.ids, (Ids{2, 1, 1, 3}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 0}, {0, 18}, {19, 22}, {0, 0}}));
  EXPECT_EQ(tokenizer->encode("").ids, (Ids{2, 3}));
  EXPECT_EQ(tokenizer->encode("un", /*add_special_tokens=*/false).ids, (Ids{9}));
}

TEST(Tokenizer, BertNormalizerAccentsChineseControlAndSpecialTokens) {
  auto tokenizer = load(bert_config());
  // Accents stripped, tab cleaned, Chinese characters split, NUL removed, [MASK] matched before normalization;
  // offsets are bytes of the input ("é" is two).
  const Encoding e = tokenizer->encode("Caf\xC3\xA9\t\xE5\x8C\x97\xE4\xBA\xAC [MASK] abc\x01!");
  EXPECT_EQ(e.ids, (Ids{2, 12, 13, 14, 4, 15, 16, 17, 8, 3}));
  EXPECT_EQ(e.offsets,
            (Offsets{{0, 0}, {0, 5}, {6, 9}, {9, 12}, {13, 19}, {20, 21}, {21, 22}, {22, 23}, {24, 25}, {0, 0}}));
  EXPECT_EQ(e.special_tokens_mask, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0, 0, 0, 0, 1}));  // typed [MASK]: 0
  EXPECT_EQ(tokenizer->decode(e.ids), "cafe \xE5\x8C\x97 \xE4\xBA\xAC abc!");
}

TEST(Tokenizer, BertPairsAndLongestFirstTruncation) {
  auto tokenizer = load(bert_config());
  EXPECT_EQ(tokenizer->file_truncation(), 7);  // reported, not applied
  EXPECT_EQ(tokenizer->truncation(), 0);
  Encoding e = tokenizer->encode_pair("hello world", "unaffable, abc!");
  EXPECT_EQ(e.ids, (Ids{2, 5, 7, 3, 1, 6, 15, 16, 17, 8, 3}));
  EXPECT_EQ(e.type_ids, (Ids{0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(e.special_tokens_mask, (std::vector<uint8_t>{1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1}));

  tokenizer->set_truncation(7);
  EXPECT_EQ(tokenizer->encode("hello world ! hello world ! hello").ids, (Ids{2, 5, 7, 8, 5, 7, 3}));
  e = tokenizer->encode_pair("hello world ! hello", "unaffable , abc , the the");
  EXPECT_EQ(e.ids, (Ids{2, 5, 7, 3, 1, 6, 3}));
  EXPECT_EQ(e.type_ids, (Ids{0, 0, 0, 0, 1, 1, 1}));
  tokenizer->set_truncation(0);
  EXPECT_EQ(tokenizer->encode("hello world ! hello world ! hello").ids.size(), 9u);
  EXPECT_CONTAINS(error_of([&] { tokenizer->set_truncation(-1); }), "max_length");
}

TEST(Tokenizer, VocabularyAndSpecialTokenRoles) {
  auto tokenizer = load(bert_config());
  EXPECT_EQ(tokenizer->vocab_size(), 19);
  EXPECT_EQ(tokenizer->token_to_id("##able"), 11);
  EXPECT_EQ(tokenizer->token_to_id("missing"), -1);
  EXPECT_EQ(tokenizer->id_to_token(13), "\xE5\x8C\x97");
  EXPECT_EQ(tokenizer->id_to_token(1000), "");
  EXPECT_EQ(tokenizer->pad_id(), 0);
  EXPECT_EQ(tokenizer->unk_id(), 1);
  EXPECT_EQ(tokenizer->cls_id(), 2);
  EXPECT_EQ(tokenizer->sep_id(), 3);
  EXPECT_EQ(tokenizer->mask_id(), 4);
  EXPECT_EQ(tokenizer->special_ids(), (Ids{0, 1, 2, 3, 4}));
}

TEST(Tokenizer, EncodeBatchOnThreadsMatchesEncode) {
  auto tokenizer = load(bert_config());
  std::vector<std::string> texts;
  for (int i = 0; i < 101; ++i)
    texts.push_back(str("hello world ", std::string(i % 7, '!'), " cafe", i % 3 ? "" : " un"));
  const auto batch = tokenizer->encode_batch(texts, 3);
  ASSERT_EQ(batch.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(batch[i].ids, tokenizer->encode(texts[i]).ids) << texts[i];
    EXPECT_EQ(batch[i].offsets, tokenizer->encode(texts[i]).offsets) << texts[i];
  }
  texts[57] = "bad \xFF utf-8";
  EXPECT_CONTAINS(error_of([&] { tokenizer->encode_batch(texts, 2); }), "not valid UTF-8 at byte 4");
}

// ---- byte-level BPE: GPT-2 style and RoBERTa style ---------------------------------------------------------------

// GPT-2's printable stand-ins for the 256 bytes, as UTF-8.
std::vector<std::string> byte_alphabet() {
  std::vector<std::string> out;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int c = printable ? b : next++;
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    out.push_back(s);
  }
  return out;
}

json gpt2_config() {
  // The alphabet sorted as Python sorts strings (by code point), then the merges' tokens, then <|endoftext|>.
  std::vector<std::string> alphabet = byte_alphabet();
  std::sort(alphabet.begin(), alphabet.end(), [](const std::string& a, const std::string& b) {
    auto code = [](const std::string& s) {
      return s.size() == 1
                 ? static_cast<unsigned char>(s[0])
                 : ((static_cast<unsigned char>(s[0]) & 0x1F) << 6) | (static_cast<unsigned char>(s[1]) & 0x3F);
    };
    return code(a) < code(b);
  });
  const std::string G = "\xC4\xA0";  // "Ġ", a space
  const std::vector<std::pair<std::string, std::string>> merges = {
      {G, "w"},   {"o", "r"}, {G + "w", "or"}, {"l", "d"},    {G + "wor", "ld"},
      {"H", "e"}, {"l", "l"}, {"He", "ll"},    {"Hell", "o"}, {G, "H"}};
  std::vector<std::string> tokens = alphabet;
  json merge_list = json::array();
  for (const auto& [a, b] : merges) tokens.push_back(a + b), merge_list.push_back(a + " " + b);
  tokens.push_back("<|endoftext|>");
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"added_tokens", {added_token(266, "<|endoftext|>", true)}},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", vocab_of(tokens)},
            {"merges", merge_list}}}};
}

TEST(Tokenizer, ByteLevelBpeLikeGpt2) {
  auto tokenizer = load(gpt2_config());
  EXPECT_EQ(tokenizer->vocab_size(), 267);
  Encoding e = tokenizer->encode("Hello world");
  EXPECT_EQ(e.ids, (Ids{264, 260}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 5}, {5, 11}}));
  EXPECT_EQ(tokenizer->decode(e.ids), "Hello world");

  e = tokenizer->encode("Hello  world<|endoftext|>\xC3\xA9!");
  EXPECT_EQ(e.ids, (Ids{264, 220, 260, 266, 127, 102, 0}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 5}, {5, 6}, {6, 12}, {12, 25}, {25, 27}, {25, 27}, {27, 28}}));
  EXPECT_EQ(tokenizer->decode(e.ids), "Hello  world\xC3\xA9!");  // <|endoftext|> is special: skipped
  EXPECT_EQ(tokenizer->decode(e.ids, false), "Hello  world<|endoftext|>\xC3\xA9!");

  // GPT-2's pattern: contractions, a space glued to the next word, numbers.
  e = tokenizer->encode(" world's 12");
  EXPECT_EQ(e.ids, (Ids{260, 6, 82, 220, 16, 17}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 6}, {6, 7}, {7, 8}, {8, 9}, {9, 10}, {10, 11}}));
  EXPECT_EQ(tokenizer->bos_id(), 266);
  EXPECT_EQ(tokenizer->eos_id(), 266);
  EXPECT_EQ(tokenizer->special_ids(), (Ids{266}));
}

json small_bpe(const std::vector<std::string>& vocab, const json& merges, const json& pre_tokenizer,
               const json& options = json::object()) {
  json model = {{"type", "BPE"},          {"dropout", nullptr},     {"unk_token", nullptr},     {"fuse_unk", false},
                {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", vocab_of(vocab)}, {"merges", merges}};
  for (const auto& [key, value] : options.items()) model[key] = value;
  return {{"version", "1.0"},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", nullptr},
          {"model", model}};
}

const json kWhitespaceSplit = {{"type", "WhitespaceSplit"}};

TEST(Tokenizer, BpeMergesByRankInEitherForm) {
  // [a, b] pairs; an unknown character becomes <unk>, one per character.
  auto tokenizer =
      load(small_bpe({"<unk>", "a", "b", "c", "ab", "bc", "abc"}, json::array({{"a", "b"}, {"ab", "c"}, {"b", "c"}}),
                     kWhitespaceSplit, {{"unk_token", "<unk>"}}));
  Encoding e = tokenizer->encode("abc abcd bca");
  EXPECT_EQ(e.ids, (Ids{6, 6, 0, 5, 1}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 3}, {4, 7}, {7, 8}, {9, 11}, {11, 12}}));
  // "a b" strings; rank decides ("b c" first), and fuse_unk joins unknown characters.
  tokenizer = load(small_bpe({"<unk>", "a", "b", "c", "ab", "bc", "abc"}, {"b c", "a b", "a bc"}, kWhitespaceSplit,
                             {{"unk_token", "<unk>"}, {"fuse_unk", true}}));
  e = tokenizer->encode("abc abddc");
  EXPECT_EQ(e.ids, (Ids{6, 4, 0, 3}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 3}, {4, 6}, {6, 8}, {8, 9}}));
}

TEST(Tokenizer, BpePrefixSuffixIgnoreMergesAndByteFallback) {
  json config = small_bpe({"a", "##b", "##c", "ab", "abc"}, {"a ##b", "ab ##c"}, kWhitespaceSplit,
                          {{"continuing_subword_prefix", "##"}});
  config["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", false}};
  auto tokenizer = load(config);
  EXPECT_EQ(tokenizer->encode("abc ab a").ids, (Ids{4, 3, 0}));
  EXPECT_EQ(tokenizer->decode({4, 3, 0}), "abc ab a");

  config = small_bpe({"a", "b", "c", "c</w>", "b</w>", "ab", "abc</w>", "bc</w>"}, {"a b", "b c</w>", "a bc</w>"},
                     kWhitespaceSplit, {{"end_of_word_suffix", "</w>"}});
  config["decoder"] = {{"type", "BPEDecoder"}, {"suffix", "</w>"}};
  tokenizer = load(config);
  const Encoding e = tokenizer->encode("abc ab");
  EXPECT_EQ(e.ids, (Ids{5, 3, 0, 4}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 2}, {2, 3}, {4, 5}, {5, 6}}));
  EXPECT_EQ(tokenizer->decode(e.ids), "abc ab");

  tokenizer = load(small_bpe({"a", "b", "c", "ab", "abc", "bc", "abcbc"}, {"a b", "b c", "ab c"}, kWhitespaceSplit,
                             {{"ignore_merges", true}}));
  EXPECT_EQ(tokenizer->encode("abcbc abcb").ids, (Ids{6, 4, 1}));  // a whole word in the vocabulary wins

  // Byte fallback: "é" has no token, its bytes do; decoded back through Replace, ByteFallback, Fuse, Strip.
  std::vector<std::string> vocab = {"<unk>"};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab.push_back(name);
  }
  vocab.push_back("a");
  vocab.push_back("\xE2\x96\x81");  // "▁"
  config =
      small_bpe(vocab, json::array(),
                {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "always"}, {"split", true}},
                {{"unk_token", "<unk>"}, {"byte_fallback", true}});
  config["decoder"] = {{"type", "Sequence"},
                       {"decoders",
                        {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
                         {{"type", "ByteFallback"}},
                         {{"type", "Fuse"}},
                         {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  tokenizer = load(config);
  const Encoding f = tokenizer->encode("a \xC3\xA9 a");
  EXPECT_EQ(f.ids, (Ids{258, 257, 258, 196, 170, 258, 257}));
  EXPECT_EQ(f.offsets, (Offsets{{0, 1}, {0, 1}, {1, 2}, {2, 4}, {2, 4}, {4, 5}, {5, 6}}));
  EXPECT_EQ(tokenizer->decode(f.ids), "a \xC3\xA9 a");
}

TEST(Tokenizer, RobertaProcessingTrimsOffsetsAndUsesOneTokenType) {
  const std::string G = "\xC4\xA0";
  json config =
      small_bpe({"<s>", "</s>", "a", "b", "ab", G, G + "a", G + "ab"}, {"a b", G + " a", G + "a b"},
                {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}});
  config["decoder"] = {{"type", "ByteLevel"}};
  config["post_processor"] = {{"type", "RobertaProcessing"},
                              {"sep", {"</s>", 1}},
                              {"cls", {"<s>", 0}},
                              {"trim_offsets", true},
                              {"add_prefix_space", true}};
  config["added_tokens"] = {added_token(0, "<s>", true), added_token(1, "</s>", true)};
  auto tokenizer = load(config);
  Encoding e = tokenizer->encode("ab  a");
  EXPECT_EQ(e.ids, (Ids{0, 5, 4, 5, 6, 1}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 0}, {0, 0}, {0, 2}, {3, 3}, {4, 5}, {0, 0}}));
  EXPECT_EQ(tokenizer->decode(e.ids), " ab  a");
  e = tokenizer->encode_pair("ab", "a b");
  EXPECT_EQ(e.ids, (Ids{0, 5, 4, 1, 1, 6, 5, 3, 1}));
  EXPECT_EQ(e.type_ids, Ids(9, 0));
  EXPECT_EQ(e.special_tokens_mask, (std::vector<uint8_t>{1, 0, 0, 1, 1, 0, 0, 0, 1}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 0}, {0, 0}, {0, 2}, {0, 0}, {0, 0}, {0, 1}, {2, 2}, {2, 3}, {0, 0}}));
  EXPECT_EQ(tokenizer->cls_id(), 0);
  EXPECT_EQ(tokenizer->sep_id(), 1);
  EXPECT_EQ(tokenizer->bos_id(), 0);
  EXPECT_EQ(tokenizer->eos_id(), 1);
}

TEST(Tokenizer, BertProcessingKeepsTheSecondSequenceType) {
  json config = small_bpe({"[CLS]", "[SEP]", "a", "b", "ab"}, {"a b"}, kWhitespaceSplit);
  config["post_processor"] = {{"type", "BertProcessing"}, {"sep", {"[SEP]", 1}}, {"cls", {"[CLS]", 0}}};
  auto tokenizer = load(config);
  const Encoding e = tokenizer->encode_pair("ab", "b a");
  EXPECT_EQ(e.ids, (Ids{0, 4, 1, 3, 2, 1}));
  EXPECT_EQ(e.type_ids, (Ids{0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(e.special_tokens_mask, (std::vector<uint8_t>{1, 0, 1, 0, 0, 1}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 0}, {0, 2}, {0, 0}, {0, 1}, {2, 3}, {0, 0}}));
  EXPECT_EQ(tokenizer->encode("ab b", false).ids, (Ids{4, 3}));
}

// ---- normalizers, pre-tokenizers and added tokens, seen through a WordLevel model --------------------------------

const std::vector<std::string> kWords = {"[UNK]",
                                         "cafe",
                                         "CAFE",
                                         "caf\xC3\xA9",
                                         "\xEF\xAC\x81",
                                         "fi",
                                         "1",
                                         "x\xC2\xB2",
                                         "x2",
                                         "a",
                                         "b",
                                         "ab",
                                         "hi",
                                         "there",
                                         "!",
                                         "?",
                                         "12",
                                         "3",
                                         "\xE2\x96\x81hi",
                                         "\xE2\x96\x81there",
                                         "\xE2\x96\x81",
                                         "-",
                                         "the",
                                         "final",
                                         "countdown",
                                         "--",
                                         "<mask>",
                                         "Hello",
                                         "[X]"};

json word_level(const json& normalizer, const json& pre_tokenizer, const json& added = json::array()) {
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", normalizer},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", nullptr},
          {"model", {{"type", "WordLevel"}, {"vocab", vocab_of(kWords)}, {"unk_token", "[UNK]"}}}};
}

json sequence_of(const char* key, const std::vector<json>& steps) {
  json out = {{"type", "Sequence"}};
  out[key] = steps;
  return out;
}

TEST(Tokenizer, UnicodeNormalizers) {
  auto tokenizer = load(
      word_level(sequence_of("normalizers", {{{"type", "NFD"}}, {{"type", "StripAccents"}}, {{"type", "Lowercase"}}}),
                 kWhitespaceSplit));
  Encoding e = tokenizer->encode("Caf\xC3\xA9  CAF\xC3\x89");
  EXPECT_EQ(e.ids, (Ids{1, 1}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 5}, {7, 12}}));
  EXPECT_EQ(tokenizer->encode("\xEF\xAC\x81 x\xC2\xB2").ids, (Ids{4, 7}));  // NFD keeps "ﬁ" and "²"

  tokenizer = load(word_level({{"type", "NFKC"}}, kWhitespaceSplit));
  e = tokenizer->encode("\xEF\xAC\x81 x\xC2\xB2 cafe\xCC\x81 caf\xC3\xA9");  // decomposed and composed "café"
  EXPECT_EQ(e.ids, (Ids{5, 8, 3, 3}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 3}, {4, 7}, {8, 12}, {15, 20}}));  // a composite keeps its starter's span
  tokenizer = load(word_level({{"type", "NFKD"}}, kWhitespaceSplit));
  EXPECT_EQ(tokenizer->encode("\xEF\xAC\x81 x\xC2\xB2").ids, (Ids{5, 8}));
  tokenizer = load(word_level({{"type", "NFC"}}, kWhitespaceSplit));
  EXPECT_EQ(tokenizer->encode("cafe\xCC\x81 \xEF\xAC\x81").ids, (Ids{3, 4}));
}

TEST(Tokenizer, StripReplacePrependAndSplitMergedWithNext) {
  auto tokenizer = load(word_level(
      sequence_of("normalizers", {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}},
                                  {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}},
                                  {{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}}}),
      {{"type", "Split"},
       {"pattern", {{"String", "\xE2\x96\x81"}}},
       {"behavior", "MergedWithNext"},
       {"invert", false}}));
  const Encoding e = tokenizer->encode("  hi there  ");
  EXPECT_EQ(e.ids, (Ids{18, 19}));
  EXPECT_EQ(e.offsets, (Offsets{{2, 4}, {4, 10}}));
}

TEST(Tokenizer, WhitespacePunctuationAndDigits) {
  auto tokenizer = load(word_level(nullptr, {{"type", "Whitespace"}}));
  Encoding e = tokenizer->encode("hi!? there12 x\xC2\xB2");
  EXPECT_EQ(e.ids, (Ids{12, 0, 0, 0, 0}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 2}, {2, 4}, {5, 12}, {13, 14}, {14, 16}}));

  tokenizer =
      load(word_level(nullptr, sequence_of("pretokenizers", {kWhitespaceSplit,
                                                             {{"type", "Punctuation"}, {"behavior", "Isolated"}},
                                                             {{"type", "Digits"}, {"individual_digits", false}}})));
  e = tokenizer->encode("hi!? ab123");
  EXPECT_EQ(e.ids, (Ids{12, 14, 15, 11, 0}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 2}, {2, 3}, {3, 4}, {5, 7}, {7, 10}}));
  tokenizer = load(word_level(nullptr, {{"type", "Digits"}, {"individual_digits", true}}));
  EXPECT_EQ(tokenizer->encode("123").ids, (Ids{6, 0, 17}));
}

TEST(Tokenizer, MetaspacePreTokenizerAndDecoder) {
  json metaspace = {
      {"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "always"}, {"split", true}};
  json config = word_level(nullptr, metaspace);
  config["decoder"] = metaspace;
  auto tokenizer = load(config);
  Encoding e = tokenizer->encode("hi  there");
  EXPECT_EQ(e.ids, (Ids{18, 20, 19}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 2}, {2, 3}, {3, 9}}));
  EXPECT_EQ(tokenizer->decode(e.ids), "hi  there");
}

TEST(Tokenizer, SplitBehaviors) {
  auto ids_for = [](const char* behavior, bool invert) {
    auto tokenizer = load(word_level(
        nullptr, {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}}));
    return tokenizer->encode("the-final--countdown").ids;
  };
  EXPECT_EQ(ids_for("Removed", false), (Ids{22, 23, 24}));
  EXPECT_EQ(ids_for("Isolated", false), (Ids{22, 21, 23, 21, 21, 24}));
  EXPECT_EQ(ids_for("MergedWithPrevious", false), (Ids{0, 0, 21, 24}));
  EXPECT_EQ(ids_for("MergedWithNext", false), (Ids{22, 0, 21, 0}));
  EXPECT_EQ(ids_for("Contiguous", false), (Ids{22, 21, 23, 25, 24}));
  EXPECT_EQ(ids_for("Removed", true), (Ids{21, 21, 21}));
}

TEST(Tokenizer, AddedTokenFlags) {
  const json added = {
      added_token(26, "<mask>", true, false, /*lstrip=*/true),
      added_token(27, "Hello", false, /*single_word=*/true, false, /*rstrip=*/true, /*normalized=*/true),
      added_token(28, "[X]", false)};
  auto tokenizer = load(word_level({{"type", "Lowercase"}}, kWhitespaceSplit, added));
  Encoding e = tokenizer->encode("hi <mask> there");
  EXPECT_EQ(e.ids, (Ids{12, 26, 13}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 2}, {2, 9}, {10, 15}}));  // lstrip takes the space before <mask>
  EXPECT_EQ(tokenizer->decode(e.ids), "hi there");            // special: skipped
  e = tokenizer->encode("HELLO there");                       // normalized: matched after lower-casing
  EXPECT_EQ(e.ids, (Ids{27, 13}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 6}, {6, 11}}));                 // rstrip takes the space after
  EXPECT_EQ(tokenizer->encode("hiHello there").ids, (Ids{0, 13}));  // single_word: not inside a word
  e = tokenizer->encode("hi hello   there[X]ab");
  EXPECT_EQ(e.ids, (Ids{12, 27, 13, 28, 11}));
  EXPECT_EQ(e.offsets, (Offsets{{0, 2}, {3, 11}, {11, 16}, {16, 19}, {19, 21}}));
  EXPECT_EQ(tokenizer->id_to_token(27), "hello");  // a normalized added token reads back normalized
  EXPECT_EQ(tokenizer->token_to_id("Hello"), 27);
  EXPECT_EQ(tokenizer->special_ids(), (Ids{26}));
}

// ---- from_pretrained: vocabulary files without tokenizer.json ----------------------------------------------------

TEST(Tokenizer, FromPretrainedVocabTxt) {
  TempDir dir;
  std::string vocab;
  for (const std::string& token : kBertVocab) vocab += token + "\n";
  dir.write("vocab.txt", vocab);
  auto tokenizer = Tokenizer::from_pretrained(dir.path.string());
  EXPECT_EQ(tokenizer->encode("Hello, WORLD! Caf\xC3\xA9").ids, (Ids{2, 5, 6, 7, 8, 12, 3}));
  EXPECT_EQ(tokenizer->mask_id(), 4);
  EXPECT_EQ(tokenizer->special_ids(), (Ids{0, 1, 2, 3, 4}));

  dir.write("tokenizer_config.json", R"({"do_lower_case": false})");
  tokenizer = Tokenizer::from_pretrained(dir.path.string());
  EXPECT_EQ(tokenizer->encode("Hello hello").ids, (Ids{2, 1, 5, 3}));
}

TEST(Tokenizer, FromPretrainedVocabJsonAndMerges) {
  TempDir dir;
  const std::string G = "\xC4\xA0";
  json vocab = vocab_of({"<s>", "<pad>", "</s>", "<unk>", "a", "b", "ab", G, G + "a", G + "ab", "<mask>"});
  dir.write("vocab.json", vocab.dump());
  dir.write("merges.txt", "#version: 0.2\na b\n" + G + " a\n" + G + "a b\n");
  auto tokenizer = Tokenizer::from_pretrained(dir.path.string());  // GPT-2 style: no template
  EXPECT_EQ(tokenizer->encode("ab ab").ids, (Ids{6, 7, 6}));       // "a b" ranks first: "Ġ" "ab"
  dir.write("config.json", R"({"model_type": "roberta"})");
  tokenizer = Tokenizer::from_pretrained(dir.path.string());
  EXPECT_EQ(tokenizer->encode("ab ab").ids, (Ids{0, 6, 7, 6, 2}));
  EXPECT_EQ(tokenizer->encode("ab <mask>").ids, (Ids{0, 6, 10, 2}));  // <mask> strips the space on its left
  EXPECT_EQ(tokenizer->pad_id(), 1);
  EXPECT_EQ(tokenizer->mask_id(), 10);
  EXPECT_EQ(tokenizer->unk_id(), 3);
}

TEST(Tokenizer, FromPretrainedOptionsOfTheWrongTypeNameTheFile) {  // found by fuzz/tokenizer_dir.cpp
  TempDir dir;
  std::string vocab;
  for (const std::string& token : kBertVocab) vocab += token + "\n";
  dir.write("vocab.txt", vocab);
  dir.write("tokenizer_config.json", R"({"do_lower_case": "yes"})");
  const std::string options = (dir.path / "tokenizer_config.json").string();
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_pretrained(dir.path.string()); }),
                  options + ": \"do_lower_case\" should be true or false, found \"yes\"");
  dir.write("tokenizer_config.json", R"({"cls_token": {"content": 7}})");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_pretrained(dir.path.string()); }),
                  options + ": \"cls_token\" has a \"content\" that should be a string, found 7");
  dir.write("tokenizer_config.json", "{}");
  dir.write("special_tokens_map.json", R"({"mask_token": {"content": null}})");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_pretrained(dir.path.string()); }),
                  "special_tokens_map.json: \"mask_token\" has a \"content\" that should be a string, found null");

  TempDir bpe;
  bpe.write("vocab.json", R"({"<s>": "zero", "</s>": 1, "a": 2})");
  bpe.write("merges.txt", "#version: 0.2\n");
  bpe.write("config.json", R"({"model_type": "roberta"})");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_pretrained(bpe.path.string()); }),
                  "vocab.json: the id of \"<s>\" should be an integer in [0, 2147483647], found \"zero\"");
  bpe.write("config.json", R"({"model_type": ["roberta"]})");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_pretrained(bpe.path.string()); }),
                  "config.json: \"model_type\" should be a string, found [\"roberta\"]");
}

// ---- errors ----------------------------------------------------------------------------------------------------

TEST(Tokenizer, ClearErrors) {
  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_file((dir.path / "missing.json").string()); }), "cannot open");
  const std::string bad_json = dir.write("bad.json", "{not json");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_file(bad_json); }), "not valid JSON");

  json config = bert_config();
  config["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}};
  const std::string precompiled = dir.write("precompiled.json", config.dump());
  std::string message = error_of([&] { Tokenizer::from_file(precompiled); });
  EXPECT_CONTAINS(message, "normalizer type \"Precompiled\" is not supported");
  EXPECT_CONTAINS(message, precompiled);

  config = bert_config();
  config["model"] = {{"type", "Unigram"}, {"vocab", {{"a", 1}}}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "Unigram \"vocab\" must be a list of [token, score] pairs");
  config["model"] = {{"type", "Unigram"}, {"vocab", json::array({json::array({"a", "high"})})}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "is not [token, score]");
  config["model"] = {{"type", "SentencePieceBPE"}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "model type \"SentencePieceBPE\" is not supported");
  config = bert_config();
  config["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\d+"}}}, {"behavior", "Isolated"}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "Split pre-tokenizer pattern");
  config = bert_config();
  config["decoder"] = {{"type", "CTC"}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "decoder type \"CTC\"");
  config = bert_config();
  config["post_processor"] = {{"type", "Mystery"}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "post_processor type \"Mystery\"");

  EXPECT_CONTAINS(error_of([&] {
                    load(small_bpe({"a", "b"}, {"a b"}, kWhitespaceSplit));
                  }),
                  "makes \"ab\", which is not in the vocabulary");
  EXPECT_CONTAINS(error_of([&] {
                    load(small_bpe({"a", "b", "ab"}, {"a b"}, kWhitespaceSplit, {{"dropout", 0.1}}));
                  }),
                  "dropout");
  // An id far beyond the vocabulary would size the id -> token table by it (found by fuzz/tokenizer_dir.cpp).
  config = small_bpe({"a", "b"}, json::array(), kWhitespaceSplit);
  config["model"]["vocab"]["b"] = 86860209;
  EXPECT_CONTAINS(error_of([&] { load(config); }),
                  "BPE vocabulary id 86860209 of token \"b\" is out of range: ids number the 2 tokens from 0");
  config = bert_config();
  config["model"]["vocab"]["[UNK]"] = -1;
  EXPECT_CONTAINS(error_of([&] { load(config); }), "WordPiece vocabulary id -1 of token \"[UNK]\" is out of range");
  // Integers as floats, which nlohmann would convert with undefined behaviour (found by fuzz/tokenizer.cpp).
  config = bert_config();
  config["added_tokens"][0]["id"] = 2.65e92;
  EXPECT_CONTAINS(error_of([&] { load(config); }), "\"id\" should be an integer in [0, 2147483647], found 2.65e+92");
  config = bert_config();
  config["truncation"] = {{"max_length", -1e300}};
  EXPECT_CONTAINS(error_of([&] { load(config); }), "\"truncation\" \"max_length\" should be an integer");
  config = bert_config();
  config["post_processor"]["single"][0]["SpecialToken"]["type_id"] = 0.5;
  EXPECT_CONTAINS(error_of([&] { load(config); }), "TemplateProcessing item \"type_id\" should be an integer");
  auto tokenizer = load(bert_config());
  EXPECT_CONTAINS(error_of([&] { tokenizer->encode("ok \xC3("); }), "not valid UTF-8 at byte 3");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_pretrained(dir.path.string()); }), "no tokenizer found");
}

}  // namespace
}  // namespace fusetrain::testing
