#include "fusetrain/io/hf_dir.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "fusetrain/core/error.h"
#include "fusetrain/io/json_fields.h"

namespace fusetrain::io {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// "; did you mean \"x\"?" for a stored name that differs from `name` only by a prefix (the usual "bert." /
// "model." mismatch) or a suffix, else "".
std::string prefix_hint(const std::string& name, const std::map<std::string, size_t>& names) {
  for (const auto& [candidate, file] : names) {
    const std::string& longer = candidate.size() > name.size() ? candidate : name;
    const std::string& shorter = candidate.size() > name.size() ? name : candidate;
    if (!shorter.empty() && longer.size() != shorter.size() &&
        (longer.ends_with("." + shorter) || longer.starts_with(shorter + ".")))
      return str("; did you mean \"", candidate, "\"?");
  }
  return "";
}

// True when `relative` stays inside the directory it is joined to.
bool stays_inside(const fs::path& relative) {
  if (relative.empty() || !relative.is_relative() || relative.has_root_name()) return false;
  for (const fs::path& part : relative)
    if (part == "..") return false;
  return true;
}

void write_json_file(const fs::path& path, const json& value) {
  // As transformers writes it: json.dumps(value, indent=2, sort_keys=True) + "\n" (ensure_ascii on).
  std::string text;
  try {
    text = value.dump(2, ' ', true) + "\n";
  } catch (const json::exception& e) {
    throw Error(str(path.string(), ": cannot serialize: ", json_error_text(e)));
  }
  write_file_atomic(path.string(), {{text.data(), text.size()}});
}

// Opens every shard the index names and maps each listed tensor to its shard.
void read_sharded_weights(HfModelDir& model, const fs::path& index_path) {
  const std::string index_name = index_path.string();
  json index = read_json_object(index_name);
  auto weight_map = index.find("weight_map");
  FT_CHECK(weight_map != index.end() && weight_map->is_object(), index_name,
           ": no \"weight_map\" object (tensor name -> shard file)");

  std::set<std::string> shard_names;
  for (const auto& [tensor, shard] : weight_map->items()) {
    FT_CHECK(shard.is_string(), index_name, ": weight_map entry for tensor \"", tensor, "\" is a JSON ",
             shard.type_name(), ", expected a shard file name");
    const std::string& shard_name = shard.get_ref<const std::string&>();
    FT_CHECK(stays_inside(fs::path(shard_name)), index_name, ": shard \"", shard_name, "\" for tensor \"", tensor,
             "\" is not a file name inside the model directory");
    shard_names.insert(shard_name);
  }
  std::map<std::string, size_t> shard_file;
  for (const std::string& shard_name : shard_names) {
    fs::path shard_path = fs::path(model.path) / shard_name;
    std::error_code error;
    if (!fs::exists(shard_path, error)) {
      std::string example;
      for (const auto& [tensor, shard] : weight_map->items())
        if (shard.get_ref<const std::string&>() == shard_name) {
          example = tensor;
          break;
        }
      throw Error(str(index_name, ": names shard \"", shard_name, "\" (holding tensor \"", example, "\"), but ",
                      shard_path.string(), " does not exist"));
    }
    model.files.push_back(SafetensorsFile::open(shard_path.string()));
    shard_file[shard_name] = model.files.size() - 1;
  }
  for (const auto& [tensor, shard] : weight_map->items()) {
    const std::string& shard_name = shard.get_ref<const std::string&>();
    size_t file = shard_file.at(shard_name);
    FT_CHECK(model.files[file].contains(tensor), index_name, ": lists tensor \"", tensor, "\" in shard \"", shard_name,
             "\", but ", model.files[file].path(), " has no such tensor");
    model.tensor_file[tensor] = file;
  }
  // A shard may hold tensors the index does not list; transformers loads them too. The index wins on conflicts.
  for (size_t file = 0; file < model.files.size(); ++file)
    for (const SafetensorsEntry& e : model.files[file].entries()) model.tensor_file.emplace(e.name, file);
}

}  // namespace

