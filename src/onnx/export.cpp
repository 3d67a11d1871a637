// ONNX export of a model's inference graph.
//
// The graph is the one the model trains (models::Model::build), op for op: each IR op maps to standard ONNX ops
// (an IR op the table does not cover is refused, naming it). The IR is built for one batch shape; ONNX wants
// dynamic batch and sequence axes. So the graph is built twice, at two shapes, and every extent that differs
// between the two is solved as k·B, k·T or k·B·T; those extents are computed at run time from input_ids' shape.
#include "fusetrain/onnx/export.h"
#include "fusetrain/onnx/import.h"

#include <onnx/onnx_pb.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <variant>

#include "fusetrain/core/error.h"
#include "fusetrain/ir/graph.h"
#include "fusetrain/io/safetensors.h"
#include "fusetrain/ir/params.h"
#include "fusetrain/models/model.h"
#include "models/family.h"

namespace fusetrain::onnx_export {
namespace {

namespace pb = ::onnx;
using ir::ValueId;

// The two shapes the graph is built at. Their extents and products are distinct, so an extent of k·B, k·T or
// k·B·T has exactly one reading.
constexpr int64_t kB1 = 3, kT1 = 5, kB2 = 4, kT2 = 7;

/// An extent k·B^b·T^t (b, t in {0, 1}).
struct Dim {
  int64_t k = 0;
  int b = 0, t = 0;
  bool symbolic() const { return b != 0 || t != 0; }
  bool operator==(const Dim&) const = default;
};

Dim solve(int64_t d1, int64_t d2, const std::string& where) {
  if (d1 == d2) return {d1, 0, 0};
  for (auto [b, t] : {std::pair{1, 0}, {0, 1}, {1, 1}}) {
    const int64_t p1 = (b ? kB1 : 1) * (t ? kT1 : 1), p2 = (b ? kB2 : 1) * (t ? kT2 : 1);
    if (d1 % p1 == 0 && d2 % p2 == 0 && d1 / p1 == d2 / p2) return {d1 / p1, b, t};
  }
  throw Error(str("ONNX export: an extent of ", where, " is ", d1, " at batch ", kB1, " x sequence ", kT1, " and ",
                  d2, " at ", kB2, " x ", kT2, "; expected a multiple of the batch size, the sequence length or "
                  "their product"));
}

int32_t onnx_type(DType t) {
  switch (t) {
    case DType::f32:
      return pb::TensorProto::FLOAT;
    case DType::bf16:
      return pb::TensorProto::BFLOAT16;
    case DType::f16:
      return pb::TensorProto::FLOAT16;
    case DType::i64:
      return pb::TensorProto::INT64;
    case DType::i32:
      return pb::TensorProto::INT32;
    case DType::u8:
      return pb::TensorProto::UINT8;
  }
  return pb::TensorProto::UNDEFINED;
}

class Writer {
 public:
  Writer(const models::Model& model, const ExportOptions& options)
      : model_(model), options_(options), g1_(build(model, kB1, kT1)), g2_(build(model, kB2, kT2)) {
    FT_CHECK(options.opset >= 17 && options.opset <= 20, "ONNX export: opset ", options.opset,
             " is not supported; expected 17 to 20");
    FT_CHECK(g1_.graph.nodes().size() == g2_.graph.nodes().size() &&
                 g1_.graph.values().size() == g2_.graph.values().size(),
             "ONNX export: the model builds different graphs for different batch shapes");
  }

  pb::ModelProto write() {
    pb::ModelProto proto;
    proto.set_ir_version(options_.opset >= 19 ? 9 : 8);
    proto.set_producer_name("fusetrain");
    proto.set_producer_version(FUSETRAIN_VERSION);
    pb::OperatorSetIdProto* opset = proto.add_opset_import();
    opset->set_domain("");
    opset->set_version(options_.opset);
    graph_ = proto.mutable_graph();
    graph_->set_name(model_.architecture());

    const ir::Graph& g = g1_.graph;
    std::vector<std::pair<std::string, ValueId>> outputs;
    const models::Head head = model_.architecture_info().head;
    if (head == models::Head::QuestionAnswering) {
      outputs = {{"start_logits", g1_.logits}, {"end_logits", g1_.end_logits}};
    } else {
      outputs = {{head == models::Head::Base ? "last_hidden_state" : "logits", g1_.logits}};
    }
    live_ = live_nodes(outputs);
    std::set<ValueId> read;  // the values the live nodes read
    for (const ir::Node& n : g.nodes())
      if (live_[static_cast<size_t>(n.id)]) read.insert(n.inputs.begin(), n.inputs.end());

    for (ValueId v : g.inputs()) {
      const std::string& name = g.value(v).name;
      if (!read.count(v)) continue;
      if (name == models::InputNames::input_ids || name == models::InputNames::attention_mask ||
          (name == models::InputNames::token_type_ids && token_types_are_input())) {
        names_[v] = name;
      } else if (name == models::InputNames::token_type_ids) {  // RoBERTa's single segment
        names_[v] = op("ConstantOfShape", {shape_of_ids()});
        fill_value(last_, pb::TensorProto::INT64, 0);
      } else if (name == models::InputNames::position_ids) {
        names_[v] = position_ids();
      } else if (name == models::InputNames::pool_index) {
        names_[v] = pool_index();
      } else if (name == models::InputNames::rope_cos || name == models::InputNames::rope_sin) {
        names_[v] = rotary_table(name == models::InputNames::rope_sin);
      } else {
        throw Error(str("ONNX export: the inference graph reads input \"", name, "\", which export cannot derive"));
      }
    }
    // input_ids and attention_mask are always inputs (Optimum feeds both); token_type_ids and position_ids as
    // Optimum has them.
    declare_input(models::InputNames::input_ids);
    declare_input(models::InputNames::attention_mask);
    if (g.find(models::InputNames::token_type_ids) != ir::kNone && token_types_are_input())
      declare_input(models::InputNames::token_type_ids);
    if (model_.derived_inputs().position_ids_input) declare_input(models::InputNames::position_ids);

    for (ValueId v : g.params())
      if (read.count(v)) names_[v] = g.value(v).name;
    for (const ir::Node& n : g.nodes())
      if (live_[static_cast<size_t>(n.id)]) lower(n);

    for (const auto& [name, v] : outputs) {
      node("Identity", {name_of(v)}, {name});
      pb::ValueInfoProto* out = graph_->add_output();
      out->set_name(name);
      set_type(*out, g.value(v).dtype, dims(v));
    }
    return proto;
  }

