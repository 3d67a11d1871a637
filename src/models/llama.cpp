// Llama, Mistral and Qwen2: decoder-only transformers with RMSNorm, rotary position embeddings, a SwiGLU MLP and
// grouped-query attention (num_key_value_heads ≤ num_attention_heads), with the causal-LM head (tied or not) and
// Llama's sequence-classification head (the last non-padding token). Qwen2 adds biases to q, k and v; Llama's
// attention_bias and mlp_bias add them to every projection.
//
// The rotary tables cos/sin (B, T, D) are computed on the host from the position ids (rope_parameters, or
// rope_theta and rope_scaling in older configs: default, linear, dynamic and llama3) and fed to the plan.
//
// Shape letters: B batch, T sequence, C hidden, H heads, K key/value heads, D head size, F intermediate,
// V vocabulary, L labels.
#include <cmath>
#include <numbers>

#include "fusetrain/core/error.h"
#include "models/family.h"

namespace fusetrain::models {
namespace {

using ir::ValueId;

constexpr const char* kCos = InputNames::rope_cos;
constexpr const char* kSin = InputNames::rope_sin;

class LlamaFamily final : public Family {
 public:
  LlamaFamily(Head head, const nlohmann::json& json) : config_(json) {
    head_ = head;
    ConfigReader c(config_);
    type_ = c.get_string("model_type", "llama");
    V_ = c.positive("vocab_size");
    C_ = c.positive("hidden_size");
    layers_ = c.positive("num_hidden_layers");
    H_ = c.positive("num_attention_heads");
    // num_key_value_heads and head_dim may be null, as transformers' configs allow: all heads, hidden_size // heads.
    // transformers builds a model whose key/value heads do not divide the heads, and fails in its first forward.
    K_ = c.has("num_key_value_heads") ? c.positive("num_key_value_heads") : H_;
    FT_CHECK(H_ % K_ == 0, "config.json: \"num_attention_heads\" ", H_, " is not a multiple of \"num_key_value_heads\" ",
             K_);
    // LlamaConfig.validate_architecture refuses a hidden_size the heads do not divide, head_dim or not; Mistral and
    // Qwen2 take head_dim, else hidden_size // heads rounded down. A head_dim of 0 is refused for all three (Llama and
    // Qwen2 fail on it; transformers' Mistral happens to read 0 as unset).
    FT_CHECK(type_ != "llama" || C_ % H_ == 0, "config.json: \"hidden_size\" is ", C_, " but \"num_attention_heads\" ",
             H_, " does not divide it (transformers' LlamaConfig refuses it too, with or without \"head_dim\")");
    D_ = c.has("head_dim") ? c.positive("head_dim") : C_ / H_;
    FT_CHECK(D_ > 0, "config.json: \"hidden_size\" ", C_, " is smaller than \"num_attention_heads\" ", H_,
             ", which leaves heads of size 0");
    // transformers refuses an odd head_dim above 4 in validate_rope and fails in the forward for one up to 4.
    FT_CHECK(D_ % 2 == 0, "config.json: the head size ", D_, " must be even for rotary embeddings");
    F_ = c.positive("intermediate_size");
    P_ = c.positive("max_position_embeddings");
    eps_ = c.epsilon("rms_norm_eps", 1e-6);
    init_std_ = c.init_std("initializer_range", 0.02);
    FT_CHECK(type_ != "llama" || init_std_ <= 1.0, "config.json: \"initializer_range\" is ", init_std_,
             ", expected at most 1 (LlamaConfig's interval for it; transformers refuses it too)");
    attn_dropout_ = c.probability("attention_dropout", 0.0);
    const std::string act = c.get_string("hidden_act", "silu");
    FT_CHECK(act == "silu", "config.json: \"hidden_act\" is \"", act, "\"; fusetrain's ", type_,
             " supports silu (SwiGLU) only");
    qkv_bias_ = type_ == "qwen2" || c.get_bool("attention_bias", false);
    o_bias_ = type_ != "qwen2" && c.get_bool("attention_bias", false);
    mlp_bias_ = c.get_bool("mlp_bias", false);
    tie_ = c.get_bool("tie_word_embeddings", false);
    pad_ = c.get_int("pad_token_id", -1);
    num_labels_ = c.num_labels();
    read_windows(c);
    read_rope(c);
    prefix_ = head == Head::Base ? "" : "model.";
  }

