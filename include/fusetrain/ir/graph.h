// The graph IR: values (typed, shaped tensors) produced and consumed by nodes (ops).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/shape.h"
#include "fusetrain/ir/attrs.h"
#include "fusetrain/ir/op.h"

namespace fusetrain::ir {

using ValueId = int32_t;
using NodeId = int32_t;
constexpr int32_t kNone = -1;

/// Where a value comes from.
enum class ValueKind : uint8_t {
  Input,       ///< fed each step (token ids, labels, masks)
  Param,       ///< a trainable parameter, stored in the flat parameter buffer
  Activation,  ///< produced by a node
};

/// A tensor-valued SSA value. Every value has exactly one definition: a graph
/// input, a parameter, or one output of one node.
struct Value {
  ValueId id = kNone;
  Shape shape;
  DType dtype = DType::f32;
  ValueKind kind = ValueKind::Activation;
  NodeId producer = kNone;  ///< kNone for inputs and parameters
  int output_index = 0;     ///< which output of `producer`
  std::string name;
};

/// One application of an op.
struct Node {
  NodeId id = kNone;
  OpKind op = OpKind::Fill;
  std::vector<ValueId> inputs;
  std::vector<ValueId> outputs;
  Attrs attrs;
  std::string name;
};

/// A dataflow graph. Nodes are kept in an order where every input is defined
/// before it is used, so node order is a valid schedule. Adding a node infers
/// its output shapes and dtypes and throws Error (naming the op and the input
/// shapes) if the inputs do not fit the op.
class Graph {
 public:
  /// Declares a value fed by the caller each step.
  ValueId add_input(const std::string& name, Shape shape, DType dtype);
  /// Declares a trainable parameter.
  ValueId add_param(const std::string& name, Shape shape, DType dtype = DType::f32);
  /// Appends a node; returns its output values.
  std::vector<ValueId> add_node(OpKind op, std::vector<ValueId> inputs, Attrs attrs = {}, std::string name = "");
  /// Appends a single-output node; returns its output.
  ValueId add(OpKind op, std::vector<ValueId> inputs, Attrs attrs = {}, std::string name = "");
  /// Gives node `node` one more output of `shape` and `dtype` (for passes that turn a node into
  /// an op with more outputs); returns it. The graph is consistent again once the node's op,
  /// inputs and attributes infer that output too.
  ValueId add_node_output(NodeId node, Shape shape, DType dtype);
  /// Marks a value as a graph output: it stays readable after a step.
  void mark_output(ValueId v);

  const Value& value(ValueId id) const;
  Value& value(ValueId id);
  const Node& node(NodeId id) const;
  Node& node(NodeId id);
  const std::vector<Value>& values() const { return values_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<ValueId>& outputs() const { return outputs_; }
  bool is_output(ValueId v) const;
  /// Values of kind Input / Param, in declaration order.
  std::vector<ValueId> inputs() const;
  std::vector<ValueId> params() const;
  /// Finds an input or parameter by name; kNone if absent.
  ValueId find(const std::string& name) const;
  /// For each value, the nodes that read it (a node reading a value twice appears twice).
  std::vector<std::vector<NodeId>> consumers() const;

  /// Checks the invariants: arity, dtypes and shapes agree with inference, every
  /// value has a single producer, and the graph is acyclic. Throws Error on the
  /// first violation, naming the node.
  void verify() const;
  /// A readable listing: one line per input, parameter and node.
  std::string dump() const;
  /// "%12:f32(3, 17)" style label used in dumps and errors.
  std::string describe(ValueId v) const;

  /// Replaces the node list with `order` (a permutation of a subset of node ids,
  /// used by passes that reorder or drop nodes). Ids are renumbered.
  void reorder_nodes(const std::vector<NodeId>& order);

 private:
  ValueId new_value(const std::string& name, Shape shape, DType dtype, ValueKind kind);
  std::vector<Value> values_;
  std::vector<Node> nodes_;
  std::vector<ValueId> outputs_;
};

/// Inferred (shape, dtype) of one output.
struct TypedShape {
  Shape shape;
  DType dtype;
};

/// Infers the outputs of `op` applied to `inputs` with `attrs`; throws Error
/// naming the op, the node name and the input shapes if they are invalid.
std::vector<TypedShape> infer_outputs(const Graph& g, OpKind op, const std::vector<ValueId>& inputs, const Attrs& attrs,
                                      const std::string& node_name);

}  // namespace fusetrain::ir