  /// The parameters the graph reads, in declaration order.
  std::vector<ValueId> initializer_values() const {
    std::vector<ValueId> out;
    for (ValueId v : g1_.graph.params())
      if (names_.count(v)) out.push_back(v);
    return out;
  }
  const ir::Graph& graph() const { return g1_.graph; }

 private:
  static models::BuiltGraph build(const models::Model& model, int64_t B, int64_t T) {
    models::BatchSpec spec;
    spec.batch = B;
    spec.seq = T;
    spec.attention_mask = true;
    spec.token_type_ids = model.uses_token_type_ids();
    spec.fusions = false;
    spec.every_window = true;
    return model.build(spec);
  }

  // Nodes that the outputs depend on.
  std::vector<bool> live_nodes(const std::vector<std::pair<std::string, ValueId>>& outputs) const {
    const ir::Graph& g = g1_.graph;
    std::vector<bool> live(g.nodes().size(), false);
    std::vector<ValueId> work;
    for (const auto& [name, v] : outputs) {
      FT_CHECK(v != ir::kNone, "ONNX export: ", model_.architecture(), " builds no ", name);
      work.push_back(v);
    }
    std::set<ValueId> seen;
    while (!work.empty()) {
      const ValueId v = work.back();
      work.pop_back();
      if (!seen.insert(v).second) continue;
      const ir::NodeId p = g.value(v).producer;
      if (p == ir::kNone || live[static_cast<size_t>(p)]) continue;
      live[static_cast<size_t>(p)] = true;
      for (ValueId in : g.node(p).inputs) work.push_back(in);
    }
    return live;
  }

  // Optimum's ONNX configs give BERT a token_type_ids input and RoBERTa none (its one segment is all zeros).
  bool token_types_are_input() const { return model_.model_type() == "bert"; }

  std::vector<Dim> dims(ValueId v) const {
    const Shape& s1 = g1_.graph.value(v).shape;
    const Shape& s2 = g2_.graph.value(v).shape;
    FT_CHECK(s1.rank() == s2.rank(), "ONNX export: ", g1_.graph.describe(v), " changes rank with the batch shape");
    std::vector<Dim> out;
    for (int64_t i = 0; i < s1.rank(); ++i) out.push_back(solve(s1[i], s2[i], g1_.graph.describe(v)));
    return out;
  }

  void set_type(pb::ValueInfoProto& info, DType dtype, const std::vector<Dim>& shape) {
    pb::TypeProto_Tensor* t = info.mutable_type()->mutable_tensor_type();
    t->set_elem_type(onnx_type(dtype));
    pb::TensorShapeProto* s = t->mutable_shape();
    for (const Dim& d : shape) {
      pb::TensorShapeProto_Dimension* dim = s->add_dim();
      if (!d.symbolic())
        dim->set_dim_value(d.k);
      else if (d.k == 1 && d.b && !d.t)
        dim->set_dim_param("batch_size");
      else if (d.k == 1 && d.t && !d.b)
        dim->set_dim_param("sequence_length");
    }
  }

  void declare_input(const char* name) {
    pb::ValueInfoProto* in = graph_->add_input();
    in->set_name(name);
    set_type(*in, DType::i64, {{1, 1, 0}, {1, 0, 1}});
  }

  // ---- emitting nodes ----

  std::string fresh(const std::string& hint) { return "/" + hint + "_" + std::to_string(counter_++); }

