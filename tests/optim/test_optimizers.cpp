// The fused optimizers against step-by-step double-precision transcriptions of torch.optim.AdamW, torch.optim.SGD,
// transformers' Adafactor and torch.nn.utils.clip_grad_norm_; every elementwise optimizer sharded as ZeRO shards it;
// the choice by transformers' optim name. (The Python tests compare each optimizer with the implementation it
// reproduces, through both Trainers.)
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

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

// Every elementwise optimizer updates a ZeRO shard (segments that split parameters, read from the shard's own
// gradient buffer) exactly as the whole store's update updates those elements.
TEST(Optimizers, ShardsUpdateTheirSegmentsAsTheWholeUpdateDoes) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"adamw_torch", ""}, {"sgd", "momentum=0.9,nesterov=true"}, {"rmsprop", "momentum=0.5,centered=true"},
      {"adagrad", "lr_decay=0.1"}, {"lion_32bit", ""}, {"rmsprop_bnb", ""}};
  for (const auto& [name, args] : cases) {
    runtime::ParameterStore whole = make_store(), sharded = make_store();
    whole.set_weight_decay(1, false);
    sharded.set_weight_decay(1, false);
    std::mt19937 rng(4);
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < whole.flat_numel(); ++i) whole.params_data()[i] = sharded.params_data()[i] = normal(rng);
    const optim::OptimizerSpec spec{name, 1e-2, 0.1, 0.9, 0.99, 1e-8, optim::parse_optim_args(args)};
    auto reference = optim::make_optimizer(whole, spec);
    const int64_t n = whole.flat_numel(), cut = 40;  // inside "w" (51 elements), then the rest
    std::vector<optim::Segment> halves[2] = {{{0, cut}, {n / 2, n / 2 + 7}}, {{cut, n / 2}, {n / 2 + 7, n}}};
    std::vector<kernels::DeviceBuffer> shard_grads;  // the shards' gradients: the store's device's memory
    std::vector<std::unique_ptr<optim::Optimizer>> parts;
    for (int r = 0; r < 2; ++r) {
      int64_t numel = 0;
      for (const optim::Segment& seg : halves[r]) numel += seg.end - seg.begin;
      shard_grads.push_back(sharded.device().allocate(static_cast<size_t>(numel) * sizeof(float)));
      parts.push_back(optim::make_optimizer(sharded, spec,
                                            optim::Shard{halves[r], static_cast<float*>(shard_grads[r].get())}));
    }
    for (int t = 1; t <= 4; ++t) {
      fill_grads(whole, rng, 0.5);
      for (int r = 0; r < 2; ++r) {
        int64_t at = 0;
        float* g = static_cast<float*>(shard_grads[static_cast<size_t>(r)].get());
        for (const optim::Segment& seg : halves[r])
          for (int64_t k = seg.begin; k < seg.end; ++k) g[at++] = whole.grads_data()[k];
      }
      reference->step(0.5, 1e-2);
      for (auto& part : parts) part->step(0.5, 1e-2);
    }
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(whole.params_data()[i], sharded.params_data()[i]) << name << " element " << i;
    EXPECT_EQ(parts[0]->states().size(), reference->states().size()) << name;
  }
}

TEST(Optimizers, BadNamesAndOptionsAreOneClearError) {
  runtime::ParameterStore s = make_store();
  auto message = [&](const std::string& name, const std::string& args) {
    return error_of([&] { optim::make_optimizer(s, {name, 1e-3, 0.0, 0.9, 0.999, 1e-8, optim::parse_optim_args(args)}); });
  };
  EXPECT_CONTAINS(message("adamw_8bit_typo", ""), "optim: the engine runs adamw_torch,");
  EXPECT_CONTAINS(message("adamw_8bit_typo", ""), "found \"adamw_8bit_typo\"");
  EXPECT_CONTAINS(message("sgd", "momentum=abc"), "optim_args: momentum=abc is not a finite number (optim sgd)");
  EXPECT_CONTAINS(message("sgd", "betas=0.9"), "optim_args: optim sgd takes momentum, dampening, nesterov, weight_decay, "
                                              "found betas");
  EXPECT_CONTAINS(message("lion_32bit", "beta1=0.5"), "optim_args: optim lion_32bit takes no options, found beta1");
  EXPECT_CONTAINS(error_of([&] { optim::parse_optim_args("momentum=0.9,nesterov"); }),
                  "optim_args: \"nesterov\" is not key=value");
  EXPECT_EQ(optim::parse_optim_args(" momentum = 0.9, nesterov=True "),
            (std::map<std::string, std::string>{{"momentum", "0.9"}, {"nesterov", "True"}}));
  EXPECT_CONTAINS(message("sgd", "momentum=-1"), "SGD: momentum must be >= 0, found -1");
}