  BuiltGraph build(const BatchSpec& spec) const override {
    BuiltGraph out;
    ir::GraphBuilder b(out.graph, 0x11a3a);
    matmul_dtype_ = spec.fp16 ? DType::f16 : spec.bf16 ? DType::bf16 : DType::f32;
    const int64_t B = spec.batch, T = spec.seq, C = C_, H = H_, K = K_, D = D_;
    const bool train = spec.training;
    const DType io = attention_dtype(matmul_dtype_);
    auto [ids, mask, positions] = sequence_inputs(b, B, T);
    (void)positions;  // read on the host, for the rotary tables
    const ValueId key_begin = packed_key_begin(b, spec);
    ValueId mask_add = additive_mask(b, mask, B, T);
    ValueId cos = b.input(kCos, {B, T, D}), sin = b.input(kSin, {B, T, D});

    ValueId embed = b.param(p("embed_tokens.weight"), {V_, C});
    ValueId x = b.embedding(embed, ids, pad_ >= 0 && pad_ < V_ ? pad_ : -1);
    out.layer_boundaries.push_back(x);
    for (int64_t l = 0; l < layers_; ++l) {
      const std::string layer = p("layers." + std::to_string(l) + ".");
      ValueId a = rms_norm(b, x, layer + "input_layernorm");
      ValueId q = proj(b, a, layer + "self_attn.q_proj", H * D, C, qkv_bias_);
      ValueId k = proj(b, a, layer + "self_attn.k_proj", K * D, C, qkv_bias_);
      ValueId v = proj(b, a, layer + "self_attn.v_proj", K * D, C, qkv_bias_);
      // Grouped-query attention reads the K key/value heads as they are (no repeat in memory). bf16: q, k, v and
      // the context are kept in bf16, as autocast's bf16 projections and attention produce them.
      q = b.rope(b.reshape(q, {B, T, H, D}), cos, sin);
      k = b.rope(b.reshape(k, {B, T, K, D}), cos, sin);
      v = b.reshape(v, {B, T, K, D});
      if (io != DType::f32) {
        q = b.cast(q, io);
        k = b.cast(k, io);
        v = b.cast(v, io);
      }
      // v, k, q in turn, one statement each: node order is not left to the compiler's argument order.
      ValueId v_heads = b.transpose(v, {0, 2, 1, 3});
      ValueId k_heads = b.transpose(k, {0, 2, 1, 3});
      ValueId q_heads = b.transpose(q, {0, 2, 1, 3});
      ValueId context = b.attention(q_heads, k_heads, v_heads, mask_add, 1.0 / std::sqrt(double(D)), true,
                                    train ? attn_dropout_ : 0.0, io, window_of(l, T, spec.every_window), 0.0,
                                    key_begin);
      ValueId merged = b.reshape(b.transpose(context, {0, 2, 1, 3}), {B, T, H * D});
      x = b.add(x, proj(b, merged, layer + "self_attn.o_proj", C, H * D, o_bias_));
      ValueId m = rms_norm(b, x, layer + "post_attention_layernorm");
      ValueId gate = proj(b, m, layer + "mlp.gate_proj", F_, C, mlp_bias_);
      ValueId up = proj(b, m, layer + "mlp.up_proj", F_, C, mlp_bias_);
      if (matmul_dtype_ == DType::bf16) {  // as bf16 autocast hands the projections to silu and the product
        gate = b.cast(gate, matmul_dtype_);
        up = b.cast(up, matmul_dtype_);
      }
      x = b.add(x, proj(b, b.swiglu(gate, up), layer + "mlp.down_proj", C, F_, mlp_bias_));
      out.layer_boundaries.push_back(x);
    }
    x = rms_norm(b, x, p("norm"));
    out.hidden_states = x;
    ValueId logits = x;  // Head::Base: the hidden states
    switch (head_) {
      case Head::Base:
        break;
      case Head::CausalLM: {
        ValueId lm_head = tie_ ? embed : b.param("lm_head.weight", {V_, C});
        logits = project(b, x, lm_head, ir::kNone, matmul_dtype_);
        break;
      }
      case Head::SequenceClassification:
        logits = last_token_logits(b, x, spec, num_labels_, C);
        break;
      default:
        throw Error(str(type_, " in fusetrain has causal-LM and sequence-classification heads only"));
    }
    head_outputs(b, head_, {logits}, spec, ConfigReader(config_), out);
    return out;
  }

