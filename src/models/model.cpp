// models::Model: loading, saving, parameter naming, and running batches through
// plans compiled per batch shape.
#include "fusetrain/models/model.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "models/family.h"
#include "models/lora_graph.h"

namespace fusetrain::models {

namespace {

// The family of a registry row, built from a config.
std::unique_ptr<Family> family_for(const ArchitectureInfo& info, const nlohmann::json& config) {
  return info.make_family(info.head, config);
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Refuses a weight holding inf or NaN; `where` names the tensor (and its file).
void check_finite(const Tensor& src, const std::string& where) {
  const int64_t bad = find_nonfinite(src.data(), src.dtype(), src.numel());
  FT_CHECK(bad < 0, where, " holds a non-finite value at element ", bad,
           "; a model with inf or NaN weights cannot be trained or evaluated (was it saved from a diverged run?)");
}

// Copies `src` into f32 storage; a value inf or NaN, which no weight may hold, is refused.
void copy_converted(float* dst, const Tensor& src, const std::string& where) {
  check_finite(src, where);
  switch (src.dtype()) {
    case DType::f32:
      std::memcpy(dst, src.data(), src.nbytes());
      return;
    case DType::bf16:
      bf16_to_float(dst, static_cast<const uint16_t*>(src.data()), static_cast<size_t>(src.numel()));
      return;
    case DType::f16:
      f16_to_float(dst, static_cast<const uint16_t*>(src.data()), static_cast<size_t>(src.numel()));
      return;
    default:
      throw Error(str("expected a floating-point tensor, found ", dtype_name(src.dtype())));
  }
}

// Uploads `src` (host memory, any float dtype, checked finite) into the parameter `dest` (the device's memory: f32,
// or bf16 for a frozen base weight kept in bf16, or a quantised weight's u8 codes taken as they are), converted on
// the host a slice at a time: no host copy of a whole weight (an 8B model's embedding is 2 GB of f32).
void copy_into(const kernels::Device& device, const Tensor& dest, const Tensor& src, const std::string& where) {
  if (dest.dtype() == DType::u8) {
    FT_CHECK(src.dtype() == DType::u8, where, ": a quantised weight's codes are uint8; found ", dtype_name(src.dtype()));
    device.upload(dest.data(), src.data(), static_cast<size_t>(src.nbytes()));
    return;
  }
  FT_CHECK(dest.dtype() == DType::f32 || dest.dtype() == DType::bf16, where, ": cannot store into a ",
           dtype_name(dest.dtype()), " parameter");
  if (dest.dtype() == src.dtype()) {  // f32 into f32, bf16 into bf16: as it is
    check_finite(src, where);
    device.upload(dest.data(), src.data(), static_cast<size_t>(src.nbytes()));
    return;
  }
  constexpr int64_t kSlice = int64_t{1} << 20;
  const int64_t n = src.numel();
  const size_t item = dtype_size(src.dtype());
  std::vector<float> tmp(static_cast<size_t>(std::min(n, kSlice)));
  std::vector<uint16_t> narrow(dest.dtype() == DType::bf16 ? tmp.size() : 0);
  for (int64_t begin = 0; begin < n; begin += kSlice) {
    const int64_t count = std::min(kSlice, n - begin);
    const Tensor slice = Tensor::view(const_cast<char*>(static_cast<const char*>(src.data())) + size_t(begin) * item,
                                      Shape{count}, src.dtype());
    copy_converted(tmp.data(), slice, where);
    if (dest.dtype() == DType::f32) {
      device.upload(dest.data_as<float>() + begin, tmp.data(), static_cast<size_t>(count) * sizeof(float));
    } else {
      float_to_bf16(narrow.data(), tmp.data(), static_cast<size_t>(count));
      device.upload(static_cast<uint16_t*>(dest.data()) + begin, narrow.data(), static_cast<size_t>(count) * 2);
    }
  }
}

// The store's trained parameters, named `prefix` + name, for writing to a file: views of the device's memory where
// the host reads it in place, else copies downloaded into `copies`.
std::vector<std::pair<std::string, Tensor>> host_tensors(const runtime::ParameterStore& store, const std::string& prefix,
                                                         std::vector<std::vector<uint8_t>>& copies) {
  std::vector<std::pair<std::string, Tensor>> out;
  const bool in_place = store.device().host_visible();
  for (size_t i = 0; i < store.slots().size(); ++i) {
    Tensor t = store.param(i);
    if (!in_place) {
      copies.emplace_back(t.nbytes());
      store.device().download(copies.back().data(), t.data(), t.nbytes());
      t = Tensor::view(copies.back().data(), t.shape(), t.dtype());
    }
    out.emplace_back(prefix + store.slots()[i].name, t);
  }
  return out;
}

// Uploads host f32 values into the f32 parameter `dest`.
void upload_values(const kernels::Device& device, const Tensor& dest, const std::vector<float>& values) {
  device.upload(dest.data(), values.data(), values.size() * sizeof(float));
}

}  // namespace


Model::~Model() = default;

namespace {

// Fills every parameter as the architecture initialises it, from one seeded stream.
void initialise(runtime::ParameterStore& params, const Family& family, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < params.slots().size(); ++i) {
    const runtime::ParamSlot& slot = params.slots()[i];
    std::vector<float> values(static_cast<size_t>(slot.numel));  // drawn on the host, then uploaded
    float* p = values.data();
    ParamInit init = family.init(slot.name);
    switch (init.kind) {
      case Init::Zeros:
        std::fill(p, p + slot.numel, 0.0f);
        break;
      case Init::Ones:
        std::fill(p, p + slot.numel, 1.0f);
        break;
      case Init::Normal: {
        if (init.stddev <= 0.0) {  // normal(0, 0), as torch draws it: zeros
          std::fill(p, p + slot.numel, 0.0f);
          break;
        }
        std::normal_distribution<float> normal(0.0f, static_cast<float>(init.stddev));
        for (int64_t k = 0; k < slot.numel; ++k) p[k] = normal(rng);
        if (init.zero_row >= 0 && slot.shape.rank() == 2 && init.zero_row < slot.shape[0])
          std::fill(p + init.zero_row * slot.shape[1], p + (init.zero_row + 1) * slot.shape[1], 0.0f);
        break;
      }
    }
    upload_values(params.device(), params.param(i), values);
  }
}

std::unique_ptr<runtime::ParameterStore> layout_parameters(const Family& family) {
  BatchSpec probe;
  BuiltGraph built = family.build(probe);
  return std::make_unique<runtime::ParameterStore>(built.graph);
}

}  // namespace

std::unique_ptr<Model> Model::from_config(const nlohmann::json& config_or_path, uint64_t seed,
                                          const std::string& architecture) {
  std::unique_ptr<Model> m = from_config_uninitialised(config_or_path, architecture);
  initialise(*m->params_, *m->family_, seed);
  return m;
}

std::unique_ptr<Model> Model::from_config_uninitialised(const nlohmann::json& config_or_path,
                                                        const std::string& architecture) {
  nlohmann::json config =
      config_or_path.is_string() ? io::read_json_file(config_or_path.get<std::string>()) : config_or_path;
  std::unique_ptr<Model> m(new Model());
  const ArchitectureInfo& info = choose_architecture(config, architecture);
  m->architecture_info_ = &info;
  m->architecture_ = info.name;
  m->model_type_ = info.model_type;
  m->config_ = config;
  m->config_["architectures"] = nlohmann::json::array({m->architecture_});
  m->family_ = family_for(info, m->config_);
  m->inputs_ = m->family_->inputs();
  m->params_ = layout_parameters(*m->family_);
  m->aliases_ = m->family_->tied();
  return m;
}

std::unique_ptr<Model> Model::from_family(std::unique_ptr<Family> family, const nlohmann::json& config, Head head) {
  std::unique_ptr<Model> m(new Model());
  m->config_ = config;
  m->architecture_ = config.contains("architectures") && config["architectures"].is_array() &&
                             !config["architectures"].empty() && config["architectures"][0].is_string()
                         ? config["architectures"][0].get<std::string>()
                         : "OnnxModel";
  m->model_type_ = config.value("model_type", std::string("onnx"));
  m->onnx_info_ = std::make_unique<ArchitectureInfo>(
      ArchitectureInfo{m->architecture_.c_str(), m->model_type_.c_str(), head, nullptr});
  m->architecture_info_ = m->onnx_info_.get();
  m->family_ = std::move(family);
  m->inputs_ = m->family_->inputs();
  m->params_ = layout_parameters(*m->family_);
  for (const auto& [name, value] : m->family_->initial_values())
    m->params_->device().upload(m->params_->param(name).data(), value.data(), size_t(value.nbytes()));
  m->family_->release_initial_values();  // the parameters hold them now
  return m;
}

std::unique_ptr<Model> Model::from_pretrained(const std::string& dir, const std::string& architecture,
                                              const nlohmann::json& config_overrides, uint64_t init_seed) {
  return from_pretrained(io::read_hf_dir(dir), architecture, config_overrides, init_seed);
}

std::unique_ptr<Model> Model::from_pretrained(const io::HfModelDir& hf, const std::string& architecture,
                                              const nlohmann::json& config_overrides, uint64_t init_seed) {
  return load_pretrained(hf, architecture, config_overrides, init_seed, nullptr);
}

std::unique_ptr<Model> Model::from_pretrained(const io::HfModelDir& hf, const std::string& architecture,
                                              const nlohmann::json& config_overrides, uint64_t init_seed,
                                              const LoraConfig& lora) {
  return load_pretrained(hf, architecture, config_overrides, init_seed, &lora);
}

std::unique_ptr<Model> Model::load_pretrained(const io::HfModelDir& hf, const std::string& architecture,
                                              const nlohmann::json& config_overrides, uint64_t init_seed,
                                              const LoraConfig* lora) {
  const std::string& dir = hf.path;
  nlohmann::json config = hf.config;
  FT_CHECK(config_overrides.is_object(), "config overrides must be a JSON object");
  for (auto it = config_overrides.begin(); it != config_overrides.end(); ++it) config[it.key()] = it.value();
  if (config_overrides.contains("num_labels"))  // the checkpoint's label names no longer apply, unless given anew
    for (const char* key : {"id2label", "label2id"})
      if (!config_overrides.contains(key)) config.erase(key);
  // Laid out only: the weights are drawn below if the checkpoint lacks some (a new head), else never.
  std::unique_ptr<Model> m = from_config_uninitialised(config, architecture);
  const Family* family = m->family_.get();
  const std::string prefix = family->base_prefix() + ".";
  const bool head_model = family->head() != Head::Base;
  runtime::ParameterStore& params = *m->params_;

  auto known = [&](const std::string& name) { return params.contains(name) || m->aliases_.count(name) > 0; };
  auto droppable = [&](const std::string& name) {
    std::string local = starts_with(name, prefix) ? name.substr(prefix.size()) : name;
    for (const std::string& head : family->head_prefixes())
      if (starts_with(name, head) || starts_with(local, head)) return true;
    // Buffers older checkpoints carry.
    for (const char* buffer : {"position_ids", "attn.bias", "attn.masked_bias", "token_type_ids"})
      if (local.size() >= std::strlen(buffer) &&
          local.compare(local.size() - std::strlen(buffer), std::strlen(buffer), buffer) == 0)
        return true;
    return false;
  };

  std::map<std::string, Tensor> sources;  // parameter -> the checkpoint's tensor (a view into its mapped file)
  std::map<std::string, std::string> source_names;  // parameter -> "<file>: tensor \"<name>\"", for errors
  std::vector<std::string> unexpected;
  std::string file_of_first_problem;
  for (const std::string& name : hf.tensor_names()) {
    std::string target;
    if (known(name))
      target = name;
    else if (head_model && known(prefix + name))
      target = prefix + name;
    else if (!head_model && starts_with(name, prefix) && known(name.substr(prefix.size())))
      target = name.substr(prefix.size());
    if (target.empty()) {
      if (!droppable(name)) unexpected.push_back(name);
      continue;
    }
    auto alias = m->aliases_.find(target);
    if (alias != m->aliases_.end()) {
      if (hf.tensor_file.count(alias->second) ||
          hf.tensor_file.count(alias->second.substr(starts_with(alias->second, prefix) ? prefix.size() : 0)))
        continue;  // a tied duplicate of a tensor the checkpoint also holds
      target = alias->second;
    }
    Tensor source = hf.tensor(name);
    Tensor dest = params.param(target);
    const std::string& file = hf.files[hf.tensor_file.at(name)].path();
    FT_CHECK(source.shape() == dest.shape(), file, ": tensor \"", name, "\" has shape ", source.shape().to_string(),
             " but the config (", m->architecture_, ") expects ", dest.shape().to_string());
    FT_CHECK(is_floating(source.dtype()), file, ": tensor \"", name, "\" is ", dtype_name(source.dtype()),
             "; weights must be F32, BF16 or F16");
    sources[target] = source;
    source_names[target] = str(file, ": tensor \"", name, "\"");
  }
  std::vector<std::string> missing_required;
  for (const runtime::ParamSlot& slot : params.slots()) {
    if (sources.count(slot.name)) continue;
    bool head_parameter =
        (head_model && !starts_with(slot.name, prefix)) || slot.name.find("pooler.") != std::string::npos;
    if (head_parameter)
      m->missing_keys_.push_back(slot.name);
    else
      missing_required.push_back(slot.name);
  }
  if (!unexpected.empty() || !missing_required.empty()) {
    std::string msg = str(dir, ": the weights do not match ", m->architecture_, " with this config.json");
    if (!missing_required.empty()) msg += str("; missing tensors: ", join(missing_required));
    if (!unexpected.empty()) msg += str("; unexpected tensors: ", join(unexpected));
    throw Error(msg);
  }
  std::optional<LoraConfig> config_lora;
  if (lora) {
    config_lora = *lora;
    if (!config_lora->quant_type.empty() && config_lora->quantized.empty())
      config_lora->quantized = m->quantizable_weights(*config_lora);
  }
  if (lora && m->missing_keys_.empty()) {  // a mapped load: straight into the LoRA layout
    m->enable_lora(*config_lora, &sources);
    return m;
  }
  initialise(params, *family, init_seed);
  for (const auto& [target, source] : sources)
    copy_into(params.device(), params.param(target), source, source_names.at(target));
  if (lora) m->enable_lora(*config_lora);
  return m;
}

std::vector<std::string> Model::quantizable_weights(const LoraConfig& config) const {
  LoraConfig plain = config;
  plain.quant_type.clear();
  plain.quantized.clear();
  plain.base_dtype = DType::f32;
  ir::Graph g = family_->build(BatchSpec{}).graph;
  lora::apply(g, plain, false, {}, family_->head_prefixes());
  return lora::quantizable(g, family_->head_prefixes());
}

int64_t Model::max_positions() const { return family_->max_positions(); }

bool Model::uses_token_type_ids() const { return family_->uses_token_type_ids(); }

int64_t max_positions(const nlohmann::json& config) {
  // Positions do not depend on the head: the base model of the config's model_type answers, whatever
  // config["architectures"] names; choose_architecture throws the problem of a config without a known model_type.
  const nlohmann::json model_type = config.is_object() ? config.value("model_type", nlohmann::json()) : nullptr;
  const ArchitectureInfo* base = model_type.is_string() ? find_architecture(model_type.get<std::string>(), Head::Base)
                                                        : nullptr;
  return family_for(choose_architecture(config, base ? base->name : ""), config)->max_positions();
}

bool decayed_by_name(const std::string& name) {
  // transformers' Trainer.get_decay_parameter_names: the lower-cased full name must not match "bias", "layernorm",
  // "rmsnorm", "(^|\.)norm($|\.)" or "_norm($|\.)".
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  for (const char* part : {"bias", "layernorm", "rmsnorm"})
    if (lower.find(part) != std::string::npos) return false;
  for (size_t at = lower.find("norm"); at != std::string::npos; at = lower.find("norm", at + 1)) {
    const size_t end = at + 4;
    const bool ends = end == lower.size() || lower[end] == '.';
    const bool starts = at == 0 || lower[at - 1] == '.' || lower[at - 1] == '_';
    if (ends && starts) return false;
  }
  return true;
}

bool Model::decays(const std::string& name) const {
  if (decayed_) {
    const auto alias = aliases_.find(name);
    return decayed_->count(alias == aliases_.end() ? name : alias->second) > 0;
  }
  return decayed_by_name(name) && !family_->in_layer_norm(name);
}

void Model::set_decayed(const std::set<std::string>& names) {
  std::set<std::string> stored;
  for (const std::string& name : names) {
    const auto alias = aliases_.find(name);
    const std::string& held = alias == aliases_.end() ? name : alias->second;
    FT_CHECK(params_->contains(held), architecture_, ": weight decay was asked for \"", name,
             "\", which is not a trained parameter of the model");
    stored.insert(held);
  }
  decayed_ = std::move(stored);
  for (size_t i = 0; i < params_->slots().size(); ++i) params_->set_weight_decay(i, decays(params_->slots()[i].name));
}

std::vector<std::string> Model::state_dict_names() const {
  std::vector<std::string> names;
  for (const runtime::FrozenSlot& slot : params_->frozen_slots()) names.push_back(slot.name);
  for (const runtime::ParamSlot& slot : params_->slots()) names.push_back(slot.name);
  for (const auto& [alias, stored] : aliases_) names.push_back(alias);
  return names;
}

std::vector<std::string> Model::trainable_names() const {
  std::vector<std::string> names;
  for (const runtime::ParamSlot& slot : params_->slots()) names.push_back(slot.name);
  for (const auto& [alias, stored] : aliases_)
    if (params_->contains(stored)) names.push_back(alias);
  return names;
}

DerivedInputs Model::derived_inputs() const { return family_->derived_inputs(); }

Tensor Model::parameter(const std::string& hf_name) const {
  auto alias = aliases_.find(hf_name);
  const std::string& name = alias == aliases_.end() ? hf_name : alias->second;
  if (lora_ && params_->contains_frozen(name)) return params_->frozen(name);
  return params_->param(name);
}

Tensor Model::gradient(const std::string& hf_name) const {
  auto alias = aliases_.find(hf_name);
  const std::string& name = alias == aliases_.end() ? hf_name : alias->second;
  FT_CHECK(!params_->contains_frozen(name), "\"", hf_name, "\" is a frozen base weight of this LoRA model: it has no ",
           "gradient");
  return params_->grad(name);
}

void Model::load_state_dict(const std::map<std::string, Tensor>& tensors, bool strict) {
  std::vector<std::string> unexpected, missing;
  std::set<std::string> seen;
  for (const auto& [name, tensor] : tensors) {
    if (!params_->contains(name) && !params_->contains_frozen(name) && !aliases_.count(name)) {
      unexpected.push_back(name);
      continue;
    }
    Tensor dest = parameter(name);
    FT_CHECK(tensor.shape() == dest.shape(), "load_state_dict: \"", name, "\" has shape ", tensor.shape().to_string(),
             " but the model expects ", dest.shape().to_string());
    copy_into(params_->device(), dest, tensor, str("tensor \"", name, "\""));
    seen.insert(aliases_.count(name) ? aliases_.at(name) : name);
  }
  for (const runtime::ParamSlot& slot : params_->slots())
    if (!seen.count(slot.name)) missing.push_back(slot.name);
  for (const runtime::FrozenSlot& slot : params_->frozen_slots())
    if (!seen.count(slot.name)) missing.push_back(slot.name);
  if (strict && (!unexpected.empty() || !missing.empty()))
    throw Error(str("load_state_dict: ", missing.empty() ? "" : "missing keys: " + join(missing),
                    !missing.empty() && !unexpected.empty() ? "; " : "",
                    unexpected.empty() ? "" : "unexpected keys: " + join(unexpected)));
}

void Model::save_pretrained(const std::string& dir) const {
  if (lora_) return save_adapter(dir);
  if (imported_from_onnx()) {
    // The trained graph always; a transformers directory only where the graph's parameters carry transformers'
    // names. An exporter that folded transposes wrote names of its own (onnx::MatMul_12, val_34), which no
    // transformers class reads, so a model.safetensors under them would load as random weights.
    std::filesystem::create_directories(dir);
    family_->save_graph(*this, dir);
    bool transformers_names = config_.contains("model_type");
    for (const runtime::ParamSlot& slot : params_->slots())
      if (slot.name.find("::") != std::string::npos || slot.name.find('.') == std::string::npos)
        transformers_names = false;
    if (!transformers_names) {
      if (!config_.empty()) {
        const std::string text = config_.dump(2) + "\n";
        io::write_file_atomic((std::filesystem::path(dir) / "config.json").string(),
                              {io::ByteSpan{text.data(), text.size()}});
      }
      return;
    }
  }
  std::vector<std::vector<uint8_t>> copies;
  const std::vector<std::pair<std::string, Tensor>> tensors = host_tensors(*params_, "", copies);
  nlohmann::json config = config_;
  config["architectures"] = nlohmann::json::array({architecture_});
  if (!config.contains("torch_dtype")) config["torch_dtype"] = "float32";
  io::write_hf_dir(dir, config, tensors);
}

BuiltGraph Model::build(const BatchSpec& spec) const {
  BuiltGraph built = family_->build(spec);
  if (lora_) {
    std::vector<ir::ValueId*> watched = {&built.logits, &built.end_logits, &built.hidden_states};
    for (ir::ValueId& v : built.layer_boundaries) watched.push_back(&v);
    lora::apply(built.graph, *lora_, spec.training, lora_bf16_, family_->head_prefixes(), watched,
                /*with_adapters=*/!spec.reference);
  }
  return built;
}

void Model::enable_lora(const LoraConfig& config) { enable_lora(config, nullptr); }

namespace {

// Quantises `source` (any float dtype) into the QLoRA weight `name` of `store`: its codes and absmax, and for a 4-bit
// format the code table, as bitsandbytes would from the same weight.
void quantize_into(runtime::ParameterStore& store, const std::string& name, const Tensor& source,
                   const LoraConfig& config, const std::string& where) {
  FT_CHECK(source.shape().rank() == 2, where, ": a quantised weight is (out, in); found ", source.shape().to_string());
  const int64_t rows = source.shape()[0], cols = source.shape()[1];
  std::vector<float> values(static_cast<size_t>(source.numel()));
  copy_converted(values.data(), source, where);  // refuses inf and NaN
  const Tensor codes = store.frozen(name), absmax = store.frozen(name + ".absmax");
  // Quantised on the host, then uploaded.
  std::vector<uint8_t> host_codes(codes.nbytes());
  std::vector<float> host_absmax(static_cast<size_t>(absmax.numel()));
  const kernels::Device& device = store.device();
  if (config.quant_type == "int8") {
    quant::quantize_int8_rows(values.data(), rows, cols, reinterpret_cast<int8_t*>(host_codes.data()),
                              host_absmax.data());
  } else {
    const float* code = quant::code_4bit(config.quant_type);
    quant::quantize_4bit(values.data(), rows * cols, quant::block_shift(config.quant_blocksize), code,
                         host_codes.data(), host_absmax.data());
    device.upload(store.frozen(name + ".quant_map").data(), code, 16 * sizeof(float));
  }
  device.upload(codes.data(), host_codes.data(), host_codes.size());
  device.upload(absmax.data(), host_absmax.data(), host_absmax.size() * sizeof(float));
}

}  // namespace

void Model::enable_lora(const LoraConfig& config, const std::map<std::string, Tensor>* checkpoint) {
  config.validate();
  FT_CHECK(!lora_, architecture_, " already has LoRA adapters (merge_lora() first to add others)");
  FT_CHECK(!imported_from_onnx(), "LoRA adapts models fusetrain builds; ", architecture_,
           " was imported from ONNX (its projections have no module names)");
  // Lay out the LoRA model's parameters: adapters and modules_to_save trainable, the rest frozen.
  std::optional<LoraConfig> saved_lora = std::move(lora_);
  std::set<std::string> saved_bf16 = std::move(lora_bf16_);
  lora_ = config;
  lora_bf16_.clear();
  std::unique_ptr<runtime::ParameterStore> next;
  try {
    // The probe graph with the adapters in; the adapters it added are the model's.
    auto adapted = [&] {
      ir::Graph g = family_->build(BatchSpec{}).graph;
      lora_adapters_ = lora::apply(g, config, false, lora_bf16_, family_->head_prefixes());
      return g;
    };
    ir::Graph graph = adapted();
    if (config.base_dtype == DType::bf16) {
      lora_bf16_ = lora::bf16_candidates(graph);
      graph = adapted();
    }
    next = std::make_unique<runtime::ParameterStore>(graph);
  } catch (...) {
    lora_ = std::move(saved_lora);
    lora_bf16_ = std::move(saved_bf16);
    lora_adapters_.clear();
    throw;
  }
  // Carry every weight over, from the model's store or (a mapped load) straight from the checkpoint's mapped files;
  // draw the adapters as PEFT does: A ~ kaiming_uniform(a=√5) = U(±1/√in), B = 0.
  // The old store is dropped below, so each base weight's pages go back to the kernel as soon as it is copied:
  // otherwise the f32 base and its bf16 copy are resident side by side (a 1.1B Llama: 4.1 + 2.1 GiB); a checkpoint
  // tensor's mapped pages are dropped the same way, so a load never holds more than the model it builds and one
  // weight. The model's own weights are checked first, so that nothing can throw once the first one is released; a
  // checkpoint's are checked as they are converted (an error there leaves this model as it was).
  // A quantised weight's codes, absmax and code table have no source of their own: with config.quantize_base they
  // are made from the weight's full-precision values, otherwise load_state_dict gives them (a bitsandbytes model's).
  const std::set<std::string> quantized(config.quantized.begin(), config.quantized.end());
  auto source_of = [&](const std::string& name) -> std::optional<Tensor> {
    if (checkpoint) {
      auto it = checkpoint->find(name);
      if (it != checkpoint->end()) return it->second;
    } else if (params_->contains(name)) {
      return params_->param(name);
    }
    return std::nullopt;
  };
  auto release = [&](const std::string& name) {
    if (std::optional<Tensor> s = source_of(name)) release_pages(s->data(), s->nbytes());
  };
  auto carried = [&](size_t i) {
    const std::string& name = next->frozen_slots()[i].name;
    return (next->frozen(i).dtype() != DType::u8 || (config.quantize_base && quantized.count(name))) &&
           source_of(name).has_value();
  };
  for (size_t i = 0; !checkpoint && i < next->frozen_slots().size(); ++i)
    if (carried(i)) check_finite(*source_of(next->frozen_slots()[i].name), next->frozen_slots()[i].name);
  for (size_t i = 0; i < next->frozen_slots().size(); ++i) {
    const std::string& name = next->frozen_slots()[i].name;
    if (!carried(i)) {
      if (!checkpoint) release(name);
      continue;
    }
    const Tensor source = *source_of(name), dest = next->frozen(i);
    if (dest.dtype() == DType::u8)
      quantize_into(*next, name, source, config, name);
    else
      copy_into(next->device(), dest, source, name);
    release(name);
  }
  std::mt19937_64 rng(config.seed);
  for (size_t i = 0; i < next->slots().size(); ++i) {
    const std::string& name = next->slots()[i].name;
    Tensor dest = next->param(i);
    if (std::optional<Tensor> source = source_of(name)) {
      copy_into(next->device(), dest, *source, name);
      continue;
    }
    if (ends_with(name, ".lora_B.weight")) continue;  // zero: the fresh buffer is
    std::vector<float> values(static_cast<size_t>(dest.numel()));  // A drawn on the host, then uploaded
    const float bound = 1.0f / std::sqrt(static_cast<float>(dest.shape()[1]));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    for (float& v : values) v = uniform(rng);
    upload_values(next->device(), dest, values);
  }
  for (size_t i = 0; i < next->slots().size(); ++i) next->set_weight_decay(i, decays(next->slots()[i].name));
  params_ = std::move(next);
  programs_.clear();
  last_plan_ = nullptr;
  last_pass_log_ = nullptr;
}

std::vector<std::string> Model::head_modules() const {
  std::vector<std::string> out;
  for (const std::string& prefix : family_->head_prefixes()) {
    std::string m = prefix;
    while (!m.empty() && m.back() == '.') m.pop_back();
    if (!m.empty()) out.push_back(m);
  }
  return out;
}

void Model::merge_lora() {
  FT_CHECK(lora_, "merge_lora: ", architecture_, " has no LoRA adapters");
  FT_CHECK(lora_->quant_type.empty(), "merge_lora: the base weights are quantised (", lora_->quant_type, ", ",
           lora_->quantized.size(), " weights): the adapters cannot be folded into 4-bit codes; save the adapters "
           "(save_adapter) and merge them into the full-precision base model with PEFT");
  const double s = lora_->scaling();
  // Back to the plain layout, every weight f32 and trainable.
  std::optional<LoraConfig> config = std::move(lora_);
  lora_.reset();
  std::unique_ptr<runtime::ParameterStore> plain = layout_parameters(*family_);
  for (size_t i = 0; i < plain->slots().size(); ++i) {
    const std::string& name = plain->slots()[i].name;
    const Tensor source = params_->contains(name) ? params_->param(name) : params_->frozen(name);
    copy_into(plain->device(), plain->param(i), source, name);
  }
  const kernels::Device& device = plain->device();
  auto download = [&](const Tensor& t) {
    std::vector<float> host(static_cast<size_t>(t.numel()));
    device.download(host.data(), t.data(), host.size() * sizeof(float));
    return host;
  };
  for (const LoraAdapter& ad : lora_adapters_) {
    const std::vector<float> a_host = download(params_->param(lora::a_name(ad.module)));  // (r, in)
    const std::vector<float> b_host = download(params_->param(lora::b_name(ad.module)));  // (out, r)
    const Tensor w_dest = plain->param(ad.weight);
    std::vector<float> w_host = download(w_dest);
    const float* a = a_host.data();
    const float* b = b_host.data();
    float* w = w_host.data();
    const int64_t r = config->r;
    for (int64_t o = 0; o < ad.out; ++o)
      for (int64_t i = 0; i < ad.in; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += double(b[o * r + k]) * double(a[k * ad.in + i]);
        float& target = ad.in_out ? w[i * ad.out + o] : w[o * ad.in + i];
        target += static_cast<float>(s * acc);
      }
    upload_values(device, w_dest, w_host);
  }
  for (size_t i = 0; i < plain->slots().size(); ++i) plain->set_weight_decay(i, decays(plain->slots()[i].name));
  params_ = std::move(plain);
  lora_adapters_.clear();
  lora_bf16_.clear();
  programs_.clear();
  last_plan_ = nullptr;
  last_pass_log_ = nullptr;
}

namespace {
constexpr const char* kPeftPrefix = "base_model.model.";

std::string peft_task_type(Head head) {
  switch (head) {
    case Head::CausalLM: return "CAUSAL_LM";
    case Head::SequenceClassification: return "SEQ_CLS";
    case Head::TokenClassification: return "TOKEN_CLS";
    case Head::QuestionAnswering: return "QUESTION_ANS";
    case Head::Base: return "FEATURE_EXTRACTION";
    default: return "";
  }
}
}  // namespace

void Model::save_adapter(const std::string& dir, const std::string& base_model) const {
  FT_CHECK(lora_, "save_adapter: ", architecture_, " has no LoRA adapters");
  std::vector<std::vector<uint8_t>> copies;
  const std::vector<std::pair<std::string, Tensor>> tensors = host_tensors(*params_, kPeftPrefix, copies);
  const std::string text = lora_->to_peft_json(peft_task_type(family_->head()), base_model).dump(2) + "\n";
  std::error_code error;
  if (std::filesystem::exists(dir, error)) {
    FT_CHECK(std::filesystem::is_directory(dir, error), dir, ": exists and is not a directory; cannot write adapters there");
  } else {
    std::filesystem::create_directories(dir, error);
    FT_CHECK(!error, dir, ": cannot create the directory: ", error.message());
  }
  // adapter_config.json last: a directory whose config is new has new weights too.
  io::save_safetensors((std::filesystem::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  io::write_file_atomic((std::filesystem::path(dir) / "adapter_config.json").string(),
                        {io::ByteSpan{text.data(), text.size()}});
}

void Model::load_adapter(const std::string& dir) {
  const std::filesystem::path config_file = std::filesystem::path(dir) / "adapter_config.json";
  const std::filesystem::path weights_file = std::filesystem::path(dir) / "adapter_model.safetensors";
  FT_CHECK(std::filesystem::exists(config_file), dir, ": no adapter_config.json (not a PEFT adapter directory)");
  FT_CHECK(std::filesystem::exists(weights_file), dir, ": no adapter_model.safetensors (PEFT's adapter weights)");
  LoraConfig config = LoraConfig::from_peft_json(io::read_json_file(config_file.string()), config_file.string());
  if (lora_) {
    config.base_dtype = lora_->base_dtype;
    config.seed = lora_->seed;
    FT_CHECK(config.r == lora_->r && config.alpha == lora_->alpha && config.target_modules == lora_->target_modules &&
                 config.modules_to_save == lora_->modules_to_save && config.use_rslora == lora_->use_rslora,
             config_file.string(), ": the adapter's settings differ from the LoRA this model was set up with");
  } else {
    enable_lora(config);
  }
  io::SafetensorsFile file = io::SafetensorsFile::open(weights_file.string());
  std::map<std::string, Tensor> tensors;
  std::vector<std::string> unexpected;
  for (const io::SafetensorsEntry& entry : file.entries()) {
    const std::string& key = entry.name;
    const std::string name = key.rfind(kPeftPrefix, 0) == 0 ? key.substr(std::strlen(kPeftPrefix)) : key;
    if (!params_->contains(name)) {
      unexpected.push_back(key);
      continue;
    }
    tensors[name] = file.tensor(key);
  }
  std::vector<std::string> missing;
  for (const runtime::ParamSlot& slot : params_->slots())
    if (!tensors.count(slot.name)) missing.push_back(slot.name);
  FT_CHECK(unexpected.empty() && missing.empty(), weights_file.string(), ": the adapter weights do not match ",
           architecture_, " with this adapter_config.json",
           missing.empty() ? "" : "; missing: " + join(missing), unexpected.empty() ? "" : "; unexpected: " + join(unexpected));
  for (const auto& [name, t] : tensors) {
    Tensor dest = params_->param(name);
    FT_CHECK(t.shape() == dest.shape(), weights_file.string(), ": \"", name, "\" has shape ", t.shape().to_string(),
             " but the adapter config gives ", dest.shape().to_string());
    copy_into(params_->device(), dest, t, str(weights_file.string(), ": tensor \"", name, "\""));
  }
}

namespace {

// Whether a batch packs several examples in a row, as transformers decides: no attention_mask, and position_ids
// that somewhere do not step by one (find_packed_sequence_indices).
bool packed_rows(const Batch& batch) {
  const Tensor& positions = batch.get(InputNames::position_ids);
  if (batch.has(InputNames::attention_mask) || positions.data() == nullptr || positions.shape().rank() != 2 ||
      positions.dtype() != DType::i64)
    return false;
  const int64_t* p = positions.data_as<int64_t>();
  const int64_t rows = positions.shape()[0], T = positions.shape()[1];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 1; t < T; ++t)
      if (p[r * T + t] != p[r * T + t - 1] + 1) return true;
  return false;
}

// key_begin of packed rows: each token's example starts where the position ids last failed to step by one.
void example_starts(const int64_t* positions, int64_t B, int64_t T, int64_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t > 0 && positions[b * T + t] != positions[b * T + t - 1] + 1) start = t;
      out[b * T + t] = start;
    }
  }
}

}  // namespace

