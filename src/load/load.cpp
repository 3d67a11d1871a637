// load::model_source and load::load_model: native build or ONNX import, picked in one place.
#include "fusetrain/load/load.h"

#include <filesystem>

#include "fusetrain/core/error.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/models/model.h"
#include "fusetrain/onnx/import.h"

namespace fusetrain::load {

ModelSource model_source(const std::string& path) {
  return std::filesystem::path(path).extension() == ".onnx" ? ModelSource::Imported : ModelSource::Native;
}

std::unique_ptr<models::Model> load_model(const std::string& path, const std::string& task, const io::HfModelDir* hf,
                                          const std::string& architecture, const nlohmann::json& overrides,
                                          uint64_t seed) {
  switch (model_source(path)) {
    case ModelSource::Imported:
      FT_CHECK(std::filesystem::is_regular_file(path), "--model: ONNX file \"", path, "\" does not exist");
      return onnx_import::import_model(path, task);
    case ModelSource::Native:
      if (hf != nullptr) return models::Model::from_pretrained(*hf, architecture, overrides, seed);
      return models::Model::from_pretrained(io::read_hf_dir(path), architecture, overrides, seed);
  }
  throw Error(str("load_model: unknown source for ", path));
}

}  // namespace fusetrain::load
