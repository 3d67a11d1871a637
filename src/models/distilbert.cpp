// DistilBERT: DistilBertModel with masked-LM and sequence-classification heads.
//
// Shape letters: B batch, T sequence, C dim, H heads, D head size, F hidden_dim,
// V vocabulary, L labels.
#include <cmath>

#include "fusetrain/core/error.h"
#include "models/family.h"

namespace fusetrain::models {
namespace {

using ir::ValueId;

constexpr double kLayerNormEps = 1e-12;  // fixed in transformers' DistilBERT

class DistilBertFamily final : public Family {
 public:
  DistilBertFamily(Head head, const nlohmann::json& json) : config_(json) {
    head_ = head;
    ConfigReader c(config_);
    V_ = c.positive("vocab_size");
    C_ = c.positive("dim");
    layers_ = c.positive("n_layers");
    H_ = c.positive("n_heads");
    F_ = c.positive("hidden_dim");
    P_ = c.positive("max_position_embeddings");
    FT_CHECK(C_ % H_ == 0, "config.json: \"dim\" is ", C_, " but \"n_heads\" ", H_, " does not divide it");
    pad_ = c.get_int("pad_token_id", 0);
    FT_CHECK(pad_ >= 0 && pad_ < V_, "config.json: \"pad_token_id\" ", pad_, " is outside the vocabulary [0, ", V_,
             ")");
    dropout_ = c.probability("dropout", 0.1);
    attention_dropout_ = c.probability("attention_dropout", 0.1);
    classifier_dropout_ = c.probability("seq_classif_dropout", 0.2);
    init_std_ = c.init_std("initializer_range", 0.02);
    act_ = c.get_string("activation", "gelu");
    check_activation(act_, "activation");
    FT_CHECK(!c.get_bool("sinusoidal_pos_embds", false),
             "config.json: \"sinusoidal_pos_embds\": true is not supported; fusetrain learns position embeddings");
    num_labels_ = c.num_labels();
    tie_ = c.get_bool("tie_word_embeddings", true);
    prefix_ = head == Head::Base ? "" : "distilbert.";
  }

  BuiltGraph build(const BatchSpec& spec) const override {
    BuiltGraph out;
    ir::GraphBuilder b(out.graph, 0x5eed);
    matmul_dtype_ = spec.fp16 ? DType::f16 : spec.bf16 ? DType::bf16 : DType::f32;
    const int64_t B = spec.batch, T = spec.seq, C = C_;
    const bool train = spec.training;
    auto [ids, mask, positions] = sequence_inputs(b, B, T);
    ValueId mask_add = additive_mask(b, mask, B, T);  // before the layers' segments (recompute)
    const TokenRows rows = token_rows(b, spec);

    ValueId word = b.param(p("embeddings.word_embeddings.weight"), {V_, C});
    ValueId position = b.param(p("embeddings.position_embeddings.weight"), {P_, C});
    ValueId position_rows = b.embedding(position, positions);  // first: node order is not left to argument order
    ValueId x = b.add(b.embedding(word, ids, pad_), position_rows);
    x = maybe_dropout(b, layer_norm(b, unpad(b, x, rows, C), p("embeddings.LayerNorm")), dropout_, train);
    out.layer_boundaries.push_back(x);

    for (int64_t l = 0; l < layers_; ++l) {
      std::string layer = p("transformer.layer." + std::to_string(l) + ".");
      ValueId attn = self_attention(b, x, mask_add, layer + "attention.q_lin", layer + "attention.k_lin",
                                    layer + "attention.v_lin", layer + "attention.out_lin", B, T, C, H_,
                                    train ? attention_dropout_ : 0.0, rows);
      x = layer_norm(b, b.add(attn, x), layer + "sa_layer_norm");
      ValueId h = activation(b, dense(b, x, layer + "ffn.lin1", F_, C), act_, matmul_dtype_);
      h = maybe_dropout(b, dense(b, h, layer + "ffn.lin2", C, F_), dropout_, train);
      x = layer_norm(b, b.add(h, x), layer + "output_layer_norm");
      out.layer_boundaries.push_back(x);
    }
    out.hidden_states = x;

    ValueId logits = x;  // Head::Base: the hidden states
    switch (head_) {
      case Head::Base:
        break;
      case Head::MaskedLM: {
        ValueId h = activation(b, dense(b, x, "vocab_transform", C, C), act_, matmul_dtype_);
        h = layer_norm(b, h, "vocab_layer_norm");
        ValueId projector = tie_ ? word : b.param("vocab_projector.weight", {V_, C});
        logits = project(b, h, projector, b.param("vocab_projector.bias", {V_}), matmul_dtype_);
        break;
      }
      case Head::SequenceClassification: {
        ValueId pooled = b.relu(dense(b, first_token(b, x, B, T, C, rows), "pre_classifier", C, C));
        pooled = maybe_dropout(b, pooled, classifier_dropout_, train);
        logits = dense(b, pooled, "classifier", num_labels_, C);
        break;
      }
      default:
        throw Error("DistilBERT in fusetrain has masked-LM and sequence-classification heads only");
    }
    head_outputs(b, head_, {logits}, spec, ConfigReader(config_), out);
    return out;
  }

  ParamInit init(const std::string& name) const override {
    if (ends_with(name, "bias")) return {Init::Zeros};
    if (ends_with(name, "LayerNorm.weight") || ends_with(name, "layer_norm.weight")) return {Init::Ones};
    if (ends_with(name, "word_embeddings.weight")) return {Init::Normal, init_std_, pad_};
    return {Init::Normal, init_std_};
  }

  std::map<std::string, std::string> tied() const override {
    if (head_ != Head::MaskedLM || !tie_) return {};
    return {{"vocab_projector.weight", p("embeddings.word_embeddings.weight")}};
  }
  std::string base_prefix() const override { return "distilbert"; }
  std::vector<std::string> head_prefixes() const override {
    return {"vocab_transform.", "vocab_layer_norm.", "vocab_projector.",
            "pre_classifier.",  "classifier.",       "qa_outputs."};
  }
  bool uses_token_type_ids() const override { return false; }
  int64_t max_positions() const override { return P_; }
  // Sequence classification reads only each row's first token: every other output row is the layers' own.
  bool unpads() const override { return head_ == Head::SequenceClassification; }

 private:
  ValueId layer_norm(ir::GraphBuilder& b, ValueId x, const std::string& name) const {
    return named_layer_norm(b, x, name, C_, kLayerNormEps);
  }

  nlohmann::json config_;
  int64_t V_, C_, layers_, H_, F_, P_, pad_, num_labels_;
  double dropout_, attention_dropout_, classifier_dropout_, init_std_;
  std::string act_;
  bool tie_;
};

}  // namespace

std::unique_ptr<Family> make_distilbert_family(Head head, const nlohmann::json& config) {
  return std::make_unique<DistilBertFamily>(head, config);
}

}  // namespace fusetrain::models
