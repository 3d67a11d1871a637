// GPT-2: GPT2Model with the causal-LM head (tied to the token embeddings) and
// the sequence-classification head (scores the last non-padding token).
// Conv1D weights are stored (in, out), so projections are x·W + b (MatMul + Add).
//
// Shape letters: B batch, T sequence, C n_embd, H heads, D head size, F n_inner,
// V vocabulary, L labels.
#include <cmath>

#include "fusetrain/core/error.h"
#include "models/family.h"

namespace fusetrain::models {
namespace {

using ir::ValueId;

class Gpt2Family final : public Family {
 public:
  Gpt2Family(Head head, const nlohmann::json& json) : config_(json) {
    head_ = head;
    ConfigReader c(config_);
    V_ = c.positive("vocab_size");
    C_ = c.positive("n_embd");
    layers_ = c.positive("n_layer");
    H_ = c.positive("n_head");
    P_ = c.positive("n_positions");
    F_ = c.has("n_inner") ? c.positive("n_inner") : 4 * C_;
    FT_CHECK(C_ % H_ == 0, "config.json: \"n_embd\" is ", C_, " but \"n_head\" ", H_, " does not divide it");
    eps_ = c.epsilon("layer_norm_epsilon", 1e-5);
    embd_dropout_ = c.probability("embd_pdrop", 0.1);
    attn_dropout_ = c.probability("attn_pdrop", 0.1);
    resid_dropout_ = c.probability("resid_pdrop", 0.1);
    init_std_ = c.init_std("initializer_range", 0.02);
    act_ = c.get_string("activation_function", "gelu_new");
    check_activation(act_, "activation_function");
    scale_attn_ = c.get_bool("scale_attn_weights", true);
    scale_by_layer_ = c.get_bool("scale_attn_by_inverse_layer_idx", false);
    FT_CHECK(!c.get_bool("add_cross_attention", false), "config.json: GPT-2 cross-attention is not supported");
    pad_ = c.get_int("pad_token_id", -1);
    num_labels_ = c.num_labels();
    tie_ = c.get_bool("tie_word_embeddings", true);
    prefix_ = head == Head::Base ? "" : "transformer.";
  }

  BuiltGraph build(const BatchSpec& spec) const override {
    BuiltGraph out;
    ir::GraphBuilder b(out.graph, 0x5eed);
    matmul_dtype_ = spec.fp16 ? DType::f16 : spec.bf16 ? DType::bf16 : DType::f32;
    const int64_t B = spec.batch, T = spec.seq, C = C_, D = C_ / H_;
    const bool train = spec.training;
    auto [ids, mask, positions] = sequence_inputs(b, B, T);
    const ValueId key_begin = packed_key_begin(b, spec);
    ValueId mask_add = additive_mask(b, mask, B, T);  // before the layers' segments (recompute)

    ValueId wte = b.param(p("wte.weight"), {V_, C});
    ValueId wpe = b.param(p("wpe.weight"), {P_, C});
    ValueId position_rows = b.embedding(wpe, positions);  // first: node order is not left to argument order
    ValueId x = maybe_dropout(b, b.add(b.embedding(wte, ids), position_rows), embd_dropout_, train);
    out.layer_boundaries.push_back(x);

    for (int64_t l = 0; l < layers_; ++l) {
      std::string block = p("h." + std::to_string(l) + ".");
      ValueId a = layer_norm(b, x, block + "ln_1");
      // bf16: q, k, v and the context are kept in bf16, as autocast's bf16 projections and attention produce them.
      const DType io = attention_dtype(matmul_dtype_);
      ValueId projected = conv1d(b, a, block + "attn.c_attn", C, 3 * C);
      std::vector<ValueId> qkv = b.split(io == DType::f32 ? projected : b.cast(projected, io), -1, {C, C, C});
      double scale = scale_attn_ ? 1.0 / std::sqrt(static_cast<double>(D)) : 1.0;
      if (scale_by_layer_) scale /= static_cast<double>(l + 1);
      // v, k, q in turn, one statement each: node order is not left to the compiler's argument order.
      ValueId v = split_heads(b, qkv[2], B, T, H_, D);
      ValueId k = split_heads(b, qkv[1], B, T, H_, D);
      ValueId q = split_heads(b, qkv[0], B, T, H_, D);
      ValueId context = b.attention(q, k, v, mask_add, scale, true, train ? attn_dropout_ : 0.0, io, 0, 0.0, key_begin);
      ValueId attn = conv1d(b, merge_heads(b, context, B, T, H_, D), block + "attn.c_proj", C, C);
      x = b.add(x, maybe_dropout(b, attn, resid_dropout_, train));
      ValueId h = activation(b, conv1d(b, layer_norm(b, x, block + "ln_2"), block + "mlp.c_fc", C, F_), act_, matmul_dtype_);
      h = conv1d(b, h, block + "mlp.c_proj", F_, C);
      x = b.add(x, maybe_dropout(b, h, resid_dropout_, train));
      out.layer_boundaries.push_back(x);
    }
    x = layer_norm(b, x, p("ln_f"));
    out.hidden_states = x;

    ValueId logits = x;  // Head::Base: the hidden states
    switch (head_) {
      case Head::Base:
        break;
      case Head::CausalLM: {
        ValueId lm_head = tie_ ? wte : b.param("lm_head.weight", {V_, C});
        logits = project(b, x, lm_head, ir::kNone, matmul_dtype_);
        break;
      }
      case Head::SequenceClassification:
        logits = last_token_logits(b, x, spec, num_labels_, C);
        break;
      default:
        throw Error("GPT-2 in fusetrain has causal-LM and sequence-classification heads only");
    }
    head_outputs(b, head_, {logits}, spec, ConfigReader(config_), out);
    return out;
  }

