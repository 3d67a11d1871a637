// ONNX import's validator: a ModelProto is checked against the ONNX specification before anything is built from it,
// so that every later step (the value lookup, the host evaluator, the op mapping) may assume a well-formed graph.
#pragma once

#include <onnx/onnx_pb.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fusetrain::onnx_import {

/// The newest default-domain opset the importer reads, and the oldest.
int max_supported_opset();
constexpr int kMinSupportedOpset = 13;

/// Checks `model` (read from `path`, named in messages) before anything is built from it: IR version and opsets
/// within what the importer reads; unique initializer, input and output names; every node in topological order
/// (a cycle, or a value read before the node writing it, is refused naming both); each node's input and output
/// counts and attributes against its operator's ONNX schema at the graph's opset (the table generated from the ONNX
/// project's schema registry, scripts/gen_onnx_schemas.py); and every initializer's declared size against the data
/// it holds. Throws Error naming the node or tensor, for the first problem found. Loops only: no recursion on the
/// graph's structure.
void validate_model(const onnx::ModelProto& model, const std::string& path);

/// The element count of a tensor of extents `dims`. Throws Error naming `what` for a negative extent or a count
/// that overflows 64 bits.
int64_t checked_numel(const std::vector<int64_t>& dims, const std::string& what);

}  // namespace fusetrain::onnx_import