BatchSpec Model::spec_for(const Batch& batch, bool training, bool with_backward) const {
  BatchSpec spec;
  spec.batch = 0;
  for (const InputDecl& input : inputs_) {
    const Tensor& t = batch.get(input.name);
    if (t.data() == nullptr) continue;
    spec.shapes.emplace_back(input.name, t.shape());
    spec.batch = t.shape()[0];
    if (input.seq_axis >= 0) spec.seq = t.shape()[input.seq_axis];
  }
  spec.packed = packed_rows(batch) && (family_->packs_sequences() || family_->head() == Head::CausalLM);
  FT_CHECK(!spec.packed || family_->packs_sequences(), architecture_, ": position_ids restart inside a row and no ",
           "attention_mask is given, so the rows pack several examples; this model cannot keep them apart (the ",
           "GPT-2, Llama, Mistral and Qwen2 families can). Give an attention_mask, or one example per row");
  spec.training = training;
  spec.bf16 = bf16_;
  spec.fp16 = fp16_;
  spec.recompute = recompute_ && with_backward;
  spec.fusions = fusions_;
  const Tensor& labels = batch.get(InputNames::labels);
  if (batch.has(InputNames::start_positions) || batch.has(InputNames::end_positions))
    spec.labels = LabelKind::Spans;
  else if (labels.data() != nullptr) {
    if (labels.dtype() == DType::f32)
      spec.labels = LabelKind::Values;
    else
      spec.labels = labels.shape().rank() == 2 ? LabelKind::TokenIds : LabelKind::ClassIds;
  }
  spec.token_stats = token_stats_ && spec.labels == LabelKind::TokenIds &&
                     (family_->head() == Head::CausalLM || family_->head() == Head::MaskedLM);
  if (preference_ && spec.labels != LabelKind::None) {
    FT_CHECK(family_->head() == Head::CausalLM && spec.labels == LabelKind::TokenIds, architecture_,
             ": a preference loss needs a causal LM and (batch, sequence) token labels");
    FT_CHECK(!spec.packed, "a preference batch cannot pack sequences (position_ids restart inside a row): give "
             "one sequence per row with an attention_mask");
    FT_CHECK(!imported_from_onnx(), architecture_, ": a preference loss needs a causal LM fusetrain builds (an "
             "imported graph computes its own logits only)");
    spec.preference = preference_;
  }
  return spec;
}

