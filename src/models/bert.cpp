// BERT and RoBERTa: BertModel / RobertaModel bodies with masked-LM, sequence-,
// token-classification and question-answering heads, named as transformers
// names them. RoBERTa differs in its position ids (offset past padding_idx),
// its heads, and in having no pooler under its heads.
//
// Shape letters: B batch, T sequence, C hidden, H heads, D head size, I intermediate,
// V vocabulary, L labels.
#include <cmath>

#include "fusetrain/core/error.h"
#include "models/family.h"

namespace fusetrain::models {
namespace {

using ir::ValueId;

class BertFamily final : public Family {
 public:
  BertFamily(bool roberta, Head head, const nlohmann::json& json) : roberta_(roberta), config_(json) {
    head_ = head;
    ConfigReader c(config_);
    V_ = c.positive("vocab_size");
    C_ = c.positive("hidden_size");
    layers_ = c.positive("num_hidden_layers");
    H_ = c.positive("num_attention_heads");
    I_ = c.positive("intermediate_size");
    P_ = c.positive("max_position_embeddings");
    TV_ = c.get_int("type_vocab_size", 2);
    FT_CHECK(C_ % H_ == 0, "config.json: \"hidden_size\" is ", C_, " but \"num_attention_heads\" ", H_,
             " does not divide it");
    pad_ = c.get_int("pad_token_id", roberta ? 1 : 0);
    eps_ = c.epsilon("layer_norm_eps", 1e-12);
    hidden_dropout_ = c.probability("hidden_dropout_prob", 0.1);
    attention_dropout_ = c.probability("attention_probs_dropout_prob", 0.1);
    classifier_dropout_ = c.probability("classifier_dropout", hidden_dropout_);
    init_std_ = c.init_std("initializer_range", 0.02);
    act_ = c.get_string("hidden_act", "gelu");
    check_activation(act_, "hidden_act");
    num_labels_ = c.num_labels();
    tie_ = c.get_bool("tie_word_embeddings", true);
    std::string position_type = c.get_string("position_embedding_type", "absolute");
    FT_CHECK(position_type == "absolute", "config.json: \"position_embedding_type\" is \"", position_type,
             "\"; fusetrain supports \"absolute\"");
    FT_CHECK(!c.get_bool("is_decoder", false) && !c.get_bool("add_cross_attention", false),
             "config.json: decoder BERT/RoBERTa (is_decoder / add_cross_attention) is not supported");
    FT_CHECK(pad_ >= 0 && pad_ < V_, "config.json: \"pad_token_id\" ", pad_, " is outside the vocabulary [0, ", V_,
             ")");
    if (roberta_) FT_CHECK(P_ > pad_ + 1, "config.json: \"max_position_embeddings\" must exceed pad_token_id + 1");
    prefix_ = head == Head::Base ? "" : (roberta ? "roberta." : "bert.");
  }

  BuiltGraph build(const BatchSpec& spec) const override {
    BuiltGraph out;
    ir::GraphBuilder b(out.graph, 0x5eed);
    matmul_dtype_ = spec.fp16 ? DType::f16 : spec.bf16 ? DType::bf16 : DType::f32;
    const int64_t B = spec.batch, T = spec.seq, C = C_;
    const bool train = spec.training;
    auto [ids, mask, positions] = sequence_inputs(b, B, T);
    ValueId token_types = b.input(InputNames::token_type_ids, {B, T}, DType::i64);
    ValueId mask_add = additive_mask(b, mask, B, T);  // before the layers' segments (recompute)
    const TokenRows rows = token_rows(b, spec);

    // Embeddings.
    ValueId word = b.param(p("embeddings.word_embeddings.weight"), {V_, C});
    ValueId position = b.param(p("embeddings.position_embeddings.weight"), {P_, C});
    ValueId token_type = b.param(p("embeddings.token_type_embeddings.weight"), {TV_, C});
    // The token-type rows are gathered first (graph node order must not follow the compiler's argument order).
    ValueId type_rows = b.embedding(token_type, token_types);
    ValueId x = b.add(b.embedding(word, ids, pad_), type_rows);
    x = b.add(x, b.embedding(position, positions, roberta_ ? pad_ : -1));
    x = layer_norm(b, unpad(b, x, rows, C), p("embeddings.LayerNorm"));
    x = maybe_dropout(b, x, hidden_dropout_, train);
    out.layer_boundaries.push_back(x);

    // Encoder.
    for (int64_t l = 0; l < layers_; ++l) {
      std::string layer = p("encoder.layer." + std::to_string(l) + ".");
      ValueId attn = self_attention(b, x, mask_add, layer + "attention.self.query", layer + "attention.self.key",
                                    layer + "attention.self.value", layer + "attention.output.dense", B, T, C, H_,
                                    train ? attention_dropout_ : 0.0, rows);
      attn = maybe_dropout(b, attn, hidden_dropout_, train);
      x = layer_norm(b, b.add(attn, x), layer + "attention.output.LayerNorm");
      ValueId h = activation(b, dense(b, x, layer + "intermediate.dense", I_, C), act_, matmul_dtype_);
      h = maybe_dropout(b, dense(b, h, layer + "output.dense", C, I_), hidden_dropout_, train);
      x = layer_norm(b, b.add(h, x), layer + "output.LayerNorm");
      out.layer_boundaries.push_back(x);
    }
    out.hidden_states = x;

    ValueId logits = x;  // Head::Base: the hidden states
    switch (head_) {
      case Head::Base:
        pooler(b, x, B, T);  // BertModel and RobertaModel carry a pooler; the hidden states are the output
        break;
      case Head::MaskedLM:
        logits = masked_lm_head(b, x, word);
        break;
      case Head::SequenceClassification:
        if (roberta_) {
          // RobertaClassificationHead: dropout, dense, tanh, dropout, out_proj on the <s> token.
          ValueId h = maybe_dropout(b, first_token(b, x, B, T, C, rows), classifier_dropout_, train);
          h = b.tanh(dense(b, h, "classifier.dense", C, C));
          h = maybe_dropout(b, h, classifier_dropout_, train);
          logits = dense(b, h, "classifier.out_proj", num_labels_, C);
        } else {
          ValueId pooled = maybe_dropout(b, pooler(b, x, B, T, rows), classifier_dropout_, train);
          logits = dense(b, pooled, "classifier", num_labels_, C);
        }
        break;
      case Head::TokenClassification:
        logits = dense(b, maybe_dropout(b, x, classifier_dropout_, train), "classifier", num_labels_, C);
        break;
      case Head::QuestionAnswering:
        logits = dense(b, x, "qa_outputs", 2, C);
        break;
      case Head::CausalLM:
        throw Error("BERT/RoBERTa have no causal-LM head in fusetrain");
      case Head::Seq2SeqLM:
        throw Error("BERT/RoBERTa are not encoder-decoders: they have no sequence-to-sequence head");
      case Head::Ctc:
        throw Error("BERT/RoBERTa read tokens, not audio frames: they have no CTC head");
    }
    head_outputs(b, head_, {logits}, spec, ConfigReader(config_), out);
    return out;
  }

