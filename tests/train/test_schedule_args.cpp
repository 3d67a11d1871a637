#include <gtest/gtest.h>

#include <cmath>

#include "fusetrain/core/error.h"
#include "fusetrain/train/schedule.h"
#include "fusetrain/train/training_args.h"

namespace fusetrain::testing {
namespace {

using train::lr_lambda;
using train::LrSchedule;

TEST(LrSchedule, WarmupThenLinearDecay) {
  // 10 steps, 2 warmup: transformers gives 0, 0.5, then (10 - s) / 8.
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::Linear, 0, 2, 10, 1e-3), 0.0);
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::Linear, 1, 2, 10, 1e-3), 0.5);
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::Linear, 2, 2, 10, 1e-3), 1.0);
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::Linear, 6, 2, 10, 1e-3), 0.5);
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::Linear, 10, 2, 10, 1e-3), 0.0);
}

TEST(LrSchedule, CosineShapes) {
  EXPECT_NEAR(lr_lambda(LrSchedule::Cosine, 6, 2, 10, 1e-3), 0.5, 1e-12);  // half way: cos(pi/2)
  EXPECT_NEAR(lr_lambda(LrSchedule::Cosine, 10, 2, 10, 1e-3), 0.0, 1e-12);
  EXPECT_NEAR(lr_lambda(LrSchedule::CosineWithRestarts, 6, 2, 10, 1e-3), 0.5, 1e-12);
  EXPECT_NEAR(lr_lambda(LrSchedule::CosineWithRestarts, 10, 2, 10, 1e-3), 0.0, 1e-12);
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::Constant, 0, 5, 10, 1e-3), 1.0);
  EXPECT_DOUBLE_EQ(lr_lambda(LrSchedule::ConstantWithWarmup, 1, 4, 10, 1e-3), 0.25);
}

TEST(LrSchedule, PolynomialEndsAtLrEnd) {
  double base = 1e-3;
  EXPECT_NEAR(lr_lambda(LrSchedule::Polynomial, 10, 0, 10, base) * base, 1e-7, 1e-15);
  EXPECT_NEAR(lr_lambda(LrSchedule::Polynomial, 5, 0, 10, base) * base, (base - 1e-7) * 0.5 + 1e-7, 1e-15);
}

TEST(LrSchedule, WarmupRatioRoundsUp) {
  EXPECT_EQ(train::warmup_steps_for(0, 0.06, 2105), 127);
  EXPECT_EQ(train::warmup_steps_for(10, 0.5, 100), 10);
  EXPECT_EQ(train::warmup_steps_for(0.06, 0.0, 2105), 127);  // transformers 5: a float below 1 is a ratio
  EXPECT_EQ(train::warmup_steps_for(0.06, 0.5, 2105), 127);
  EXPECT_THROW(train::parse_lr_schedule("onecycle"), Error);
}

TEST(TrainingArguments, DefaultsMatchTransformers) {
  train::TrainingArguments a;
  EXPECT_EQ(a.per_device_train_batch_size, 8);
  EXPECT_DOUBLE_EQ(a.learning_rate, 5e-5);
  EXPECT_DOUBLE_EQ(a.num_train_epochs, 3.0);
  EXPECT_EQ(a.lr_scheduler_type, "linear");
  EXPECT_EQ(a.logging_steps, 500);
  EXPECT_EQ(a.seed, 42);
  EXPECT_NO_THROW(a.validate());
}

TEST(TrainingArguments, ValidationNamesTheField) {
  auto message = [](train::TrainingArguments a) {
    try {
      a.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  train::TrainingArguments a;
  a.per_device_train_batch_size = 0;
  EXPECT_NE(message(a).find("per_device_train_batch_size must be > 0, found 0"), std::string::npos);
  a = {};
  a.learning_rate = -1e-4;
  EXPECT_NE(message(a).find("learning_rate must be >= 0"), std::string::npos);
  a = {};
  a.eval_strategy = "sometimes";
  EXPECT_NE(message(a).find("eval_strategy must be no, steps or epoch"), std::string::npos);
  a = {};
  a.train_sampling_strategy = "group_by_length";  // transformers 5's LengthGroupedSampler
  EXPECT_EQ(message(a), "");
  a.train_sampling_strategy = "batch_rebalance";
  EXPECT_EQ(message(a),
            "train_sampling_strategy must be \"random\", \"sequential\" or \"group_by_length\", got "
            "\"batch_rebalance\"");
}

TEST(TrainingArguments, JsonRoundTripAndUnknownFields) {
  train::TrainingArguments a;
  a.learning_rate = 3e-4;
  a.eval_steps = 7;
  a.metric_for_best_model = "accuracy";
  train::TrainingArguments b = train::TrainingArguments::from_json(a.to_json());
  EXPECT_DOUBLE_EQ(b.learning_rate, 3e-4);
  EXPECT_EQ(b.eval_steps, 7);
  EXPECT_EQ(b.effective_metric(), "eval_accuracy");
  EXPECT_TRUE(b.effective_greater_is_better());
  EXPECT_THROW(train::TrainingArguments::from_json({{"deepspeed", "x"}}), Error);
  EXPECT_THROW(train::TrainingArguments::from_json({{"seed", "x"}}), Error);
}

}  // namespace
}  // namespace fusetrain::testing
