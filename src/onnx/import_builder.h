// The ONNX importer's internals shared by its two files: import.cpp (the family, the op-mapping table, the per-batch
// host program) and import_patterns.cpp (the patterns that become one fused op: attention with its mask or key bias,
// a patch-embedding convolution). Not a public header.
#pragma once

#include <onnx/onnx_pb.h>

#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fusetrain/ir/builder.h"
#include "fusetrain/models/model.h"
#include "models/family.h"
#include "onnx/host_eval.h"
#include "onnx/import.h"

namespace fusetrain::onnx_import {

using ir::ValueId;
using models::Batch;
using models::BatchSpec;
using models::BuiltGraph;
using models::Head;
using onnx::NodeProto;

namespace detail {

/// How a host value reaches the plan: as it is, or transformed first.
enum class Feed : uint8_t {
  AsIs,        ///< the value, as f32 or i64
  Keep,        ///< Where's condition as 1/0 (f32)
  Drop,        ///< its complement, 0/1 (f32)
  DropTimes,   ///< (1 - condition) · scalar (f32): Where's constant branch
  FlatTuples,  ///< GatherND's index tuples as flat row numbers (i64)
  Elements,    ///< GatherElements' indices as flat element numbers of the data (i64)
  KeyMask,     ///< an additive (B, 1, T|1, S) attention mask as the (B, S) key mask (scalar 1: with causal rows)
  HeadKeyBias,  ///< additive biases summed to (B, H, T, S) as the (B, H, S) key bias of each head (ALiBi); scalar 1:
                ///< with causal rows
};

struct HostFeed {
  std::string input;  ///< the IR input's name
  int value = -1;     ///< the ONNX value it reads
  Feed feed = Feed::AsIs;
  bool as_float = true;              ///< f32 (else i64)
  double scalar = 0;                 ///< DropTimes' scalar
  std::vector<int64_t> tuple_dims;   ///< FlatTuples: the extents the tuples index; Elements: the data's shape;
                                     ///< HeadKeyBias: B, H, T, S
  /// HeadKeyBias: the host values summed (value ids; `value` is the first), each broadcast to (B, H, T, S) from
  /// the 4-D shape it is read as (bias_dims: 4 per term).
  std::vector<int> terms;
  std::vector<int64_t> bias_dims;
  std::vector<float> const_f;        ///< the data of a feed from a constant, computed once
  std::vector<int64_t> const_i;
  bool constant = false;
};

/// What a build learned for one batch shape: the batch-dependent host nodes and the inputs they feed.
struct HostProgram {
  std::vector<HostTensor> consts;   ///< by value id: the constants batch-dependent nodes read
  std::vector<bool> has_const;      ///< which entries of consts are set
  std::vector<int> nodes;           ///< batch-dependent nodes, in order
  std::vector<HostFeed> feeds;
};

/// A (…, T, T) condition that keeps query t's keys s in (t − window, t]: that window (0: every s <= t), else nullopt.
std::optional<int64_t> causal_window(const HostTensor& keep);
/// HeadKeyBias: the sum of f.terms at (b, h, t, s).
float summed_bias(const HostFeed& f, const std::vector<const HostTensor*>& terms, int64_t b, int64_t h, int64_t t,
                  int64_t s);
/// HeadKeyBias: writes the (B, H, S) key bias of f's summed terms after checking every row has that form.
void fill_head_key_bias(const HostFeed& f, const std::vector<const HostTensor*>& terms, float* out);
/// `axis` of a value of rank `rank`, negative counting from the end; Error naming `what` when it is outside.
int64_t axis_in(int64_t axis, int64_t rank, const char* what);

class Builder;

class OnnxFamily final : public models::Family {
 public:
  OnnxFamily(const std::string& path, Head head, nlohmann::json config, const ImportOptions& options);

  BuiltGraph build(const BatchSpec& spec) const override;
  /// build() before unread nodes are dropped.
  BuiltGraph build_graph(const BatchSpec& spec) const;
  /// Binds initializers and inputs for `spec` and walks every node (the build's failures stay in `bld`).
  void walk(Builder& bld, const BatchSpec& spec) const;
  /// Takes the parameters that are an exporter's buffers out of params_ (the definition says which).
  void keep_buffers_constant();
  const std::vector<std::string>& constant_buffers() const { return constant_buffers_; }
  models::ParamInit init(const std::string&) const override { return {models::Init::Zeros}; }
  std::map<std::string, std::string> tied() const override { return {}; }
  std::string base_prefix() const override { return ""; }
  std::vector<std::string> head_prefixes() const override { return {}; }
  bool uses_token_type_ids() const override { return has_input("token_type_ids"); }
  bool in_layer_norm(const std::string& name) const override { return layer_norm_params_.count(name) > 0; }
  std::vector<models::InputDecl> inputs() const override;
  int64_t max_positions() const override { return max_positions_; }
  bool binds_inputs() const override { return true; }
  void bind_inputs(runtime::Plan& plan, const Batch& batch, const BatchSpec& spec) const override;
  std::map<std::string, Tensor> initial_values() const override;
  void release_initial_values() override;
  void save_graph(const models::Model& model, const std::string& dir) const override {
    save_onnx(model, (std::filesystem::path(dir) / "model.onnx").string());
  }

