// The registry's rows: every head and every architecture fusetrain implements.
#include "fusetrain/models/registry.h"

#include <algorithm>

#include "fusetrain/core/error.h"
#include "models/family.h"

namespace fusetrain::models {

namespace {

using DataLabel = data::LabelKind;

const std::vector<HeadInfo> kHeads = {
    {Head::Base, "Base", "", "hidden states", {}, {}, Outputs::HiddenStates, false, {}},
    {Head::SequenceClassification,
     "SequenceClassification",
     "seq-cls",
     "sequence classification",
     {LabelKind::ClassIds, LabelKind::Values},
     {DataLabel::Class, DataLabel::Regression},
     Outputs::Logits,
     false,
     {"sentence", "", "label"}},
    {Head::TokenClassification,
     "TokenClassification",
     "token-cls",
     "token classification",
     {LabelKind::TokenIds},
     {DataLabel::TokenClasses},
     Outputs::Logits,
     false,
     {"tokens", "", "ner_tags"}},
    {Head::QuestionAnswering,
     "QuestionAnswering",
     "qa",
     "extractive question answering",
     {LabelKind::Spans},
     {DataLabel::Spans},
     Outputs::SpanLogits,
     false,
     {"question", "context", "answers"}},
    {Head::MaskedLM,
     "MaskedLM",
     "mlm",
     "masked language modelling",
     {LabelKind::TokenIds},
     {DataLabel::Tokens},
     Outputs::Logits,
     true,
     {"text", "", ""}},
    {Head::CausalLM,
     "CausalLM",
     "clm",
     "causal language modelling",
     {LabelKind::TokenIds},
     {DataLabel::Tokens},
     Outputs::Logits,
     true,
     {"text", "", ""}},
    {Head::Seq2SeqLM,
     "Seq2SeqLM",
     "seq2seq",
     "sequence-to-sequence language modelling",
     {LabelKind::TokenIds},
     {DataLabel::Targets},
     Outputs::Logits,
     true,
     {"source", "", "target"}},
    {Head::Ctc,
     "CTC",
     "ctc",
     "speech recognition with a CTC loss",
     {LabelKind::TokenIds},
     {},
     Outputs::Logits,
     false,
     {"", "", ""}},
};

std::unique_ptr<Family> make_bert(Head head, const nlohmann::json& config) {
  return make_bert_family(false, head, config);
}
std::unique_ptr<Family> make_roberta(Head head, const nlohmann::json& config) {
  return make_bert_family(true, head, config);
}

const std::vector<ArchitectureInfo> kArchitectures = {
    {"BertModel", "bert", Head::Base, make_bert},
    {"BertForMaskedLM", "bert", Head::MaskedLM, make_bert},
    {"BertForSequenceClassification", "bert", Head::SequenceClassification, make_bert},
    {"BertForTokenClassification", "bert", Head::TokenClassification, make_bert},
    {"BertForQuestionAnswering", "bert", Head::QuestionAnswering, make_bert},
    {"RobertaModel", "roberta", Head::Base, make_roberta},
    {"RobertaForMaskedLM", "roberta", Head::MaskedLM, make_roberta},
    {"RobertaForSequenceClassification", "roberta", Head::SequenceClassification, make_roberta},
    {"RobertaForTokenClassification", "roberta", Head::TokenClassification, make_roberta},
    {"RobertaForQuestionAnswering", "roberta", Head::QuestionAnswering, make_roberta},
    {"DistilBertModel", "distilbert", Head::Base, make_distilbert_family},
    {"DistilBertForMaskedLM", "distilbert", Head::MaskedLM, make_distilbert_family},
    {"DistilBertForSequenceClassification", "distilbert", Head::SequenceClassification, make_distilbert_family},
    {"GPT2Model", "gpt2", Head::Base, make_gpt2_family},
    {"GPT2LMHeadModel", "gpt2", Head::CausalLM, make_gpt2_family},
    {"GPT2ForSequenceClassification", "gpt2", Head::SequenceClassification, make_gpt2_family},
    {"LlamaModel", "llama", Head::Base, make_llama_family},
    {"LlamaForCausalLM", "llama", Head::CausalLM, make_llama_family},
    {"LlamaForSequenceClassification", "llama", Head::SequenceClassification, make_llama_family},
    {"MistralModel", "mistral", Head::Base, make_llama_family},
    {"MistralForCausalLM", "mistral", Head::CausalLM, make_llama_family},
    {"Qwen2Model", "qwen2", Head::Base, make_llama_family},
    {"Qwen2ForCausalLM", "qwen2", Head::CausalLM, make_llama_family},
};

const std::pair<DataLabel, const char*> kDataLabelNames[] = {
    {DataLabel::None, "none"},     {DataLabel::Class, "class"},          {DataLabel::Regression, "regression"},
    {DataLabel::Tokens, "tokens"}, {DataLabel::TokenClasses, "token_classes"}, {DataLabel::Spans, "spans"},
    {DataLabel::Targets, "targets"},
};

// "a, b and c", for the model_types or tasks an error lists.
std::string and_list(const std::vector<std::string>& items) {
  if (items.size() < 2) return join(items);
  std::vector<std::string> head(items.begin(), items.end() - 1);
  return join(head) + " and " + items.back();
}

}  // namespace

const HeadInfo& ArchitectureInfo::head_info() const { return models::head_info(head); }

const std::vector<HeadInfo>& heads() { return kHeads; }

const HeadInfo& head_info(Head head) {
  for (const HeadInfo& h : kHeads)
    if (h.head == head) return h;
  throw Error(str("head ", static_cast<int>(head), " has no registry row"));
}

const std::vector<ArchitectureInfo>& architectures() { return kArchitectures; }

std::vector<std::string> supported_architectures() {
  std::vector<std::string> names;
  for (const ArchitectureInfo& a : kArchitectures) names.push_back(a.name);
  return names;
}

std::vector<std::string> model_types() {
  std::vector<std::string> types;
  for (const ArchitectureInfo& a : kArchitectures)
    if (std::find(types.begin(), types.end(), a.model_type) == types.end()) types.push_back(a.model_type);
  return types;
}

std::vector<std::string> task_names() {
  std::vector<std::string> tasks;
  for (const HeadInfo& h : kHeads)
    if (*h.task) tasks.push_back(h.task);
  return tasks;
}

const ArchitectureInfo& find_architecture(const std::string& name) {
  for (const ArchitectureInfo& a : kArchitectures)
    if (name == a.name) return a;
  throw Error(str("architecture \"", name, "\" is not supported (supported: ", join(supported_architectures()), ")"));
}

const ArchitectureInfo* find_architecture(const std::string& model_type, Head head) {
  for (const ArchitectureInfo& a : kArchitectures)
    if (model_type == a.model_type && head == a.head) return &a;
  return nullptr;
}

Head head_for_task(const std::string& task) {
  for (const HeadInfo& h : kHeads)
    if (*h.task && task == h.task) return h.head;
  if (task == "sft" || task == "dpo")  // TRL's trainers, in Python: the pip-installed command takes them (fusetrain/sft.py)
    throw Error(str("task \"", task, "\" runs TRL's ", task == "sft" ? "SFTTrainer" : "DPOTrainer", " on the engine from ",
                    "Python: use `python -m fusetrain train --task ", task, " ...` or the pip-installed `fusetrain` command ",
                    "(supported here: ", join(task_names()), ")"));
  if (task == "image-cls" || task == "audio-cls")  // decoded in Python, trained as seq-cls on a feature file
    throw Error(str("task \"", task, "\" reads ", task == "image-cls" ? "images" : "audio", ", which the pip-installed ",
                    "`fusetrain` command (or `python -m fusetrain`) decodes and preprocesses in Python before the engine ",
                    "trains on them (supported here: ", join(task_names()), ", with --task seq-cls on a feature file)"));
  throw Error(str("task \"", task, "\" is not supported (supported: ", join(task_names()), ")"));
}

const ArchitectureInfo& architecture_for_task(const std::string& model_type, Head head, const std::string& where) {
  const std::vector<std::string> types = model_types();
  FT_CHECK(std::find(types.begin(), types.end(), model_type) != types.end(), where, ": model_type \"", model_type,
           "\" is not supported (supported: ", join(types), ")");
  if (const ArchitectureInfo* a = find_architecture(model_type, head)) return *a;
  std::vector<std::string> with_head, tasks_of_type;
  for (const ArchitectureInfo& a : kArchitectures) {
    if (a.head == head) with_head.push_back(a.model_type);
    if (model_type == a.model_type && *a.head_info().task) tasks_of_type.push_back(a.head_info().task);
  }
  const HeadInfo& info = head_info(head);
  throw Error(str("--task ", info.task, " (", info.problem, ") supports ", and_list(with_head),
                  " models, found model_type \"", model_type, "\" (a ", model_type, " model takes --task ",
                  and_list(tasks_of_type), ")"));
}

const ArchitectureInfo& choose_architecture(const nlohmann::json& config, const std::string& requested) {
  const std::string supported_types = join(model_types());
  FT_CHECK(config.is_object(), "config.json: expected a JSON object");
  FT_CHECK(config.contains("model_type") && config["model_type"].is_string(),
           "config.json: missing \"model_type\" (expected one of ", supported_types, ")");
  const std::string model_type = config["model_type"].get<std::string>();
  const ArchitectureInfo* base = find_architecture(model_type, Head::Base);
  FT_CHECK(base != nullptr, "config.json: unknown model_type \"", model_type, "\" (supported: ", supported_types, ")");
  std::string name = requested;
  if (name.empty() && config.contains("architectures") && config["architectures"].is_array() &&
      !config["architectures"].empty() && config["architectures"][0].is_string())
    name = config["architectures"][0].get<std::string>();
  const ArchitectureInfo& info = name.empty() ? *base : find_architecture(name);
  FT_CHECK(model_type == info.model_type, "architecture ", info.name, " is a ", info.model_type,
           " model but config.json has model_type \"", model_type, "\"");
  return info;
}

const char* data_label_name(data::LabelKind kind) {
  for (const auto& [k, name] : kDataLabelNames)
    if (k == kind) return name;
  return "unknown";
}

data::LabelKind parse_data_label(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& [kind, n] : kDataLabelNames) {
    if (name == n) return kind;
    names.push_back(n);
  }
  throw Error(str("label_kind must be ", join(std::vector<std::string>(names.begin(), names.end() - 1)), " or ",
                  names.back(), "; got \"", name, "\""));
}

std::vector<std::string> output_names(Outputs outputs) {
  switch (outputs) {
    case Outputs::HiddenStates:
      return {"last_hidden_state"};
    case Outputs::Logits:
      return {"logits"};
    case Outputs::SpanLogits:
      return {"start_logits", "end_logits"};
  }
  return {};
}

}  // namespace fusetrain::models