  pb::NodeProto* node(const char* op, const std::vector<std::string>& in, const std::vector<std::string>& out) {
    pb::NodeProto* n = graph_->add_node();
    n->set_op_type(op);
    n->set_name(fresh(op));
    for (const std::string& s : in) n->add_input(s);
    for (const std::string& s : out) n->add_output(s);
    return n;
  }
  // A node with one fresh output; returns its name.
  std::string op(const char* type, const std::vector<std::string>& in) {
    std::string out = fresh(std::string(type) + "_out");
    last_ = node(type, in, {out});
    return out;
  }
  static void attr(pb::NodeProto* n, const char* name, int64_t v) {
    pb::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(pb::AttributeProto::INT);
    a->set_i(v);
  }
  static void attr(pb::NodeProto* n, const char* name, double v) {
    pb::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(pb::AttributeProto::FLOAT);
    a->set_f(static_cast<float>(v));
  }
  static void attr(pb::NodeProto* n, const char* name, const std::string& v) {
    pb::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(pb::AttributeProto::STRING);
    a->set_s(v);
  }
  static void attr(pb::NodeProto* n, const char* name, const std::vector<int64_t>& v) {
    pb::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(pb::AttributeProto::INTS);
    for (int64_t x : v) a->add_ints(x);
  }

  // The tensor of node n's "value" attribute (Constant, ConstantOfShape), of element type `type`.
  static pb::TensorProto* value_attr(pb::NodeProto* n, int32_t type) {
    pb::AttributeProto* a = n->add_attribute();
    a->set_name("value");
    a->set_type(pb::AttributeProto::TENSOR);
    pb::TensorProto* t = a->mutable_t();
    t->set_data_type(type);
    return t;
  }
  // ConstantOfShape's fill: one element of `type`.
  static void fill_value(pb::NodeProto* n, int32_t type, double value) {
    pb::TensorProto* t = value_attr(n, type);
    t->add_dims(1);
    if (type == pb::TensorProto::INT64)
      t->add_int64_data(static_cast<int64_t>(value));
    else if (type == pb::TensorProto::FLOAT)
      t->add_float_data(static_cast<float>(value));
    else
      throw Error(str("ONNX export: a fill of element type ", type, " is not covered (f32 and i64 are)"));
  }

  std::string constant_i64(const std::vector<int64_t>& v, bool scalar = false) {
    std::string out = fresh("const");
    pb::TensorProto* t = value_attr(node("Constant", {}, {out}), pb::TensorProto::INT64);
    if (!scalar) t->add_dims(static_cast<int64_t>(v.size()));
    for (int64_t x : v) t->add_int64_data(x);
    return out;
  }
  std::string constant_f32(double v) {
    std::string out = fresh("const");
    value_attr(node("Constant", {}, {out}), pb::TensorProto::FLOAT)->add_float_data(static_cast<float>(v));
    return out;
  }
  std::string constant_f32(const std::vector<float>& v) {
    std::string out = fresh("const");
    pb::TensorProto* t = value_attr(node("Constant", {}, {out}), pb::TensorProto::FLOAT);
    t->add_dims(static_cast<int64_t>(v.size()));
    for (float x : v) t->add_float_data(x);
    return out;
  }

  // input_ids' extent along `axis` as a 1-element tensor (scalar: a 0-d one).
  std::string extent(int axis, bool scalar) {
    std::string& cached = scalar ? scalar_extent_[axis] : extent_[axis];
    if (cached.empty()) {
      if (scalar) {
        cached = op("Gather", {shape_of_ids(), constant_i64({axis}, true)});
      } else {
        cached = op("Shape", {models::InputNames::input_ids});
        attr(last_, "start", int64_t{axis});
        attr(last_, "end", int64_t{axis + 1});
      }
    }
    return cached;
  }
  std::string shape_of_ids() {
    if (ids_shape_.empty()) ids_shape_ = op("Shape", {models::InputNames::input_ids});
    return ids_shape_;
  }

  // A 1-element int64 tensor holding `d`.
  std::string dim_tensor(const Dim& d) {
    if (!d.symbolic()) return constant_i64({d.k});
    auto key = std::tuple{d.k, d.b, d.t};
    auto found = dim_cache_.find(key);
    if (found != dim_cache_.end()) return found->second;
    std::string out;
    if (d.b) out = extent(0, false);
    if (d.t) out = out.empty() ? extent(1, false) : op("Mul", {out, extent(1, false)});
    if (d.k != 1) out = op("Mul", {out, constant_i64({d.k})});
    return dim_cache_[key] = out;
  }
  std::string shape_tensor(const std::vector<Dim>& shape) {
    bool fixed = true;
    for (const Dim& d : shape) fixed = fixed && !d.symbolic();
    if (fixed) {
      std::vector<int64_t> v;
      for (const Dim& d : shape) v.push_back(d.k);
      return constant_i64(v);
    }
    std::vector<std::string> parts;
    for (const Dim& d : shape) parts.push_back(dim_tensor(d));
    std::string out = op("Concat", parts);
    attr(last_, "axis", int64_t{0});
    return out;
  }