  const onnx::ModelProto& proto() const { return proto_; }
  bool is_param(const std::string& name) const { return params_.count(name) > 0 || tied_.count(name) > 0; }
  /// The parameter an initializer trains as: itself, or the identical initializer it is tied to.
  const std::string& param_name(const std::string& name) const {
    auto it = tied_.find(name);
    return it == tied_.end() ? name : it->second;
  }
  bool tied_transposed(const std::string& name) const { return tied_transposed_.count(name) > 0; }
  /// Whether parameter `name` is trained in the (out, in) layout of Linear although the graph holds it (in, out):
  /// a weight the graph only ever multiplies as x·W.
  bool out_in(const std::string& name) const { return out_in_.count(name) > 0; }
  bool fuse_attention() const { return fuse_attention_; }
  /// The nodes reading value `v`, as (node index, input slot).
  const std::vector<std::pair<int, int>>& readers(int v) const { return readers_[size_t(v)]; }
  bool is_graph_output(int v) const {
    for (const auto& o : proto_.graph().output())
      if (ids_.at(o.name()) == v) return true;
    return false;
  }
  /// The row of embedding table `name` that gets no gradient (-1: none). An ONNX Gather does not record
  /// nn.Embedding's padding_idx: it comes from ImportOptions::padding_rows, else from config.json's pad_token_id
  /// for the tables transformers declares it on: word embeddings (not GPT-2's), and position embeddings of the models that number positions
  /// from the padding id (RoBERTa, XLM-RoBERTa, CamemBERT, MPNet).
  int64_t padding_idx(const std::string& name) const {
    if (const auto given = padding_rows_.find(name); given != padding_rows_.end()) return given->second;
    if (!config_.contains("pad_token_id") || !config_["pad_token_id"].is_number_integer()) return -1;
    const std::string type = config_.value("model_type", std::string());
    static const std::set<std::string> kWord = {"bert", "roberta", "xlm-roberta", "camembert", "distilbert",
                                                "electra", "albert", "mpnet", "deberta-v2", "deberta"};
    static const std::set<std::string> kPosition = {"roberta", "xlm-roberta", "camembert", "mpnet"};
    auto ends = [&](const char* suffix) { return models::ends_with(name, suffix); };
    if ((ends("word_embeddings.weight") && kWord.count(type)) ||
        (ends("position_embeddings.weight") && kPosition.count(type)))
      return config_["pad_token_id"].get<int64_t>();
    return -1;
  }

 private:
  bool has_input(const std::string& name) const {
    return std::find(inputs_.begin(), inputs_.end(), name) != inputs_.end();
  }
  int id(const std::string& name) const { return name.empty() ? -1 : ids_.at(name); }

  onnx::ModelProto proto_;
  std::string dir_;
  nlohmann::json config_;
  std::map<std::string, int64_t> padding_rows_;  // ImportOptions::padding_rows
  std::map<std::string, int> ids_;           // every value name -> id
  std::vector<std::string> names_;           // id -> name
  std::map<std::string, HostTensor> inits_;  // every initializer
  std::set<std::string> params_;             // the trainable ones
  std::set<std::string> layer_norm_params_;  // parameters read as a LayerNormalization's scale or bias
  std::vector<std::string> constant_buffers_;  // float initializers keep_buffers_constant took out of params_
  std::map<std::string, std::string> tied_;  // initializer -> the identical parameter it trains as (tie_identical)
  std::set<std::string> tied_transposed_;    // the tied initializers that hold their parameter transposed
  std::set<std::string> out_in_;             // parameters stored transposed, as Linear reads them
  std::vector<std::vector<std::pair<int, int>>> readers_;  // value -> (node, slot) reading it
  std::vector<std::string> inputs_;          // graph inputs fusetrain feeds
  int64_t max_positions_ = int64_t{1} << 40;
  bool fuse_attention_ = true;
  mutable std::map<std::vector<int64_t>, std::shared_ptr<HostProgram>> programs_;  // by host_key
};

// ---- one build ----------------------------------------------------------------------------------------------

// Sequence: an ONNX sequence of IR values (SplitToSequence's output), read by SequenceAt only.
enum class Kind : uint8_t { Unset, Const, Batch, Param, Ir, IsNaNOf, Failed, Sequence };

struct Unsupported {
  std::string where, why;
  int64_t index = -1;  ///< the node's position in the graph
  bool host = false;   ///< it failed only because it reads parameters: the host could evaluate it
};

class Builder {
 public:
  Builder(const OnnxFamily& family, const std::vector<std::string>& names, const std::map<std::string, int>& ids,
          const BatchSpec& spec, ir::Graph& graph, HostProgram& program)
      : f_(family), names_(names), ids_(ids), spec_(spec), graph_(graph), b_(graph), prog_(program) {
    const size_t n = names.size();
    kind_.assign(n, Kind::Unset);
    ir_.assign(n, ir::kNone);
    host_.resize(n);
    nan_source_.assign(n, -1);
    prog_.consts.resize(n);
    prog_.has_const.assign(n, false);
  }