  bool in_layer_norm(const std::string& name) const override {
    for (const char* module : {"ln_1.", "ln_2.", "ln_f."})
      if (name.find(module) != std::string::npos) return true;
    return false;
  }

  ParamInit init(const std::string& name) const override {
    if (ends_with(name, "bias")) return {Init::Zeros};
    if (ends_with(name, "ln_1.weight") || ends_with(name, "ln_2.weight") || ends_with(name, "ln_f.weight"))
      return {Init::Ones};
    // Residual projections are scaled by 1/sqrt(2 · n_layer), as in GPT-2.
    if (ends_with(name, "c_proj.weight"))
      return {Init::Normal, init_std_ / std::sqrt(2.0 * static_cast<double>(layers_))};
    return {Init::Normal, init_std_};
  }

  std::map<std::string, std::string> tied() const override {
    if (head_ != Head::CausalLM || !tie_) return {};
    return {{"lm_head.weight", p("wte.weight")}};
  }
  std::string base_prefix() const override { return "transformer"; }
  std::vector<std::string> head_prefixes() const override { return {"lm_head.", "score."}; }
  bool uses_token_type_ids() const override { return false; }
  bool packs_sequences() const override { return true; }
  bool reads_pool_index() const override { return head_ == Head::SequenceClassification; }
  int64_t max_positions() const override { return P_; }

  DerivedInputs derived_inputs() const override {
    DerivedInputs d;
    d.pool_last_non_pad = head_ == Head::SequenceClassification;
    d.pad_token_id = pad_;
    return d;
  }

  // transformers' GPT2ForSequenceClassification pools the last non-padding token
  // (the last token when pad_token_id is unset).
  int64_t pool_position(const int64_t* ids, int64_t T) const override { return last_non_pad(ids, T, pad_); }

 private:
  ValueId conv1d(ir::GraphBuilder& b, ValueId x, const std::string& name, int64_t in, int64_t out) const {
    ValueId w = b.param(name + ".weight", {in, out});
    ValueId bias = b.param(name + ".bias", {out});
    return project_in_out(b, x, w, bias, matmul_dtype_);
  }
  ValueId layer_norm(ir::GraphBuilder& b, ValueId x, const std::string& name) const {
    return named_layer_norm(b, x, name, C_, eps_);
  }

  nlohmann::json config_;
  int64_t V_, C_, layers_, H_, P_, F_, pad_, num_labels_;
  double eps_, embd_dropout_, attn_dropout_, resid_dropout_, init_std_;
  std::string act_;
  bool scale_attn_, scale_by_layer_, tie_;
};

}  // namespace

std::unique_ptr<Family> make_gpt2_family(Head head, const nlohmann::json& config) {
  return std::make_unique<Gpt2Family>(head, config);
}

}  // namespace fusetrain::models
