// Hugging Face architectures as fusetrain graphs: BERT, RoBERTa, DistilBERT, GPT-2, Llama, Mistral, Qwen2, and
// graphs imported from ONNX.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fusetrain/compile/compiler.h"
#include "fusetrain/core/tensor.h"
#include "fusetrain/ir/graph.h"
#include "fusetrain/models/inputs.h"
#include "fusetrain/models/lora.h"
#include "fusetrain/models/registry.h"
#include "fusetrain/runtime/parameters.h"
#include "fusetrain/runtime/plan.h"

namespace fusetrain::io {
struct HfModelDir;
}

namespace fusetrain::models {

class Family;

/// A preference objective (TRL's DPOTrainer): each batch holds 2P sequences, the P chosen completions then the P
/// rejected ones of the same prompts, with labels on the completion tokens.
struct PreferenceConfig {
  std::string loss_type = "sigmoid";  ///< TRL's loss_type: "sigmoid" (DPO), "hinge" or "ipo"
  double beta = 0.1;                  ///< TRL's beta
  bool operator==(const PreferenceConfig&) const = default;
};

/// The shape of a batch; a plan is compiled once per distinct spec.
struct BatchSpec {
  int64_t batch = 1;
  int64_t seq = 1;  ///< the sequence axis of the inputs that have one (1 when none does)
  /// An encoder-decoder's target sequence (its decoder inputs' and its labels' second axis); 0: not given.
  int64_t target_seq = 0;
  /// The target sequence's length, the source's where none is given (a probe build that lays out parameters).
  int64_t target_length() const { return target_seq > 0 ? target_seq : seq; }
  /// The declared inputs the batch gives, in declaration order, with their shapes.
  std::vector<std::pair<std::string, Shape>> shapes;
  bool attention_mask = false;
  bool token_type_ids = false;
  bool position_ids = false;
  LabelKind labels = LabelKind::None;
  bool training = false;  ///< dropout active
  bool bf16 = false;      ///< matmuls in bf16 (f32 accumulation, f32 master weights)
  bool fp16 = false;      ///< matmul operands in f16 (f32 accumulation); a loss_scale input seeds backward
  bool recompute = false; ///< backward recomputes each layer's activations (activation checkpointing)
  bool fusions = true;    ///< run the fusion passes
  /// Attention windows stay on where they cover the whole sequence: the graph serves other lengths (ONNX export).
  bool every_window = false;
  /// Several examples packed in a row: position_ids restart inside a row and no attention_mask is given (the rule
  /// transformers follows). Causal attention then stays within each example (InputNames::key_begin) and the
  /// causal-LM loss skips the prediction across each boundary.
  bool packed = false;
  /// > 0: the batch runs unpadded (Model::set_unpad). Its kept tokens (attention_mask 1, and every row's first
  /// token), rounded up to this count, are the rows every token-wise op computes: the embeddings, projections,
  /// norms and feed-forward layers run on (tokens, C) rather than (batch, seq, C), and only attention reads them
  /// back in the padded (batch, seq) layout (InputNames::token_rows, padded_rows). 0: the padded layout throughout.
  int64_t tokens = 0;
  /// A causal or masked LM with token labels also computes the token statistics (ir TokenStats: summed entropy,
  /// top-1 hits, counted positions), which TRL's trainers log as entropy and mean_token_accuracy.
  bool token_stats = false;
  /// A causal LM with token labels computes each sequence's summed log-probability of its labels (BuiltGraph::
  /// sequence_logps) and, unless `reference`, the preference loss of those against the reference's (inputs
  /// ref_logps and completion_lengths, (B) f32). With token_stats, per-position statistics (BuiltGraph::row_stats).
  std::optional<PreferenceConfig> preference;
  /// The reference model's log-probabilities: the sequence log-probabilities only (no loss), LoRA adapters left out.
  bool reference = false;
  bool operator==(const BatchSpec&) const = default;
};

/// Graph values a built model exposes.
struct BuiltGraph {
  ir::Graph graph;
  ir::ValueId logits = ir::kNone;         ///< (B, T, V), (B, L), (B, T, L); for QA start logits (B, T)
  ir::ValueId end_logits = ir::kNone;     ///< QA only: (B, T)
  ir::ValueId hidden_states = ir::kNone;  ///< last hidden states (B, T, C); (N, C) unpadded
  ir::ValueId loss = ir::kNone;           ///< scalar when labels are given
  ir::ValueId token_stats = ir::kNone;    ///< (3) with BatchSpec::token_stats
  ir::ValueId sequence_logps = ir::kNone;  ///< (B) with BatchSpec::preference: Σ_t log p(label) per sequence
  ir::ValueId row_stats = ir::kNone;  ///< (B, T, 3) with preference and token_stats: entropy, top-1 hit, mean logit
  /// The first layer's input, then each layer's output: the values activation checkpointing keeps.
  std::vector<ir::ValueId> layer_boundaries;
};

/// How the graph passes changed a plan's graph (forward + backward), for reports.
using PassLog = compile::PassLog;

/// Rotary embeddings (Llama family), for a graph that computes them itself (ONNX export): the plan's inputs
/// rope_cos and rope_sin (B, T, D) hold cos and sin of position · inv_freq[j], j < D/2, repeated for the second half
/// of D and multiplied by attention_factor.
struct RotaryRule {
  std::vector<float> inv_freq;  ///< D/2 frequencies (those of a batch within max_positions when dynamic)
  double attention_factor = 1.0;
  /// Dynamic NTK scaling: when a batch's largest position + 1 exceeds max_positions, inv_freq is recomputed as
  /// 1 / base^(2j/D) with base = theta · (factor · longest / max_positions − (factor − 1))^(D / (D − 2)).
  bool dynamic = false;
  double theta = 10000.0, factor = 1.0;
  int64_t max_positions = 0;
};

/// How a model derives the inputs a caller may leave out, for a graph that must compute them itself (ONNX export).
struct DerivedInputs {
  /// RoBERTa: position ids count the non-padding tokens from pad_token_id + 1 and padding keeps pad_token_id;
  /// otherwise position ids are 0 .. T-1.
  bool positions_past_padding = false;
  /// GPT-2 sequence classification: the logits are those of each row's last non-padding token.
  bool pool_last_non_pad = false;
  int64_t pad_token_id = -1;  ///< the id both rules read (-1: none; GPT-2 then pools the last token)
  /// Llama family: position_ids is an input of an exported text-generation or feature-extraction graph (as Optimum
  /// exports these models), so a caller with left padding can pass its own.
  bool position_ids_input = false;

