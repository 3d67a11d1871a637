// The fused optimizers against step-by-step double-precision transcriptions of
// torch.optim.AdamW / torch.optim.SGD and torch.nn.utils.clip_grad_norm_.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "fusetrain/fusetrain.h"
#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

runtime::ParameterStore make_store() {
  return runtime::ParameterStore(
      std::vector<std::pair<std::string, Shape>>{{"w", {17, 3}}, {"b", {3}}, {"big", {300, 250}}});
}

void fill_grads(runtime::ParameterStore& s, std::mt19937& rng, double scale) {
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < s.slots().size(); ++i) {
    float* g = s.grad(i).data_as<float>();
    for (int64_t k = 0; k < s.slots()[i].numel; ++k) g[k] = static_cast<float>(scale) * normal(rng);
  }
}

TEST(AdamW, MatchesTorchFormula) {
  runtime::ParameterStore s = make_store();
  s.set_weight_decay(1, false);  // "b" is a bias
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < s.flat_numel(); ++i) s.params_data()[i] = normal(rng);
  optim::AdamWConfig cfg{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.98, .eps = 1e-6, .weight_decay = 0.1};
  optim::AdamW opt(s, cfg);
  // Reference state in double.
  std::vector<double> p(s.params_data(), s.params_data() + s.flat_numel()), m(p.size()), v(p.size());
  for (int t = 1; t <= 10; ++t) {
    fill_grads(s, rng, 0.5);
    double lr = cfg.lr * (t % 3 == 0 ? 0.5 : 1.0);
    for (size_t i = 0; i < s.slots().size(); ++i) {
      const runtime::ParamSlot& slot = s.slots()[i];
      for (int64_t k = slot.offset; k < slot.offset + slot.numel; ++k) {
        double g = s.grads_data()[k];
        if (slot.weight_decay) p[k] *= 1 - lr * cfg.weight_decay;
        m[k] = cfg.beta1 * m[k] + (1 - cfg.beta1) * g;
        v[k] = cfg.beta2 * v[k] + (1 - cfg.beta2) * g * g;
        double bias1 = 1 - std::pow(cfg.beta1, t), bias2 = 1 - std::pow(cfg.beta2, t);
        p[k] -= lr / bias1 * m[k] / (std::sqrt(v[k]) / std::sqrt(bias2) + cfg.eps);
      }
    }
    opt.step(1.0, lr);
  }
  double max_err = 0;
  for (size_t i = 0; i < s.slots().size(); ++i)
    for (int64_t k = s.slots()[i].offset; k < s.slots()[i].offset + s.slots()[i].numel; ++k)
      max_err = std::max(max_err, std::abs(p[k] - s.params_data()[k]));
  EXPECT_LT(max_err, 2e-6);
  EXPECT_EQ(opt.step_count(), 10);
}

TEST(AdamW, RejectsBadHyperparameters) {
  runtime::ParameterStore s = make_store();
  EXPECT_THROW(optim::AdamW(s, {.lr = -1.0}), Error);
  EXPECT_THROW(optim::AdamW(s, {.beta1 = 1.0}), Error);
}

TEST(ClipGradNorm, ScalesToMaxNormAndReportsOriginalNorm) {
  runtime::ParameterStore s = make_store();
  std::mt19937 rng(2);
  fill_grads(s, rng, 3.0);
  double expected = 0;
  for (int64_t i = 0; i < s.flat_numel(); ++i) expected += double(s.grads_data()[i]) * s.grads_data()[i];
  expected = std::sqrt(expected);
  double norm = optim::clip_grad_norm(s, 1.0);
  EXPECT_NEAR(norm, expected, 1e-6 * expected);
  EXPECT_NEAR(optim::grad_norm(s), 1.0, 1e-5);
  // Below the threshold nothing changes.
  EXPECT_NEAR(optim::clip_grad_norm(s, 10.0), 1.0, 1e-5);
  EXPECT_NEAR(optim::grad_norm(s), 1.0, 1e-5);
}

