// ONNX import: train a graph exported to ONNX (import_model), and write the trained weights back into the same
// graph.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fusetrain::models {
class Model;
}

namespace fusetrain::onnx_import {

/// How an ONNX graph becomes a trainable model.
struct ImportOptions {
  /// Float initializers to keep fixed (constants instead of parameters). Every other float initializer with more
  /// than one element is a parameter; integer, bool and single-element initializers are always constants.
  std::vector<std::string> frozen;
  /// Values replacing float initializers' (by name, each with the initializer's element count): a captured
  /// model's frozen weights and buffers, where the cached graph holds those of the model it was captured from.
  std::map<std::string, std::vector<float>> values;
  /// The row of each embedding table (by initializer name) that gets no gradient: nn.Embedding's padding_idx, which
  /// an ONNX Gather does not record (-1: none). A table not named here takes config.json's pad_token_id where
  /// transformers declares padding_idx on such a table (word embeddings of BERT-like models, ...).
  std::map<std::string, int64_t> padding_rows;
  /// Trains a float initializer equal to an earlier one, or to its transpose, as that parameter. Exporters that
  /// fold the transpose of a shared weight write a copy per use (a tied LM head next to its word embeddings,
  /// ALBERT's shared layer); tying restores the sharing, as PyTorch trains it. Tensors of one repeated value (a
  /// fresh bias or norm weight) are never tied: they are equal by chance.
  bool tie_identical = true;
  /// Recognises attention as exporters decompose it (MatMul, scale, Add of the mask, Softmax, MatMul) and runs it
  /// as one Attention op. Its mask must then be a key-padding mask, plus a causal one where the graph has it
  /// (every transformers model's is); off computes the graph's ops as written.
  bool fuse_attention = true;
  /// Keeps constant a float initializer whose every path to the outputs passes through a node that only the host
  /// can evaluate (the Cos and Sin of rotary angles): a buffer the exporter wrote like a weight, such as Llama's
  /// rotary inv_freq. An initializer read as an embedding table (Gather's data) stays a parameter. Off, such a
  /// graph is refused, listing those nodes. constant_buffers() names what was kept constant.
  bool keep_buffers_constant = true;
};

/// A graph exported to ONNX (torch.onnx.export, fusetrain export, Optimum, fusetrain.capture), trained as `task`
/// ("seq-cls", "token-cls", "qa", "mlm", "clm"): its float initializers are the parameters (but those named in
/// `frozen`), the task's loss is appended to its logits, and it compiles through the same passes as a built model.
/// config.json beside the file, when present, gives num_labels, problem_type and max_position_embeddings;
/// fusetrain_capture.json, written beside a graph the command line's capture prepared, adds its frozen initializers
/// and embedding padding rows to `options` ({"frozen": [names], "padding_rows": {name: row}}).
/// Throws Error listing every node whose op fusetrain cannot import.
std::unique_ptr<models::Model> import_model(const std::string& path, const std::string& task,
                                           const ImportOptions& options = {});

/// Writes the ONNX graph `model` was imported from to `path` with its current parameters as the initializers
/// (everything else as read). Throws Error for a model not imported from ONNX, or one whose weights hold inf or
/// NaN (nothing is written then).
void save_onnx(const models::Model& model, const std::string& path);

/// The number of nodes of the ONNX graph `model` was imported from (0 for a model built natively).
int64_t graph_nodes(const models::Model& model);

/// The float initializers ImportOptions::keep_buffers_constant kept constant (empty for a model built natively).
std::vector<std::string> constant_buffers(const models::Model& model);

}  // namespace fusetrain::onnx_import