compile::Program& Model::plan_for(const BatchSpec& spec, bool with_backward) {
  // Everything that decides the graph or how it is compiled: the shapes of the inputs the batch must give (an
  // optional input shares their batch and sequence axes, and one left out is filled with its default, so the
  // same program serves a batch with or without it), then the settings.
  compile::ProgramCache::Key key;
  for (const auto& given : spec.shapes) {
    const std::string& name = given.first;
    const Shape& shape = given.second;
    const auto input = std::find_if(inputs_.begin(), inputs_.end(), [&](const InputDecl& d) { return d.name == name; });
    if (input->source != InputSource::Batch) continue;
    key.push_back(shape.rank());
    key.insert(key.end(), shape.dims().begin(), shape.dims().end());
  }
  for (int64_t setting : {int64_t{spec.training}, int64_t{spec.bf16}, int64_t{spec.fp16}, int64_t{spec.recompute},
                          int64_t{spec.fusions}, static_cast<int64_t>(spec.labels), int64_t{with_backward},
                          int64_t{count_unfused_ops_}, int64_t{spec.packed}, int64_t{spec.token_stats},
                          int64_t{spec.preference.has_value()}, int64_t{spec.reference}})
    key.push_back(setting);
  if (spec.preference) {
    key.push_back(static_cast<int64_t>(std::hash<std::string>{}(spec.preference->loss_type)));
    int64_t beta_bits = 0;
    std::memcpy(&beta_bits, &spec.preference->beta, sizeof(beta_bits));
    key.push_back(beta_bits);
  }
  if (compile::Program* program = programs_.find(key)) return *program;
  BuiltGraph built = build(spec);
  FT_CHECK(!with_backward || built.loss != ir::kNone, architecture_, ": gradients need labels (no loss without them)");
  compile::GraphRoles roles;
  roles.loss = built.loss;
  // A preference program returns sequence log-probabilities, never the logits (they are formed in chunks only).
  if (!spec.preference)
    for (ir::ValueId v : {built.logits, built.end_logits})
      if (v != ir::kNone) roles.outputs.push_back(v);
  roles.layer_boundaries = built.layer_boundaries;
  if (built.token_stats != ir::kNone) roles.metrics.push_back(built.token_stats);
  for (ir::ValueId v : {built.sequence_logps, built.row_stats})  // metrics 0 and 1 of a preference program
    if (v != ir::kNone) roles.metrics.push_back(v);
  compile::CompileOptions options;
  options.backward = with_backward;
  options.fusions = spec.fusions;
  options.loss_scale_input = spec.fp16 && with_backward;
  options.recompute = spec.recompute;
  options.count_unfused_ops = count_unfused_ops_;
  options.plan.num_threads = num_threads_;
  compile::Program& program =
      programs_.insert(key, compile::compile(std::move(built.graph), std::move(roles), *params_, options));
  // Defaults for inputs the caller may leave out: all-ones mask, zero token types.
  if (program.plan->has_input(InputNames::attention_mask)) {
    Tensor mask = program.plan->input(InputNames::attention_mask);
    std::fill(mask.data_as<int64_t>(), mask.data_as<int64_t>() + mask.numel(), int64_t{1});
  }
  return program;
}

