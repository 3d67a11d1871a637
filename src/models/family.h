// What every architecture family provides to models::Model, and the building
// blocks they share. Shape letters: B batch, T sequence, C hidden, H heads,
// D head size, V vocabulary, L labels.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fusetrain/ir/builder.h"
#include "fusetrain/models/model.h"
#include "fusetrain/models/registry.h"

namespace fusetrain::models {

/// How a parameter is initialised from scratch (transformers' _init_weights).
enum class Init : uint8_t { Normal, Zeros, Ones };

struct ParamInit {
  Init kind = Init::Normal;
  double stddev = 0.02;
  int64_t zero_row = -1;  ///< embeddings: padding_idx row set to zero
};

/// Graph inputs every family reads (all i64 (B, T) unless noted).
struct InputNames {
  static constexpr const char* input_ids = "input_ids";
  static constexpr const char* attention_mask = "attention_mask";
  static constexpr const char* token_type_ids = "token_type_ids";
  static constexpr const char* position_ids = "position_ids";
  static constexpr const char* labels = "labels";
  static constexpr const char* start_positions = "start_positions";
  static constexpr const char* end_positions = "end_positions";
  static constexpr const char* pool_index = "pool_index";  ///< (B): flat row b·T + t of the pooled token
  static constexpr const char* rope_cos = "rope_cos";      ///< (B, T, D): DerivedInputs::Rotary
  static constexpr const char* rope_sin = "rope_sin";
  /// (B, T) i64 of packed rows: the first position of the example holding each token (BatchSpec::packed)
  static constexpr const char* key_begin = "key_begin";
  /// (N) i64 of an unpadded batch (BatchSpec::tokens): the padded row b·T + t each token row holds, every
  /// batch element's first token first (row b holds (b, 0)); the rows past the kept tokens repeat row 0
  static constexpr const char* token_rows = "token_rows";
  /// (B·T) i64 of an unpadded batch: the token row each padded position reads in attention (0 for padding, which
  /// attention's key mask hides and whose outputs nothing reads)
  static constexpr const char* padded_rows = "padded_rows";
  /// (B) f32 of a preference batch: the reference model's summed log-probability of each sequence
  static constexpr const char* ref_logps = "ref_logps";
  /// (B) f32 of a preference batch: each sequence's completion tokens (labels not -100), for loss_type ipo
  static constexpr const char* completion_lengths = "completion_lengths";
};

/// An unpadded spec's row maps (BatchSpec::tokens); both kNone for the padded layout.
struct TokenRows {
  ir::ValueId tokens = ir::kNone;  ///< InputNames::token_rows (N)
  ir::ValueId padded = ir::kNone;  ///< InputNames::padded_rows (B·T)
  bool unpadded() const { return tokens != ir::kNone; }
};

/// An architecture family (BERT, RoBERTa, DistilBERT, GPT-2) with one head.
class Family {
 public:
  virtual ~Family() = default;
  /// Builds the graph for a batch shape; parameters are declared with their
  /// Hugging Face names, in transformers' module order.
  virtual BuiltGraph build(const BatchSpec& spec) const = 0;
  /// Initialisation of a (stored) parameter by name.
  virtual ParamInit init(const std::string& name) const = 0;
  /// Tied names -> the stored name transformers keeps (e.g. lm_head.weight -> transformer.wte.weight).
  virtual std::map<std::string, std::string> tied() const = 0;
  /// Prefix of the base model's names in head models ("bert", "roberta", "distilbert", "transformer").
  virtual std::string base_prefix() const = 0;
  /// Name prefixes of heads this family has (checkpoint tensors under them are
  /// dropped when loading into another head, as transformers does).
  virtual std::vector<std::string> head_prefixes() const = 0;
  /// Position ids the model uses when none are given.
  virtual void default_position_ids(const int64_t* input_ids, int64_t B, int64_t T, int64_t* out) const;
  /// Row to pool per sequence for sequence classification (GPT-2: the last non-pad token).
  virtual int64_t pool_position(const int64_t* ids, int64_t T) const {
    (void)ids;
    (void)T;
    return 0;
  }
  /// Whether the graph reads InputNames::pool_index, the rows pool_position picks (GPT-2's sequence classification).
  virtual bool reads_pool_index() const { return false; }
  virtual bool uses_token_type_ids() const { return true; }
  /// The inputs the graphs read (token_inputs by default).
  virtual std::vector<InputDecl> inputs() const { return token_inputs(uses_token_type_ids()); }
  /// The rules default_position_ids and pool_position follow, for graphs that compute them (ONNX export).
  virtual DerivedInputs derived_inputs() const { return {}; }
  virtual int64_t max_positions() const = 0;
  /// Whether the family fills the plan's inputs from a batch itself (bind_inputs) instead of Model's binding of
  /// input_ids, attention_mask, token_type_ids and position_ids (ONNX import, whose inputs follow the graph).
  virtual bool binds_inputs() const { return false; }
  /// Whether build() honours BatchSpec::packed (its causal attention reads InputNames::key_begin).
  virtual bool packs_sequences() const { return false; }
  /// Whether build() honours BatchSpec::tokens (unpadded batches).
  virtual bool unpads() const { return false; }
  /// Fills every input of `plan` but the labels from `batch`, whose shapes `spec` holds (only when
  /// binds_inputs()).
  virtual void bind_inputs(runtime::Plan& plan, const Batch& batch, const BatchSpec& spec) const {
    (void)plan;
    (void)batch;
    (void)spec;
  }
  /// Fills inputs the family computes on the host from the position ids the batch runs with (Llama's rotary
  /// tables), after Model's own binding.
  virtual void bind_extra_inputs(runtime::Plan& plan, const int64_t* positions, int64_t B, int64_t T) const {
    (void)plan;
    (void)positions;
    (void)B;
    (void)T;
  }
  /// Parameter values the family brings itself (an imported graph's initializers), by stored name.
  virtual std::map<std::string, Tensor> initial_values() const { return {}; }
  /// Frees the values initial_values() returned, once the parameters hold them (an imported graph would
  /// otherwise keep two more copies of its weights: as read and in the file's bytes).
  virtual void release_initial_values() {}
  /// Writes into `dir` the graph the family keeps beside the weights, with `model`'s parameters (an imported
  /// graph: model.onnx); nothing for the families the registry builds.
  virtual void save_graph(const Model& model, const std::string& dir) const {
    (void)model;
    (void)dir;
  }
  /// Whether stored parameter `name` belongs to a module transformers' Trainer exempts from weight decay by its type
  /// (an nn.LayerNorm: GPT-2's ln_1, ln_2, ln_f; an imported graph's LayerNormalization scales and biases), whatever
  /// its name says. The name rules are Model::decays'.
  virtual bool in_layer_norm(const std::string& name) const {
    (void)name;
    return false;
  }
  Head head() const { return head_; }