  // Reduce* with its axes: an attribute before opset 18 (ReduceSum: 13), an input from then on.
  std::string reduce(const char* type, const std::string& x, const std::vector<int64_t>& axes, bool keepdims) {
    const bool axes_input = std::string(type) == "ReduceSum" || options_.opset >= 18;
    std::string out = axes_input ? op(type, {x, constant_i64(axes)}) : op(type, {x});
    if (!axes_input) attr(last_, "axes", axes);
    attr(last_, "keepdims", int64_t{keepdims ? 1 : 0});
    return out;
  }
  std::string transpose(const std::string& x, const std::vector<int64_t>& perm) {
    std::string out = op("Transpose", {x});
    attr(last_, "perm", perm);
    return out;
  }
  std::string cast(const std::string& x, int32_t to) {
    std::string out = op("Cast", {x});
    attr(last_, "to", int64_t{to});
    return out;
  }
  // 0 .. T-1 as a (1, T) int64 tensor.
  std::string positions_row() {
    std::string range = op("Range", {constant_i64({0}, true), extent(1, true), constant_i64({1}, true)});
    return op("Unsqueeze", {range, constant_i64({0})});
  }
  // 1 where input_ids is not `pad`, else 0, as int64.
  std::string not_pad(int64_t pad) {
    std::string is_pad = op("Equal", {models::InputNames::input_ids, constant_i64({pad}, true)});
    return cast(op("Not", {is_pad}), pb::TensorProto::INT64);
  }

  // The position ids the model uses when none are given (models::Family::default_position_ids).
  std::string position_ids() {
    const models::DerivedInputs d = model_.derived_inputs();
    if (!d.positions_past_padding)
      return op("Expand", {positions_row(), shape_of_ids()});
    // RoBERTa: count the non-padding tokens from pad + 1; padding keeps pad.
    std::string real = not_pad(d.pad_token_id);
    std::string count = op("CumSum", {real, constant_i64({1}, true)});
    return op("Add", {op("Mul", {count, real}), constant_i64({d.pad_token_id}, true)});
  }

  // rope_cos or rope_sin (B, T, D) as the model's host code fills them (RotaryRule): cos or sin of
  // position · inv_freq, an f32 product as transformers forms it, each half of D alike.
  std::string rotary_table(bool sine) {
    const models::DerivedInputs d = model_.derived_inputs();
    FT_CHECK(d.rotary.has_value(), "ONNX export: ", model_.architecture(), " reads rotary tables without a rule");
    const models::RotaryRule& r = *d.rotary;
    if (rotary_angles_.empty()) {
      const std::string ids = d.position_ids_input ? models::InputNames::position_ids : position_ids();
      std::string positions = cast(ids, pb::TensorProto::FLOAT);
      std::string inv = constant_f32(r.inv_freq);
      if (r.dynamic) inv = dynamic_inverse_frequencies(r, positions, inv);
      std::string angle = op("Mul", {op("Unsqueeze", {positions, constant_i64({2})}), inv});
      rotary_angles_ = op("Concat", {angle, angle});
      attr(last_, "axis", int64_t{-1});
    }
    std::string table = op(sine ? "Sin" : "Cos", {rotary_angles_});
    return r.attention_factor == 1.0 ? table : op("Mul", {table, constant_f32(r.attention_factor)});
  }

  // Dynamic NTK rope: inv_freq recomputed from the batch's largest position when it passes max_positions.
  std::string dynamic_inverse_frequencies(const models::RotaryRule& r, const std::string& positions,
                                          const std::string& within) {
    const double D = 2.0 * static_cast<double>(r.inv_freq.size()), P = static_cast<double>(r.max_positions);
    std::string longest = op("Add", {reduce("ReduceMax", positions, {0, 1}, false), constant_f32(1.0)});
    std::string ratio = op("Sub", {op("Mul", {longest, constant_f32(r.factor / P)}), constant_f32(r.factor - 1.0)});
    std::string base = op("Mul", {op("Pow", {ratio, constant_f32(D / (D - 2.0))}), constant_f32(r.theta)});
    std::vector<float> exponents;
    for (size_t j = 0; j < r.inv_freq.size(); ++j)
      exponents.push_back(static_cast<float>(2 * j) / static_cast<float>(D));
    std::string scaled = op("Reciprocal", {op("Pow", {base, constant_f32(exponents)})});
    return op("Where", {op("Greater", {longest, constant_f32(P)}), scaled, within});
  }

  // GPT-2 sequence classification: row b·T + t of the flattened scores, t each row's last non-padding token
  // (the last token without a pad id; 0 for a row of padding).
  std::string pool_index() {
    const models::DerivedInputs d = model_.derived_inputs();
    FT_CHECK(d.pool_last_non_pad, "ONNX export: ", model_.architecture(), " reads pool_index without a pooling rule");
    std::string last;
    if (d.pad_token_id < 0) {
      last = op("Sub", {extent(1, true), constant_i64({1}, true)});
    } else {
      std::string indexed = op("Mul", {not_pad(d.pad_token_id), positions_row()});
      last = reduce("ReduceMax", indexed, {1}, false);
    }
    std::string rows = op("Range", {constant_i64({0}, true), extent(0, true), constant_i64({1}, true)});
    return op("Add", {op("Mul", {rows, extent(1, true)}), last});
  }

  const std::string& name_of(ValueId v) {
    auto found = names_.find(v);
    if (found == names_.end())
      throw Error(str("ONNX export: ", g1_.graph.describe(v), " is read before it is written"));
    return found->second;
  }
  std::string in(const ir::Node& n, size_t i) { return name_of(n.inputs.at(i)); }
  void define(const ir::Node& n, size_t i, const std::string& name) { names_[n.outputs.at(i)] = name; }