namespace {

void require_ids(const Tensor& t, const char* what, int64_t B, int64_t T) {
  FT_CHECK(t.dtype() == DType::i64, what, " must be int64, found ", dtype_name(t.dtype()));
  FT_CHECK(t.shape() == Shape({B, T}), what, " has shape ", t.shape().to_string(), ", expected (", B, ", ", T,
           ") like input_ids");
}

// A shape as NumPy prints it: "(8,)" for one axis.
std::string numpy_shape(const Shape& shape) {
  return shape.rank() == 1 ? str("(", shape[0], ",)") : shape.to_string();
}

bool is_label(const std::string& name) {
  return std::find(std::begin(kLabelNames), std::end(kLabelNames), name) != std::end(kLabelNames);
}

}  // namespace

void Model::check_inputs(const Batch& batch) const {
  for (const auto& entry : batch.tensors()) {
    const std::string& name = entry.first;
    const Tensor& tensor = entry.second;
    if (is_label(name)) continue;
    const bool declared =
        std::any_of(inputs_.begin(), inputs_.end(), [&](const InputDecl& d) { return d.name == name; });
    if (declared) continue;
    std::string takes;
    for (const InputDecl& d : inputs_) takes += (takes.empty() ? "" : ", ") + d.name;
    if (name == InputNames::attention_mask && tensor.dtype() == DType::i64) {
      // A graph exported without a mask input attends to every token: a mask without padding asks for just that.
      const int64_t* m = tensor.data_as<int64_t>();
      const int64_t at = std::find_if(m, m + tensor.numel(), [](int64_t x) { return x != 1; }) - m;
      if (at == tensor.numel()) continue;
      throw Error(str(architecture_, " does not take attention_mask (it takes ", takes, "), so it cannot mask the ",
                      "padding the mask marks (value ", m[at], " at flat position ", at, ")"));
    }
    throw Error(str(architecture_, " does not take ", name, " (it takes ", takes, ")"));
  }
  // Every sequence input shares the batch and sequence axes of the first one given.
  const InputDecl* first = nullptr;
  int64_t B = 0, T = 0;
  for (const InputDecl& input : inputs_) {
    const Tensor& t = batch.get(input.name);
    if (t.data() == nullptr) {
      FT_CHECK(input.source != InputSource::Batch, architecture_, " needs ", input.name, ", ", describe(input),
               "; the batch has none");
      continue;
    }
    FT_CHECK(t.dtype() == input.dtype, input.name, " must be ", element_type_name(input.dtype), ", found ",
             element_type_name(t.dtype()));
    bool fits = t.shape().rank() == input.rank;
    for (size_t k = 0; fits && k < input.fixed.size(); ++k)
      fits = input.fixed[k] < 0 || t.shape()[int64_t(k)] == input.fixed[k];
    FT_CHECK(fits, input.name, " must be ", describe(input), "; found shape ", numpy_shape(t.shape()));
    FT_CHECK(t.numel() > 0, input.name, " is empty: shape ", t.shape().to_string());
    if (first == nullptr) {
      first = &input;
      B = t.shape()[0];
      T = input.seq_axis >= 0 ? t.shape()[input.seq_axis] : 0;
      continue;
    }
    FT_CHECK(t.shape()[0] == B, input.name, " has batch size ", t.shape()[0], ", but ", first->name, " has ", B);
    if (input.seq_axis >= 0 && T > 0)
      FT_CHECK(t.shape()[input.seq_axis] == T, input.name, " has shape ", t.shape().to_string(), ", expected (", B,
               ", ", T, ") like ", first->name);
  }
  FT_CHECK(T <= family_->max_positions(), "sequence length ", T, " exceeds the model's maximum of ",
           family_->max_positions(), " positions");
  const Tensor& mask = batch.get(InputNames::attention_mask);
  if (mask.data() != nullptr && mask.dtype() == DType::i64) {
    // The graph turns the mask into an additive bias, (1 - m) * min: any value but 0 or 1 would silently become
    // NaN (large values), a full mask (2) or a reweighting (negative values).
    const int64_t* m = mask.data_as<int64_t>();
    const int64_t cols = mask.shape()[-1];
    for (int64_t i = 0; i < mask.numel(); ++i)
      FT_CHECK(m[i] == 0 || m[i] == 1, "attention_mask: value ", m[i], " at (", i / cols, ", ", i % cols,
               "); expected 1 for a token to attend to and 0 for padding");
  }
}