 protected:
  /// `name` under the base model's prefix ("bert.", "transformer.", ...; none for a bare model).
  std::string p(const std::string& name) const { return prefix_ + name; }
  /// A Linear with "<name>.weight" (out, in) and "<name>.bias" (out), declared weight
  /// first as transformers orders them; in bf16 or f16 when the spec being built asks.
  ir::ValueId dense(ir::GraphBuilder& b, ir::ValueId x, const std::string& name, int64_t out, int64_t in) const;
  /// Bidirectional multi-head self-attention over x (B, T, C): projections `q`, `k`,
  /// `v` (C → C), scaled dot-product with the additive key mask and dropout on the
  /// probabilities, heads merged and projected by `out`.
  /// Unpadded (rows.unpadded()): x is (N, C) token rows; q, k and v are gathered into the padded layout for
  /// attention and its output back into token rows, which the output projection reads.
  ir::ValueId self_attention(ir::GraphBuilder& b, ir::ValueId x, ir::ValueId mask_add, const std::string& q,
                             const std::string& k, const std::string& v, const std::string& out, int64_t B, int64_t T,
                             int64_t C, int64_t H, double dropout_p, const TokenRows& rows = {}) const;
  /// A LayerNorm with "<name>.weight" and "<name>.bias" of size `channels`.
  ir::ValueId named_layer_norm(ir::GraphBuilder& b, ir::ValueId x, const std::string& name, int64_t channels,
                               double eps) const;