  ParamInit init(const std::string& name) const override {
    if (ends_with(name, "bias")) return {Init::Zeros};
    if (ends_with(name, "LayerNorm.weight") || ends_with(name, "layer_norm.weight")) return {Init::Ones};
    if (ends_with(name, "word_embeddings.weight")) return {Init::Normal, init_std_, pad_};
    if (ends_with(name, "position_embeddings.weight") && roberta_) return {Init::Normal, init_std_, pad_};
    return {Init::Normal, init_std_};
  }

  std::map<std::string, std::string> tied() const override {
    if (head_ != Head::MaskedLM) return {};
    std::string head = roberta_ ? "lm_head." : "cls.predictions.";
    if (!tie_) return {};
    return {{head + "decoder.bias", head + "bias"}, {head + "decoder.weight", p("embeddings.word_embeddings.weight")}};
  }

  std::string base_prefix() const override { return roberta_ ? "roberta" : "bert"; }
  std::vector<std::string> head_prefixes() const override {
    return {"cls.", "lm_head.", "classifier.", "qa_outputs.", "pooler.", base_prefix() + ".pooler."};
  }
  int64_t max_positions() const override { return roberta_ ? P_ - pad_ - 1 : P_; }
  // Sequence classification reads only each row's first token: every other output row is the layers' own.
  bool unpads() const override { return head_ == Head::SequenceClassification; }

  DerivedInputs derived_inputs() const override {
    DerivedInputs d;
    if (roberta_) {
      d.positions_past_padding = true;
      d.pad_token_id = pad_;
    }
    return d;
  }

  // RoBERTa: positions count non-padding tokens from padding_idx + 1; padding keeps padding_idx.
  void default_position_ids(const int64_t* ids, int64_t B, int64_t T, int64_t* out) const override {
    if (!roberta_) return Family::default_position_ids(ids, B, T, out);
    for (int64_t b = 0; b < B; ++b) {
      int64_t count = 0;
      for (int64_t t = 0; t < T; ++t) {
        bool real = ids[b * T + t] != pad_;
        count += real;
        out[b * T + t] = real ? count + pad_ : pad_;
      }
    }
  }

 private:
  ValueId layer_norm(ir::GraphBuilder& b, ValueId x, const std::string& name) const {
    return named_layer_norm(b, x, name, C_, eps_);
  }
  ValueId pooler(ir::GraphBuilder& b, ValueId x, int64_t B, int64_t T, const TokenRows& rows = {}) const {
    return b.tanh(dense(b, first_token(b, x, B, T, C_, rows), p("pooler.dense"), C_, C_));
  }
  // BERT: transform (dense, act, LayerNorm), decoder tied to the word embeddings + bias.
  // RoBERTa: dense, gelu, layer_norm, decoder + bias.
  ValueId masked_lm_head(ir::GraphBuilder& b, ValueId x, ValueId word) const {
    std::string head = roberta_ ? "lm_head." : "cls.predictions.";
    ValueId bias = b.param(head + "bias", {V_});
    ValueId h = roberta_ ? dense(b, x, "lm_head.dense", C_, C_) : dense(b, x, head + "transform.dense", C_, C_);
    h = activation(b, h, roberta_ ? "gelu" : act_, matmul_dtype_);
    h = roberta_ ? layer_norm(b, h, "lm_head.layer_norm") : layer_norm(b, h, head + "transform.LayerNorm");
    if (tie_) return project(b, h, word, bias, matmul_dtype_);
    // Untied, transformers gives the decoder its own weight and bias; `bias` stays an unused parameter.
    ValueId decoder = b.param(head + "decoder.weight", {V_, C_});
    return project(b, h, decoder, b.param(head + "decoder.bias", {V_}), matmul_dtype_);
  }

  bool roberta_;
  nlohmann::json config_;
  int64_t V_, C_, layers_, H_, I_, P_, TV_, pad_, num_labels_;
  double eps_, hidden_dropout_, attention_dropout_, classifier_dropout_, init_std_;
  std::string act_;
  bool tie_;
};

}  // namespace

std::unique_ptr<Family> make_bert_family(bool roberta, Head head, const nlohmann::json& config) {
  return std::make_unique<BertFamily>(roberta, head, config);
}

}  // namespace fusetrain::models
