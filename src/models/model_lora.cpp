// Model's LoRA: the adapters' layout (QLoRA's quantised base weights included), merging, PEFT adapter files.
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

std::vector<std::string> Model::quantizable_weights(const LoraConfig& config) const {
  LoraConfig plain = config;
  plain.quant_type.clear();
  plain.quantized.clear();
  plain.base_dtype = DType::f32;
  ir::Graph g = family_->build(BatchSpec{}).graph;
  lora::apply(g, plain, false, {}, family_->head_prefixes());
  return lora::quantizable(g, family_->head_prefixes());
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
    case Head::Seq2SeqLM: return "SEQ_2_SEQ_LM";
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

}  // namespace fusetrain::models
