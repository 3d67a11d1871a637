// ONNX import's host evaluator: the nodes of an imported graph that read no parameter (shape arithmetic,
// constants, and what derives from the batch alone: attention masks, position ids, pooled rows) run here, on
// small host tensors, once per batch shape (constants) or once per batch (batch-derived values), never in the
// compiled plan.
#pragma once

#include <onnx/onnx_pb.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fusetrain::onnx_import {

/// The element types the evaluator computes in: every ONNX float type is read as f32, every integer type as
/// i64, bool as Bool (held in the i64 storage as 0/1).
enum class HostType : uint8_t { F32, I64, Bool };

/// The most elements one host tensor may hold (16 GiB of f32): a larger one is refused by HostTensor::zeros.
constexpr int64_t kMaxHostElements = int64_t{1} << 32;

/// Throws Error naming `what` unless `shape`'s extents are non-negative and their product (zeros left out) is at
/// most kMaxHostElements: every stride and row count computed from such a shape fits 64 bits.
void check_host_shape(const std::vector<int64_t>& shape, const std::string& what);

/// A dense row-major host tensor.
struct HostTensor {
  HostType type = HostType::F32;
  std::vector<int64_t> shape;
  std::vector<float> f;    ///< F32 values
  std::vector<int64_t> i;  ///< I64 and Bool values

  int64_t numel() const;
  bool is_float() const { return type == HostType::F32; }
  /// Element k as a double (any type).
  double at(int64_t k) const { return is_float() ? double(f[size_t(k)]) : double(i[size_t(k)]); }
  /// The values as integers (floats truncated), for shape, axis and index operands.
  std::vector<int64_t> ints() const;
  /// Throws Error for a shape whose count overflows or exceeds kMaxHostElements, or when memory runs out.
  static HostTensor zeros(HostType type, std::vector<int64_t> shape);
  static HostTensor scalar_f32(float v);
  static HostTensor vector_i64(std::vector<int64_t> v);
};

/// "(2, 3)".
std::string shape_string(const std::vector<int64_t>& shape);

/// "FLOAT", "INT64", ...; "element type N" for a number ONNX does not define.
std::string data_type_name(int32_t elem);

/// Reads an ONNX TensorProto (raw or typed fields; external data from files under `dir`). Throws Error naming
/// the tensor for an element type the importer does not read, or a declared shape whose size overflows or differs
/// from the data present (checked before anything is allocated).
HostTensor read_tensor(const onnx::TensorProto& t, const std::string& dir);

/// Whether the evaluator implements `op_type` (default domain).
bool host_supports(const std::string& op_type);

/// Evaluates one node on host tensors (null for an omitted optional input). Throws Error naming the node for
/// an attribute or operand it cannot take.
std::vector<HostTensor> eval_host(const onnx::NodeProto& node, const std::vector<const HostTensor*>& inputs);

/// numpy broadcasting of two shapes; throws Error naming `where` when they do not broadcast.
std::vector<int64_t> broadcast_shapes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                                      const std::string& where);

/// ONNX Reshape's target for an input of `in`: 0 copies the input's extent (unless allowzero), one -1 is
/// inferred. Throws Error naming `node` when the element counts differ.
std::vector<int64_t> onnx_reshape_target(const std::vector<int64_t>& in, const std::vector<int64_t>& target,
                                         bool allowzero, const onnx::NodeProto& node);
/// The shapes Squeeze (no axes: every extent 1), Unsqueeze and Flatten produce.
std::vector<int64_t> squeeze_shape(const std::vector<int64_t>& shape, const std::vector<int64_t>& axes,
                                   const onnx::NodeProto& node);
std::vector<int64_t> unsqueeze_shape(const std::vector<int64_t>& shape, const std::vector<int64_t>& axes,
                                     const onnx::NodeProto& node);
std::vector<int64_t> flatten_shape(const std::vector<int64_t>& shape, int64_t axis, const onnx::NodeProto& node);

/// An integer attribute of `node`, or `fallback`.
int64_t attr_int(const onnx::NodeProto& node, const std::string& name, int64_t fallback);
/// A float attribute of `node`, or `fallback`.
float attr_float(const onnx::NodeProto& node, const std::string& name, float fallback);
/// A string attribute of `node`, or `fallback`.
std::string attr_string(const onnx::NodeProto& node, const std::string& name, const std::string& fallback);
/// An integer-list attribute of `node` (empty when absent).
std::vector<int64_t> attr_ints(const onnx::NodeProto& node, const std::string& name);
/// Whether `node` has attribute `name`.
bool has_attr(const onnx::NodeProto& node, const std::string& name);
/// "node 12 (Softmax \"/attn/Softmax\")": how errors name a node; a node torch.onnx's dynamo exporter wrote also
/// names its module ("... in module vit.embeddings.patch_embeddings.projection").
std::string node_label(const onnx::NodeProto& node, int64_t index);

}  // namespace fusetrain::onnx_import
