// ONNX export: a model's inference graph (no dropout, no loss) as an ONNX ModelProto, written with the ONNX
// project's own protobuf schema (Debian's libonnx-dev).
#pragma once

#include <cstdint>
#include <string>

namespace fusetrain::models {
class Model;
}

namespace fusetrain::onnx_export {

/// What export writes beyond the graph itself.
struct ExportOptions {
  /// The ONNX opset the graph imports (17 to 20). 17 writes GELU as Erf (or Tanh) arithmetic and
  /// LayerNormalization; 20 writes the Gelu op.
  int64_t opset = 17;
  /// Initializers go to "<file>_data" beside the graph (ONNX external data) when they total more than this many
  /// bytes; protobuf cannot serialise a message of 2 GiB or more.
  int64_t external_data_threshold = int64_t{1} << 31;
};

/// What was written, for reports.
struct ExportReport {
  std::string path;           ///< the .onnx file
  std::string external_data;  ///< the external data file, empty when the initializers are inline
  int64_t nodes = 0;          ///< ONNX nodes in the graph
  int64_t initializers = 0;   ///< parameters written as initializers
};

/// Writes `model`'s inference graph to `path` (a .onnx file): inputs input_ids, attention_mask, token_type_ids for
/// BERT and position_ids for Llama-family causal LMs and base models (as Optimum exports them), all int64
/// (batch_size, sequence_length); outputs named as Hugging Face Optimum names them (logits; start_logits and
/// end_logits for question answering; last_hidden_state for a base model). Other position ids, the rotary tables
/// and the pooled row are computed inside the graph as the model computes them. Parameters are
/// initializers under their transformers names. Throws Error naming the op when the graph holds one ONNX export
/// does not cover, and before anything is written.
ExportReport export_onnx(const models::Model& model, const std::string& path, const ExportOptions& options = {});

}  // namespace fusetrain::onnx_export