  void bind_extra_inputs(runtime::Plan& plan, const int64_t* positions, int64_t B, int64_t T) const override {
    if (!plan.has_input(kCos)) return;
    int64_t longest = 0;
    for (int64_t i = 0; i < B * T; ++i) longest = std::max(longest, positions[i] + 1);
    const std::vector<double> inv = inverse_frequencies(longest);
    float* cos = plan.staging(kCos).data_as<float>();  // built on the host, uploaded below
    float* sin = plan.staging(kSin).data_as<float>();
    const int64_t half = D_ / 2;
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t j = 0; j < half; ++j) {
        // transformers computes the angle in f32 (position · inv_freq as a float product).
        const float angle = static_cast<float>(positions[r]) * static_cast<float>(inv[size_t(j)]);
        const float c = std::cos(angle) * static_cast<float>(attention_factor_);
        const float s = std::sin(angle) * static_cast<float>(attention_factor_);
        cos[r * D_ + j] = cos[r * D_ + j + half] = c;
        sin[r * D_ + j] = sin[r * D_ + j + half] = s;
      }
    plan.upload_staging(kCos);
    plan.upload_staging(kSin);
  }

  ParamInit init(const std::string& name) const override {
    if (ends_with(name, "bias")) return {Init::Zeros};
    if (ends_with(name, "norm.weight")) return {Init::Ones};
    return {Init::Normal, init_std_, ends_with(name, "embed_tokens.weight") ? pad_ : -1};
  }
  std::map<std::string, std::string> tied() const override {
    if (head_ != Head::CausalLM || !tie_) return {};
    return {{"lm_head.weight", p("embed_tokens.weight")}};
  }
  std::string base_prefix() const override { return "model"; }
  std::vector<std::string> head_prefixes() const override { return {"lm_head.", "score."}; }
  bool uses_token_type_ids() const override { return false; }
  bool packs_sequences() const override { return true; }
  bool reads_pool_index() const override { return head_ == Head::SequenceClassification; }
  int64_t max_positions() const override { return std::numeric_limits<int32_t>::max(); }
  int64_t pool_position(const int64_t* ids, int64_t T) const override { return last_non_pad(ids, T, pad_); }
  DerivedInputs derived_inputs() const override {
    DerivedInputs d;
    d.pool_last_non_pad = head_ == Head::SequenceClassification;
    d.pad_token_id = pad_;
    d.position_ids_input = head_ != Head::SequenceClassification;
    RotaryRule& r = d.rotary.emplace();
    for (double f : inverse_frequencies(0)) r.inv_freq.push_back(static_cast<float>(f));
    r.attention_factor = attention_factor_;
    r.dynamic = rope_type_ == "dynamic";
    r.theta = theta_;
    r.factor = factor_;
    r.max_positions = P_;
    return d;
  }

 private:
  ValueId proj(ir::GraphBuilder& b, ValueId x, const std::string& name, int64_t out, int64_t in, bool bias) const {
    ValueId w = b.param(name + ".weight", {out, in});
    ValueId bv = bias ? b.param(name + ".bias", {out}) : ir::kNone;
    return project(b, x, w, bv, matmul_dtype_);
  }
  ValueId rms_norm(ir::GraphBuilder& b, ValueId x, const std::string& name) const {
    return b.rms_norm(x, b.param(name + ".weight", {C_}), eps_);
  }

  // Sliding-window layers as transformers picks them. Mistral: every layer. Qwen2: only with "use_sliding_window",
  // the layers "layer_types" names "sliding_attention", or without that list those from "max_window_layers"
  // (default 28) on. Llama: none. "sliding_window" is `int | None = 4096` in both configs: absent it is 4096, null
  // none; transformers builds a window of 0 or less and fails in its first forward.
  void read_windows(const ConfigReader& c) {
    windows_.assign(static_cast<size_t>(layers_), 0);
    const bool qwen2 = type_ == "qwen2";
    if (!(type_ == "mistral" || (qwen2 && c.get_bool("use_sliding_window", false)))) return;
    if (config_.contains("sliding_window") && config_["sliding_window"].is_null()) return;
    const int64_t window = c.has("sliding_window") ? c.positive("sliding_window") : 4096;
    if (!qwen2) {
      windows_.assign(static_cast<size_t>(layers_), window);
      return;
    }
    if (c.has("layer_types")) {
      const nlohmann::json& types = config_["layer_types"];
      FT_CHECK(types.is_array() && static_cast<int64_t>(types.size()) == layers_, "config.json: \"layer_types\" should",
               " be a list of ", layers_, " strings (one per layer), found ", types.dump());
      for (int64_t l = 0; l < layers_; ++l) {
        const nlohmann::json& t = types[static_cast<size_t>(l)];
        FT_CHECK(t == "sliding_attention" || t == "full_attention", "config.json: \"layer_types\"[", l,
                 "] should be \"full_attention\" or \"sliding_attention\", found ", t.dump());
        if (t == "sliding_attention") windows_[static_cast<size_t>(l)] = window;
      }
      return;
    }
    const int64_t first = c.get_int("max_window_layers", 28);
    for (int64_t l = std::max<int64_t>(first, 0); l < layers_; ++l) windows_[static_cast<size_t>(l)] = window;
  }
  // The window layer l's attention takes at sequence length T: none where it covers the whole sequence, unless
  // the graph serves other lengths too (`every`).
  int64_t window_of(int64_t l, int64_t T, bool every) const {
    const int64_t window = windows_[static_cast<size_t>(l)];
    return window < T || every ? window : 0;
  }

