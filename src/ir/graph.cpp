#include "fusetrain/ir/graph.h"

#include <algorithm>
#include <sstream>

#include "fusetrain/core/error.h"

namespace fusetrain::ir {

ValueId Graph::new_value(const std::string& name, Shape shape, DType dtype, ValueKind kind) {
  for (int64_t d : shape.dims()) FT_CHECK(d >= 0, "value \"", name, "\": negative extent in shape ", shape.to_string());
  Value v;
  v.id = static_cast<ValueId>(values_.size());
  v.shape = std::move(shape);
  v.dtype = dtype;
  v.kind = kind;
  v.name = name;
  values_.push_back(std::move(v));
  return values_.back().id;
}

ValueId Graph::add_input(const std::string& name, Shape shape, DType dtype) {
  FT_CHECK(find(name) == kNone, "graph input \"", name, "\" is declared twice");
  return new_value(name, std::move(shape), dtype, ValueKind::Input);
}

ValueId Graph::add_param(const std::string& name, Shape shape, DType dtype) {
  FT_CHECK(find(name) == kNone, "parameter \"", name, "\" is declared twice");
  FT_CHECK(is_floating(dtype), "parameter \"", name, "\" must be floating point, found ", dtype_name(dtype));
  return new_value(name, std::move(shape), dtype, ValueKind::Param);
}

void Graph::freeze(ValueId v, DType dtype) {
  Value& val = value(v);
  FT_CHECK(val.kind == ValueKind::Param || val.kind == ValueKind::Frozen, "freeze: ", describe(v),
           " is not a parameter");
  FT_CHECK(dtype == DType::f32 || dtype == DType::bf16, "freeze: \"", val.name, "\" can be kept in f32 or bf16, not ",
           dtype_name(dtype));
  val.kind = ValueKind::Frozen;
  val.dtype = dtype;
}

void Graph::freeze_packed(ValueId v, Shape shape) {
  Value& val = value(v);
  FT_CHECK(val.kind == ValueKind::Frozen, "freeze_packed: ", describe(v), " is not a frozen parameter");
  val.dtype = DType::u8;
  val.shape = std::move(shape);
}

std::vector<ValueId> Graph::add_node(OpKind op, std::vector<ValueId> inputs, Attrs attrs, std::string name) {
  for (ValueId v : inputs)
    FT_CHECK(v >= 0 && v < static_cast<ValueId>(values_.size()), op_name(op), ": input value id ", v,
             " does not exist in this graph");
  std::vector<TypedShape> outs = infer_outputs(*this, op, inputs, attrs, name);
  Node n;
  n.id = static_cast<NodeId>(nodes_.size());
  n.op = op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  n.name = name.empty() ? str(op_name(op), "_", n.id) : std::move(name);
  n.phase = phase_;
  for (size_t i = 0; i < outs.size(); ++i) {
    ValueId v =
        new_value(outs.size() == 1 ? n.name : str(n.name, ":", i), outs[i].shape, outs[i].dtype, ValueKind::Activation);
    values_[static_cast<size_t>(v)].producer = n.id;
    values_[static_cast<size_t>(v)].output_index = static_cast<int>(i);
    n.outputs.push_back(v);
  }
  nodes_.push_back(std::move(n));
  return nodes_.back().outputs;
}

ValueId Graph::add(OpKind op, std::vector<ValueId> inputs, Attrs attrs, std::string name) {
  std::vector<ValueId> outs = add_node(op, std::move(inputs), std::move(attrs), std::move(name));
  FT_CHECK(outs.size() == 1, op_name(op), " has ", outs.size(), " outputs; use add_node");
  return outs[0];
}

ValueId Graph::add_node_output(NodeId node, Shape shape, DType dtype) {
  Node& n = this->node(node);
  const ValueId v = new_value(str(n.name, ":", n.outputs.size()), std::move(shape), dtype, ValueKind::Activation);
  values_[static_cast<size_t>(v)].producer = node;
  values_[static_cast<size_t>(v)].output_index = static_cast<int>(n.outputs.size());
  n.outputs.push_back(v);
  return v;
}

void Graph::replace_all_uses(ValueId from, ValueId to, NodeId except) {
  const Value& a = value(from);
  const Value& b = value(to);
  FT_CHECK(a.shape == b.shape && a.dtype == b.dtype, "replace_all_uses: ", describe(from), " and ", describe(to),
           " differ in shape or dtype");
  for (Node& n : nodes_)
    if (n.id != except)
      for (ValueId& in : n.inputs)
        if (in == from) in = to;
  for (ValueId& out : outputs_)
    if (out == from) out = to;
}

int Graph::replace_uses_if(ValueId from, ValueId to, const std::function<bool(const Node&)>& which) {
  FT_CHECK(value(from).shape == value(to).shape && value(from).dtype == value(to).dtype, "replace_uses_if: ",
           describe(from), " and ", describe(to), " differ in shape or dtype");
  int changed = 0;
  for (Node& n : nodes_) {
    if (is_removed(n.id) || !which(n)) continue;
    for (ValueId& in : n.inputs)
      if (in == from) {
        in = to;
        ++changed;
      }
  }
  return changed;
}

std::vector<ValueId> Graph::insert_before(NodeId anchor, OpKind op, std::vector<ValueId> inputs, Attrs attrs,
                                          std::string name) {
  const Phase saved = phase_;
  phase_ = node(anchor).phase;
  std::vector<ValueId> outs = add_node(op, std::move(inputs), std::move(attrs), std::move(name));
  phase_ = saved;
  inserted_before_.emplace(anchor, static_cast<NodeId>(nodes_.size() - 1));
  return outs;
}

void Graph::set_op(NodeId id, OpKind op, std::vector<ValueId> inputs, Attrs attrs) {
  Node& n = node(id);
  std::vector<TypedShape> outs = infer_outputs(*this, op, inputs, attrs, n.name);
  FT_CHECK(outs.size() >= n.outputs.size(), "set_op: node ", n.name, " has ", n.outputs.size(), " outputs but ",
           op_name(op), " gives ", outs.size());
  for (size_t k = 0; k < n.outputs.size(); ++k) {
    const Value& v = values_[static_cast<size_t>(n.outputs[k])];
    FT_CHECK(v.shape == outs[k].shape && v.dtype == outs[k].dtype, "set_op: node ", n.name, " as ", op_name(op),
             " would turn output ", describe(n.outputs[k]), " into ", dtype_name(outs[k].dtype),
             outs[k].shape.to_string());
  }
  n.op = op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  for (size_t k = n.outputs.size(); k < outs.size(); ++k) add_node_output(id, outs[k].shape, outs[k].dtype);
}

void Graph::fuse_into(NodeId id, OpKind op, std::vector<ValueId> inputs, Attrs attrs, std::vector<ValueId> outputs) {
  Node& n = node(id);
  std::vector<TypedShape> outs = infer_outputs(*this, op, inputs, attrs, n.name);
  FT_CHECK(outs.size() == outputs.size(), "fuse_into: ", op_name(op), " gives ", outs.size(), " outputs, not ",
           outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Value& v = value(outputs[k]);
    FT_CHECK(v.shape == outs[k].shape && v.dtype == outs[k].dtype, "fuse_into: node ", n.name, " as ", op_name(op),
             " would turn output ", describe(outputs[k]), " into ", dtype_name(outs[k].dtype),
             outs[k].shape.to_string());
  }
  n.op = op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  n.outputs = std::move(outputs);
  for (size_t k = 0; k < n.outputs.size(); ++k) {
    Value& v = values_[static_cast<size_t>(n.outputs[k])];
    v.producer = id;
    v.output_index = static_cast<int>(k);
  }
}

void Graph::remove_node(NodeId id) {
  node(id);  // checks the id
  if (removed_.size() < nodes_.size()) removed_.resize(nodes_.size(), false);
  if (!removed_[static_cast<size_t>(id)]) ++removed_count_;
  removed_[static_cast<size_t>(id)] = true;
}

int64_t Graph::commit() {
  if (!has_pending_edits()) return 0;
  std::vector<NodeId> order;
  order.reserve(nodes_.size());
  std::vector<bool> placed(nodes_.size(), false);
  for (const auto& [anchor, inserted] : inserted_before_) placed[static_cast<size_t>(inserted)] = true;
  // Nodes inserted before an inserted node run with it; chains resolve depth-first on an explicit stack (a chain is
  // as long as the passes make it).
  std::vector<std::pair<NodeId, bool>> stack;  // (node, its inserted nodes already emitted)
  auto emit = [&](NodeId root) {
    stack.assign(1, {root, false});
    while (!stack.empty()) {
      const auto [id, ready] = stack.back();
      stack.pop_back();
      if (ready) {
        if (!is_removed(id)) order.push_back(id);
        continue;
      }
      stack.push_back({id, true});
      auto [lo, hi] = inserted_before_.equal_range(id);
      const size_t first = stack.size();
      for (auto it = lo; it != hi; ++it) stack.push_back({it->second, false});
      std::reverse(stack.begin() + std::ptrdiff_t(first), stack.end());  // the first inserted runs first
    }
  };
  for (NodeId id = 0; id < static_cast<NodeId>(nodes_.size()); ++id)
    if (!placed[static_cast<size_t>(id)]) emit(id);
  const int64_t removed = removed_count_;
  inserted_before_.clear();
  removed_.clear();
  removed_count_ = 0;
  reorder_nodes(order);
  verify();
  return removed;
}

void Graph::mark_output(ValueId v) {
  FT_CHECK(v >= 0 && v < static_cast<ValueId>(values_.size()), "mark_output: value id ", v, " does not exist");
  if (!is_output(v)) outputs_.push_back(v);
}

const Value& Graph::value(ValueId id) const {
  FT_CHECK(id >= 0 && id < static_cast<ValueId>(values_.size()), "value id ", id, " does not exist");
  return values_[static_cast<size_t>(id)];
}
Value& Graph::value(ValueId id) {
  FT_CHECK(id >= 0 && id < static_cast<ValueId>(values_.size()), "value id ", id, " does not exist");
  return values_[static_cast<size_t>(id)];
}
const Node& Graph::node(NodeId id) const {
  FT_CHECK(id >= 0 && id < static_cast<NodeId>(nodes_.size()), "node id ", id, " does not exist");
  return nodes_[static_cast<size_t>(id)];
}
Node& Graph::node(NodeId id) {
  FT_CHECK(id >= 0 && id < static_cast<NodeId>(nodes_.size()), "node id ", id, " does not exist");
  return nodes_[static_cast<size_t>(id)];
}

bool Graph::is_output(ValueId v) const {
  for (ValueId o : outputs_)
    if (o == v) return true;
  return false;
}

std::vector<ValueId> Graph::inputs() const {
  std::vector<ValueId> out;
  for (const Value& v : values_)
    if (v.kind == ValueKind::Input) out.push_back(v.id);
  return out;
}

std::vector<ValueId> Graph::params() const {
  std::vector<ValueId> out;
  for (const Value& v : values_)
    if (v.kind == ValueKind::Param) out.push_back(v.id);
  return out;
}

std::vector<ValueId> Graph::frozen() const {
  std::vector<ValueId> out;
  for (const Value& v : values_)
    if (v.kind == ValueKind::Frozen) out.push_back(v.id);
  return out;
}

ValueId Graph::find(const std::string& name) const {
  for (const Value& v : values_)
    if (v.kind != ValueKind::Activation && v.name == name) return v.id;
  return kNone;
}

std::vector<std::vector<NodeId>> Graph::consumers() const {
  std::vector<std::vector<NodeId>> out(values_.size());
  for (const Node& n : nodes_)
    for (ValueId v : n.inputs) out[static_cast<size_t>(v)].push_back(n.id);
  return out;
}

void Graph::verify() const {
  FT_CHECK(!has_pending_edits(), "verify: the graph has insertions or removals not yet applied (call commit())");
  std::vector<NodeId> producer(values_.size(), kNone);
  std::vector<bool> defined(values_.size(), false);
  for (const Value& v : values_) {
    if (v.kind != ValueKind::Activation) {
      FT_CHECK(v.producer == kNone, "value ", describe(v.id), " is an input or parameter but has a producer");
      defined[static_cast<size_t>(v.id)] = true;
    }
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    const OpInfo& info = op_info(n.op);
    std::string where = str("node ", n.name, " (", info.name, ")");
    FT_CHECK(n.id == static_cast<NodeId>(i), where, ": id ", n.id, " does not match its position ", i);
    for (ValueId v : n.inputs) {
      FT_CHECK(v >= 0 && v < static_cast<ValueId>(values_.size()), where, ": input id ", v, " does not exist");
      FT_CHECK(defined[static_cast<size_t>(v)], where, ": reads ", describe(v),
               " before it is defined (the graph has a cycle or is out of order)");
    }
    std::vector<TypedShape> expected = infer_outputs(*this, n.op, n.inputs, n.attrs, n.name);
    FT_CHECK(expected.size() == n.outputs.size(), where, ": has ", n.outputs.size(), " outputs, expected ",
             expected.size());
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      ValueId v = n.outputs[k];
      FT_CHECK(v >= 0 && v < static_cast<ValueId>(values_.size()), where, ": output id ", v, " does not exist");
      const Value& val = values_[static_cast<size_t>(v)];
      FT_CHECK(producer[static_cast<size_t>(v)] == kNone && val.kind == ValueKind::Activation, where, ": output ",
               describe(v), " already has a definition");
      FT_CHECK(val.producer == n.id && val.output_index == static_cast<int>(k), where, ": output ", describe(v),
               " does not point back at this node");
      FT_CHECK(val.shape == expected[k].shape && val.dtype == expected[k].dtype, where, ": output ", k, " is ",
               dtype_name(val.dtype), val.shape.to_string(), " but the op produces ", dtype_name(expected[k].dtype),
               expected[k].shape.to_string());
      producer[static_cast<size_t>(v)] = n.id;
      defined[static_cast<size_t>(v)] = true;
    }
  }
  for (ValueId v : outputs_)
    FT_CHECK(defined[static_cast<size_t>(v)], "graph output ", describe(v), " has no definition");
}