namespace {

// A preference run's per-sequence figures: its sequence log-probabilities (metric 0), the reference's (input), and
// over the positions with a (shifted) label, their count and the sums of the row statistics (metric 1).
PreferenceStats preference_stats(runtime::Plan& plan, const std::vector<ir::ValueId>& metrics, const BatchSpec& spec,
                                 const Tensor& shifted) {
  const int64_t B = spec.batch, T = spec.seq;
  PreferenceStats s;
  const Tensor logps = plan.output(metrics[0]);
  const int64_t* labels = shifted.data_as<int64_t>();
  const float* rows = metrics.size() > 1 ? plan.output(metrics[1]).data_as<float>() : nullptr;
  const float* ref = spec.reference ? nullptr : plan.input(InputNames::ref_logps).data_as<float>();
  for (int64_t b = 0; b < B; ++b) {
    s.logps.push_back(logps.item(b));
    if (ref) s.ref_logps.push_back(ref[b]);
    double tokens = 0, entropy = 0, top1 = 0, mean_logit = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (labels[b * T + t] == -100) continue;
      tokens += 1;
      if (!rows) continue;
      const float* r = rows + (b * T + t) * 3;
      entropy += r[0];
      top1 += r[1];
      mean_logit += r[2];
    }
    s.tokens.push_back(tokens);
    if (rows) {
      s.entropy_sum.push_back(entropy);
      s.top1.push_back(top1);
      s.mean_logit_sum.push_back(mean_logit);
    }
  }
  return s;
}

}  // namespace