  // Only output 0 of an op whose other outputs serve backward (LayerNorm's statistics, Attention's lse) may be read.
  void check_only_output0(const ir::Node& n) {
    for (size_t i = 1; i < n.outputs.size(); ++i)
      for (const ir::Node& m : g1_.graph.nodes())
        for (ValueId v : m.inputs)
          FT_CHECK(v != n.outputs[i] || !live_[static_cast<size_t>(m.id)], "ONNX export: ", op_name(n.op),
                   " output ", i, " is read by the inference graph; export writes only its first output");
  }

  std::string gelu(const std::string& x, ops::GeluApproximation form) {
    const bool tanh_form = form == ops::GeluApproximation::Tanh;
    if (options_.opset >= 20) {
      std::string out = op("Gelu", {x});
      attr(last_, "approximate", std::string(tanh_form ? "tanh" : "none"));
      return out;
    }
    std::string inner;
    if (tanh_form) {  // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
      std::string cube = op("Mul", {op("Mul", {x, x}), x});
      std::string poly = op("Add", {x, op("Mul", {cube, constant_f32(0.044715)})});
      inner = op("Tanh", {op("Mul", {poly, constant_f32(std::sqrt(2.0 / M_PI))})});
    } else {  // 0.5·x·(1 + erf(x/√2))
      inner = op("Erf", {op("Mul", {x, constant_f32(M_SQRT1_2)})});
    }
    return op("Mul", {op("Mul", {x, constant_f32(0.5)}), op("Add", {inner, constant_f32(1.0)})});
  }

  // softmax(q·kᵀ·scale + mask)·v. Grouped-query attention (K key/value heads for H = K·G query heads, query head h
  // reading key/value head h / G) repeats each key/value head G times first, as transformers' repeat_kv does, so
  // the graph keeps the 4-D attention pattern that ONNX import (fusetrain's, ONNX Runtime's fusions) recognises.
  std::string attention(const ir::Node& n, const ops::AttentionParams& p) {
    auto heads_first = [&](const std::string& x) { return p.seq_major ? transpose(x, {0, 2, 1, 3}) : x; };
    std::string q = heads_first(in(n, 0)), k = heads_first(in(n, 1)), v = heads_first(in(n, 2));
    std::vector<Dim> qd = dims(n.inputs[0]), kd = dims(n.inputs[1]);
    if (p.seq_major) {
      std::swap(qd[1], qd[2]);
      std::swap(kd[1], kd[2]);
    }
    FT_CHECK(!qd[1].symbolic() && !kd[1].symbolic() && qd[1].k % kd[1].k == 0, "ONNX export: attention with ",
             qd[1].k, " query heads over ", kd[1].k, " key/value heads is not covered");
    const int64_t groups = qd[1].k / kd[1].k;
    if (groups > 1) {  // (B, K, S, D) -> (B, K, G, S, D) -> (B, H, S, D)
      const std::string grouped = shape_tensor({kd[0], kd[1], Dim{groups}, kd[2], kd[3]});
      const std::string repeated = shape_tensor({kd[0], qd[1], kd[2], kd[3]});
      auto repeat = [&](const std::string& x) {
        return op("Reshape", {op("Expand", {op("Unsqueeze", {x, constant_i64({2})}), grouped}), repeated});
      };
      k = repeat(k);
      v = repeat(v);
    }
    std::string scores = op("MatMul", {q, transpose(k, {0, 1, 3, 2})});
    scores = op("Mul", {scores, constant_f32(p.scale)});
    if (p.softcap > 0)  // softcap·tanh(scores / softcap), before the mask
      scores = op("Mul", {op("Tanh", {op("Div", {scores, constant_f32(p.softcap)})}), constant_f32(p.softcap)});
    const size_t first = p.first_extra(false);
    if (p.score_bias) scores = op("Add", {scores, in(n, p.bias_input(false))});  // (B|1, H|1, T, S)
    const bool integer_extra = n.inputs.size() > first && graph().value(n.inputs[first]).dtype == DType::i64;
    const ops::AttentionExtras extras = ops::AttentionExtras::locate(n.inputs.size(), first, integer_extra);
    FT_CHECK(extras.key_begin < 0,
             "ONNX export: attention over packed sequences (key_begin) is not covered; export a model built for "
             "unpacked batches");
    if (extras.mask >= 0) {  // the additive key mask (B, S) -> (B, 1, 1, S), or a key bias per head (B, H, S)
      const bool per_head = graph().value(n.inputs[size_t(extras.mask)]).shape.rank() == 3;
      scores = op("Add", {scores, op("Unsqueeze", {in(n, size_t(extras.mask)),
                                                   per_head ? constant_i64({2}) : constant_i64({1, 2})})});
    }
    if (p.causal) {
      // Query t sees keys s <= t + S - T (and, with a window, s > t + S - T - window): keep the lower triangle
      // shifted by S - T (less the one shifted by window more), the rest to the lowest float (set, not added, so a
      // row that the key mask also removes stays finite).
      const Dim tq = qd[2], s = kd[2];
      FT_CHECK(tq == s, "ONNX export: causal attention with ", tq.k, " queries over ", s.k,
               " keys (a cache) is not covered");
      std::string square = op("Concat", {dim_tensor(tq), dim_tensor(s)});
      attr(last_, "axis", int64_t{0});
      std::string ones = op("ConstantOfShape", {square});
      fill_value(last_, pb::TensorProto::INT64, 1.0);
      std::string lower = op("Trilu", {ones});
      attr(last_, "upper", int64_t{0});
      if (p.window > 0) {
        std::string before = op("Trilu", {ones, constant_i64({-p.window}, true)});
        attr(last_, "upper", int64_t{0});
        lower = op("Sub", {lower, before});
      }
      std::string keep = cast(lower, pb::TensorProto::BOOL);
      scores = op("Where", {keep, scores, constant_f32(std::numeric_limits<float>::lowest())});
    }
    std::string probs = op("Softmax", {scores});
    attr(last_, "axis", int64_t{-1});
    std::string out = op("MatMul", {probs, v});
    return p.seq_major ? transpose(out, {0, 2, 1, 3}) : out;
  }