  std::optional<RotaryRule> rotary;  ///< absent: the model reads no rotary tables
};

/// Outputs of a run, valid until the next run of the same model.
/// Token statistics of a run (BatchSpec::token_stats) over the positions the loss counts.
struct TokenStats {
  double entropy_sum = 0;  ///< Σ the softmax entropy of each counted position
  double top1 = 0;         ///< counted positions whose label is the first largest logit
  double counted = 0;      ///< counted positions
};

/// Per-sequence figures of a preference run (2P sequences: P chosen, then P rejected), from which TRL's
/// DPOTrainer metrics follow.
struct PreferenceStats {
  std::vector<double> logps;      ///< Σ log p(label) over each sequence's completion
  std::vector<double> ref_logps;  ///< the same under the reference model
  std::vector<double> tokens;     ///< completion positions predicted (labels after the shift)
  std::vector<double> entropy_sum, top1, mean_logit_sum;  ///< with token_stats: sums over those positions
};

struct ModelOutput {
  Tensor logits;
  Tensor end_logits;  ///< QA only
  std::optional<double> loss;
  std::optional<TokenStats> token_stats;  ///< with set_token_stats(true) and token labels
  std::optional<PreferenceStats> preference;  ///< with set_preference and token labels
};

/// A Hugging Face model: config, parameters under their Hugging Face names in
/// one flat buffer, and graphs built per batch shape. Tied weights (the LM head
/// and the word embeddings) are one parameter known under both names.
class Model {
 public:
  /// Loads config.json and safetensors weights from a model directory. `architecture`
  /// ("BertForSequenceClassification", ...) overrides config["architectures"][0];
  /// `config_overrides` (e.g. {"num_labels": 2}) are merged into the config first.
  /// Weights of a head missing from the checkpoint are freshly initialised and
  /// listed by missing_keys(), drawn from `init_seed`; unexpected tensors are an error listing them.
  static std::unique_ptr<Model> from_pretrained(const std::string& dir, const std::string& architecture = "",
                                                const nlohmann::json& config_overrides = nlohmann::json::object(),
                                                uint64_t init_seed = 0);
  /// The same from a model directory already read (io::read_hf_dir), so a caller that needed its config.json
  /// first does not read and parse it again.
  static std::unique_ptr<Model> from_pretrained(const io::HfModelDir& dir, const std::string& architecture = "",
                                                const nlohmann::json& config_overrides = nlohmann::json::object(),
                                                uint64_t init_seed = 0);
  /// A LoRA model loaded from a model directory: the same as from_pretrained followed by enable_lora(lora), but
  /// when the checkpoint holds every weight each one goes from its mapped file straight into the LoRA layout (bf16
  /// or quantised with lora.quantize_base), so the full-precision model never exists in memory: an 8B model with
  /// a 4-bit base loads within its own 4-bit size plus one weight. `lora.quantized` empty with a quant_type names
  /// every quantizable_weights() weight.
  static std::unique_ptr<Model> from_pretrained(const io::HfModelDir& dir, const std::string& architecture,
                                                const nlohmann::json& config_overrides, uint64_t init_seed,
                                                const LoraConfig& lora);
  /// A model whose graphs a family made outside the registry builds (an ONNX graph: onnx_import::import_model),
  /// with `head` and the parameter values the family brings; `config` names the architecture ("architectures"[0],
  /// else "OnnxModel") and model_type (else "onnx").
  static std::unique_ptr<Model> from_family(std::unique_ptr<Family> family, const nlohmann::json& config, Head head);
  /// Fresh weights from a config (a JSON object or a config.json path), initialised as the
  /// architecture does in transformers (normal(0, initializer_range), zero biases, unit LayerNorm).
  static std::unique_ptr<Model> from_config(const nlohmann::json& config, uint64_t seed = 0,
                                            const std::string& architecture = "");
  /// The same without drawing the weights: the parameter store is laid out (address space only, no page
  /// written) for a load that fills it or replaces it.
  static std::unique_ptr<Model> from_config_uninitialised(const nlohmann::json& config,
                                                          const std::string& architecture = "");
  ~Model();