std::string Graph::describe(ValueId id) const {
  const Value& v = value(id);
  return str("%", id, (v.name.empty() ? "" : str(" \"", v.name, "\"")), ":", dtype_name(v.dtype), v.shape.to_string());
}

std::string Graph::dump() const {
  std::ostringstream out;
  auto label = [&](ValueId id) {
    const Value& v = values_[static_cast<size_t>(id)];
    return str("%", id, ":", dtype_name(v.dtype), v.shape.to_string());
  };
  for (const Value& v : values_) {
    if (v.kind == ValueKind::Input) out << "input " << label(v.id) << " \"" << v.name << "\"\n";
    if (v.kind == ValueKind::Param) out << "param " << label(v.id) << " \"" << v.name << "\"\n";
    if (v.kind == ValueKind::Frozen) out << "frozen " << label(v.id) << " \"" << v.name << "\"\n";
  }
  for (const Node& n : nodes_) {
    for (size_t k = 0; k < n.outputs.size(); ++k) out << (k ? ", " : "") << label(n.outputs[k]);
    out << " = " << op_name(n.op) << '(';
    for (size_t k = 0; k < n.inputs.size(); ++k) out << (k ? ", " : "") << '%' << n.inputs[k];
    out << ')';
    if (!n.attrs.items().empty()) out << " {" << n.attrs.to_string() << '}';
    out << "  # " << n.name << '\n';
  }
  out << "outputs:";
  for (ValueId v : outputs_) out << " %" << v;
  out << '\n';
  return out.str();
}

void Graph::reorder_nodes(const std::vector<NodeId>& order) {
  std::deque<Node> nodes;
  for (NodeId id : order) nodes.push_back(std::move(nodes_[static_cast<size_t>(id)]));
  for (Value& v : values_)
    if (v.kind == ValueKind::Activation) v.producer = kNone;
  for (size_t i = 0; i < nodes.size(); ++i) {
    nodes[i].id = static_cast<NodeId>(i);
    for (size_t k = 0; k < nodes[i].outputs.size(); ++k) {
      Value& v = values_[static_cast<size_t>(nodes[i].outputs[k])];
      v.producer = nodes[i].id;
      v.output_index = static_cast<int>(k);
    }
  }
  nodes_ = std::move(nodes);
}

}  // namespace fusetrain::ir