  // x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁) of x's two halves; cos and sin (B, T, R) broadcast over
  // the heads of x (B, T, H, D). With R < D (partial rotary) the first R of each head rotate and the rest is
  // concatenated after them unchanged.
  std::string rope(const ir::Node& n) {
    FT_CHECK(!std::get<ops::RoPEParams>(ir::decode_params(n.op, n.attrs, n.name)).inverse,
             "ONNX export: the inverse rotation is RoPE's backward and has no place in the inference graph");
    const int64_t D = g1_.graph.value(n.inputs[0]).shape[3], R = g1_.graph.value(n.inputs[1]).shape[2];
    const int64_t half = R / 2;
    std::string x = in(n, 0), rest;
    if (R < D) {
      const std::string rotary = fresh("Split_out");
      rest = fresh("Split_out");
      attr(node("Split", {x, constant_i64({R, D - R})}, {rotary, rest}), "axis", int64_t{3});
      x = rotary;
    }
    const std::string first = fresh("Split_out"), second = fresh("Split_out");
    attr(node("Split", {x, constant_i64({half, half})}, {first, second}), "axis", int64_t{3});
    std::string rotated = op("Concat", {op("Neg", {second}), first});
    attr(last_, "axis", int64_t{3});
    const std::string cos = op("Unsqueeze", {in(n, 1), constant_i64({2})});
    const std::string sin = op("Unsqueeze", {in(n, 2), constant_i64({2})});
    std::string y = op("Add", {op("Mul", {x, cos}), op("Mul", {rotated, sin})});
    if (R < D) {
      y = op("Concat", {y, rest});
      attr(last_, "axis", int64_t{3});
    }
    return y;
  }