  const nlohmann::json& config() const { return config_; }
  /// The transformers class this model mirrors, e.g. "GPT2LMHeadModel".
  const std::string& architecture() const { return architecture_; }
  /// "bert", "roberta", "distilbert", "gpt2", "llama", "mistral" or "qwen2" (an imported ONNX graph: its config's
  /// model_type, else "onnx").
  const std::string& model_type() const { return model_type_; }
  /// The registry's row for this model: its head, what it returns, the task it trains.
  const ArchitectureInfo& architecture_info() const { return *architecture_info_; }
  /// Whether the model's family came from outside the registry (from_family: an imported ONNX graph).
  bool imported_from_onnx() const { return onnx_info_ != nullptr; }
  /// The family that builds this model's graphs (src/models/family.h).
  const Family& family() const { return *family_; }
  /// The longest sequence the model takes (its position embeddings; RoBERTa's two padding offsets left out).
  int64_t max_positions() const;
  /// Whether the architecture reads token_type_ids (BERT and RoBERTa do).
  bool uses_token_type_ids() const;
  /// The inputs the model reads (a batch may also carry the labels of kLabelNames).
  const std::vector<InputDecl>& inputs() const { return inputs_; }
  /// Error naming the input unless `batch` holds every input the model needs, each of its declared dtype and
  /// shape, with one batch size and sequence length, and nothing it does not take (labels aside).
  void check_inputs(const Batch& batch) const;
  /// Whether a trained parameter gets weight decay: as transformers' Trainer.get_decay_parameter_names decides
  /// (decayed_by_name, and no parameter of an nn.LayerNorm module), unless set_decayed gave the set.
  bool decays(const std::string& stored_name) const;
  /// The trained parameters that decay (stored or tied names), in place of the rule (the Python Trainer hands over
  /// transformers' own choice, so a Trainer subclass's rule holds); updates the store's flags. Error naming a name
  /// that is not a trained parameter.
  void set_decayed(const std::set<std::string>& names);
  runtime::ParameterStore& params() { return *params_; }
  const runtime::ParameterStore& params() const { return *params_; }