ModelOutput Model::run(const Batch& batch, bool training, bool with_backward, bool zero_grads,
                       runtime::RunObserver* observer, bool reference) {
  check_inputs(batch);
  const Family* family = family_.get();
  BatchSpec spec = spec_for(batch, training, with_backward);
  if (reference) {
    FT_CHECK(family->head() == Head::CausalLM && spec.labels == LabelKind::TokenIds && !spec.packed,
             architecture_, ": sequence log-probabilities need a causal LM, (batch, sequence) token labels and one "
             "sequence per row");
    FT_CHECK(!lora_ || lora_->modules_to_save.empty(), architecture_, ": the reference (the base without its ",
             "adapters) is not kept for modules_to_save, which train in full; give a reference model or precomputed "
             "reference log-probabilities");
    if (!spec.preference) spec.preference = PreferenceConfig{};
    spec.reference = true;
    spec.token_stats = false;
  }
  const int64_t B = spec.batch, T = spec.seq;
  compile::Program& program = plan_for(spec, with_backward);
  runtime::Plan& plan = *program.plan;
  const ir::ValueId logits = program.roles.outputs.empty() ? ir::kNone : program.roles.outputs[0];
  const Tensor& ids = batch.get(InputNames::input_ids);
  const int64_t* id_data = ids.data() != nullptr ? ids.data_as<int64_t>() : nullptr;

  if (family->binds_inputs()) {
    family->bind_inputs(plan, batch, spec);
  } else {
    for (const InputDecl& input : inputs_) {
      if (input.name == InputNames::position_ids) continue;
      const Tensor& t = batch.get(input.name);
      plan.upload_input(input.name.c_str(), t.data());  // null: the plan's buffer keeps the default
    }
    std::vector<int64_t> default_positions;
    const Tensor& given_positions = batch.get(InputNames::position_ids);
    const int64_t* positions = given_positions.data() != nullptr ? given_positions.data_as<int64_t>() : nullptr;
    if (positions == nullptr) {
      default_positions.resize(static_cast<size_t>(B * T));
      family->default_position_ids(id_data, B, T, default_positions.data());
      positions = default_positions.data();
    }
    if (plan.has_input(InputNames::position_ids)) {
      plan.bind_input(InputNames::position_ids, nullptr);
      std::copy(positions, positions + B * T, plan.input(InputNames::position_ids).data_as<int64_t>());
    }
    if (spec.packed) example_starts(positions, B, T, plan.input(InputNames::key_begin).data_as<int64_t>());
    family->bind_extra_inputs(plan, positions, B, T);
  }
  if (family->reads_pool_index()) {
    int64_t* rows = plan.input(InputNames::pool_index).data_as<int64_t>();
    for (int64_t b = 0; b < B; ++b) rows[b] = b * T + family->pool_position(id_data + b * T, T);
  }

  const Tensor& labels = batch.get(InputNames::labels);
  // Integer labels must name a class of the logits (or be -100, ignored).
  auto check_classes = [&](const Tensor& labels) {
    const int64_t classes = logits != ir::kNone ? plan.graph().value(logits).shape[-1]
                                                : ConfigReader(config_).get_int("vocab_size");
    const int64_t* l = labels.data_as<int64_t>();
    for (int64_t i = 0; i < labels.numel(); ++i)
      FT_CHECK(l[i] == -100 || (l[i] >= 0 && l[i] < classes), "labels: value ", l[i], " at position ", i,
               " is outside [0, ", classes, ") (the model has ", classes, " classes; -100 marks ignored positions)");
  };
  switch (spec.labels) {
    case LabelKind::None:
      break;
    case LabelKind::TokenIds: {
      FT_CHECK(std::any_of(inputs_.begin(), inputs_.end(), [](const InputDecl& d) { return d.seq_axis >= 0; }),
               "labels have shape ", labels.shape().to_string(), "; ", architecture_,
               " reads no sequence, so its labels are one class per example, of shape (", B, ")");
      require_ids(labels, "labels", B, T);
      check_classes(labels);
      if (family->head() == Head::CausalLM) {
        // Shift left: position t predicts token t + 1; the last position is ignored, and in packed rows the last
        // of each example (it would predict the next example's first token).
        int64_t* shifted = plan.input(InputNames::labels).data_as<int64_t>();
        const int64_t* given = labels.data_as<int64_t>();
        const int64_t* starts = spec.packed ? plan.input(InputNames::key_begin).data_as<int64_t>() : nullptr;
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t t = 0; t + 1 < T; ++t)
            shifted[b * T + t] = starts && starts[b * T + t + 1] == t + 1 ? -100 : given[b * T + t + 1];
          shifted[b * T + T - 1] = -100;
        }
      } else {
        plan.upload_input(InputNames::labels, labels.data());
      }
      break;
    }
    case LabelKind::ClassIds:
      FT_CHECK(labels.dtype() == DType::i64 && labels.shape() == Shape({B}), "labels have shape ",
               labels.shape().to_string(), "; class labels must be int64 of shape (", B, ")");
      check_classes(labels);
      plan.upload_input(InputNames::labels, labels.data());
      break;
    case LabelKind::Values: {
      Tensor dest = plan.input(InputNames::labels);
      FT_CHECK(labels.numel() == dest.numel(), "float labels have shape ", labels.shape().to_string(),
               ", expected ", dest.shape().to_string());
      plan.upload_input(InputNames::labels, labels.data());
      break;
    }
    case LabelKind::Spans: {
      FT_CHECK(batch.has(InputNames::start_positions) && batch.has(InputNames::end_positions),
               "question answering needs both start_positions and end_positions");
      for (auto [name, t] : {std::pair{InputNames::start_positions, &batch.get(InputNames::start_positions)},
                             std::pair{InputNames::end_positions, &batch.get(InputNames::end_positions)}}) {
        FT_CHECK(t->dtype() == DType::i64 && t->shape() == Shape({B}), name, " must be int64 of shape (", B, ")");
        int64_t* dest = plan.input(name).data_as<int64_t>();
        for (int64_t b = 0; b < B; ++b) dest[b] = std::clamp<int64_t>(t->data_as<int64_t>()[b], 0, T);
      }
      break;
    }
  }

  if (spec.preference && !spec.reference) {
    // Completion lengths (TRL counts the completion mask, before the shift) and the reference log-probabilities.
    const int64_t* given = labels.data_as<int64_t>();
    float* lengths = plan.input(InputNames::completion_lengths).data_as<float>();
    for (int64_t b = 0; b < B; ++b)
      lengths[b] = static_cast<float>(std::count_if(given + b * T, given + (b + 1) * T, [](int64_t l) { return l != -100; }));
    float* ref = plan.input(InputNames::ref_logps).data_as<float>();
    const Tensor& given_ref = batch.get(InputNames::ref_logps);
    if (given_ref.data() != nullptr) {
      FT_CHECK(given_ref.dtype() == DType::f32 && given_ref.numel() == B, "ref_logps must be float32 of shape (", B,
               ",): one reference log-probability per sequence; found ", element_type_name(given_ref.dtype()), " ",
               given_ref.shape().to_string());
      const float* r = given_ref.data_as<float>();
      for (int64_t b = 0; b < B; ++b)
        FT_CHECK(std::isfinite(r[b]), "ref_logps: value ", r[b], " at sequence ", b, " is not finite");
      std::copy(r, r + B, ref);
    } else {
      reference_log_probs(batch, ref);
    }
  }
  if (spec.fp16 && with_backward)
    *plan.input(compile::kLossScaleInput).data_as<float>() = static_cast<float>(loss_scale_);
  if (zero_grads) params_->zero_grads();
  if (training) plan.set_step((dropout_seed_ << 32) + rng_step_++);
  plan.run(observer);
  last_plan_ = &plan;
  last_pass_log_ = &program.log;
  ModelOutput out;
  if (!with_backward && logits != ir::kNone) {
    out.logits = plan.output(logits);
    if (program.roles.outputs.size() > 1) out.end_logits = plan.output(program.roles.outputs[1]);
  }
  if (program.roles.loss != ir::kNone) out.loss = plan.output(program.roles.loss).item();
  if (spec.preference) {
    out.preference = preference_stats(plan, program.roles.metrics, spec, plan.input(InputNames::labels));
    if (!reference) last_preference_stats_ = out.preference;
    last_token_stats_.reset();
    return out;
  }
  if (!program.roles.metrics.empty()) {
    const Tensor stats = plan.output(program.roles.metrics[0]);
    out.token_stats = TokenStats{stats.item(0), stats.item(1), stats.item(2)};
  }
  last_token_stats_ = out.token_stats;
  return out;
}

ModelOutput Model::forward(const Batch& batch, bool training) { return run(batch, training, false, false); }

std::vector<double> Model::sequence_log_probs(const Batch& batch) {
  return run(batch, /*training=*/false, false, false, nullptr, /*reference=*/true).preference->logps;
}

void Model::reference_log_probs(const Batch& batch, float* out) {
  std::vector<double> logps;
  if (reference_ != nullptr)
    logps = reference_->sequence_log_probs(batch);
  else if (lora_)
    logps = sequence_log_probs(batch);  // the base: the same weights without the adapters
  else
    throw Error(str(architecture_, ": a preference loss compares against reference log-probabilities: give them "
                    "(ref_logps), a reference model, or train LoRA adapters (the reference is then the base)"));
  for (size_t i = 0; i < logps.size(); ++i) out[i] = static_cast<float>(logps[i]);
}

double Model::loss_and_grads(const Batch& batch, bool training) { return *run(batch, training, true, true).loss; }

double Model::accumulate_grads(const Batch& batch, bool training, runtime::RunObserver* observer) {
  return *run(batch, training, true, false, observer).loss;
}

}  // namespace fusetrain::models
