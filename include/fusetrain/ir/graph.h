// The graph IR: values (typed, shaped tensors) produced and consumed by nodes (ops).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
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
  Frozen,      ///< a parameter that does not train (LoRA's base weights): no gradient, f32 or bf16
  Activation,  ///< produced by a node
};

/// Which half of a training graph a node belongs to. Autodiff emits Backward nodes; a pass that
/// moves work into backward (recompute) inserts Backward nodes. Forward/backward membership is this
/// property of each node, never a position in the node list.
enum class Phase : uint8_t { Forward, Backward };

/// A tensor-valued SSA value. Every value has exactly one definition: a graph
/// input, a parameter, or one output of one node.
struct Value {
  ValueId id = kNone;
  Shape shape;
  DType dtype = DType::f32;
  ValueKind kind = ValueKind::Activation;
  NodeId producer = kNone;  ///< kNone for inputs and parameters
  int output_index = 0;     ///< which output of `producer`
  ValueId gradient_of = kNone;  ///< for a parameter's gradient (autodiff sets it): that parameter
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
  Phase phase = Phase::Forward;
};

/// A dataflow graph. Nodes are kept in an order where every input is defined
/// before it is used, so node order is a valid schedule. Adding a node infers
/// its output shapes and dtypes and throws Error (naming the op and the input
/// shapes) if the inputs do not fit the op.
///
/// Rewrites. References to nodes and values stay valid while nodes are added, and a NodeId
/// stays the same node until commit(): insert_before() and remove_node() only record where a
/// node goes (or that it goes), and commit() applies all of them at once, renumbers the nodes in
/// their new order and verifies the graph. The compiler commits after every pass.
class Graph {
 public:
  /// Declares a value fed by the caller each step.
  ValueId add_input(const std::string& name, Shape shape, DType dtype);
  /// Declares a trainable parameter.
  ValueId add_param(const std::string& name, Shape shape, DType dtype = DType::f32);
  /// Turns trainable parameter `v` into a frozen one stored in `dtype` (f32 or bf16): autodiff gives it no
  /// gradient. Readers that need another dtype must be rewritten by the caller before commit().
  void freeze(ValueId v, DType dtype);
  /// Turns frozen parameter `v` into packed bytes of `shape` (u8): a 4-bit quantised weight, which only the
  /// QuantizedLinear nodes that replace its readers may read.
  void freeze_packed(ValueId v, Shape shape);
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

  // ---- rewrites ----
  /// The phase given to nodes added from now on (autodiff sets Backward while it emits).
  void set_phase(Phase phase) { phase_ = phase; }
  Phase phase() const { return phase_; }
  /// Points every read of `from` (node inputs and graph outputs) at `to`; both must have the same
  /// shape and dtype. `except` (optional) keeps its reads: the node that computes `to` from `from`.
  void replace_all_uses(ValueId from, ValueId to, NodeId except = kNone);
  /// Points the reads of `from` by the nodes `which` accepts at `to`; returns how many changed.
  int replace_uses_if(ValueId from, ValueId to, const std::function<bool(const Node&)>& which);
  /// Adds a node that runs just before node `anchor` once committed, in `anchor`'s phase; several
  /// inserted before one anchor run in insertion order. Returns its outputs.
  std::vector<ValueId> insert_before(NodeId anchor, OpKind op, std::vector<ValueId> inputs, Attrs attrs = {},
                                     std::string name = "");
  /// Turns node `id` into another op on other inputs, keeping its outputs (and so every reader): the
  /// new op must infer the same shapes and dtypes for them. An op with more outputs gets new values for
  /// the extra ones.
  void set_op(NodeId id, OpKind op, std::vector<ValueId> inputs, Attrs attrs);
  /// Turns node `id` into `op` on `inputs` whose outputs are the existing values `outputs`, in order (the op must
  /// infer their shapes and dtypes), taken over from the nodes that made them: a fusion keeps every value its
  /// readers know. The nodes that made them go at the next commit() (the caller removes them), and an output of
  /// `id` left out of `outputs` must be read by nothing by then.
  void fuse_into(NodeId id, OpKind op, std::vector<ValueId> inputs, Attrs attrs, std::vector<ValueId> outputs);
  /// Marks node `id` for removal at the next commit(); nothing may read its outputs by then.
  void remove_node(NodeId id);
  bool is_removed(NodeId id) const {
    return id >= 0 && id < static_cast<NodeId>(removed_.size()) && removed_[static_cast<size_t>(id)];
  }
  /// Applies pending insertions and removals (see the class comment) and verifies the graph.
  /// Returns the number of nodes removed.
  int64_t commit();
  /// True while insertions or removals wait for commit().
  bool has_pending_edits() const { return !inserted_before_.empty() || removed_count_ > 0; }

  const Value& value(ValueId id) const;
  Value& value(ValueId id);
  const Node& node(NodeId id) const;
  Node& node(NodeId id);
  const std::deque<Value>& values() const { return values_; }
  const std::deque<Node>& nodes() const { return nodes_; }
  const std::vector<ValueId>& outputs() const { return outputs_; }
  bool is_output(ValueId v) const;
  /// Values of kind Input / Param, in declaration order.
  std::vector<ValueId> inputs() const;
  std::vector<ValueId> params() const;
  /// Values of kind Frozen, in declaration order.
  std::vector<ValueId> frozen() const;
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

  /// Replaces the node list with `order` (a permutation of a subset of node ids). Ids are
  /// renumbered. Passes use the rewrites above instead; commit() calls this.
  void reorder_nodes(const std::vector<NodeId>& order);

 private:
  ValueId new_value(const std::string& name, Shape shape, DType dtype, ValueKind kind);
  // Deques: a reference to a node or value survives appends.
  std::deque<Value> values_;
  std::deque<Node> nodes_;
  std::vector<ValueId> outputs_;
  Phase phase_ = Phase::Forward;
  std::multimap<NodeId, NodeId> inserted_before_;  // anchor -> nodes placed just before it
  std::vector<bool> removed_;
  int64_t removed_count_ = 0;
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