  /// Every Hugging Face parameter name (tied names included), in transformers' order; a LoRA model's frozen base
  /// weights first, then its adapters.
  std::vector<std::string> state_dict_names() const;
  /// The names of the parameters that train (all of them but a LoRA model's frozen base weights).
  std::vector<std::string> trainable_names() const;
  /// The parameter under a Hugging Face name (a view into the flat buffer; a frozen base weight: into the frozen
  /// buffer, in bf16 when the LoRA config keeps it so).
  Tensor parameter(const std::string& hf_name) const;
  /// parameter() in host memory: the view itself where the device is host-visible, else an owning copy downloaded
  /// from the device (for reading weights: exports, the Python layer).
  Tensor host_parameter(const std::string& hf_name) const;
  /// The gradient of that parameter (a view into the flat gradient buffer); Error for a frozen weight.
  Tensor gradient(const std::string& hf_name) const;
  /// gradient() in host memory, as host_parameter() reads a weight.
  Tensor host_gradient(const std::string& hf_name) const;

  /// Turns the model into a LoRA model (PEFT's get_peft_model): an adapter beside every projection
  /// `config.target_modules` names, A drawn as PEFT draws it (kaiming-uniform) and B zero, every other weight frozen
  /// (no gradient, no optimizer state) but those under config.modules_to_save; frozen projection weights are kept in
  /// bf16 when config.base_dtype is bf16. Compiled plans are dropped.
  void enable_lora(const LoraConfig& config);
  /// The weights LoraConfig::quantized may name for this model and `config` (its target modules): every frozen
  /// (out, in) weight only Linear projections read, the output layer left out (bitsandbytes' load_in_4bit).
  std::vector<std::string> quantizable_weights(const LoraConfig& config) const;
  /// The modules of the model's head ("score", "classifier", "lm_head", ...): what a LoRA run on a new task head
  /// trains in full (LoraConfig::modules_to_save).
  std::vector<std::string> head_modules() const;
  /// The LoRA config (null for a model trained in full).
  const LoraConfig* lora() const { return lora_ ? &*lora_ : nullptr; }
  /// The adapters enable_lora added, in parameter order.
  const std::vector<LoraAdapter>& lora_adapters() const { return lora_adapters_; }
  /// Folds every adapter into its base weight (W += s·B·A) and makes the model a plain one again, every weight
  /// trainable in f32 (PEFT's merge_and_unload).
  void merge_lora();
  /// Writes the adapters in PEFT's format: adapter_config.json and adapter_model.safetensors (f32, keys
  /// "base_model.model.<module>.lora_A.weight", modules_to_save under their own names), for
  /// peft.PeftModel.from_pretrained. Error unless LoRA is enabled.
  void save_adapter(const std::string& dir, const std::string& base_model = "") const;
  /// Reads a PEFT adapter directory: enables LoRA from its adapter_config.json (when not enabled with the same
  /// settings already) and loads adapter_model.safetensors. Error naming the file on a mismatch.
  void load_adapter(const std::string& dir);
  /// Copies tensors into parameters by Hugging Face name (f32, bf16 or f16 sources).
  /// With strict, missing or unexpected names are an error listing them.
  void load_state_dict(const std::map<std::string, Tensor>& tensors, bool strict = true);
  /// A LoRA model writes its adapters (save_adapter), as PEFT's save_pretrained does.
  /// Otherwise writes config.json and model.safetensors (f32) in transformers' layout; tied
  /// weights are written once, under the name transformers keeps. A model imported from ONNX writes model.onnx
  /// (its graph, the trained initializers) and config.json, plus model.safetensors when its parameters carry
  /// transformers' names.
  void save_pretrained(const std::string& dir) const;
  /// Parameters the checkpoint did not provide (freshly initialised).
  const std::vector<std::string>& missing_keys() const { return missing_keys_; }

  /// Builds the forward graph (and loss, when spec has labels) for a batch shape.
  BuiltGraph build(const BatchSpec& spec) const;
  /// How the position ids (and GPT-2's pooled rows) the graph reads follow from input_ids.
  DerivedInputs derived_inputs() const;

