// Hugging Face model directories: config.json, generation_config.json and safetensors weights.
#pragma once

#include <cstddef>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fusetrain/core/tensor.h"
#include "fusetrain/io/safetensors.h"

namespace fusetrain::io {

/// A Hugging Face model directory: config.json, optional generation_config.json, and weights in
/// model.safetensors or sharded (model.safetensors.index.json plus the shards it names).
struct HfModelDir {
  /// The directory as given to read_hf_dir.
  std::string path;
  /// config.json (an object with a "model_type").
  nlohmann::json config;
  /// generation_config.json, if the directory has one.
  std::optional<nlohmann::json> generation_config;
  /// The weight files, mapped: one for model.safetensors, one per shard otherwise.
  std::vector<SafetensorsFile> files;
  /// Every tensor name -> index into files.
  std::map<std::string, size_t> tensor_file;

  /// The named weight, a read-only view into its file (see SafetensorsFile::tensor); throws Error naming the
  /// directory and the tensor if absent.
  Tensor tensor(const std::string& name) const;
  /// Every tensor name, sorted.
  std::vector<std::string> tensor_names() const;
};

/// Reads and validates a model directory. Prefers model.safetensors over a sharded index when both exist. Throws
/// one Error per problem: a missing path or non-directory; config.json missing, malformed (with the parser's
/// position), not an object or without "model_type"; no safetensors weights (pointing at a conversion command when
/// only pytorch_model.bin weights exist); a malformed index, a shard it names that is missing, or a tensor it
/// lists that its shard lacks; and any error SafetensorsFile::open reports for a weight file.
HfModelDir read_hf_dir(const std::string& path);

/// Writes config.json (indented 2, keys sorted, as transformers writes it), generation_config.json when given,
/// and model.safetensors (metadata {"format": "pt"}) into `path`, creating the directory if missing; an Error if
/// `path` exists and is not a directory. Each file is written to a temporary name and renamed, so an interrupted
/// save never leaves a half-written file under a final name.
void write_hf_dir(const std::string& path, const nlohmann::json& config,
                  const std::vector<std::pair<std::string, Tensor>>& tensors,
                  const std::optional<nlohmann::json>& generation_config = std::nullopt);

/// Parses a JSON file; on failure the Error names the file and, for malformed JSON, the line and column.
nlohmann::json read_json_file(const std::string& path);

/// read_json_file for files whose top level must be an object (config.json, trainer_state.json, ...): anything else
/// is an Error "<path>: expected a JSON object, found a JSON array".
nlohmann::json read_json_object(const std::string& path);

}  // namespace fusetrain::io