// transformers.optimization.Adafactor with scale_parameter=False, relative_step=False (what the Trainer makes),
// transcribed in double: a factored (rank >= 2, here rank 3) and an elementwise (rank 1) second moment.
TEST(Adafactor, MatchesTransformersFormula) {
  runtime::ParameterStore s(std::vector<std::pair<std::string, Shape>>{{"m", {2, 5, 7}}, {"v", {9}}});
  s.set_weight_decay(1, false);
  std::mt19937 rng(6);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < s.flat_numel(); ++i) s.params_data()[i] = normal(rng);
  optim::Adafactor opt(s, {.lr = 0.05, .weight_decay = 0.1});
  std::vector<double> p(s.params_data(), s.params_data() + s.flat_numel());
  std::vector<double> row(10), col(14), sq(9);
  const double eps = 1e-30;
  const int64_t m0 = s.slots()[0].offset, v0 = s.slots()[1].offset;  // slots start aligned, not back to back
  for (int t = 1; t <= 6; ++t) {
    fill_grads(s, rng, t == 3 ? 50.0 : 0.3);  // step 3's update is clipped
    const double b2 = 1 - std::pow(t, -0.8), lr = 0.05;
    const float* gm = s.grads_data() + m0;
    const float* gv = s.grads_data() + v0;
    std::vector<double> um(70), uv(9);
    for (int b = 0; b < 2; ++b) {  // "m": (2, 5, 7)
      for (int r = 0; r < 5; ++r) {
        double mean = 0;
        for (int c = 0; c < 7; ++c) mean += double(gm[b * 35 + r * 7 + c]) * gm[b * 35 + r * 7 + c] + eps;
        row[b * 5 + r] = b2 * row[b * 5 + r] + (1 - b2) * mean / 7;
      }
      for (int c = 0; c < 7; ++c) {
        double mean = 0;
        for (int r = 0; r < 5; ++r) mean += double(gm[b * 35 + r * 7 + c]) * gm[b * 35 + r * 7 + c] + eps;
        col[b * 7 + c] = b2 * col[b * 7 + c] + (1 - b2) * mean / 5;
      }
      double row_mean = 0;
      for (int r = 0; r < 5; ++r) row_mean += row[b * 5 + r] / 5;
      for (int r = 0; r < 5; ++r)
        for (int c = 0; c < 7; ++c)
          um[b * 35 + r * 7 + c] = gm[b * 35 + r * 7 + c] / std::sqrt(row[b * 5 + r] / row_mean) / std::sqrt(col[b * 7 + c]);
    }
    for (int k = 0; k < 9; ++k) {
      sq[k] = b2 * sq[k] + (1 - b2) * (double(gv[k]) * gv[k] + eps);
      uv[k] = gv[k] / std::sqrt(sq[k]);
    }
    for (auto [u, at, decays] : {std::tuple{&um, m0, true}, std::tuple{&uv, v0, false}}) {
      double squares = 0;
      for (double x : *u) squares += x * x;
      const double divisor = std::max(std::sqrt(squares / static_cast<double>(u->size())), 1.0);
      for (size_t k = 0; k < u->size(); ++k) {
        double& pk = p[static_cast<size_t>(at) + k];
        if (decays) pk -= 0.1 * lr * pk;
        pk -= (*u)[k] / divisor * lr;
      }
    }
    opt.step();
  }
  double max_err = 0;
  for (size_t k = 0; k < p.size(); ++k) max_err = std::max(max_err, std::abs(p[k] - s.params_data()[k]));
  EXPECT_LT(max_err, 1e-5);
  const std::vector<optim::StateBuffer> states = opt.states();
  ASSERT_EQ(states.size(), 3u);
  EXPECT_EQ(states[0].name, "exp_avg_sq_row");
  EXPECT_EQ(states[0].per_slot[0].second, Shape({2, 5}));
  EXPECT_EQ(states[1].per_slot[0].second, Shape({2, 7}));
  EXPECT_EQ(states[2].per_slot[1].second, Shape({9}));
  EXPECT_EQ(states[2].per_slot[0].first, -1);
  EXPECT_EQ(opt.state_bytes(), (10 + 14 + 9) * sizeof(float));
}