  // RoPE as transformers 5 reads it (modeling_rope_utils.py). The dict is "rope_scaling" when that is a non-empty
  // object, else "rope_parameters" (convert_rope_params_to_dict); its type "rope_type", else "type", else
  // "default"; its "rope_theta", else the top-level one, else 10000 (standardize_rope_params). A type needs the keys
  // its _validate_<type>_rope_parameters requires (a missing one is a KeyError there), and every key read must be a
  // number: transformers fails on null, a string or a list when it validates the config or builds the model.
  void read_rope(const ConfigReader& c) {
    nlohmann::json rope = nlohmann::json::object();
    std::string field = "rope_parameters";
    for (const char* key : {"rope_parameters", "rope_scaling"}) {  // rope_scaling second: it wins
      if (!config_.contains(key) || config_[key].is_null()) continue;
      const nlohmann::json& v = config_[key];
      FT_CHECK(v.is_object(), "config.json: \"", key, "\" should be an object, found ", v.dump(),
               " (transformers refuses it too)");
      if (!v.empty()) {
        rope = v;
        field = key;
      }
    }
    for (const char* layer_type : {"full_attention", "sliding_attention"})
      FT_CHECK(!rope.contains(layer_type), "config.json: \"", field, "\" holds parameters per layer type (\"",
               layer_type, "\"), which fusetrain's ", type_, " does not read; give one set for every layer");
    auto number = [&](const nlohmann::json& v, const std::string& where, const char* expected) {
      FT_CHECK(v.is_number(), "config.json: ", where, " is ", v.dump(), ", expected ", expected,
               " (transformers fails on it too)");
      return v.get<double>();
    };
    auto key_of = [&](const char* key) { return str("\"", field, "\" \"", key, "\""); };
    // A key the rope type needs: missing, transformers raises KeyError.
    auto required = [&](const char* key, const char* expected) {
      FT_CHECK(rope.contains(key), "config.json: \"", field, "\" of type \"", rope_type_, "\" needs \"", key, "\" (",
               expected, "), as transformers requires; it has none");
      return number(rope[key], key_of(key), expected);
    };

    const char* type_key = rope.contains("rope_type") ? "rope_type" : rope.contains("type") ? "type" : nullptr;
    if (type_key) {
      FT_CHECK(rope[type_key].is_string(), "config.json: ", key_of(type_key), " is ", rope[type_key].dump(),
               ", expected the name of a rope type (transformers fails on it too)");
      rope_type_ = rope[type_key].get<std::string>();
    }
    if (rope.contains("rope_theta"))
      theta_ = number(rope["rope_theta"], key_of("rope_theta"), "a number > 0");
    else if (config_.contains("rope_theta"))
      theta_ = number(config_["rope_theta"], "\"rope_theta\"", "a number > 0");
    // transformers takes 0 or a negative base and computes infinite or NaN frequencies from it.
    FT_CHECK(theta_ > 0 && std::isfinite(theta_), "config.json: \"rope_theta\" is ", theta_, ", expected > 0");
    if (rope_type_ == "default") return;  // transformers ignores any other key here, with a warning
    FT_CHECK(rope_type_ == "linear" || rope_type_ == "dynamic" || rope_type_ == "llama3", "config.json: ",
             key_of(type_key), " is \"", rope_type_, "\", which fusetrain does not support (supported: default, ",
             "linear, dynamic, llama3)");
    factor_ = required("factor", "a number >= 1");
    // transformers only warns below 1 ("factor field must be a float or int >= 1"); fusetrain refuses what that
    // rule calls invalid rather than train on it (0 divides by zero, a negative factor inverts the frequencies).
    FT_CHECK(factor_ >= 1.0 && std::isfinite(factor_), "config.json: ", key_of("factor"), " is ", factor_,
             ", expected a number >= 1 (transformers' rule for it)");
    // The scaled types compute frequencies for int(head_dim · partial_rotary_factor) dimensions (the dict's, else
    // the top-level one) while these models rotate whole heads: anything short of a whole head fails in
    // transformers' forward. (The default type ignores it.)
    const bool own_partial = rope.contains("partial_rotary_factor");
    if (own_partial || c.has("partial_rotary_factor")) {
      const double partial = number(own_partial ? rope["partial_rotary_factor"] : config_["partial_rotary_factor"],
                                    own_partial ? key_of("partial_rotary_factor") : "\"partial_rotary_factor\"",
                                    "a fraction of the head");
      FT_CHECK(static_cast<int64_t>(static_cast<double>(D_) * partial) == D_, "config.json: \"partial_rotary_factor\" ",
               partial, " rotates part of each head, which ", type_, " does not (transformers fails on it in the ",
               "forward with rope type \"", rope_type_, "\")");
    }
    if (rope_type_ != "llama3") return;
    low_ = required("low_freq_factor", "a number > 0");
    high_ = required("high_freq_factor", "a number > low_freq_factor");
    // standardize_rope_params: the top-level "original_max_position_embeddings" when the config has one, else the
    // dict's, else "max_position_embeddings".
    if (config_.contains("original_max_position_embeddings"))
      original_ = number(config_["original_max_position_embeddings"], "\"original_max_position_embeddings\"",
                         "a positive number of positions");
    else if (rope.contains("original_max_position_embeddings"))
      original_ = number(rope["original_max_position_embeddings"], key_of("original_max_position_embeddings"),
                         "a positive number of positions");
    else
      original_ = static_cast<double>(P_);
    // transformers divides by low_freq_factor, and only warns when high_freq_factor is not above it (equal, its
    // smoothing divides by zero) or the original length is not positive; fusetrain refuses all three.
    FT_CHECK(low_ > 0 && high_ > low_ && original_ > 0, "config.json: ", key_of(type_key), " \"llama3\" needs 0 < ",
             "\"low_freq_factor\" < \"high_freq_factor\" and a positive \"original_max_position_embeddings\", found ",
             low_, ", ", high_, " and ", original_);
  }