  Head head_ = Head::Base;
  std::string prefix_;
  mutable DType matmul_dtype_ = DType::f32;  // operands of projections; set by build() for the spec being built
};

/// True if `name` ends with `suffix`.
bool ends_with(const std::string& name, const std::string& suffix);

/// The families' factories, which the registry's rows name (src/models/registry.cpp); each throws Error naming
/// the config.json field it cannot build.
std::unique_ptr<Family> make_bert_family(bool roberta, Head head, const nlohmann::json& config);
std::unique_ptr<Family> make_distilbert_family(Head head, const nlohmann::json& config);
std::unique_ptr<Family> make_gpt2_family(Head head, const nlohmann::json& config);
std::unique_ptr<Family> make_llama_family(Head head, const nlohmann::json& config);

// ---- config access ------------------------------------------------------------------------

/// Reads typed config fields with defaults; errors name config.json and the field.
class ConfigReader {
 public:
  explicit ConfigReader(const nlohmann::json& config) : config_(config) {}
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key, double fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  bool has(const std::string& key) const { return config_.contains(key) && !config_[key].is_null(); }
  /// num_labels as transformers derives it: len(id2label), else "num_labels", else 2.
  int64_t num_labels() const;
  /// Throws unless `value` is positive.
  int64_t positive(const std::string& key) const;
  /// A norm's epsilon: a finite float > 0; null or an integer is refused, as transformers refuses them (else an
  /// Error naming the field).
  double epsilon(const std::string& key, double fallback) const;
  /// A standard deviation of fresh weights: a finite float >= 0; null or an integer is refused, as transformers
  /// refuses them (else an Error naming the field).
  double init_std(const std::string& key, double fallback) const;
  /// A dropout probability in [0, 1) (else an Error naming the field).
  double probability(const std::string& key, double fallback) const;
  const nlohmann::json& json() const { return config_; }

 private:
  /// Throws if `key` is null or a JSON integer: transformers 5 types it `float`, and its strict dataclass refuses
  /// both (it does not read null as the default).
  void check_float_field(const std::string& key, const char* expected) const;

