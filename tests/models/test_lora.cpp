// LoRA on built models: adapters get gradients that match finite differences, frozen base weights live outside the
// trained buffers (no gradient, optionally bf16), zero-initialised B leaves the function unchanged, merging folds the
// adapters in exactly, and bad settings give clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "fusetrain/core/error.h"
#include "fusetrain/models/model.h"

namespace fusetrain::testing {
namespace {

using models::Batch;
using models::LoraConfig;
using models::Model;

nlohmann::json tiny_llama() {
  return {{"model_type", "llama"},        {"vocab_size", 41},  {"hidden_size", 24}, {"num_hidden_layers", 2},
          {"num_attention_heads", 4},     {"num_key_value_heads", 2}, {"intermediate_size", 36},
          {"max_position_embeddings", 32}, {"pad_token_id", 0}};
}

struct Data {
  std::vector<int64_t> ids, labels;
  Batch batch;
};

Data lm_batch(int64_t B, int64_t T, uint64_t seed) {
  Data d;
  std::mt19937_64 rng(seed);
  d.ids.resize(size_t(B * T));
  for (auto& id : d.ids) id = 1 + int64_t(rng() % 40);
  d.labels = d.ids;
  d.batch.set("input_ids", Tensor::view(d.ids.data(), {B, T}, DType::i64));
  d.batch.set("labels", Tensor::view(d.labels.data(), {B, T}, DType::i64));
  return d;
}

LoraConfig config(std::vector<std::string> targets, DType base = DType::f32) {
  LoraConfig c;
  c.r = 3;
  c.alpha = 6;
  c.target_modules = std::move(targets);
  c.base_dtype = base;
  c.seed = 7;
  return c;
}

// Draws B away from zero so that A's gradient is not zero too.
void perturb_adapters(Model& m) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (const std::string& name : m.trainable_names()) {
    Tensor p = m.parameter(name);
    for (int64_t i = 0; i < p.numel(); ++i) p.data_as<float>()[i] += normal(rng);
  }
}

TEST(Lora, AdapterGradientsMatchFiniteDifferences) {
  auto model = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  model->enable_lora(config({"q_proj", "v_proj", "down_proj"}));
  perturb_adapters(*model);
  Data d = lm_batch(2, 6, 5);
  model->loss_and_grads(d.batch);
  std::mt19937_64 rng(2);
  for (const std::string& name : model->trainable_names()) {
    Tensor p = model->parameter(name);
    Tensor g = model->gradient(name).clone();
    for (int k = 0; k < 3; ++k) {
      const int64_t i = int64_t(rng() % uint64_t(p.numel()));
      const double original = p.item(i), eps = 2e-3;
      p.set_item(i, original + eps);
      const double up = *model->forward(d.batch).loss;
      p.set_item(i, original - eps);
      const double down = *model->forward(d.batch).loss;
      p.set_item(i, original);
      const double numeric = (up - down) / (2 * eps);
      // f32 central differences of a loss near 3.7: ~1e-4 absolute noise, hence the 3e-2 floor.
      EXPECT_LT(std::abs(numeric - g.item(i)) / std::max(3e-2, std::abs(numeric)), 5e-2)
          << name << "[" << i << "] analytic " << g.item(i) << " numeric " << numeric;
    }
  }
}

TEST(Lora, BaseIsFrozenAndStartsUnchanged) {
  auto plain = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  auto lora = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  const int64_t total = plain->params().num_parameters();
  lora->enable_lora(config({"q_proj", "k_proj", "v_proj", "o_proj"}));
  // 2 layers x 4 projections, A (3, in) + B (out, r): q, o are 24->24, k, v 24->12.
  const int64_t adapters = 2 * (2 * (3 * 24 + 24 * 3) + 2 * (3 * 24 + 12 * 3));
  EXPECT_EQ(lora->params().num_parameters(), adapters);
  EXPECT_EQ(lora->params().num_frozen_parameters(), total);
  EXPECT_EQ(lora->lora_adapters().size(), 8u);
  EXPECT_THROW(lora->gradient("model.layers.0.self_attn.q_proj.weight"), Error);
  Data d = lm_batch(2, 6, 1);
  // B = 0: the adapted model computes what the plain one does.
  EXPECT_NEAR(*lora->forward(d.batch).loss, *plain->forward(d.batch).loss, 1e-6);
}

TEST(Lora, Bf16BaseWeightsAreStoredInBf16AndTrackF32) {
  auto f32 = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  auto bf16 = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  f32->enable_lora(config({"q_proj", "v_proj"}));
  bf16->enable_lora(config({"q_proj", "v_proj"}, DType::bf16));
  EXPECT_EQ(bf16->parameter("model.layers.0.mlp.up_proj.weight").dtype(), DType::bf16);
  EXPECT_EQ(bf16->parameter("model.layers.0.self_attn.q_proj.weight").dtype(), DType::bf16);
  EXPECT_EQ(bf16->parameter("model.embed_tokens.weight").dtype(), DType::bf16);  // lookups gather bf16 rows
  EXPECT_EQ(bf16->parameter("model.norm.weight").dtype(), DType::f32);
  perturb_adapters(*f32);
  perturb_adapters(*bf16);
  Data d = lm_batch(2, 6, 4);
  // Weights rounded to 8 significant bits (relative error <= 2^-9): the loss moves by well under 1%.
  const double a = f32->loss_and_grads(d.batch), b = bf16->loss_and_grads(d.batch);
  EXPECT_NEAR(a, b, 1e-2 * std::abs(a));
}

TEST(Lora, MergeFoldsTheAdaptersIn) {
  auto model = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  model->enable_lora(config({"q_proj", "gate_proj"}));
  perturb_adapters(*model);
  Data d = lm_batch(2, 6, 8);
  const double adapted = *model->forward(d.batch).loss;
  model->merge_lora();
  EXPECT_EQ(model->lora(), nullptr);
  EXPECT_EQ(model->params().num_frozen_parameters(), 0);
  EXPECT_NEAR(*model->forward(d.batch).loss, adapted, 1e-5);
}

TEST(Lora, BadSettingsNameTheProblem) {
  auto model = Model::from_config(tiny_llama(), 3, "LlamaForCausalLM");
  auto message = [&](const LoraConfig& c) {
    try {
      model->enable_lora(c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(config({"q_proj", "qproj"})).find("target modules not found in the model: qproj"),
            std::string::npos);
  EXPECT_NE(message(config({"norm"})).find("is not a linear layer"), std::string::npos);
  LoraConfig zero = config({"q_proj"});
  zero.r = 0;
  EXPECT_NE(message(zero).find("r must be a positive integer"), std::string::npos);
  EXPECT_EQ(model->lora(), nullptr);
  model->enable_lora(config({"q_proj"}));
  EXPECT_NE(message(config({"v_proj"})).find("already has LoRA adapters"), std::string::npos);
}

}  // namespace
}  // namespace fusetrain::testing
