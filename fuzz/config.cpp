// A model's config.json: models::Model::from_pretrained on a directory holding the input as config.json and the
// weights of a tiny model of the same model_type (so a config that matches them loads completely, and one that
// does not is refused naming the tensor).
//
// Sizes: parameters are allocated as the config says; ASan refuses any single allocation over
// max_allocation_size_mb (fuzz_support.cpp), which aligned_allocate reports as fusetrain::Error, so a config asking
// for a billion parameters is refused rather than allocated. The number of layers is bounded here instead (inputs
// with more than kMaxLayers are skipped): each layer adds graph nodes, not one large allocation.
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_support.h"
#include "fusetrain/models/model.h"

namespace {

namespace fs = std::filesystem;
namespace fuzz = fusetrain::fuzz;
using nlohmann::json;

constexpr double kMaxLayers = 16;

// The tiny configs whose weights each directory holds: one base model per model_type.
std::map<std::string, fs::path> make_dirs() {
  const std::map<std::string, json> configs = {
      {"bert",
       {{"model_type", "bert"}, {"vocab_size", 32}, {"hidden_size", 8}, {"num_hidden_layers", 1},
        {"num_attention_heads", 2}, {"intermediate_size", 16}, {"max_position_embeddings", 16}}},
      {"roberta",
       {{"model_type", "roberta"}, {"vocab_size", 32}, {"hidden_size", 8}, {"num_hidden_layers", 1},
        {"num_attention_heads", 2}, {"intermediate_size", 16}, {"max_position_embeddings", 18},
        {"type_vocab_size", 1}, {"pad_token_id", 1}}},
      {"distilbert",
       {{"model_type", "distilbert"}, {"vocab_size", 32}, {"dim", 8}, {"n_layers", 1}, {"n_heads", 2},
        {"hidden_dim", 16}, {"max_position_embeddings", 16}}},
      {"gpt2",
       {{"model_type", "gpt2"}, {"vocab_size", 32}, {"n_embd", 8}, {"n_layer", 1}, {"n_head", 2},
        {"n_positions", 16}}},
  };
  std::map<std::string, fs::path> dirs;
  for (const auto& [type, config] : configs) {
    dirs[type] = fuzz::scratch_dir() / type;
    fusetrain::models::Model::from_config(config)->save_pretrained(dirs[type].string());
  }
  return dirs;
}

// True when the config asks for more layers than kMaxLayers under any family's name for the count.
bool too_deep(const json& config) {
  if (!config.is_object()) return false;
  for (const char* key : {"num_hidden_layers", "n_layer", "n_layers"}) {
    auto it = config.find(key);
    if (it != config.end() && it->is_number() && it->get<double>() > kMaxLayers) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::map<std::string, fs::path> dirs = make_dirs();
  const std::string_view text = fuzz::as_text(data, size);
  const json parsed = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (too_deep(parsed)) return 0;
  // The directory whose weights match the model_type the config names (BERT's when it names none).
  fs::path dir = dirs.at("bert");
  if (parsed.is_object() && parsed.contains("model_type") && parsed["model_type"].is_string()) {
    auto it = dirs.find(parsed["model_type"].get<std::string>());
    if (it != dirs.end()) dir = it->second;
  }
  fuzz::write_file(dir / "config.json", text);
  fuzz::parses("Model::from_pretrained", [&] {
    std::unique_ptr<fusetrain::models::Model> model = fusetrain::models::Model::from_pretrained(dir.string());
    fuzz::sink = fuzz::sink + static_cast<uint64_t>(model->params().num_parameters());
  });
  return 0;
}