Tensor HfModelDir::tensor(const std::string& name) const {
  auto it = tensor_file.find(name);
  FT_CHECK(it != tensor_file.end(), path, ": no tensor \"", name, "\" among the model's ", tensor_file.size(),
           " weights", prefix_hint(name, tensor_file));
  FT_CHECK(it->second < files.size(), path, ": tensor \"", name, "\" maps to weight file ", it->second, " of ",
           files.size());
  return files[it->second].tensor(name);
}

std::vector<std::string> HfModelDir::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensor_file.size());
  for (const auto& [name, file] : tensor_file) names.push_back(name);
  return names;
}

json read_json_file(const std::string& path) {
  std::error_code error;
  fs::file_status status = fs::status(path, error);
  FT_CHECK(fs::exists(status), path, ": no such file");
  FT_CHECK(!fs::is_directory(status), path, ": is a directory, expected a JSON file");
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in.is_open(), path, ": cannot open: ", std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FT_CHECK(!in.bad(), path, ": cannot read: ", std::strerror(errno));
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(str(path, ": invalid JSON: ", json_error_text(e)));
  }
}

json read_json_object(const std::string& path) {
  json j = read_json_file(path);
  FT_CHECK(j.is_object(), path, ": expected a JSON object, found a JSON ", j.type_name());
  return j;
}

HfModelDir read_hf_dir(const std::string& path) {
  const fs::path dir(path);
  std::error_code error;
  fs::file_status status = fs::status(dir, error);
  FT_CHECK(fs::exists(status), path, ": no such directory");
  FT_CHECK(fs::is_directory(status), path, ": is not a directory, expected a Hugging Face model directory");

  HfModelDir model;
  model.path = path;
  const fs::path config_path = dir / "config.json";
  FT_CHECK(fs::exists(config_path, error), path, ": no config.json");
  model.config = read_json_object(config_path.string());
  auto model_type = model.config.find("model_type");
  FT_CHECK(model_type != model.config.end(), config_path.string(),
           ": no \"model_type\" (expected a string such as \"bert\", \"gpt2\" or \"llama\")");
  FT_CHECK(model_type->is_string(), config_path.string(), ": \"model_type\" is a JSON ", model_type->type_name(),
           ", expected a string");

  const fs::path generation_path = dir / "generation_config.json";
  if (fs::exists(generation_path, error)) {
    model.generation_config = read_json_file(generation_path.string());
    FT_CHECK(model.generation_config->is_object(), generation_path.string(), ": expected a JSON object, found a JSON ",
             model.generation_config->type_name());
  }

  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(single, error)) {
    model.files.push_back(SafetensorsFile::open(single.string()));
    for (const SafetensorsEntry& e : model.files[0].entries()) model.tensor_file[e.name] = 0;
  } else if (fs::exists(index, error)) {
    read_sharded_weights(model, index);
  } else {
    for (const char* pickle : {"pytorch_model.bin", "pytorch_model.bin.index.json"})
      FT_CHECK(!fs::exists(dir / pickle, error), path, ": the weights are in ", pickle,
               " (PyTorch pickle), which fusetrain does not read; convert them to safetensors with: "
               "python -c \"from transformers import AutoModel; AutoModel.from_pretrained('",
               path, "').save_pretrained('", path, "', safe_serialization=True)\"");
    throw Error(str(path, ": no model.safetensors or model.safetensors.index.json"));
  }
  return model;
}

void write_hf_dir(const std::string& path, const json& config,
                  const std::vector<std::pair<std::string, Tensor>>& tensors,
                  const std::optional<json>& generation_config) {
  FT_CHECK(config.is_object(), path, ": config must be a JSON object, found a JSON ", config.type_name());
  FT_CHECK(!generation_config || generation_config->is_object(), path,
           ": generation config must be a JSON object, found a JSON ", generation_config->type_name());
  const fs::path dir(path);
  std::error_code error;
  fs::file_status status = fs::status(dir, error);
  if (fs::exists(status)) {
    FT_CHECK(fs::is_directory(status), path, ": exists and is not a directory; cannot write a model directory there");
  } else {
    fs::create_directories(dir, error);
    FT_CHECK(!error, path, ": cannot create the directory: ", error.message());
  }
  // config.json last: a directory whose config is new has all its other files new too.
  save_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
  if (generation_config) write_json_file(dir / "generation_config.json", *generation_config);
  write_json_file(dir / "config.json", config);
}

}  // namespace fusetrain::io
