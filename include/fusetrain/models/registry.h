// The one list of what fusetrain builds: each transformers architecture (class name, model_type, head, the family
// that builds it) and each head (the task it solves, the labels it reads, the outputs it returns, the CLI task
// and data columns it pairs with). The model builder, the CLI, the Python module and the Python package all read
// it; adding an architecture or a head is a row here (see docs/architecture.md).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fusetrain/data/dataset.h"

namespace fusetrain::models {

class Family;

/// The task a head solves, which decides its outputs, its loss, how a batch's labels are read and which
/// metrics evaluation reports. Base is a model without a head (it returns its last hidden states).
enum class Head : uint8_t {
  Base,
  MaskedLM,
  CausalLM,
  SequenceClassification,
  TokenClassification,
  QuestionAnswering,
  Seq2SeqLM,  ///< an encoder-decoder's language-model head: (B, target, V) logits, labels (B, target) unshifted
  Ctc,        ///< per-frame classes (B, frames, V) against label sequences (B, L) of any length: the CTC loss
};

/// What the labels of a batch are, which decides the loss.
enum class LabelKind : uint8_t {
  None,      ///< no labels: logits only
  TokenIds,  ///< (B, T) i64, -100 ignored: masked/causal LM, token classification; (B, target) for seq2seq
  ClassIds,  ///< (B) i64: single-label sequence classification
  Values,    ///< (B, L) f32: regression (L == 1, MSE) or multi-label (BCE with logits)
  Spans,     ///< start_positions, end_positions (B) i64: question answering
};

/// What a head's forward pass returns.
enum class Outputs : uint8_t {
  HiddenStates,  ///< last_hidden_state (B, T, C): a model without a head
  Logits,        ///< logits: (B, T, V) language models, (B, L) sequence and (B, T, L) token classification
  SpanLogits,    ///< start_logits and end_logits (B, T): question answering
};

/// The data columns the CLI reads for a task unless flags name others (empty: none).
struct DefaultColumns {
  const char* text = "";
  const char* text_pair = "";
  const char* label = "";
};

/// One head: what it solves, what it reads and what it returns.
struct HeadInfo {
  Head head = Head::Base;
  /// The head's name, as Python sees it: "SequenceClassification", "Base", ...
  const char* name = "";
  /// The task name of the CLI's --task and of the Python Trainer ("seq-cls", ...); empty for Base (nothing to
  /// train).
  const char* task = "";
  /// What it solves, in words, for help texts and errors: "sequence classification".
  const char* problem = "";
  /// The label layouts its loss accepts (empty for Base).
  std::vector<LabelKind> batch_labels;
  /// The dataset labels it trains on (data::LabelKind), in the order the CLI's datasets prefer them.
  std::vector<data::LabelKind> data_labels;
  Outputs outputs = Outputs::Logits;
  /// Evaluation reports perplexity (language models) rather than classification metrics.
  bool language_model = false;
  DefaultColumns columns;
};

/// Builds the family of an architecture with one head from its config.json (throws Error naming a bad field).
using FamilyFactory = std::unique_ptr<Family> (*)(Head head, const nlohmann::json& config);

/// One transformers class fusetrain implements.
struct ArchitectureInfo {
  const char* name;        ///< the transformers class: "BertForSequenceClassification"
  const char* model_type;  ///< config.json's model_type: "bert"
  Head head;
  FamilyFactory make_family;
  /// The row of heads() for this architecture's head.
  const HeadInfo& head_info() const;
};

/// Every head, Base first.
const std::vector<HeadInfo>& heads();
/// The row of `head`.
const HeadInfo& head_info(Head head);
/// Every architecture, grouped by model_type, each group's base model first.
const std::vector<ArchitectureInfo>& architectures();
/// The transformers classes fusetrain implements, in registry order (for error messages).
std::vector<std::string> supported_architectures();
/// The model_types fusetrain builds, in registry order: bert, roberta, distilbert, gpt2, llama, mistral, qwen2.
std::vector<std::string> model_types();
/// The tasks heads train, in registry order: seq-cls, token-cls, qa, mlm, clm, seq2seq.
std::vector<std::string> task_names();

/// The row of a transformers class; throws Error `architecture "X" is not supported (supported: ...)`.
const ArchitectureInfo& find_architecture(const std::string& name);
/// The architecture of `model_type` with `head`, or null when fusetrain has none.
const ArchitectureInfo* find_architecture(const std::string& model_type, Head head);
/// The head that trains a task ("seq-cls", ...); throws Error `task "x" is not supported (supported: ...)`.
Head head_for_task(const std::string& task);
/// The architecture the CLI builds for --task on a model of `model_type`; `where` (the config.json path) prefixes
/// the error for an unknown model_type, and a model_type without that head gets an Error naming the model_types
/// that have it and the tasks this one supports.
const ArchitectureInfo& architecture_for_task(const std::string& model_type, Head head, const std::string& where);

/// The architecture to build from a config.json: `requested` when given, else config["architectures"][0], else
/// the base model of its model_type. Throws Error for a config without a known model_type, an unknown
/// architecture, or one of another model_type.
const ArchitectureInfo& choose_architecture(const nlohmann::json& config, const std::string& requested = "");

/// The name Python and the data layer use for a dataset label kind: "none", "class", "regression", "tokens",
/// "token_classes", "spans", "targets".
const char* data_label_name(data::LabelKind kind);
/// The inverse of data_label_name; throws Error listing the names.
data::LabelKind parse_data_label(const std::string& name);
/// The names a forward pass returns its outputs under, as transformers' ModelOutput does: last_hidden_state;
/// logits; start_logits and end_logits.
std::vector<std::string> output_names(Outputs outputs);

}  // namespace fusetrain::models