  // inv_freq as transformers' ROPE_INIT_FUNCTIONS compute it for a batch whose longest position is `longest`.
  std::vector<double> inverse_frequencies(int64_t longest) const {
    double base = theta_;
    if (rope_type_ == "dynamic" && longest > P_)
      base *= std::pow(factor_ * double(longest) / double(P_) - (factor_ - 1.0), double(D_) / double(D_ - 2));
    std::vector<double> inv(size_t(D_ / 2));
    for (int64_t j = 0; j < D_ / 2; ++j) {
      // f32 as transformers computes it: 1 / base ** (arange(0, D, 2).float() / D)
      const float exponent = static_cast<float>(2 * j) / static_cast<float>(D_);
      inv[size_t(j)] = 1.0f / std::pow(static_cast<float>(base), exponent);
    }
    if (rope_type_ == "linear")
      for (double& f : inv) f = static_cast<float>(f / factor_);
    if (rope_type_ == "llama3") {
      const double low_wavelen = original_ / low_, high_wavelen = original_ / high_;
      for (double& f : inv) {
        const double wavelen = 2 * std::numbers::pi / f;
        const double scaled = wavelen > low_wavelen ? f / factor_ : f;
        const double smooth = (original_ / wavelen - low_) / (high_ - low_);
        const double smoothed = (1 - smooth) * scaled / factor_ + smooth * scaled;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        f = static_cast<float>(medium ? smoothed : scaled);
      }
    }
    return inv;
  }

  nlohmann::json config_;
  std::string type_, rope_type_ = "default";
  int64_t V_, C_, layers_, H_, K_, D_, F_, P_, pad_, num_labels_;
  std::vector<int64_t> windows_;  // per layer: its sliding window in tokens, 0 for full causal attention
  double eps_, init_std_, attn_dropout_, theta_ = 10000.0, factor_ = 1.0, low_ = 1.0, high_ = 4.0;
  double original_ = 8192;  // llama3's original_max_position_embeddings, a float as transformers divides by it
  double attention_factor_ = 1.0;
  bool qkv_bias_, o_bias_, mlp_bias_, tie_;
};

}  // namespace

std::unique_ptr<Family> make_llama_family(Head head, const nlohmann::json& config) {
  return std::make_unique<LlamaFamily>(head, config);
}

}  // namespace fusetrain::models
