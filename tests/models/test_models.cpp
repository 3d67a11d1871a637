// Model builders end to end on tiny configs: every architecture runs forward and
// backward, whole-model gradients match finite differences, save/load round-trips,
// and bad checkpoints and configs give clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "fusetrain/models/model.h"
#include "fusetrain/models/registry.h"

#include "support/test_util.h"

namespace fusetrain::testing {
namespace {

using models::Batch;
using models::Model;
namespace fs = std::filesystem;

nlohmann::json tiny_config(const std::string& model_type) {
  if (model_type == "gpt2")
    return {{"model_type", "gpt2"}, {"vocab_size", 37},  {"n_embd", 16},      {"n_layer", 2},
            {"n_head", 2},          {"n_positions", 32}, {"pad_token_id", 0}, {"num_labels", 3}};
  if (model_type == "distilbert")
    return {{"model_type", "distilbert"},
            {"vocab_size", 37},
            {"dim", 16},
            {"n_layers", 2},
            {"n_heads", 2},
            {"hidden_dim", 24},
            {"max_position_embeddings", 32},
            {"num_labels", 3}};
  return {{"model_type", model_type},
          {"vocab_size", 37},
          {"hidden_size", 16},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"intermediate_size", 24},
          {"max_position_embeddings", 40},
          {"type_vocab_size", 2},
          {"num_labels", 3},
          {"pad_token_id", model_type == "roberta" ? 1 : 0}};
}

struct Data {
  std::vector<int64_t> ids, mask, labels;
  std::vector<float> values;
  Batch batch;
};

// Random ids in [2, V), right padding in the second row, labels per head.
Data make_batch(const Model& m, int64_t B, int64_t T, uint64_t seed) {
  Data d;
  std::mt19937_64 rng(seed);
  int64_t vocab = m.config().value("vocab_size", 37);
  d.ids.resize(B * T);
  d.mask.assign(B * T, 1);
  for (auto& id : d.ids) id = 2 + static_cast<int64_t>(rng() % (vocab - 2));
  int64_t pad = m.config().value("pad_token_id", 0);
  for (int64_t t = T - 2; t < T; ++t) {
    d.mask[1 * T + t] = 0;
    d.ids[1 * T + t] = pad;
  }
  d.batch.set("input_ids", Tensor::view(d.ids.data(), {B, T}, DType::i64));
  d.batch.set("attention_mask", Tensor::view(d.mask.data(), {B, T}, DType::i64));
  const std::string& arch = m.architecture();
  if (arch.find("MaskedLM") != std::string::npos || arch.find("LMHead") != std::string::npos ||
      arch.find("TokenClassification") != std::string::npos) {
    int64_t classes = arch.find("TokenClassification") != std::string::npos ? 3 : vocab;
    d.labels.resize(B * T);
    for (size_t i = 0; i < d.labels.size(); ++i)
      d.labels[i] = i % 3 == 0 ? -100 : static_cast<int64_t>(rng() % classes);
    d.batch.set("labels", Tensor::view(d.labels.data(), {B, T}, DType::i64));
  } else if (arch.find("SequenceClassification") != std::string::npos) {
    d.labels.resize(B);
    for (auto& l : d.labels) l = static_cast<int64_t>(rng() % 3);
    d.batch.set("labels", Tensor::view(d.labels.data(), {B}, DType::i64));
  } else if (arch.find("QuestionAnswering") != std::string::npos) {
    d.labels = {1, 3, 2, T + 5};  // start0, start1, end0, end1 (clamped to T: ignored)
    d.batch.set("start_positions", Tensor::view(d.labels.data(), {B}, DType::i64));
    d.batch.set("end_positions", Tensor::view(d.labels.data() + 2, {B}, DType::i64));
  }
  return d;
}

// A copy of every gradient, in the flat buffer's order.
std::vector<float> gradients_of(const Model& m) {
  return {m.params().grads_data(), m.params().grads_data() + m.params().flat_numel()};
}

// ‖got − want‖ / ‖want‖ over whole gradient buffers.
double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

const std::vector<std::pair<std::string, std::string>> kHeads = {{"bert", "BertForMaskedLM"},
                                                                 {"bert", "BertForSequenceClassification"},
                                                                 {"bert", "BertForTokenClassification"},
                                                                 {"bert", "BertForQuestionAnswering"},
                                                                 {"roberta", "RobertaForMaskedLM"},
                                                                 {"roberta", "RobertaForSequenceClassification"},
                                                                 {"roberta", "RobertaForQuestionAnswering"},
                                                                 {"distilbert", "DistilBertForMaskedLM"},
                                                                 {"distilbert", "DistilBertForSequenceClassification"},
                                                                 {"gpt2", "GPT2LMHeadModel"},
                                                                 {"gpt2", "GPT2ForSequenceClassification"}};

class Heads : public ::testing::TestWithParam<size_t> {};

TEST_P(Heads, GradientsMatchFiniteDifferences) {
  auto [type, arch] = kHeads[GetParam()];
  auto model = Model::from_config(tiny_config(type), 5, arch);
  Data d = make_batch(*model, 2, 7, 9);
  double loss = model->loss_and_grads(d.batch);
  ASSERT_TRUE(std::isfinite(loss)) << arch;
  // A few elements of every parameter, central differences in f32. Padding rows
  // of embeddings get no gradient by design (torch.nn.Embedding(padding_idx)), so
  // rows 0 and 1 of embedding tables (the pad ids of these configs) are skipped.
  std::mt19937_64 rng(3);
  double worst = 0;
  for (const std::string& name : model->state_dict_names()) {
    Tensor p = model->parameter(name);
    Tensor g = model->gradient(name).clone();
    for (int k = 0; k < 2; ++k) {
      int64_t i = static_cast<int64_t>(rng() % static_cast<uint64_t>(p.numel()));
      bool embedding = name.find("embeddings") != std::string::npos || name.find("decoder") != std::string::npos ||
                       name.find("wte") != std::string::npos || name.find("projector.weight") != std::string::npos;
      if (embedding && p.shape().rank() == 2 && p.shape()[0] > 4 && i / p.shape()[1] < 2) i += 2 * p.shape()[1];
      double original = p.item(i), eps = 2e-3;
      p.set_item(i, original + eps);
      double up = *model->forward(d.batch).loss;
      p.set_item(i, original - eps);
      double down = *model->forward(d.batch).loss;
      p.set_item(i, original);
      double numeric = (up - down) / (2 * eps);
      double err = std::abs(numeric - g.item(i)) / std::max(3e-2, std::abs(numeric));
      worst = std::max(worst, err);
      EXPECT_LT(err, 5e-2) << arch << " " << name << "[" << i << "] analytic " << g.item(i) << " numeric " << numeric;
    }
  }
}

TEST_P(Heads, SaveAndLoadRoundTrip) {
  auto [type, arch] = kHeads[GetParam()];
  auto model = Model::from_config(tiny_config(type), 11, arch);
  Data d = make_batch(*model, 2, 5, 1);
  Tensor before = model->forward(d.batch).logits.clone();
  fs::path dir =
      fs::temp_directory_path() / ("fusetrain_model_" + std::to_string(GetParam()) + "_" + std::to_string(getpid()));
  model->save_pretrained(dir.string());
  auto loaded = Model::from_pretrained(dir.string());
  EXPECT_EQ(loaded->architecture(), arch);
  EXPECT_TRUE(loaded->missing_keys().empty());
  Tensor after = loaded->forward(d.batch).logits;
  ASSERT_EQ(before.shape(), after.shape());
  for (int64_t i = 0; i < before.numel(); ++i) ASSERT_EQ(before.item(i), after.item(i)) << arch;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(AllHeads, Heads, ::testing::Range<size_t>(0, kHeads.size()),
                         [](const ::testing::TestParamInfo<size_t>& info) { return kHeads[info.param].second; });

TEST(Models, Bf16MixedPrecisionTracksF32) {
  for (const auto& [type, arch] :
       {std::pair<std::string, std::string>{"bert", "BertForMaskedLM"}, {"gpt2", "GPT2LMHeadModel"}}) {
    auto model = Model::from_config(tiny_config(type), 4, arch);
    Data d = make_batch(*model, 2, 7, 3);
    double f32 = model->loss_and_grads(d.batch);
    std::vector<float> g32 = gradients_of(*model);
    model->set_bf16(true);
    double bf16 = model->loss_and_grads(d.batch);
    EXPECT_NEAR(bf16, f32, 0.01 * std::abs(f32)) << arch;
    EXPECT_LT(relative_l2(gradients_of(*model), g32), 0.05) << arch;
    EXPECT_GT(relative_l2(gradients_of(*model), g32), 0.0) << arch << ": the bf16 path must actually round";
  }
}

TEST(Models, DropoutIsOnlyActiveWhenTraining) {
  nlohmann::json cfg = tiny_config("bert");
  cfg["hidden_dropout_prob"] = 0.3;
  auto model = Model::from_config(cfg, 1, "BertForMaskedLM");
  Data d = make_batch(*model, 2, 6, 2);
  double eval1 = *model->forward(d.batch).loss, eval2 = *model->forward(d.batch).loss;
  EXPECT_EQ(eval1, eval2);
  double train = *model->forward(d.batch, /*training=*/true).loss;
  EXPECT_NE(train, eval1);
}

TEST(Models, ConfigErrorsNameTheField) {
  nlohmann::json cfg = tiny_config("bert");
  cfg["num_attention_heads"] = 5;
  EXPECT_NE(error_of([&] { Model::from_config(cfg); }).find("\"hidden_size\" is 16 but \"num_attention_heads\" 5"),
            std::string::npos);
  cfg = tiny_config("bert");
  cfg["hidden_act"] = "swish";
  EXPECT_NE(error_of([&] { Model::from_config(cfg); }).find("\"hidden_act\" is \"swish\""), std::string::npos);
  cfg["model_type"] = "t5";
  EXPECT_NE(error_of([&] { Model::from_config(cfg); }).find("unknown model_type \"t5\""), std::string::npos);
  EXPECT_NE(error_of([&] {
              Model::from_config(tiny_config("bert"), 0, "BertForNextSentencePrediction");
            }).find("not supported (supported: BertModel"),
            std::string::npos);
  cfg = tiny_config("gpt2");
  cfg.erase("n_embd");
  EXPECT_NE(error_of([&] { Model::from_config(cfg); }).find("missing required field \"n_embd\""), std::string::npos);
  // Integral values no int64_t holds are refused, not converted (found by fuzz/config.cpp).
  cfg = tiny_config("bert");
  auto refused = [&](const nlohmann::json& size) {
    cfg["intermediate_size"] = size;
    return error_of([&] { Model::from_config(cfg); });
  };
  EXPECT_NE(refused(1.5e106).find("\"intermediate_size\" should be an integer, found 1.5e+106"), std::string::npos);
  EXPECT_NE(refused(uint64_t{1} << 63).find("should be an integer, found 9223372036854775808"), std::string::npos);
}

TEST(Models, BadBatchesGiveClearErrors) {
  auto model = Model::from_config(tiny_config("bert"), 0, "BertForSequenceClassification");
  std::vector<int64_t> ids(2 * 50, 3);
  Batch batch;
  batch.set("input_ids", Tensor::view(ids.data(), {2, 50}, DType::i64));
  EXPECT_NE(error_of([&] { model->forward(batch); }).find("sequence length 50 exceeds the model's maximum of 40"),
            std::string::npos);
  batch.set("input_ids", Tensor::view(ids.data(), {2, 5}, DType::i64));
  ids[3] = 99;
  EXPECT_NE(error_of([&] { model->forward(batch); }).find("99"), std::string::npos);
  ids[3] = 3;
  std::vector<int64_t> labels{0, 7};
  batch.set("labels", Tensor::view(labels.data(), {2}, DType::i64));
  EXPECT_NE(error_of([&] { model->loss_and_grads(batch); }).find("labels: value 7"), std::string::npos);
}

TEST(Models, HeadMissingFromCheckpointIsInitialisedAndReported) {
  auto base = Model::from_config(tiny_config("bert"), 3, "BertModel");
  fs::path dir = fs::temp_directory_path() / ("fusetrain_base_" + std::to_string(getpid()));
  base->save_pretrained(dir.string());
  auto cls = Model::from_pretrained(dir.string(), "BertForSequenceClassification", {{"num_labels", 2}});
  std::vector<std::string> expected{"classifier.weight", "classifier.bias"};  // transformers' order
  EXPECT_EQ(cls->missing_keys(), expected);
  // The body came from the checkpoint, under the head model's "bert." prefix.
  Tensor a = base->parameter("encoder.layer.1.output.dense.weight");
  Tensor b = cls->parameter("bert.encoder.layer.1.output.dense.weight");
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.item(i), b.item(i));
  fs::remove_all(dir);
}

// fp16: half-precision projection operands track f32, and the loss scale multiplies
// every gradient (a power of two: exactly, barring f16 underflow) without touching the loss.
TEST(Models, Fp16MixedPrecisionTracksF32AndScalesGradients) {
  for (const auto& [type, arch] :
       {std::pair<std::string, std::string>{"bert", "BertForMaskedLM"}, {"gpt2", "GPT2LMHeadModel"}}) {
    auto model = Model::from_config(tiny_config(type), 4, arch);
    Data d = make_batch(*model, 2, 7, 3);
    double f32 = model->loss_and_grads(d.batch);
    const models::PassLog* plain_log = model->last_pass_log();
    std::vector<float> g32 = gradients_of(*model);
    model->set_fp16(true);
    EXPECT_FALSE(model->bf16());
    double fp16 = model->loss_and_grads(d.batch);
    ASSERT_NE(model->last_pass_log(), plain_log) << "fp16 must compile its own plan";
    EXPECT_GT(model->last_pass_log()->ops_after.at("Cast"), 0) << arch;
    EXPECT_NEAR(fp16, f32, 0.01 * std::abs(f32)) << arch;
    std::vector<float> g16 = gradients_of(*model);
    EXPECT_LT(relative_l2(g16, g32), 0.02) << arch;
    EXPECT_GT(relative_l2(g16, g32), 0.0) << arch << ": the fp16 path must actually round";
    model->set_loss_scale(1024.0);
    double scaled_loss = model->loss_and_grads(d.batch);
    EXPECT_EQ(scaled_loss, fp16) << arch << ": the loss itself is not scaled";
    double worst = 0;
    for (size_t i = 0; i < g16.size(); ++i)
      worst = std::max(worst, std::abs(model->params().grads_data()[i] / 1024.0 - g16[i]) /
                                  std::max(1e-3, double(std::abs(g16[i]))));
    EXPECT_LT(worst, 1e-2) << arch;
  }
}

// Activation checkpointing changes where activations are computed, not what: with
// dropout on (masks redrawn from the same counter stream) the loss and every gradient
// are bit-identical, and the activation arena is smaller.
TEST(Models, RecomputeGivesIdenticalGradientsInASmallerArena) {
  for (const auto& [type, arch, bf16] :
       {std::tuple<std::string, std::string, bool>{"bert", "BertForSequenceClassification", false},
        {"bert", "BertForMaskedLM", true},
        {"distilbert", "DistilBertForMaskedLM", false},
        {"gpt2", "GPT2LMHeadModel", false}}) {
    nlohmann::json cfg = tiny_config(type);
    cfg[type == "gpt2" ? "n_layer" : type == "distilbert" ? "n_layers" : "num_hidden_layers"] = 4;
    auto model = Model::from_config(cfg, 6, arch);
    model->set_bf16(bf16);
    model->set_num_threads(2);  // kernel scratch in the arena grows with threads; the comparison is of activations
    Data d = make_batch(*model, 2, 24, 8);
    std::vector<double> losses;
    std::vector<std::vector<float>> grads;
    std::vector<size_t> peaks;
    for (bool recompute : {false, true}) {
      model->set_recompute(recompute);
      model->set_rng_step(3);
      losses.push_back(model->loss_and_grads(d.batch, /*training=*/true));
      grads.emplace_back(model->params().grads_data(), model->params().grads_data() + model->params().flat_numel());
      peaks.push_back(model->last_plan()->memory_report().activation_peak_bytes);
      ASSERT_NE(model->last_pass_log(), nullptr);
      const std::vector<std::string>& applied = model->last_pass_log()->applied;
      EXPECT_EQ(std::count_if(applied.begin(), applied.end(),
                              [](const std::string& a) { return a.rfind("recompute:", 0) == 0; }),
                recompute ? 1 : 0)
          << arch;
      // The classifier reads the first token: the last layer runs on it alone and is not checkpointed.
      const int recomputed_layers = arch == "BertForSequenceClassification" ? 3 : 4;
      EXPECT_EQ(model->last_pass_log()->ops_after.at("Attention"), recompute ? 4 + recomputed_layers : 4) << arch;
    }
    EXPECT_EQ(losses[0], losses[1]) << arch;
    for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << arch << " gradient " << i;
    EXPECT_LT(static_cast<double>(peaks[1]), 0.8 * static_cast<double>(peaks[0])) << arch;
  }
}

// The fusion passes change where data lives, not the arithmetic: every architecture
// gives the same loss and gradients with and without them (dropout on), bit for bit
// except where a first-token classifier's last layer is pruned to that token.
TEST(Models, FusionPassesKeepLossAndGradientsBitForBit) {
  for (const auto& [type, arch] : kHeads)
    for (bool bf16 : {false, true}) {
      auto model = Model::from_config(tiny_config(type), 2, arch);
      model->set_bf16(bf16);
      model->set_count_unfused_ops(true);
      Data d = make_batch(*model, 2, 9, 4);
      std::vector<double> losses;
      std::vector<std::vector<float>> grads;
      bool pruned = false;
      for (bool fusions : {false, true}) {
        model->set_fusions(fusions);
        model->set_rng_step(1);
        losses.push_back(model->loss_and_grads(d.batch, /*training=*/true));
        grads.emplace_back(model->params().grads_data(), model->params().grads_data() + model->params().flat_numel());
        const models::PassLog& log = *model->last_pass_log();
        int transposes = log.ops_after.count("Transpose") ? log.ops_after.at("Transpose") : 0;
        auto dropouts = [](const std::map<std::string, int>& ops) {
          return ops.count("Dropout") ? ops.at("Dropout") : 0;
        };
        if (fusions) {
          pruned = std::any_of(log.applied.begin(), log.applied.end(),
                               [](const std::string& a) { return a.rfind("prune_sliced_rows:", 0) == 0; });
          EXPECT_EQ(transposes, 0) << arch;
          EXPECT_GT(log.ops_after.count("AddLayerNorm") ? log.ops_after.at("AddLayerNorm") : 0, 0) << arch;
          if (type != "gpt2")  // GPT-2's MLP is Conv1D: MatMul + Add, not Linear
            EXPECT_GT(log.ops_after.count("LinearGelu") ? log.ops_after.at("LinearGelu") : 0, 0) << arch;
          EXPECT_LT(dropouts(log.ops_after), dropouts(log.ops_before)) << arch;
          const bool merged = std::any_of(log.applied.begin(), log.applied.end(), [](const std::string& a) {
            return a.rfind("merge_duplicate_casts:", 0) == 0;
          });
          EXPECT_EQ(merged, bf16 && type != "gpt2") << arch;  // separate query, key and value projections
          // Every GELU's output (or its bf16 cast) is read by backward, and recomputed there instead.
          int recomputed = -1;
          for (const std::string& a : log.applied)
            if (a.rfind("recompute_gelu_outputs: ", 0) == 0) recomputed = std::stoi(a.substr(24));
          EXPECT_EQ(recomputed, log.ops_before.count("Gelu") ? log.ops_before.at("Gelu") : -1) << arch;
          // Every head here ends in Linear + SoftmaxCrossEntropy except question answering (split logits)
          // and GPT-2's classifier (the logits of the pooled position are gathered from all of them).
          const bool gathered = arch.find("QuestionAnswering") != std::string::npos ||
                                arch == "GPT2ForSequenceClassification";
          EXPECT_EQ(log.ops_after.count("LinearCrossEntropy") ? log.ops_after.at("LinearCrossEntropy") : 0,
                    gathered ? 0 : 1)
              << arch;
        } else {
          EXPECT_GT(transposes, 0) << arch;
          EXPECT_EQ(dropouts(log.ops_after), dropouts(log.ops_before)) << arch;
        }
      }
      // A first-token classifier runs its last layer on one row per sequence (prune_sliced_rows):
      // its weight gradients then sum fewer (only zero) rows, so they agree to rounding there.
      const bool first_token = arch.find("SequenceClassification") != std::string::npos && type != "gpt2";
      EXPECT_EQ(pruned, first_token) << arch;
      if (!first_token) {
        EXPECT_EQ(losses[0], losses[1]) << arch;
        for (size_t i = 0; i < grads[0].size(); ++i)
          ASSERT_EQ(grads[0][i], grads[1][i]) << arch << (bf16 ? " bf16" : " f32") << " gradient " << i;
        continue;
      }
      EXPECT_NEAR(losses[0], losses[1], 1e-6 * std::abs(losses[0])) << arch;
      double max_grad = 0.0;
      for (float v : grads[0]) max_grad = std::max(max_grad, static_cast<double>(std::abs(v)));
      for (size_t i = 0; i < grads[0].size(); ++i)
        ASSERT_NEAR(grads[0][i], grads[1][i], 1e-5 * max_grad) << arch << " gradient " << i;
    }
}

// Sequence classification over a padded batch runs unpadded (the token-wise layers on the kept tokens only) and
// computes what the padded layout computes: the same logits and loss and, but for the rounding of the weight
// gradients' sums over fewer rows, the same gradients. Left padding (a hidden first token, which the classifier
// still pools) included; a row the mask hides entirely keeps the padded layout.
TEST(Models, UnpaddedSequenceClassificationMatchesPadded) {
  for (const std::string type : {"bert", "roberta", "distilbert"})
    for (bool bf16 : {false, true}) {
      const std::string arch = type == "bert"      ? "BertForSequenceClassification"
                               : type == "roberta" ? "RobertaForSequenceClassification"
                                                   : "DistilBertForSequenceClassification";
      auto model = Model::from_config(tiny_config(type), 7, arch);
      model->set_bf16(bf16);
      const int64_t B = 4, T = 16;
      Data d = make_batch(*model, B, T, 5);
      // Rows of 16, 5 and 7 tokens, right padded, and one of 4 tokens after 3 of left padding: 32 kept of 64.
      const int64_t pad = tiny_config(type).value("pad_token_id", 0);
      for (int64_t t = 0; t < T; ++t) {
        d.mask[1 * T + t] = t < 5;
        d.mask[2 * T + t] = t < 7;
        d.mask[3 * T + t] = t >= 3 && t < 7;
      }
      for (int64_t i = 0; i < B * T; ++i)
        if (d.mask[i] == 0) d.ids[i] = pad;
      std::vector<Tensor> logits;
      std::vector<double> losses;
      std::vector<std::vector<float>> grads;
      for (bool unpad : {false, true}) {
        model->set_unpad(unpad);
        models::ModelOutput out = model->forward(d.batch);
        EXPECT_EQ(model->last_plan()->has_input("token_rows"), unpad) << arch;
        logits.push_back(out.logits.clone());
        losses.push_back(model->loss_and_grads(d.batch));
        grads.push_back(gradients_of(*model));
      }
      // Each kept row's projections are the same dot products in either layout; only the row count changes.
      const double tol = bf16 ? 1e-3 : 1e-5;
      for (int64_t i = 0; i < logits[0].numel(); ++i)
        EXPECT_NEAR(logits[1].item(i), logits[0].item(i), tol) << arch << " logit " << i;
      EXPECT_NEAR(losses[1], losses[0], tol * std::abs(losses[0])) << arch;
      EXPECT_LT(relative_l2(grads[1], grads[0]), bf16 ? 1e-2 : 1e-5) << arch;

      // A row with no kept token: attention spreads evenly over its padding, which only the padded layout holds.
      std::fill(d.mask.begin() + 2 * T, d.mask.begin() + 3 * T, int64_t{0});
      model->forward(d.batch);
      EXPECT_FALSE(model->last_plan()->has_input("token_rows")) << arch;
    }
}

// A model's programs share one arena: a program whose memory a larger program has since replaced (the arena grew)
// rebinds to it and computes what a fresh model computes, bit for bit.
TEST(Models, ProgramsShareOneArenaAndRebindWhenItGrows) {
  auto model = Model::from_config(tiny_config("bert"), 3, "BertForMaskedLM");
  auto fresh = Model::from_config(tiny_config("bert"), 3, "BertForMaskedLM");
  Data small = make_batch(*model, 2, 6, 1), large = make_batch(*model, 3, 30, 2);
  const double first = model->loss_and_grads(small.batch);
  const size_t small_peak = model->last_plan()->memory_report().activation_peak_bytes;
  model->loss_and_grads(large.batch);  // a larger arena replaces the one the small program was bound to
  EXPECT_GT(model->last_plan()->memory_report().activation_peak_bytes, small_peak);
  const double again = model->loss_and_grads(small.batch);
  EXPECT_EQ(again, first);
  EXPECT_EQ(again, fresh->loss_and_grads(small.batch));
  EXPECT_EQ(gradients_of(*model), gradients_of(*fresh));
  Tensor logits = model->forward(small.batch).logits.clone();
  Tensor want = fresh->forward(small.batch).logits;
  for (int64_t i = 0; i < want.numel(); ++i) ASSERT_EQ(logits.item(i), want.item(i)) << i;
}

// The training seed reaches dropout and fresh heads: the same seed repeats a run, another
// seed draws other masks and other head weights.
TEST(Models, DropoutSeedAndHeadInitSeedTakeEffect) {
  auto model = Model::from_config(tiny_config("bert"), 3, "BertForSequenceClassification");
  Data d = make_batch(*model, 2, 9, 5);
  std::vector<double> losses;
  for (uint64_t seed : {1u, 1u, 2u}) {
    model->set_dropout_seed(seed);
    model->set_rng_step(0);
    losses.push_back(*model->forward(d.batch, /*training=*/true).loss);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_NE(losses[0], losses[2]);

  fs::path dir = fs::temp_directory_path() / ("fusetrain_seeded_head_" + std::to_string(getpid()));
  Model::from_config(tiny_config("bert"), 3, "BertModel")->save_pretrained(dir.string());
  auto a = Model::from_pretrained(dir.string(), "BertForSequenceClassification", nlohmann::json::object(), 42);
  auto b = Model::from_pretrained(dir.string(), "BertForSequenceClassification", nlohmann::json::object(), 42);
  auto c = Model::from_pretrained(dir.string(), "BertForSequenceClassification", nlohmann::json::object(), 43);
  Tensor wa = a->parameter("classifier.weight"), wb = b->parameter("classifier.weight");
  Tensor wc = c->parameter("classifier.weight");
  EXPECT_EQ(std::memcmp(wa.data(), wb.data(), wa.nbytes()), 0);
  EXPECT_NE(std::memcmp(wa.data(), wc.data(), wa.nbytes()), 0);
  fs::remove_all(dir);
}

// Every registry row builds: its model_type's config makes a model of that architecture whose graph returns what
// the head's row says and takes a loss for every label layout the row lists.
TEST(Registry, EveryArchitectureBuildsAsItsRowSays) {
  for (const models::ArchitectureInfo& row : models::architectures()) {
    SCOPED_TRACE(row.name);
    auto model = Model::from_config(tiny_config(row.model_type), 1, row.name);
    EXPECT_EQ(model->architecture(), row.name);
    EXPECT_EQ(model->model_type(), row.model_type);
    EXPECT_EQ(&model->architecture_info(), &row);
    EXPECT_EQ(&models::find_architecture(row.name), &row);
    EXPECT_EQ(models::find_architecture(row.model_type, row.head), &row);
    const models::HeadInfo& head = row.head_info();
    models::BatchSpec spec;
    spec.batch = 2;
    spec.seq = 5;
    models::BuiltGraph built = model->build(spec);
    EXPECT_EQ(built.end_logits != ir::kNone, head.outputs == models::Outputs::SpanLogits);
    EXPECT_EQ(head.outputs == models::Outputs::HiddenStates, row.head == models::Head::Base);
    EXPECT_EQ(built.loss, ir::kNone);
    EXPECT_EQ(head.batch_labels.empty(), row.head == models::Head::Base);
    for (models::LabelKind labels : head.batch_labels) {
      spec.labels = labels;
      nlohmann::json config = tiny_config(row.model_type);
      if (labels == models::LabelKind::Values) config["num_labels"] = 1;  // regression
      EXPECT_NE(Model::from_config(config, 1, row.name)->build(spec).loss, ir::kNone) << static_cast<int>(labels);
    }
    // Its task picks it back on its model_type, and the base model of the model_type exists.
    if (*head.task) {
      EXPECT_EQ(models::head_for_task(head.task), row.head);
      EXPECT_EQ(&models::architecture_for_task(row.model_type, row.head, "config.json"), &row);
      EXPECT_FALSE(head.data_labels.empty());
    }
    EXPECT_NE(models::find_architecture(row.model_type, models::Head::Base), nullptr);
  }
}

TEST(Registry, EveryHeadHasOneRowAndTasksAreUnique) {
  std::set<std::string> tasks;
  for (const models::HeadInfo& head : models::heads()) {
    EXPECT_EQ(&models::head_info(head.head), &head);
    if (*head.task) EXPECT_TRUE(tasks.insert(head.task).second) << head.task;
  }
  EXPECT_EQ(models::task_names(), std::vector<std::string>({"seq-cls", "token-cls", "qa", "mlm", "clm", "seq2seq", "ctc"}));
  EXPECT_EQ(models::model_types(),
            std::vector<std::string>({"bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2"}));
}

TEST(Registry, ErrorsNameWhatIsSupported) {
  EXPECT_CONTAINS(error_of([] { models::head_for_task("summarise"); }),
                  "task \"summarise\" is not supported (supported: seq-cls, token-cls, qa, mlm, clm, seq2seq, ctc)");
  EXPECT_CONTAINS(error_of([] { models::architecture_for_task("gpt2", models::Head::MaskedLM, "m/config.json"); }),
                  "--task mlm (masked language modelling) supports bert, roberta and distilbert models, found "
                  "model_type \"gpt2\" (a gpt2 model takes --task clm and seq-cls)");
  EXPECT_CONTAINS(error_of([] { models::architecture_for_task("t5", models::Head::MaskedLM, "m/config.json"); }),
                  "m/config.json: model_type \"t5\" is not supported (supported: bert, roberta, distilbert, gpt2, llama, mistral, qwen2)");
  nlohmann::json config = tiny_config("bert");
  config["architectures"] = {"BertForPreTraining"};
  EXPECT_EQ(models::max_positions(config), 40);  // the base model answers, whatever "architectures" names
}

}  // namespace
}  // namespace fusetrain::testing