// An overflowed fp16 step (inf or NaN in any gradient) changes nothing; a finite one steps.
TEST(AdamW, ClipAndStepIfFiniteSkipsOverflowedGradients) {
  runtime::ParameterStore params({{"a", Shape{5}}, {"b", Shape{3}}});
  for (int64_t i = 0; i < params.flat_numel(); ++i) params.params_data()[i] = 0.5f;
  optim::AdamW adamw(params, {.lr = 0.1});
  std::vector<float> before(params.params_data(), params.params_data() + params.flat_numel());
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    params.zero_grads();
    params.grad(1).data_as<float>()[2] = bad;
    EXPECT_FALSE(std::isfinite(adamw.clip_and_step(1.0, -1.0, 1.0 / 65536)));
    EXPECT_EQ(adamw.step_count(), 0);
    for (int64_t i = 0; i < params.flat_numel(); ++i) ASSERT_EQ(params.params_data()[i], before[i]);
  }
  params.zero_grads();
  params.grad(0).data_as<float>()[0] = 65536.0f;
  EXPECT_NEAR(adamw.clip_and_step(1.0, -1.0, 1.0 / 65536), 1.0, 1e-12);  // the unscaled norm
  EXPECT_EQ(adamw.step_count(), 1);
  EXPECT_NE(params.params_data()[0], before[0]);
}

// torch.amp.GradScaler's schedule: halve on overflow (and count the skip), double
// after growth_interval clean steps; the state survives a JSON round trip.
TEST(LossScaler, BacksOffGrowsAndRoundTrips) {
  train::LossScaler scaler(1024.0, 2.0, 0.5, 3);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 512.0);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 1024.0);
  scaler.update(false);
  train::LossScaler restored;
  restored.load_json(scaler.to_json());
  EXPECT_EQ(restored.scale(), 1024.0);
  EXPECT_EQ(restored.skipped_steps(), 1);
  EXPECT_EQ(restored.to_json(), scaler.to_json());
  EXPECT_THROW(restored.load_json(nlohmann::json{{"scale", -1.0}, {"growth_tracker", 0}}), Error);
  EXPECT_THROW(restored.load_json(nlohmann::json::array()), Error);
  // Errors name the file and the field; skipped_steps cannot exceed the steps taken.
  std::string message = error_of([&] {
    restored.load_json(nlohmann::json{{"scale", 8.0}, {"growth_tracker", "x"}}, "ckpt/scaler.json");
  });
  EXPECT_CONTAINS(message, "ckpt/scaler.json: \"growth_tracker\" should be an integer, found \"x\"");
  message = error_of([&] {
    restored.load_json(nlohmann::json{{"scale", 8.0}, {"growth_tracker", 0}, {"skipped_steps", 9}}, "s.json", 4);
  });
  EXPECT_CONTAINS(message, "s.json: \"skipped_steps\" is 9, expected a value in [0, 4]");
  EXPECT_EQ(restored.scale(), 1024.0) << "a refused state changes nothing";
  EXPECT_THROW(train::LossScaler(0.0), Error);
}

TEST(Sgd, MomentumAndNesterovMatchTorchFormula) {
  for (bool nesterov : {false, true}) {
    runtime::ParameterStore s = make_store();
    std::mt19937 rng(3);
    optim::SgdConfig cfg{.lr = 0.1, .momentum = 0.9, .dampening = 0.0, .weight_decay = 1e-3, .nesterov = nesterov};
    optim::Sgd opt(s, cfg);
    std::vector<double> p(s.params_data(), s.params_data() + s.flat_numel()), buf(p.size());
    for (int t = 1; t <= 5; ++t) {
      fill_grads(s, rng, 1.0);
      for (size_t k = 0; k < p.size(); ++k) {
        double g = s.grads_data()[k] + cfg.weight_decay * p[k];
        buf[k] = t == 1 ? g : cfg.momentum * buf[k] + (1 - cfg.dampening) * g;
        g = nesterov ? g + cfg.momentum * buf[k] : buf[k];
        p[k] -= cfg.lr * g;
      }
      opt.step();
    }
    double max_err = 0;
    for (size_t k = 0; k < p.size(); ++k) max_err = std::max(max_err, std::abs(p[k] - s.params_data()[k]));
    EXPECT_LT(max_err, 1e-5) << "nesterov=" << nesterov;
  }
}

}  // namespace
}  // namespace fusetrain::testing
