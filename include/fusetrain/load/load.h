// Where an engine model comes from: the one place that picks the registry's native builder or the ONNX importer
// for a path. It sits above models/ and onnx/ (neither reaches into the other); a transformers directory whose
// architecture the registry does not build is captured by the Python layer (fusetrain.capture), which hands this
// layer the ONNX graph it wrote.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace fusetrain::io {
struct HfModelDir;
}
namespace fusetrain::models {
class Model;
}

namespace fusetrain::load {

/// How the engine gets the model at a path.
enum class ModelSource : uint8_t {
  Native,    ///< a model directory whose config.json the registry builds (models::Model::from_pretrained)
  Imported,  ///< an ONNX graph (onnx_import::import_model): a .onnx file, e.g. the graph a capture wrote
};

/// The source of `path`: a file named *.onnx is imported; anything else is a model directory, built natively.
ModelSource model_source(const std::string& path);

/// The model at `path` for `task` ("seq-cls", ...): an ONNX graph imported, or a model directory (read once
/// already into `hf`) built as `architecture` (empty: its config's) with `overrides` merged into its config and a
/// missing head drawn from `seed`. Throws Error naming what is wrong.
std::unique_ptr<models::Model> load_model(const std::string& path, const std::string& task, const io::HfModelDir* hf,
                                          const std::string& architecture = "",
                                          const nlohmann::json& overrides = nlohmann::json::object(),
                                          uint64_t seed = 0);

}  // namespace fusetrain::load
