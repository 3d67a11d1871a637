// Evaluation metrics: classification accuracy and F1, and entity-level precision, recall and F1 over BIO tags.
#include <gtest/gtest.h>

#include "fusetrain/train/trainer.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using train::entity_metrics;
using Tags = std::vector<std::vector<std::string>>;

TEST(Metrics, ClassificationAccuracyAndBinaryF1) {
  train::Predictions p;
  p.classes = 2;
  p.rows = 4;
  p.logits = {0.9f, 0.1f, 0.2f, 0.8f, 0.3f, 0.7f, 0.6f, 0.4f};  // predicts 0, 1, 1, 0
  p.labels = {0, 1, 0, 1};
  auto m = train::classification_metrics(p);
  EXPECT_DOUBLE_EQ(m["accuracy"], 0.5);
  EXPECT_DOUBLE_EQ(m["f1"], 0.5);  // class 1: one true positive, two predicted, two actual
}

TEST(Metrics, EntitiesMustMatchInTypeAndBothEnds) {
  auto m = entity_metrics(Tags{{"B-PER", "I-PER", "O", "B-ORG"}, {"B-LOC", "O"}},
                          Tags{{"B-PER", "I-PER", "O", "B-LOC"}, {"B-LOC", "I-LOC"}});
  // Predicted PER(0-1) right, ORG(3) wrong, LOC(0) wrong (the reference's LOC spans 0-1): 1 of 3 found, 1 of 3.
  EXPECT_DOUBLE_EQ(m["precision"], 1.0 / 3);
  EXPECT_DOUBLE_EQ(m["recall"], 1.0 / 3);
  EXPECT_DOUBLE_EQ(m["f1"], 1.0 / 3);
  EXPECT_DOUBLE_EQ(m["accuracy"], 4.0 / 6);
}

TEST(Metrics, LenientIobReading) {
  // An I-X after O starts an entity; an I-Y after an X entity starts a Y entity; B-X after B-X is two entities.
  auto m = entity_metrics(Tags{{"I-PER", "I-PER", "O", "B-PER", "I-LOC", "B-ORG", "B-ORG"}},
                          Tags{{"B-PER", "I-PER", "O", "B-PER", "B-LOC", "B-ORG", "B-ORG"}});
  EXPECT_DOUBLE_EQ(m["precision"], 1.0);
  EXPECT_DOUBLE_EQ(m["recall"], 1.0);
  EXPECT_DOUBLE_EQ(entity_metrics(Tags{{"O", "O"}}, Tags{{"O", "O"}})["f1"], 0.0);  // no entities at all
  EXPECT_EQ(error_of([] { entity_metrics(Tags{{"O"}}, Tags{{"O", "O"}}); }),
            "entity_metrics: sequence 0 has 1 predicted tags for 2 reference tags");
}

TEST(Metrics, TranscriptionErrorRatesAsJiwerSumsThem) {
  // jiwer.wer / jiwer.cer of these lists: 4/9 and 9/29 (a deletion of a word; a substitution and an insertion; a
  // substitution of é, one UTF-8 character, and a doubled space that words ignore and characters count).
  auto m = train::transcription_metrics({"the cat", "a x c d e", "hello  world"},
                                        {"the cat sat", "a b c d", "h\xc3\xa9llo world"});
  EXPECT_DOUBLE_EQ(m["wer"], 4.0 / 9);
  EXPECT_DOUBLE_EQ(m["cer"], 9.0 / 29);
  EXPECT_EQ(train::transcription_metrics({" x "}, {""}).count("wer"), 0u);  // no reference words: no rate
  EXPECT_DOUBLE_EQ(train::transcription_metrics({""}, {"a b"})["wer"], 1.0);
  EXPECT_CONTAINS(error_of([] { train::transcription_metrics({"a"}, {}); }), "1 transcriptions for 0 references");
}

TEST(Metrics, BioLabelSetsAreRecognised) {
  EXPECT_TRUE(train::is_bio({"B-LOC", "B-PER", "I-PER", "O"}));
  EXPECT_FALSE(train::is_bio({"NEG", "POS"}));
  EXPECT_FALSE(train::is_bio({"O"}));
  EXPECT_FALSE(train::is_bio({}));
}

}  // namespace
}  // namespace fusetrain::testing