  /// Runs a forward pass (dropout per `training`), with the loss when labels are given.
  ModelOutput forward(const Batch& batch, bool training = false);
  /// Zeroes the gradients, runs forward and backward, and returns the loss;
  /// gradients are then readable through gradient(name).
  double loss_and_grads(const Batch& batch, bool training = false);
  /// Forward + backward without zeroing gradients first (gradient accumulation). `observer`, when given, watches
  /// the plan's run between nodes (data parallel gradient buckets).
  double accumulate_grads(const Batch& batch, bool training = false, runtime::RunObserver* observer = nullptr);
  /// Training runs draw dropout masks from a counter shared by all of this model's
  /// plans: run k uses stream offset k. Resuming restores it, so masks continue exactly.
  uint64_t rng_step() const { return rng_step_; }
  void set_rng_step(uint64_t step) { rng_step_ = step; }
  /// Selects the dropout streams: run k of a model with dropout seed s draws its masks at
  /// stream offset s·2³² + k, so different seeds give independent masks (default 0).
  void set_dropout_seed(uint64_t seed) { dropout_seed_ = seed; }
  /// bf16 mixed precision: every projection and the LM head multiply in bf16
  /// (AVX512-BF16/AMX GEMMs, f32 accumulation); norms, softmax, attention and the
  /// loss stay f32, parameters and gradients stay f32.
  void set_bf16(bool on) {
    bf16_ = on;
    if (on) fp16_ = false;
  }
  bool bf16() const { return bf16_; }
  /// fp16 mixed precision, as on GPUs: projection operands rounded to IEEE half,
  /// products accumulated in f32 (on CPUs without fp16 arithmetic the GEMMs convert
  /// the operands and run at f32 speed), f32 master weights. Backward starts from
  /// loss_scale() instead of 1, so every gradient comes out multiplied by it: the
  /// caller unscales, and skips steps whose gradients overflowed (train::LossScaler).
  void set_fp16(bool on) {
    fp16_ = on;
    if (on) bf16_ = false;
  }
  bool fp16() const { return fp16_; }
  void set_loss_scale(double scale) { loss_scale_ = scale; }
  double loss_scale() const { return loss_scale_; }
  /// Activation checkpointing per transformer layer: training plans keep only each
  /// layer's input and recompute the layer's activations in backward (one extra
  /// forward, a much smaller activation peak; gradients bit-identical).
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }
  /// Runs padded batches unpadded where the family can (on by default; BatchSpec::tokens): a batch whose
  /// attention_mask leaves at most three quarters of its (batch, seq) positions after rounding computes only those
  /// tokens outside attention. The same math as the padded layout (masked keys weigh exactly 0 either way); the
  /// rounding of float sums differs, and dropout draws other masks.
  void set_unpad(bool on) { unpad_ = on; }
  bool unpad() const { return unpad_; }
  /// The rows the token-wise layers computed in the most recent run: its unpadded token rows (BatchSpec::tokens),
  /// else batch × sequence; 0 before the first run.
  int64_t last_token_rows() const { return last_token_rows_; }
  /// The fusion passes (on by default); off compiles the graph as built, to measure
  /// or test what they change.
  void set_fusions(bool on) { fusions_ = on; }
  /// Whether runs with token labels also return ModelOutput::token_stats (BatchSpec::token_stats).
  void set_token_stats(bool on) { token_stats_ = on; }
  bool token_stats() const { return token_stats_; }
  /// The token statistics of the most recent run, when it computed them.
  const std::optional<TokenStats>& last_token_stats() const { return last_token_stats_; }
  /// Trains a causal LM on a preference loss (TRL's DPO; nullopt: back to cross-entropy). A batch then holds 2P
  /// sequences, P chosen then P rejected, labelled on their completions; its reference log-probabilities come from
  /// the batch ("ref_logps", (2P) f32: precomputed), else from the reference model (set_reference), else, for a
  /// LoRA model, from this model with its adapters left out (a second program on the same weights).
  void set_preference(std::optional<PreferenceConfig> config) { preference_ = std::move(config); }
  const std::optional<PreferenceConfig>& preference() const { return preference_; }
  /// The frozen model whose log-probabilities a preference loss compares against (not owned; null: none).
  void set_reference(Model* reference) { reference_ = reference; }
  /// Each sequence's summed log-probability of its labels (-100 ignored; the causal shift applied), LoRA adapters
  /// left out, no dropout: what a reference model gives. (B) values.
  std::vector<double> sequence_log_probs(const Batch& batch);
  /// The per-sequence figures of the most recent preference run.
  const std::optional<PreferenceStats>& last_preference_stats() const { return last_preference_stats_; }
  bool fusions() const { return fusions_; }
  /// Threads used by the kernels (0: all cores).
  void set_num_threads(int n) { num_threads_ = n; }
  /// Plans compiled from now on also count the ops of the graph as built (PassLog::ops_before), at the
  /// cost of a second autodiff per plan: for reports such as `fusetrain inspect`.
  void set_count_unfused_ops(bool on) { count_unfused_ops_ = on; }
  /// The compiled plan for the most recent batch shape, for reports.
  const runtime::Plan* last_plan() const { return last_plan_; }
  /// How the graph passes changed the most recent plan (null before the first run).
  const PassLog* last_pass_log() const { return last_pass_log_; }