// Three "ranks" (threads), each updating one ZeRO shard cut mid-row, mid-matrix and mid-vector, their per-parameter
// statistics summed by a shared reduction: after every step their shards together are the whole optimizer's update
// (the f64 sums in another order: within 1e-6), and every rank holds the whole optimizer's states.
TEST(Adafactor, ShardsSumTheirStatisticsToTheWholeUpdate) {
  const std::vector<std::pair<std::string, Shape>> shapes{{"m", {2, 5, 7}}, {"v", {9}}, {"w", {6, 4}}};
  runtime::ParameterStore whole(shapes);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < whole.flat_numel(); ++i) whole.params_data()[i] = normal(rng);
  const int64_t n = whole.flat_numel();
  const int64_t v0 = whole.slots()[1].offset;
  const std::vector<std::vector<optim::Segment>> shards{{{0, 23}}, {{23, v0 + 4}}, {{v0 + 4, n}}};
  constexpr int kRanks = 3;
  std::vector<std::unique_ptr<runtime::ParameterStore>> stores;
  std::vector<kernels::DeviceBuffer> grads;  // the shards' gradients: the store's device's memory
  std::vector<std::unique_ptr<optim::Adafactor>> ranks;
  // The reduction: each rank adds its values into a shared sum; the last to arrive wakes the others.
  std::mutex mutex;
  std::condition_variable arrived;
  std::vector<double> sum;
  int waiting = 0, generation = 0;
  auto all_reduce = [&](double* data, int64_t count) {
    std::unique_lock<std::mutex> lock(mutex);
    if (waiting == 0) sum.assign(static_cast<size_t>(count), 0.0);
    for (int64_t k = 0; k < count; ++k) sum[static_cast<size_t>(k)] += data[k];
    const int mine = generation;
    if (++waiting == kRanks) {
      waiting = -kRanks;  // now counting the ranks that have read the sum
      ++generation;
      arrived.notify_all();
    } else {
      arrived.wait(lock, [&] { return generation != mine; });
    }
    std::copy(sum.begin(), sum.end(), data);
    if (++waiting == 0) arrived.notify_all();
    else arrived.wait(lock, [&] { return waiting >= 0; });
  };
  for (int r = 0; r < kRanks; ++r) {
    stores.push_back(std::make_unique<runtime::ParameterStore>(shapes));
    std::copy_n(whole.params_data(), n, stores[r]->params_data());
    grads.push_back(stores[r]->device().allocate(
        static_cast<size_t>(shards[r][0].end - shards[r][0].begin) * sizeof(float)));
    ranks.push_back(std::make_unique<optim::Adafactor>(
        *stores[r], optim::AdafactorConfig{.lr = 0.05, .weight_decay = 0.1},
        optim::Shard{shards[r], static_cast<float*>(grads[static_cast<size_t>(r)].get())}));
    ranks[r]->set_all_reduce(all_reduce);
    ranks[r]->set_num_threads(1);
  }
  optim::Adafactor reference(whole, {.lr = 0.05, .weight_decay = 0.1});
  reference.set_num_threads(1);
  for (int t = 1; t <= 5; ++t) {
    fill_grads(whole, rng, t == 2 ? 50.0 : 0.3);  // step 2's update is clipped
    for (int r = 0; r < kRanks; ++r)
      std::copy(whole.grads_data() + shards[r][0].begin, whole.grads_data() + shards[r][0].end,
                static_cast<float*>(grads[static_cast<size_t>(r)].get()));
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { ranks[r]->step(); });
    for (std::thread& thread : threads) thread.join();
    reference.step();
    double max_err = 0;
    for (int r = 0; r < kRanks; ++r)
      for (int64_t k = shards[r][0].begin; k < shards[r][0].end; ++k)
        max_err = std::max(max_err, std::abs(double(stores[r]->params_data()[k]) - whole.params_data()[k]));
    ASSERT_LT(max_err, 1e-6) << "step " << t;
    for (int r = 0; r < kRanks; ++r) {  // the gather: every rank gets every shard's parameters
      std::copy_n(whole.params_data(), n, stores[r]->params_data());
      const std::vector<optim::StateBuffer> mine = ranks[r]->states(), want = reference.states();
      for (size_t b = 0; b < want.size(); ++b)
        for (int64_t k = 0; k < want[b].numel; ++k) {
          const float x = static_cast<const float*>(mine[b].data)[k], y = static_cast<const float*>(want[b].data)[k];
          ASSERT_NEAR(x, y, 1e-6 * std::abs(y)) << want[b].name << " element " << k << " rank " << r;
        }
    }
  }
  // Over a shard and without the ranks' sums, a step is refused by name.
  runtime::ParameterStore alone(shapes);
  optim::Adafactor lonely(alone, {}, optim::Shard{{{0, 23}}, nullptr});
  EXPECT_CONTAINS(error_of([&] { lonely.step(); }), "Adafactor over a ZeRO shard needs the ranks' sums");
}

}  // namespace
}  // namespace fusetrain::testing