  // Writes node n's ONNX equivalent.
  void lower(const ir::Node& n) {
    FT_CHECK(n.phase == ir::Phase::Forward, "ONNX export: the inference graph holds a backward node");
    const ir::Graph& g = g1_.graph;
    const ops::OpParams params = ir::decode_params(n.op, n.attrs, n.name);
    const ir::Node& n2 = g2_.graph.node(n.id);
    const ops::OpParams params2 = ir::decode_params(n2.op, n2.attrs, n2.name);
    using K = ir::OpKind;
    switch (n.op) {
      case K::Add:
      case K::Sub:
      case K::Mul:
      case K::Div: {
        static const std::map<K, const char*> names = {{K::Add, "Add"}, {K::Sub, "Sub"}, {K::Mul, "Mul"},
                                                       {K::Div, "Div"}};
        define(n, 0, op(names.at(n.op), {in(n, 0), in(n, 1)}));
        return;
      }
      case K::Tanh:
      case K::Relu:
      case K::Sqrt:
      case K::Erf: {
        static const std::map<K, const char*> names = {{K::Tanh, "Tanh"}, {K::Relu, "Relu"}, {K::Sqrt, "Sqrt"},
                                                       {K::Erf, "Erf"}};
        define(n, 0, op(names.at(n.op), {in(n, 0)}));
        return;
      }
      case K::Copy:
      case K::Dropout:  // inference: the identity
        define(n, 0, op("Identity", {in(n, 0)}));
        return;
      case K::Scale:
        define(n, 0, op("Mul", {in(n, 0), constant_f32(std::get<ops::ScaleParams>(params).alpha)}));
        return;
      case K::Pow:
        define(n, 0, op("Pow", {in(n, 0), constant_f32(std::get<ops::PowParams>(params).exponent)}));
        return;
      case K::Gelu:
        define(n, 0, gelu(in(n, 0), std::get<ops::GeluParams>(params).approximate));
        return;
      case K::Softmax:
        define(n, 0, op("Softmax", {in(n, 0)}));
        attr(last_, "axis", int64_t{-1});
        return;
      case K::Cast:
        define(n, 0, cast(in(n, 0), onnx_type(std::get<ops::CastParams>(params).dtype)));
        return;
      case K::Fill: {
        const auto& p = std::get<ops::FillParams>(params);
        define(n, 0, op("ConstantOfShape", {shape_tensor(dims(n.outputs[0]))}));
        fill_value(last_, onnx_type(p.dtype), p.value);
        return;
      }
      case K::MatMul: {
        const auto& p = std::get<ops::MatMulParams>(params);
        auto swap_last = [&](size_t i, bool trans) {
          if (!trans) return in(n, i);
          std::vector<int64_t> perm;
          const int64_t rank = g.value(n.inputs[i]).shape.rank();
          for (int64_t d = 0; d < rank; ++d) perm.push_back(d);
          std::swap(perm[static_cast<size_t>(rank - 1)], perm[static_cast<size_t>(rank - 2)]);
          return transpose(in(n, i), perm);
        };
        define(n, 0, op("MatMul", {swap_last(0, p.trans_a), swap_last(1, p.trans_b)}));
        return;
      }
      case K::Linear: {  // x·wᵀ (+ bias), w kept in transformers' (out, in) layout
        std::string y = op("MatMul", {in(n, 0), transpose(in(n, 1), {1, 0})});
        if (n.inputs.size() > 2 && n.inputs[2] != ir::kNone) y = op("Add", {y, in(n, 2)});
        define(n, 0, y);
        return;
      }
      case K::LayerNorm: {
        check_only_output0(n);
        std::string y = fresh("LayerNormalization_out");
        pb::NodeProto* ln = node("LayerNormalization", {in(n, 0), in(n, 1), in(n, 2)}, {y});
        attr(ln, "axis", int64_t{-1});
        attr(ln, "epsilon", std::get<ops::LayerNormParams>(params).eps);
        define(n, 0, y);
        return;
      }
      case K::Embedding:
        define(n, 0, op("Gather", {in(n, 0), in(n, 1)}));
        attr(last_, "axis", int64_t{0});
        return;
      case K::Reshape:
        define(n, 0, op("Reshape", {in(n, 0), shape_tensor(dims(n.outputs[0]))}));
        return;
      case K::ExpandTo:
        define(n, 0, op("Expand", {in(n, 0), shape_tensor(dims(n.outputs[0]))}));
        return;
      case K::Transpose:
        define(n, 0, transpose(in(n, 0), std::get<ops::TransposeParams>(params).perm));
        return;
      case K::Concat: {
        std::vector<std::string> parts;
        for (size_t i = 0; i < n.inputs.size(); ++i) parts.push_back(in(n, i));
        define(n, 0, op("Concat", parts));
        attr(last_, "axis", std::get<ops::ConcatParams>(params).axis);
        return;
      }
      case K::Split: {
        const auto& p = std::get<ops::SplitParams>(params);
        FT_CHECK(p.sizes == std::get<ops::SplitParams>(params2).sizes, "ONNX export: a Split whose sizes follow ",
                 "the batch shape is not covered");
        std::vector<std::string> outs;
        for (size_t i = 0; i < n.outputs.size(); ++i) outs.push_back(fresh("Split_out"));
        pb::NodeProto* split = node("Split", {in(n, 0), constant_i64(p.sizes)}, outs);
        attr(split, "axis", p.axis);
        for (size_t i = 0; i < outs.size(); ++i) define(n, i, outs[i]);
        return;
      }
      case K::Slice: {
        const auto& p = std::get<ops::SliceParams>(params);
        const auto& p2 = std::get<ops::SliceParams>(params2);
        const Shape& in1 = g.value(n.inputs[0]).shape;
        const Shape& in2 = g2_.graph.value(n2.inputs[0]).shape;
        const int64_t axis = p.axis < 0 ? p.axis + in1.rank() : p.axis;
        FT_CHECK(p.start == p2.start, "ONNX export: a Slice whose start follows the batch shape is not covered");
        int64_t end = p.end;
        if (p.end != p2.end) {
          FT_CHECK(p.end == in1[axis] && p2.end == in2[axis], "ONNX export: a Slice whose end follows the batch ",
                   "shape but is not the whole extent is not covered");
          end = std::numeric_limits<int64_t>::max();
        }
        define(n, 0, op("Slice", {in(n, 0), constant_i64({p.start}), constant_i64({end}), constant_i64({axis})}));
        return;
      }
      case K::ReduceSum:
      case K::ReduceMean: {
        const auto& p = std::get<ops::ReduceParams>(params);
        define(n, 0, reduce(n.op == K::ReduceSum ? "ReduceSum" : "ReduceMean", in(n, 0), p.axes, p.keepdims));
        return;
      }
      case K::Attention:
        check_only_output0(n);
        define(n, 0, attention(n, std::get<ops::AttentionParams>(params)));
        return;
      case K::RMSNorm: {  // x / √(mean(x²) + eps) · weight, as transformers' LlamaRMSNorm in f32
        check_only_output0(n);
        const std::string x = in(n, 0);
        std::string mean_square = reduce("ReduceMean", op("Mul", {x, x}), {-1}, true);
        std::string eps = constant_f32(std::get<ops::LayerNormParams>(params).eps);
        std::string inverse_rms = op("Reciprocal", {op("Sqrt", {op("Add", {mean_square, eps})})});
        define(n, 0, op("Mul", {op("Mul", {x, inverse_rms}), in(n, 1)}));
        return;
      }
      case K::RoPE:
        define(n, 0, rope(n));
        return;
      case K::Conv: {  // ONNX's Conv has the engine's attributes and input order
        const auto& p = std::get<ops::ConvParams>(params);
        std::vector<std::string> inputs = {in(n, 0), in(n, 1)};
        if (n.inputs.size() > 2) inputs.push_back(in(n, 2));
        define(n, 0, op("Conv", inputs));
        if (!p.strides.empty()) attr(last_, "strides", p.strides);
        if (!p.pads.empty()) attr(last_, "pads", p.pads);
        if (!p.dilations.empty()) attr(last_, "dilations", p.dilations);
        attr(last_, "group", p.group);
        return;
      }

      case K::SwiGLU: {  // silu(gate)·up
        const std::string gate = in(n, 0);
        define(n, 0, op("Mul", {op("Mul", {gate, op("Sigmoid", {gate})}), in(n, 1)}));
        return;
      }
      default:
        throw Error(str("ONNX export: op ", op_name(n.op), " (node ", n.name.empty() ? std::to_string(n.id) : n.name,
                        ") has no ONNX mapping"));
    }
  }