 private:
  Model() = default;
  static std::unique_ptr<Model> load_pretrained(const io::HfModelDir& dir, const std::string& architecture,
                                                const nlohmann::json& config_overrides, uint64_t init_seed,
                                                const LoraConfig* lora);
  // enable_lora taking the frozen and trainable weights from `checkpoint` (name -> a mapped file's tensor) when
  // given, else from the model's own store.
  void enable_lora(const LoraConfig& config, const std::map<std::string, Tensor>* checkpoint);
  BatchSpec spec_for(const Batch& batch, bool training, bool with_backward) const;
  compile::Program& plan_for(const BatchSpec& spec, bool with_backward);
  ModelOutput run(const Batch& batch, bool training, bool with_backward, bool zero_grads,
                  runtime::RunObserver* observer = nullptr, bool reference = false);
  // The reference log-probabilities of a preference batch, into `out` (B).
  void reference_log_probs(const Batch& batch, float* out);

  nlohmann::json config_;
  std::string architecture_;
  std::string model_type_;
  const ArchitectureInfo* architecture_info_ = nullptr;
  std::unique_ptr<ArchitectureInfo> onnx_info_;  // an imported graph's row, which the registry does not hold
  std::unique_ptr<Family> family_;  // built once from config_: the graphs, initialisation and position rules
  std::vector<InputDecl> inputs_;   // family_->inputs()
  std::unique_ptr<runtime::ParameterStore> params_;
  std::map<std::string, std::string> aliases_;  // tied name -> stored name
  std::optional<std::set<std::string>> decayed_;  // set_decayed's names
  std::optional<LoraConfig> lora_;
  std::vector<LoraAdapter> lora_adapters_;
  std::set<std::string> lora_bf16_;  // frozen weights kept in bf16
  std::vector<std::string> missing_keys_;
  compile::ProgramCache programs_;
  // One arena for every program: they run one at a time, so the model holds the largest arena, not their sum.
  std::shared_ptr<runtime::SharedArena> arena_ = std::make_shared<runtime::SharedArena>();
  const runtime::Plan* last_plan_ = nullptr;
  const PassLog* last_pass_log_ = nullptr;
  int num_threads_ = 0;
  uint64_t rng_step_ = 0;
  uint64_t dropout_seed_ = 0;
  bool bf16_ = false;
  bool recompute_ = false;
  bool unpad_ = true;
  int64_t last_token_rows_ = 0;
  bool count_unfused_ops_ = false;
  bool fusions_ = true;
  bool token_stats_ = false;
  std::optional<TokenStats> last_token_stats_;
  std::optional<PreferenceConfig> preference_;
  Model* reference_ = nullptr;
  std::optional<PreferenceStats> last_preference_stats_;
  bool fp16_ = false;
  double loss_scale_ = 1.0;
};

/// Model::max_positions of the model a config.json describes, without building it (Error on an invalid config).
int64_t max_positions(const nlohmann::json& config);

/// transformers' name rule for weight decay (Trainer.get_decay_parameter_names): false when the lower-cased name
/// contains "bias", "layernorm" or "rmsnorm", or "norm" as a whole dotted part or a "_norm" suffix of one.
bool decayed_by_name(const std::string& name);

}  // namespace fusetrain::models