  void set_const(int v, HostTensor t) {
    kind_[size_t(v)] = Kind::Const;
    host_[size_t(v)] = std::move(t);
  }
  /// A float input of the batch, which only the graph reads.
  void set_input(int v, ValueId x) {
    kind_[size_t(v)] = Kind::Ir;
    ir_[size_t(v)] = x;
  }
  void set_batch(int v, HostTensor dummy) {
    kind_[size_t(v)] = Kind::Batch;
    host_[size_t(v)] = std::move(dummy);
  }
  /// A parameter; `same` is the value of the parameter it is tied to (-1: none).
  void set_param(int v, const std::vector<int64_t>& shape, int same = -1, bool transposed = false) {
    kind_[size_t(v)] = Kind::Param;
    host_[size_t(v)].shape = shape;
    if (same >= 0) tied_to_[v] = {same, transposed};
  }

  void node(const NodeProto& node, int64_t index);
  /// Keeps, in the program, the constants its batch-dependent nodes read.
  void finish(const onnx::GraphProto& g) {
    for (int k : prog_.nodes)
      for (const std::string& i : g.node(k).input())
        if (!i.empty() && kind(ids_.at(i)) == Kind::Const) {
          prog_.consts[size_t(ids_.at(i))] = host_[size_t(ids_.at(i))];
          prog_.has_const[size_t(ids_.at(i))] = true;
        }
  }
  ValueId output(int v, const std::string& name);
  const std::vector<Unsupported>& unsupported() const { return unsupported_; }
  ir::GraphBuilder& builder() { return b_; }