  const nlohmann::json& config_;
};

// ---- shared graph pieces ------------------------------------------------------------------

/// The dtype attention reads q, k, v in and writes its output in for a model whose matmuls take
/// `matmul_dtype`: bf16 under bf16 mixed precision, else f32.
DType attention_dtype(DType matmul_dtype);
/// x·wᵀ + bias with x and w cast to `matmul_dtype` (bf16 or f16; f32: no cast; x already in it:
/// not cast again), f32 accumulation and output.
ir::ValueId project(ir::GraphBuilder& b, ir::ValueId x, ir::ValueId w, ir::ValueId bias, DType matmul_dtype);
/// x·w (w stored (in, out), GPT-2's Conv1D) + bias, operands in `matmul_dtype`.
ir::ValueId project_in_out(ir::GraphBuilder& b, ir::ValueId x, ir::ValueId w, ir::ValueId bias, DType matmul_dtype);
/// The (B, T) i64 inputs every family reads.
struct SequenceInputs {
  ir::ValueId ids, mask, positions;
};
/// Declares input_ids, attention_mask and position_ids.
SequenceInputs sequence_inputs(ir::GraphBuilder& b, int64_t B, int64_t T);
/// Declares the row maps of an unpadded spec; empty for a padded one.
TokenRows token_rows(ir::GraphBuilder& b, const BatchSpec& spec);
/// x (B, T, C) -> (N, C) token rows of an unpadded spec; x itself otherwise.
ir::ValueId unpad(ir::GraphBuilder& b, ir::ValueId x, const TokenRows& rows, int64_t C);
/// x (N, C) token rows -> (B, T, C) padded; x itself for a padded spec.
ir::ValueId pad(ir::GraphBuilder& b, ir::ValueId x, const TokenRows& rows, int64_t B, int64_t T, int64_t C);
/// Declares InputNames::key_begin (B, T) for a packed spec (BatchSpec::packed); kNone otherwise.
ir::ValueId packed_key_begin(ir::GraphBuilder& b, const BatchSpec& spec);
/// Dropout only while training and only for p > 0.
ir::ValueId maybe_dropout(ir::GraphBuilder& b, ir::ValueId x, double p, bool training);
/// transformers' ACT2FN for the supported names ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "tanh").
/// With bf16 matmuls a GELU reads x rounded to bf16 (what autocast's bf16 projection hands it), so
/// backward keeps half the bytes for it.
ir::ValueId activation(ir::GraphBuilder& b, ir::ValueId x, const std::string& name, DType matmul_dtype = DType::f32);
/// Throws unless `name` is an activation `activation` supports.
void check_activation(const std::string& name, const char* field);
/// (B, T) i64 1/0 mask -> additive (B, T) f32: 0 where 1, the lowest float where 0.
ir::ValueId additive_mask(ir::GraphBuilder& b, ir::ValueId mask, int64_t B, int64_t T);
/// (B, T, C) -> (B, H, T, D)
ir::ValueId split_heads(ir::GraphBuilder& b, ir::ValueId x, int64_t B, int64_t T, int64_t H, int64_t D);
/// (B, H, T, D) -> (B, T, C)
ir::ValueId merge_heads(ir::GraphBuilder& b, ir::ValueId x, int64_t B, int64_t T, int64_t H, int64_t D);
/// x (B, T, C) -> x[:, 0] (B, C); unpadded, x (N, C) -> its first B rows (token_rows puts each first token there).
ir::ValueId first_token(ir::GraphBuilder& b, ir::ValueId x, int64_t B, int64_t T, int64_t C,
                        const TokenRows& rows = {});
/// What a head's layers compute, before its loss: `logits` as the head kind has them, and for question answering
/// given as two outputs, the end logits beside the start logits.
struct HeadLogits {
  ir::ValueId logits = ir::kNone;
  ir::ValueId end_logits = ir::kNone;  ///< question answering: end logits (B, T) when `logits` are the start logits
};
/// The one place a head's outputs and loss are built, for every family (native and imported). By head kind:
///  - Base: `logits` are the hidden states, returned as they are; no loss.
///  - MaskedLM, CausalLM, TokenClassification: logits (B, T, L); cross-entropy against (B, T) token labels, -100
///    ignored (causal-LM labels arrive shifted left by one, so no slicing here).
///  - SequenceClassification: logits (B, L); the problem_type loss (MSE, cross-entropy or BCE with logits).
///  - QuestionAnswering: logits (B, T, 2), or start and end logits (B, T); the mean of the start and end
///    cross-entropies, positions clamped to [0, T] and T ignored, as transformers does.
/// Labels are declared as graph inputs only when `spec` carries them. Throws Error naming the shape the head needs
/// when the logits have another (an imported graph's outputs).
void head_outputs(ir::GraphBuilder& b, Head head, HeadLogits logits, const BatchSpec& spec,
                  const ConfigReader& config, BuiltGraph& out);
/// The decoder models' sequence-classification logits (B, L): "score.weight" (L, C) applied to every position of
/// x (B, T, C), the row InputNames::pool_index picks per sequence kept.
ir::ValueId last_token_logits(ir::GraphBuilder& b, ir::ValueId x, const BatchSpec& spec, int64_t num_labels,
                              int64_t C);
/// The last position of ids (T) that is not `pad` (T - 1 when pad < 0): the token decoder models classify.
int64_t last_non_pad(const int64_t* ids, int64_t T, int64_t pad);

}  // namespace fusetrain::models