 private:
  const models::Model& model_;
  const ExportOptions& options_;
  models::BuiltGraph g1_, g2_;
  std::vector<bool> live_;  // nodes the outputs depend on
  pb::GraphProto* graph_ = nullptr;
  pb::NodeProto* last_ = nullptr;
  std::map<ValueId, std::string> names_;
  std::map<std::tuple<int64_t, int, int>, std::string> dim_cache_;
  std::string extent_[2], scalar_extent_[2], ids_shape_, rotary_angles_;
  int64_t counter_ = 0;
};

}  // namespace

ExportReport export_onnx(const models::Model& model, const std::string& path, const ExportOptions& options) {
  FT_CHECK(model.lora() == nullptr, path, ": ", model.architecture(), " carries LoRA adapters; merge them into the ",
           "base weights first (Model::merge_lora, fusetrain train --merge-lora) and export the merged model");
  if (model.imported_from_onnx()) {  // the graph it was imported from, with the trained initializers
    onnx_import::save_onnx(model, path);
    ExportReport report;
    report.path = path;
    report.nodes = onnx_import::graph_nodes(model);
    report.initializers = static_cast<int64_t>(model.params().slots().size());
    return report;
  }
  Writer writer(model, options);
  pb::ModelProto proto = writer.write();
  const ir::Graph& g = writer.graph();
  const std::vector<ValueId> params = writer.initializer_values();
  int64_t total = 0;
  for (ValueId v : params) total += static_cast<int64_t>(g.value(v).shape.numel() * 4);
  ExportReport report;
  report.path = path;
  report.nodes = proto.graph().node_size();
  report.initializers = static_cast<int64_t>(params.size());
  for (ValueId v : params) {  // before any file is opened: a non-finite weight is never written
    const Tensor t = model.host_parameter(g.value(v).name);
    FT_CHECK(t.dtype() == DType::f32, "ONNX export: parameter ", g.value(v).name, " is not f32");
    const float* x = t.data_as<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      FT_CHECK(std::isfinite(x[i]), "ONNX export: parameter ", g.value(v).name,
               " holds a non-finite value at element ", i, "; nothing was written");
  }
  const bool external = total > options.external_data_threshold;
  const std::filesystem::path file(path);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  const std::string data_name = file.filename().string() + "_data";
  std::vector<io::ByteSpan> data;  // the external data file's pieces, one per initializer
  int64_t offset = 0;
  std::vector<Tensor> held;  // downloaded copies the external data file's pieces point into (a device not host-visible)
  held.reserve(params.size());
  for (ValueId v : params) {
    const ir::Value& value = g.value(v);
    const Tensor& t = held.emplace_back(model.host_parameter(value.name));
    pb::TensorProto* init = proto.mutable_graph()->add_initializer();
    init->set_name(value.name);
    init->set_data_type(pb::TensorProto::FLOAT);
    for (int64_t d = 0; d < value.shape.rank(); ++d) init->add_dims(value.shape[d]);
    if (!external) {
      init->set_raw_data(t.data(), t.nbytes());
      continue;
    }
    init->set_data_location(pb::TensorProto::EXTERNAL);
    auto entry = [&](const char* key, const std::string& text) {
      pb::StringStringEntryProto* e = init->add_external_data();
      e->set_key(key);
      e->set_value(text);
    };
    entry("location", data_name);
    entry("offset", std::to_string(offset));
    entry("length", std::to_string(t.nbytes()));
    data.push_back({t.data(), t.nbytes(), value.name.c_str(), DType::f32});
    offset += static_cast<int64_t>(t.nbytes());
  }
  std::string bytes;
  FT_CHECK(proto.SerializeToString(&bytes), "ONNX export: serialising the graph failed (", proto.ByteSizeLong(),
           " bytes; protobuf's limit is 2 GiB)");
  // Each file is written whole under a temporary name and renamed (io::write_file_atomic): a failed export leaves
  // the files already there as they were.
  if (external) {
    report.external_data = (file.parent_path() / data_name).string();
    io::write_file_atomic(report.external_data, data);
  }
  io::write_file_atomic(path, {{bytes.data(), bytes.size()}});
  return report;
}

}  // namespace fusetrain::onnx_export