 private:
  int in_id(const NodeProto& n, int k) const {
    return k < n.input_size() && !n.input(k).empty() ? ids_.at(n.input(k)) : -1;
  }
  Kind kind(int v) const { return v < 0 ? Kind::Unset : kind_[size_t(v)]; }
  bool is_host(int v) const { return kind(v) == Kind::Const || kind(v) == Kind::Batch; }
  bool is_ir(int v) const { return kind(v) == Kind::Ir || kind(v) == Kind::Param; }
  const HostTensor& const_of(const NodeProto& n, int k, const char* what);
  double const_scalar(const NodeProto& n, int k, const char* what);
  bool scalar_const(int v, double& value) const {
    if (kind(v) != Kind::Const || host_[size_t(v)].numel() != 1) return false;
    value = host_[size_t(v)].at(0);
    return true;
  }
  std::vector<int64_t> shape_of(int v) const {
    if (is_ir(v) && ir_[size_t(v)] != ir::kNone) {
      const Shape& s = graph_.value(ir_[size_t(v)]).shape;
      return std::vector<int64_t>(s.dims().begin(), s.dims().end());
    }
    return host_[size_t(v)].shape;
  }
  ValueId ir_of(int v, bool as_float = true);
  ValueId feed(int v, Feed how, bool as_float, double scalar = 0, std::vector<int64_t> tuple_dims = {});
  void set_ir(const NodeProto& n, int k, ValueId x) {
    const int v = ids_.at(n.output(k));
    kind_[size_t(v)] = Kind::Ir;
    ir_[size_t(v)] = x;
  }
  void fail(const NodeProto& n, int64_t index, const std::string& why, bool host = false) {
    unsupported_.push_back({node_label(n, index), why, index, host});
    for (const std::string& o : n.output())
      if (!o.empty()) kind_[size_t(ids_.at(o))] = Kind::Failed;
  }
  void map_ir(const NodeProto& n, int64_t index);
  ValueId binary(const NodeProto& n, int a, int b);
  ValueId attention(const NodeProto& probs_times_v);
  ValueId projection(const NodeProto& n, int64_t index);
  ValueId conv(const NodeProto& n);
  ValueId pool(const NodeProto& n);
  std::vector<int64_t> window_pads(const NodeProto& n, const std::vector<int64_t>& xs,
                                   const std::vector<int64_t>& kernel, const std::vector<int64_t>& strides,
                                   const std::vector<int64_t>& dilations);
  ValueId patch_conv(const NodeProto& n);
  /// The key bias input and whether its rows are causal; nullopt when the biases are no key bias per head.
  std::optional<std::pair<ValueId, bool>> head_key_bias(const std::vector<std::pair<int, bool>>& biases, int64_t B,
                                                        int64_t H, int64_t T, int64_t S);
  const NodeProto* producer(int v) const {
    auto it = producers_.find(v);
    return it == producers_.end() ? nullptr : it->second;
  }
  // v without a Mul or Div by a one-element constant in front of it; `scale` takes the factor.
  int unscaled(int v, double& scale) const {
    const NodeProto* p = producer(v);
    double c = 0;
    if (p && (p->op_type() == "Mul" || p->op_type() == "Div") && p->input_size() == 2) {
      const int a = ids_.at(p->input(0)), b = ids_.at(p->input(1));
      if (scalar_const(b, c) && is_ir(a)) {
        scale *= p->op_type() == "Mul" ? c : 1.0 / c;
        return a;
      }
      if (p->op_type() == "Mul" && scalar_const(a, c) && is_ir(b)) {
        scale *= c;
        return b;
      }
    }
    return v;
  }
  ValueId transposed(ValueId x, std::vector<int64_t> perm);
  /// u when `x` is u with its last two axes swapped (a Transpose doing only that, or the dynamo exporter's kᵀ chain
  /// Reshape → Transpose (0, 2, 1) → Reshape), read without adding nodes; kNone otherwise.
  ValueId unswapped(ValueId x) const;
  /// A projection's operand (input or weight) in the dtype mixed precision runs projections in: bf16 or f16, as
  /// autocast hands a Linear's operands to the GEMM and as the built families cast them (models::project); f32
  /// training, or an operand already in it: v itself.
  ValueId gemm_operand(ValueId v) {
    const DType want = spec_.fp16 ? DType::f16 : spec_.bf16 ? DType::bf16 : DType::f32;
    if (want == DType::f32 || graph_.value(v).dtype == want) return v;
    const ir::NodeId p = graph_.value(v).producer;  // a widened value of that dtype: the value itself (exact)
    if (p != ir::kNone && graph_.node(p).op == ops::OpKind::Cast && graph_.value(graph_.node(p).inputs[0]).dtype == want)
      return graph_.node(p).inputs[0];
    return b_.cast(v, want);
  }
  /// Whether `v` is the f32 result of a product with bf16 operands (a projection under bf16 mixed precision).
  bool bf16_product(ValueId v) const {
    const ir::Value& x = graph_.value(v);
    if (!spec_.bf16 || spec_.fp16 || x.dtype != DType::f32 || x.producer == ir::kNone) return false;
    const ir::Node& p = graph_.node(x.producer);
    return (p.op == ops::OpKind::Linear || p.op == ops::OpKind::MatMul) &&
           graph_.value(p.inputs[0]).dtype == DType::bf16;
  }
  /// q, k or v of a fused attention in the dtype mixed precision runs attention in: bf16 under bf16, as autocast
  /// hands scaled_dot_product_attention bf16 operands (the output stays f32, as the graph's later ops read it; the
  /// projection that reads it rounds it to bf16 as autocast's bf16 output is); f32 otherwise (fp16 included: the
  /// kernel takes f32 or bf16). The cast goes before a heads transpose, so fold_attention_transposes still folds it.
  ValueId attention_operand(ValueId v);
  ValueId unrepeated_heads(ValueId x) const;
  ValueId where(const NodeProto& n, int64_t index);

  const OnnxFamily& f_;
  const std::vector<std::string>& names_;
  const std::map<std::string, int>& ids_;
  const BatchSpec& spec_;
  ir::Graph& graph_;
  ir::GraphBuilder b_;
  HostProgram& prog_;
  std::vector<Kind> kind_;
  std::vector<ValueId> ir_;
  std::vector<HostTensor> host_;
  std::vector<int> nan_source_;
  std::map<int, std::vector<ValueId>> sequences_;  // a Kind::Sequence value's elements
  std::map<int, std::pair<int, bool>> tied_to_;  // a tied initializer -> (its parameter, held transposed)
  std::map<std::string, ValueId> feeds_;
  std::map<int, const NodeProto*> producers_;  // value -> the node that wrote it (nodes mapped so far)
  std::map<int, bool> key_mask_causal_;        // attention masks fed as (B, S) key masks -> causal
  std::map<int, std::optional<int64_t>> band_windows_;  // Where conditions read by attentions -> causal_window
  std::map<int64_t, ValueId> done_;            // nodes already computed by an earlier fused op (a Linear's bias)
  std::vector<Unsupported> unsupported_;
};

}  // namespace detail
}  // namespace fusetrain::onnx_import
