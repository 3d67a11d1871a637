// Model's loading and saving: from a config, a family or a Hugging Face directory; state dicts; save_pretrained.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/quant.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "models/family.h"
#include "models/lora_graph.h"
#include "models/model_units.h"

namespace fusetrain::models {

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

}  // namespace fusetrain::models
