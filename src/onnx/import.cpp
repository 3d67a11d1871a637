// ONNX import (see import.h and docs/architecture.md, "ONNX import"). A graph is bound to one batch shape per
// build: every node whose operands are known then (initializers that are not parameters, constants, shapes) is
// folded on the host; every node that reads only the batch (masks, position ids, pooled rows) runs on the host
// per batch and hands its result to the plan as an input; every node that reads a parameter maps to IR ops
// through the op-mapping table below.
#include "onnx/import.h"

#include <onnx/onnx_pb.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/error.h"
#include "fusetrain/io/hf_dir.h"
#include "fusetrain/io/safetensors.h"
#include "fusetrain/models/model.h"
#include "models/family.h"
#include "onnx/host_eval.h"
#include "onnx/import_builder.h"
#include "onnx/validate.h"

namespace fusetrain::onnx_import {

namespace detail {

/// The ONNX graph inputs fusetrain feeds from the batch: token inputs (int64 (batch, sequence), which the host may
/// evaluate nodes on) and float inputs (which only the graph reads).
const char* const kTokenInputs[] = {"input_ids",         "attention_mask",        "token_type_ids",
                                    "position_ids",      "decoder_input_ids",     "decoder_attention_mask"};
const char* const kFloatInputs[] = {"pixel_values", "input_features", "input_values", "mask_time_indices",
                                    "mask_feature_indices"};
/// Float inputs the batch may leave out: SpecAugment's masks (capture's mask inputs), zeros (nothing masked) when
/// absent.
const char* const kOptionalFloatInputs[] = {"mask_time_indices", "mask_feature_indices"};

bool is_optional_float_input(const std::string& name) {
  for (const char* s : kOptionalFloatInputs)
    if (name == s) return true;
  return false;
}

bool is_token_input(const std::string& name) {
  for (const char* s : kTokenInputs)
    if (name == s) return true;
  return false;
}

bool is_float_input(const std::string& name) {
  for (const char* s : kFloatInputs)
    if (name == s) return true;
  return false;
}

bool is_batch_input(const std::string& name) { return is_token_input(name) || is_float_input(name); }

/// Whether a token input measures an encoder-decoder's target sequence (the decoder's inputs).
bool is_target_input(const std::string& name) {
  for (const char* s : models::kDecoderInputNames)
    if (name == s) return true;
  return false;
}

/// The sequence length of token input `name` in a build for `spec` (a build without a target sequence, such as
/// the probe that lays out the parameters, gives the decoder the source's length).
int64_t sequence_of(const std::string& name, const models::BatchSpec& spec) {
  return is_target_input(name) ? spec.target_length() : spec.seq;
}

/// The example sizes a graph's metadata gives float input `name` ("fusetrain.example_shape.<name>": sizes separated
/// by commas, as capture writes them for raw audio's dynamic length); empty when it gives none.
std::vector<int64_t> example_shape(const onnx::ModelProto& model, const std::string& name) {
  std::vector<int64_t> dims;
  for (const auto& entry : model.metadata_props()) {
    if (entry.key() != "fusetrain.example_shape." + name) continue;
    std::stringstream text(entry.value());
    for (std::string item; std::getline(text, item, ',');) {
      int64_t size = 0;
      const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), size);
      FT_CHECK(error == std::errc() && end == item.data() + item.size() && size >= 1 && size <= (int64_t{1} << 24),
               "ONNX metadata ", entry.key(), " is \"", entry.value(), "\"; expected sizes from 1 to 2^24 separated "
               "by commas");
      dims.push_back(size);
    }
  }
  return dims;
}

/// The shape a float input has in a build for `spec`: the batch's, else the graph's fixed sizes with the batch
/// size of the spec on a dynamic axis 0 and the graph's example sizes on other dynamic axes (a build that only lays
/// out the parameters).
std::vector<int64_t> float_input_shape(const onnx::ModelProto& model, const onnx::ValueInfoProto& input,
                                       const models::BatchSpec& spec) {
  for (const auto& [name, shape] : spec.shapes)
    if (name == input.name()) return shape.dims();
  std::vector<int64_t> shape;
  const std::vector<int64_t> example = example_shape(model, input.name());
  const auto& dims = input.type().tensor_type().shape().dim();
  for (int k = 0; k < dims.size(); ++k) {
    const bool known = dims[k].has_dim_value() || k == 0 || (size_t(k) < example.size() && example[size_t(k)] > 0);
    FT_CHECK(known, "ONNX input \"", input.name(), "\" has a dynamic axis ", k,
             "; fusetrain needs its size from a batch");
    shape.push_back(dims[k].has_dim_value() ? dims[k].dim_value() : k == 0 ? spec.batch : example[size_t(k)]);
  }
  return shape;
}

/// The key of a build's host program: the batch and sequence sizes, then the float inputs' shapes.
std::vector<int64_t> host_key(const models::BatchSpec& spec) {
  std::vector<int64_t> key{spec.batch, spec.seq, spec.target_seq};
  for (const auto& [name, shape] : spec.shapes)
    if (is_float_input(name)) key.insert(key.end(), shape.dims().begin(), shape.dims().end());
  return key;
}


void fill_feed(const HostFeed& f, const HostTensor& v, void* out) {
  const int64_t n = v.numel();
  if (f.feed == Feed::KeyMask) {
    // v (B|1, 1, T|1, S): each row must be the key row (its last, which a causal mask leaves whole), and with
    // causal rows, masked above the diagonal; anything else is a mask the fused attention cannot take.
    const int64_t B = v.shape[0], T = v.shape[2], S = v.shape[3];
    const bool causal = f.scalar != 0;
    float* o = static_cast<float*>(out);
    const int64_t rows = static_cast<int64_t>(f.tuple_dims.empty() ? B : f.tuple_dims[0]);
    for (int64_t b = 0; b < rows; ++b) {
      const float* m = v.f.data() + size_t((B == 1 ? 0 : b) * T * S);
      const float* key = m + (T - 1) * S;
      for (int64_t s = 0; s < S; ++s) o[b * S + s] = key[s];
      for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < S; ++s) {
          const float x = m[t * S + s];
          const bool ok = causal && s > t ? x <= -1e30f : (x == key[s] || (x <= -1e30f && key[s] <= -1e30f));
          FT_CHECK(ok, "the graph's attention mask at (", b, ", ", t, ", ", s, ") is ", x,
                   ", which is neither a key-padding mask", causal ? " plus a causal one" : "",
                   "; import it with fuse_attention off");
        }
    }
    return;
  }
  if (f.feed == Feed::Elements) {  // element (p0, .., idx, .., pr) of the data, axis = scalar
    const std::vector<int64_t> idx = v.ints();
    const std::vector<int64_t>& dims = f.tuple_dims;
    const size_t r = dims.size(), axis = size_t(f.scalar);
    std::vector<int64_t> pos(r, 0);
    int64_t* o = static_cast<int64_t*>(out);
    for (int64_t k = 0; k < n; ++k) {
      int64_t flat = 0;
      for (size_t ax = 0; ax < r; ++ax) {
        int64_t p = pos[ax];
        if (ax == axis) {
          p = idx[size_t(k)];
          if (p < 0) p += dims[ax];
          FT_CHECK(p >= 0 && p < dims[ax], "GatherElements: index ", idx[size_t(k)], " is out of range for ", dims[ax]);
        }
        flat = flat * dims[ax] + p;
      }
      o[k] = flat;
      for (size_t ax = r; ax-- > 0;) {
        if (++pos[ax] < v.shape[ax]) break;
        pos[ax] = 0;
      }
    }
    return;
  }
  if (f.feed == Feed::FlatTuples) {
    const std::vector<int64_t> idx = v.ints();
    const int64_t m = int64_t(f.tuple_dims.size());
    int64_t* o = static_cast<int64_t*>(out);
    for (int64_t t = 0; t < n / m; ++t) {
      int64_t flat = 0;
      for (int64_t k = 0; k < m; ++k) {
        int64_t x = idx[size_t(t * m + k)];
        const int64_t dim = f.tuple_dims[size_t(k)];
        if (x < 0) x += dim;
        FT_CHECK(x >= 0 && x < dim, "GatherND: index ", idx[size_t(t * m + k)], " is out of range for ", dim);
        flat = flat * dim + x;
      }
      o[t] = flat;
    }
    return;
  }
  if (!f.as_float) {
    const std::vector<int64_t> idx = v.ints();
    if (n > 0) std::memcpy(out, idx.data(), size_t(n) * sizeof(int64_t));
    return;
  }
  float* o = static_cast<float*>(out);
  for (int64_t k = 0; k < n; ++k) {
    const double x = v.at(k);
    switch (f.feed) {
      case Feed::Keep:
        o[k] = x != 0 ? 1.0f : 0.0f;
        break;
      case Feed::Drop:
        o[k] = x != 0 ? 0.0f : 1.0f;
        break;
      case Feed::DropTimes:
        o[k] = x != 0 ? 0.0f : float(f.scalar);
        break;
      default:
        o[k] = v.is_float() ? v.f[size_t(k)] : float(v.i[size_t(k)]);
        break;
    }
  }
}


const HostTensor& Builder::const_of(const NodeProto& n, int k, const char* what) {
  const int v = in_id(n, k);
  if (kind(v) != Kind::Const)
    throw Error(str(what, " (input ", k, " \"", k < n.input_size() ? n.input(k) : "", "\") must be a constant; ",
                    kind(v) == Kind::Batch ? "it depends on the batch's values" : "it is computed from parameters"));
  return host_[size_t(v)];
}

double Builder::const_scalar(const NodeProto& n, int k, const char* what) {
  const HostTensor& t = const_of(n, k, what);
  FT_CHECK(t.numel() == 1, what, " (input ", k, ") should hold one element, found shape ", shape_string(t.shape));
  return t.at(0);
}

ValueId Builder::feed(int v, Feed how, bool as_float, double scalar, std::vector<int64_t> tuple_dims) {
  static const char* kSuffix[] = {"", ":keep", ":drop", ":drop_times", ":flat", ":elements", ":key_mask"};
  const std::string name = "onnx:" + names_[size_t(v)] + kSuffix[int(how)] + (as_float ? "" : ":i64");
  auto it = feeds_.find(name);
  if (it != feeds_.end()) return it->second;
  const HostTensor& h = host_[size_t(v)];
  std::vector<int64_t> shape = h.shape;
  if (how == Feed::FlatTuples) shape.pop_back();
  if (how == Feed::KeyMask) shape = {spec_.batch, h.shape[3]};
  HostFeed f;
  f.input = name;
  f.value = v;
  f.feed = how;
  f.as_float = as_float;
  f.scalar = scalar;
  if (how == Feed::KeyMask) tuple_dims = {spec_.batch};
  f.tuple_dims = std::move(tuple_dims);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (kind(v) == Kind::Const) {
    f.constant = true;
    if (as_float) {
      f.const_f.resize(size_t(n));
      fill_feed(f, h, f.const_f.data());
    } else {
      f.const_i.resize(size_t(n));
      fill_feed(f, h, f.const_i.data());
    }
  }
  prog_.feeds.push_back(std::move(f));
  const ValueId x = b_.input(name, Shape(shape), as_float ? DType::f32 : DType::i64);
  feeds_[name] = x;
  return x;
}

ValueId Builder::ir_of(int v, bool as_float) {
  if (kind(v) == Kind::Param) {
    if (tied_to_.count(v)) {
      if (ir_[size_t(v)] == ir::kNone) {
        const auto [same, transposed] = tied_to_.at(v);
        FT_CHECK(same != v && !tied_to_.count(same), "initializer \"", names_[size_t(v)],
                 "\" is tied to an initializer that is itself tied");  // ties are one level deep: no recursion
        ir_[size_t(v)] = transposed ? b_.transpose(ir_of(same), {1, 0}) : ir_of(same);
      }
      return ir_[size_t(v)];
    }
    if (ir_[size_t(v)] == ir::kNone) ir_[size_t(v)] = b_.param(names_[size_t(v)], Shape(host_[size_t(v)].shape));
    return ir_[size_t(v)];
  }
  if (kind(v) == Kind::Ir) return ir_[size_t(v)];
  FT_CHECK(kind(v) != Kind::Sequence, "sequence \"", names_[size_t(v)], "\" is read by an op other than SequenceAt");
  FT_CHECK(is_host(v), "value \"", names_[size_t(v)], "\" is not available");
  return feed(v, Feed::AsIs, as_float);
}

ValueId Builder::binary(const NodeProto& n, int a, int bv) {
  const std::string& op = n.op_type();
  // A one-element constant operand is a one-element Fill, the form the fusion passes read their constants in
  // (fuse_erf_gelu, fuse_decomposed_layernorm).
  double c = 0;
  const ValueId x = scalar_const(a, c) ? b_.fill(Shape{1}, c) : ir_of(a);
  const ValueId y = scalar_const(bv, c) ? b_.fill(Shape{1}, c) : ir_of(bv);
  if (op == "Add") return b_.add(x, y);
  if (op == "Sub") return b_.sub(x, y);
  if (op == "Mul") return b_.mul(x, y);
  return b_.div(x, y);
}

// Where(c, x, y) with a host condition as x·c + y·(1 − c), the constant branch folded into one host addend;
// Where(IsNaN(v), 0, v) (softmax's fully masked rows) is v itself, whose values are finite.
ValueId Builder::where(const NodeProto& n, int64_t index) {
  const int c = in_id(n, 0), x = in_id(n, 1), y = in_id(n, 2);
  double zero = 1;
  if (kind(c) == Kind::IsNaNOf && scalar_const(x, zero) && zero == 0 && nan_source_[size_t(c)] == y) return ir_of(y);
  if (!is_host(c)) {
    fail(n, index, "the condition is computed from parameters (only a condition from the batch or constants, or "
                   "Where(IsNaN(x), 0, x), is supported)");
    return ir::kNone;
  }
  double sx = 0, sy = 0;
  const ValueId taken = scalar_const(x, sx) ? b_.scale(feed(c, Feed::Keep, true), sx)
                                            : b_.mul(ir_of(x), feed(c, Feed::Keep, true));
  const ValueId other = scalar_const(y, sy) ? feed(c, Feed::DropTimes, true, sy)
                                            : b_.mul(ir_of(y), feed(c, Feed::Drop, true));
  return b_.add(taken, other);
}


// MatMul(x, W) with W a parameter: a Linear when the weight is trained (out, in) (OnnxFamily::out_in) or the
// graph transposes an (out, in) parameter itself (an export without constant folding), with the bias of a
// following Add folded in when that Add is the product's only reader. Otherwise a MatMul.
ValueId Builder::projection(const NodeProto& n, int64_t index) {
  (void)index;
  const int x = in_id(n, 0), w = in_id(n, 1);
  int weight = -1;
  if (kind(w) == Kind::Param && f_.out_in(names_[size_t(w)])) {
    weight = w;
  } else if (kind(w) == Kind::Param && tied_to_.count(w) && tied_to_.at(w).second) {
    weight = tied_to_.at(w).first;  // a folded transpose of an (out, in) parameter (a tied LM head)
  } else if (const NodeProto* t = producer(w); t && t->op_type() == "Transpose" && attr_ints(*t, "perm") ==
                                                                                     std::vector<int64_t>{1, 0}) {
    const int src = ids_.at(t->input(0));
    if (kind(src) == Kind::Param && !tied_to_.count(src) && host_[size_t(src)].shape.size() == 2) weight = src;
  }
  if (weight < 0) {
    // Any other product runs in the mixed-precision dtype, as autocast runs matmul and bmm; an operand whose last
    // two axes a Transpose swapped (attention's kᵀ where no fused attention took it, T5's) is read through
    // MatMul's transpose flag, the Transpose (and its gradient's) left unread.
    const ValueId a = ir_of(x), b = ir_of(w);
    const ValueId ua = graph_.value(a).shape.rank() >= 3 ? unswapped(a) : ir::kNone;
    const ValueId ub = graph_.value(b).shape.rank() >= 3 ? unswapped(b) : ir::kNone;
    return b_.matmul(gemm_operand(ua != ir::kNone ? ua : a), gemm_operand(ub != ir::kNone ? ub : b), ua != ir::kNone,
                     ub != ir::kNone);
  }
  const ValueId wv = ir_of(weight);
  const int64_t N = graph_.value(wv).shape[0];
  // The bias: the one Add reading the product, with a (N) parameter as its other operand.
  const int out = ids_.at(n.output(0));
  const auto& readers = f_.readers(out);
  if (readers.size() == 1 && !f_.is_graph_output(out)) {
    const NodeProto& add = f_.proto().graph().node(readers[0].first);
    if (add.op_type() == "Add" && add.input_size() == 2) {
      const int bias = ids_.at(add.input(1 - readers[0].second));
      if (kind(bias) == Kind::Param && host_[size_t(bias)].shape == std::vector<int64_t>{N}) {
        const ValueId y = b_.linear(gemm_operand(ir_of(x)), gemm_operand(wv), ir_of(bias));
        done_[readers[0].first] = y;
        return y;
      }
    }
  }
  return b_.linear(gemm_operand(ir_of(x)), gemm_operand(wv));
}


void Builder::node(const NodeProto& n, int64_t index) {
  const std::string& op = n.op_type();
  for (const std::string& o : n.output())
    if (!o.empty()) producers_[ids_.at(o)] = &n;
  if (auto it = done_.find(index); it != done_.end()) {
    set_ir(n, 0, it->second);
    return;
  }
  if (!n.domain().empty() && n.domain() != "ai.onnx") {
    fail(n, index, str("domain \"", n.domain(), "\" (only the default ONNX domain is supported)"));
    return;
  }
  bool any_ir = false, any_batch = false, any_failed = false;
  for (int k = 0; k < n.input_size(); ++k) {
    const Kind kd = kind(in_id(n, k));
    any_ir |= kd == Kind::Ir || kd == Kind::Param || kd == Kind::IsNaNOf || kd == Kind::Sequence;
    any_batch |= kd == Kind::Batch;
    any_failed |= kd == Kind::Failed;
  }
  if (any_failed) {  // downstream of an op already reported
    for (const std::string& o : n.output())
      if (!o.empty()) kind_[size_t(ids_.at(o))] = Kind::Failed;
    return;
  }
  if (op == "Shape" || op == "Size") {  // static for the batch shape, whatever computes the operand
    HostTensor proxy = HostTensor::zeros(HostType::I64, shape_of(in_id(n, 0)));
    std::vector<const HostTensor*> in{&proxy};
    set_const(ids_.at(n.output(0)), eval_host(n, in)[0]);
    return;
  }
  if (any_ir) {
    if (op == "IsNaN") {
      const int v = ids_.at(n.output(0));
      kind_[size_t(v)] = Kind::IsNaNOf;
      nan_source_[size_t(v)] = in_id(n, 0);
      return;
    }
    try {
      map_ir(n, index);
    } catch (const Error& e) {
      fail(n, index, e.what(), host_supports(op));
    }
    return;
  }
  if (!host_supports(op)) {
    fail(n, index, "no host evaluation for this op");
    return;
  }
  std::vector<const HostTensor*> in;
  for (int k = 0; k < n.input_size(); ++k) {
    const int v = in_id(n, k);
    in.push_back(v < 0 ? nullptr : &host_[size_t(v)]);
  }
  std::vector<HostTensor> out;
  try {
    out = eval_host(n, in);
  } catch (const Error& e) {
    fail(n, index, e.what());
    return;
  }
  for (size_t k = 0; k < out.size() && int(k) < n.output_size(); ++k) {
    if (n.output(int(k)).empty()) continue;
    const int v = ids_.at(n.output(int(k)));
    if (any_batch)
      set_batch(v, std::move(out[k]));
    else
      set_const(v, std::move(out[k]));
  }
  if (any_batch) prog_.nodes.push_back(int(index));
}

int64_t axis_in(int64_t axis, int64_t rank, const char* what) {
  const int64_t a = axis < 0 ? axis + rank : axis;
  FT_CHECK(a >= 0 && a < rank, what, " ", axis, " is out of range for a value of rank ", rank);
  return a;
}

void Builder::map_ir(const NodeProto& n, int64_t index) {
  const std::string& op = n.op_type();
  const int x = in_id(n, 0);
  auto in_shape = [&](int k) { return shape_of(in_id(n, k)); };
  if (op == "Add" || op == "Sub" || op == "Mul" || op == "Div") {
    set_ir(n, 0, binary(n, x, in_id(n, 1)));
  } else if (op == "MatMul") {
    FT_CHECK(in_shape(0).size() >= 2 && in_shape(1).size() >= 2, "MatMul of a 1-D operand is not supported");
    const ValueId fused = attention(n);
    set_ir(n, 0, fused != ir::kNone ? fused : projection(n, index));
  } else if (op == "Gemm") {
    const bool ta = attr_int(n, "transA", 0) != 0, tb = attr_int(n, "transB", 0) != 0;
    const double alpha = attr_float(n, "alpha", 1.0f), beta = attr_float(n, "beta", 1.0f);
    const int c = in_id(n, 2), w = in_id(n, 1);
    const bool out_in = kind(w) == Kind::Param && f_.out_in(names_[size_t(w)]);  // held (out, in): x·Wᵀ
    ValueId y;
    if ((tb || out_in) && !ta && alpha == 1.0 && (c < 0 || beta == 1.0) && (c < 0 || in_shape(2).size() == 1)) {
      y = b_.linear(gemm_operand(ir_of(x)), gemm_operand(ir_of(w)), c < 0 ? ir::kNone : ir_of(c));
    } else {
      y = b_.matmul(gemm_operand(ir_of(x)), gemm_operand(ir_of(w)), ta, tb || out_in);
      if (alpha != 1.0) y = b_.scale(y, alpha);
      if (c >= 0) y = b_.add(y, beta == 1.0 ? ir_of(c) : b_.scale(ir_of(c), beta));
    }
    set_ir(n, 0, y);
  } else if (op == "Pow") {
    double e = 0;
    FT_CHECK(scalar_const(in_id(n, 1), e), "the exponent must be a single constant");
    set_ir(n, 0, b_.graph().add(ops::OpKind::Pow, {ir_of(x)}, {{"exponent", e}}));
  } else if (op == "Relu" && bf16_product(ir_of(x))) {
    // As autocast's bf16 projection hands its result on: ReLU of the result rounded to bf16, which backward keeps
    // (half the bytes); the next projection reads the bf16 result itself (gemm_operand).
    const ValueId y = b_.graph().add(ops::OpKind::Relu, {b_.cast(ir_of(x), DType::bf16)});
    set_ir(n, 0, b_.cast(y, DType::f32));
  } else if (op == "Sqrt" || op == "Erf" || op == "Tanh" || op == "Relu") {
    const ir::OpKind k = op == "Sqrt" ? ops::OpKind::Sqrt : op == "Erf" ? ops::OpKind::Erf
                         : op == "Tanh" ? ops::OpKind::Tanh : ops::OpKind::Relu;
    set_ir(n, 0, b_.graph().add(k, {ir_of(x)}));
  } else if (op == "Sigmoid") {  // σ(x) = (1 + tanh(x/2)) / 2: the IR's Tanh, forward and backward
    const ValueId t = b_.graph().add(ops::OpKind::Tanh, {b_.scale(ir_of(x), 0.5)});
    set_ir(n, 0, b_.scale(b_.add(t, b_.fill(Shape{1}, 1.0)), 0.5));
  } else if (op == "Neg") {
    set_ir(n, 0, b_.scale(ir_of(x), -1.0));
  } else if (op == "Reciprocal") {
    set_ir(n, 0, b_.div(b_.fill(Shape{1}, 1.0), ir_of(x)));
  } else if (op == "Softmax") {
    const int64_t r = int64_t(in_shape(0).size());
    const int64_t axis = axis_in(attr_int(n, "axis", -1), r, "softmax axis");
    FT_CHECK(axis == r - 1, "softmax over axis ", attr_int(n, "axis", -1), " (only the last axis is supported)");
    set_ir(n, 0, b_.softmax(ir_of(x)));
  } else if (op == "LayerNormalization") {
    const int64_t r = int64_t(in_shape(0).size());
    const int64_t axis = axis_in(attr_int(n, "axis", -1), r, "normalisation axis");
    FT_CHECK(axis == r - 1, "normalisation over axes from ", attr_int(n, "axis", -1),
             " (only the last axis is supported)");
    const int64_t C = in_shape(0).back();
    const ValueId beta = in_id(n, 2) >= 0 ? ir_of(in_id(n, 2)) : b_.fill(Shape{C}, 0.0);
    set_ir(n, 0, b_.layer_norm(ir_of(x), ir_of(in_id(n, 1)), beta, attr_float(n, "epsilon", 1e-5f)));
    for (int k = 1; k < n.output_size(); ++k)  // Mean and InvStdDev: only a training graph reads them
      if (!n.output(k).empty()) kind_[size_t(ids_.at(n.output(k)))] = Kind::Failed;
  } else if (op == "InstanceNormalization") {
    // Each (example, channel)'s values normalised over the spatial axes (GroupNorm exports as this over (N, groups,
    // rest)): the IR's LayerNorm of (N, C, spatial) rows, then the per-channel scale and bias unless they are the
    // exporter's ones and zeros.
    const std::vector<int64_t> shape = in_shape(0);
    FT_CHECK(shape.size() >= 3, "InstanceNormalization of a rank-", shape.size(), " value (expected N, C, spatial...)");
    FT_CHECK(in_id(n, 1) >= 0 && in_id(n, 2) >= 0, "InstanceNormalization without its scale and bias inputs");
    int64_t spatial = 1;
    for (size_t k = 2; k < shape.size(); ++k) spatial *= shape[k];
    ValueId rows = b_.reshape(ir_of(x), {shape[0], shape[1], spatial});
    rows = b_.layer_norm(rows, b_.fill(Shape{spatial}, 1.0), b_.fill(Shape{spatial}, 0.0),
                         attr_float(n, "epsilon", 1e-5f));
    ValueId y = b_.reshape(rows, shape);
    std::vector<int64_t> per_channel(shape.size() - 1, 1);
    per_channel[0] = shape[1];
    auto affine = [&](int v, double identity, bool scale) {
      const bool fixed = kind(v) == Kind::Const &&
                         std::all_of(host_[size_t(v)].f.begin(), host_[size_t(v)].f.end(),
                                     [&](float e) { return e == identity; }) && !host_[size_t(v)].f.empty();
      if (fixed) return;
      const ValueId c = b_.reshape(ir_of(v), per_channel);
      y = scale ? b_.mul(y, c) : b_.add(y, c);
    };
    affine(in_id(n, 1), 1.0, true);
    affine(in_id(n, 2), 0.0, false);
    set_ir(n, 0, y);
  } else if (op == "ReduceMean" || op == "ReduceSum" || op == "ReduceL2") {  // L2: sqrt(Σ x²), weight norm's norm
    std::vector<int64_t> axes;
    if (n.input_size() > 1 && !n.input(1).empty())
      axes = const_of(n, 1, "axes").ints();
    else
      axes = attr_ints(n, "axes");
    const int64_t r = int64_t(in_shape(0).size());
    if (axes.empty())
      for (int64_t k = 0; k < r; ++k) axes.push_back(k);
    for (int64_t& a : axes) a = axis_in(a, r, "reduction axis");
    const bool keep = attr_int(n, "keepdims", 1) != 0;
    if (op == "ReduceMean") {
      set_ir(n, 0, b_.reduce_mean(ir_of(x), axes, keep));
    } else if (op == "ReduceSum") {
      set_ir(n, 0, b_.reduce_sum(ir_of(x), axes, keep));
    } else {
      const ValueId squares = b_.mul(ir_of(x), ir_of(x));
      set_ir(n, 0, b_.graph().add(ops::OpKind::Sqrt, {b_.reduce_sum(squares, axes, keep)}));
    }
  } else if (op == "Transpose") {
    std::vector<int64_t> perm = attr_ints(n, "perm");
    if (perm.empty())
      for (int64_t k = int64_t(in_shape(0).size()); k-- > 0;) perm.push_back(k);
    set_ir(n, 0, b_.transpose(ir_of(x), perm));
  } else if (op == "Reshape") {
    const std::vector<int64_t> target =
        onnx_reshape_target(in_shape(0), const_of(n, 1, "the shape").ints(), attr_int(n, "allowzero", 0) != 0, n);
    set_ir(n, 0, target == in_shape(0) ? ir_of(x) : b_.reshape(ir_of(x), target));  // a no-op stays out
  } else if (op == "Squeeze" || op == "Unsqueeze") {
    std::vector<int64_t> axes = n.input_size() > 1 && !n.input(1).empty() ? const_of(n, 1, "axes").ints()
                                                                          : attr_ints(n, "axes");
    const std::vector<int64_t> shape =
        op == "Squeeze" ? squeeze_shape(in_shape(0), axes, n) : unsqueeze_shape(in_shape(0), axes, n);
    set_ir(n, 0, b_.reshape(ir_of(x), shape));
  } else if (op == "Flatten") {
    set_ir(n, 0, b_.reshape(ir_of(x), flatten_shape(in_shape(0), attr_int(n, "axis", 1), n)));
  } else if (op == "Identity") {
    set_ir(n, 0, ir_of(x));
  } else if (op == "Cast" || op == "CastLike") {
    const bool to_float = op == "Cast" ? (attr_int(n, "to", 1) == onnx::TensorProto::FLOAT ||
                                          attr_int(n, "to", 1) == onnx::TensorProto::DOUBLE)
                                       : (is_ir(in_id(n, 1)) || host_[size_t(in_id(n, 1))].is_float());
    FT_CHECK(to_float, "a cast of a computed value to a non-float type");
    set_ir(n, 0, ir_of(x));
  } else if (op == "Dropout") {
    double ratio = 0.5;
    if (n.input_size() > 1 && !n.input(1).empty()) ratio = const_scalar(n, 1, "the ratio");
    FT_CHECK(ratio >= 0 && ratio < 1, "the ratio is ", ratio, ", expected a probability in [0, 1)");
    bool training = false;
    if (n.input_size() > 2 && !n.input(2).empty()) training = const_scalar(n, 2, "training_mode") != 0;
    const ValueId y = ir_of(x);
    set_ir(n, 0, training && spec_.training && ratio > 0 ? b_.dropout(y, ratio) : y);
    if (n.output_size() > 1 && !n.output(1).empty()) kind_[size_t(ids_.at(n.output(1)))] = Kind::Failed;
  } else if (op == "Slice") {
    const std::vector<int64_t> starts = const_of(n, 1, "starts").ints(), ends = const_of(n, 2, "ends").ints();
    std::vector<int64_t> axes, steps;
    if (n.input_size() > 3 && !n.input(3).empty()) axes = const_of(n, 3, "axes").ints();
    if (n.input_size() > 4 && !n.input(4).empty()) steps = const_of(n, 4, "steps").ints();
    if (axes.empty())
      for (size_t k = 0; k < starts.size(); ++k) axes.push_back(int64_t(k));
    FT_CHECK(ends.size() == starts.size() && axes.size() == starts.size() &&
                 (steps.empty() || steps.size() == starts.size()),
             "starts, ends, axes and steps of different lengths (", starts.size(), ", ", ends.size(), ", ",
             axes.size(), ", ", steps.size(), ")");
    std::vector<int64_t> shape = in_shape(0);
    ValueId y = ir_of(x);
    for (size_t k = 0; k < axes.size(); ++k) {
      const int64_t step = steps.empty() ? 1 : steps[k];
      FT_CHECK(step >= 1, "a slice with step ", step, " (fusetrain maps forward steps)");
      const int64_t ax = axis_in(axes[k], int64_t(shape.size()), "slice axis");
      const std::vector<int64_t> dims = graph_.value(y).shape.dims();
      const int64_t dim = dims[size_t(ax)];
      int64_t s = starts[k], e = ends[k];
      if (s < 0) s += dim;
      if (e < 0) e += dim;
      s = std::clamp<int64_t>(s, 0, dim);
      e = std::clamp<int64_t>(e, s, dim);
      if (step == 1) {
        if (s == 0 && e == dim) continue;
        y = b_.slice(y, ax, s, e);
        continue;
      }
      // Every step-th element from s (Swin's patch merging, x[:, 1::2]): a run [base, base + count·step) that
      // starts up to step − 1 before s, as (count, step), its column s − base. The run must fit the axis.
      const int64_t count = (e - s + step - 1) / step, column = std::min(s, step - 1), base = s - column;
      FT_CHECK(base + count * step <= dim, "a slice of every ", step, "th element from ", s, " to ", e,
               " of an axis of ", dim, "; fusetrain maps strided slices whose last step ends inside the axis");
      if (base != 0 || base + count * step != dim) y = b_.slice(y, ax, base, base + count * step);
      std::vector<int64_t> split = dims;
      split[size_t(ax)] = count;
      split.insert(split.begin() + ax + 1, step);
      y = b_.slice(b_.reshape(y, split), ax + 1, column, column + 1);
      std::vector<int64_t> out = dims;
      out[size_t(ax)] = count;
      y = b_.reshape(y, out);
    }
    set_ir(n, 0, y);
  } else if (op == "Gather") {
    const int idx = in_id(n, 1);
    FT_CHECK(is_host(idx), "indices computed from parameters");
    const std::vector<int64_t> shape = in_shape(0);
    const int64_t r = int64_t(shape.size());
    const int64_t axis = axis_in(attr_int(n, "axis", 0), r, "gather axis");
    const HostTensor& ih = host_[size_t(idx)];
    double scalar = 0;
    if (kind(idx) == Kind::Const && ih.shape.empty() && scalar_const(idx, scalar)) {
      // One index: a slice without its axis (e.g. a pooler's first token).
      const int64_t dim = shape[size_t(axis)];
      FT_CHECK(scalar >= double(-dim) && scalar < double(dim), "index ", scalar, " is out of range for ", dim);
      int64_t i = int64_t(scalar);
      if (i < 0) i += dim;
      std::vector<int64_t> out = shape;
      out.erase(out.begin() + axis);
      set_ir(n, 0, b_.reshape(b_.slice(ir_of(x), axis, i, i + 1), out));
      return;
    }
    FT_CHECK(axis == 0, "gathering along axis ", axis, " with an index tensor (only axis 0 is supported)");
    const int64_t padding_idx = kind(x) == Kind::Param ? f_.padding_idx(names_[size_t(x)]) : -1;
    ValueId data = ir_of(x);
    int64_t rest = 1;
    for (int64_t k = 1; k < r; ++k) rest *= shape[size_t(k)];
    if (r != 2) data = b_.reshape(data, {shape[0], rest});
    ValueId y = b_.embedding(data, feed(idx, Feed::AsIs, false), r == 2 ? padding_idx : -1);
    std::vector<int64_t> out = ih.shape;
    out.insert(out.end(), shape.begin() + 1, shape.end());
    set_ir(n, 0, r == 2 ? y : b_.reshape(y, out));
  } else if (op == "GatherND") {
    FT_CHECK(attr_int(n, "batch_dims", 0) == 0, "batch_dims other than 0");
    const int idx = in_id(n, 1);
    FT_CHECK(is_host(idx), "indices computed from parameters");
    const std::vector<int64_t> shape = in_shape(0), ishape = host_[size_t(idx)].shape;
    FT_CHECK(!ishape.empty(), "indices of rank 0 (GatherND's indices end in the tuple length)");
    const int64_t m = ishape.back(), r = int64_t(shape.size());
    FT_CHECK(m >= 1 && m <= r, "index tuples of length ", m, " for data of rank ", r);
    int64_t rows = 1, rest = 1;
    for (int64_t k = 0; k < m; ++k) rows *= shape[size_t(k)];
    for (int64_t k = m; k < r; ++k) rest *= shape[size_t(k)];
    const ValueId rows_of = b_.reshape(ir_of(x), {rows, rest});
    ValueId y = b_.embedding(rows_of, feed(idx, Feed::FlatTuples, false, 0,
                                           std::vector<int64_t>(shape.begin(), shape.begin() + m)));
    std::vector<int64_t> out(ishape.begin(), ishape.end() - 1);
    out.insert(out.end(), shape.begin() + m, shape.end());
    set_ir(n, 0, b_.reshape(y, out));
  } else if (op == "GatherElements") {
    // Each output element is one element of the data: an embedding lookup in the data seen as one column.
    const int idx = in_id(n, 1);
    FT_CHECK(is_host(idx), "indices computed from parameters");
    const std::vector<int64_t> shape = in_shape(0), ishape = host_[size_t(idx)].shape;
    FT_CHECK(ishape.size() == shape.size(), "indices of rank ", ishape.size(), " for data of rank ", shape.size());
    const int64_t axis = axis_in(attr_int(n, "axis", 0), int64_t(shape.size()), "gather axis");
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const ValueId column = b_.reshape(ir_of(x), {numel, 1});
    const ValueId y = b_.embedding(column, feed(idx, Feed::Elements, false, double(axis), shape));
    set_ir(n, 0, b_.reshape(y, ishape));
  } else if (op == "Concat") {
    std::vector<ValueId> xs;
    for (int k = 0; k < n.input_size(); ++k) xs.push_back(ir_of(in_id(n, k)));
    const int64_t axis = axis_in(attr_int(n, "axis", 0), int64_t(in_shape(0).size()), "concatenation axis");
    set_ir(n, 0, b_.concat(xs, axis));
  } else if (op == "Pad") {
    // Constant padding (Swin's maybe_pad, which the exporter writes even when every pad is 0): zeros concatenated
    // on the sides of each padded axis, a negative pad a crop; the gradient is the Concat's and Slice's.
    const std::string mode = attr_string(n, "mode", "constant");
    FT_CHECK(mode == "constant", "Pad in mode \"", mode, "\"; fusetrain maps constant padding");
    const std::vector<int64_t> shape = in_shape(0);
    const int64_t rank = int64_t(shape.size());
    const std::vector<int64_t> pads = const_of(n, 1, "pads").ints();
    std::vector<int64_t> axes;
    if (n.input_size() > 3 && !n.input(3).empty())
      for (int64_t a : const_of(n, 3, "axes").ints()) axes.push_back(axis_in(a, rank, "padded axis"));
    else
      for (int64_t a = 0; a < rank; ++a) axes.push_back(a);
    FT_CHECK(pads.size() == 2 * axes.size(), "Pad with ", pads.size(), " pads for ", axes.size(), " axes");
    const double value = n.input_size() > 2 && !n.input(2).empty() ? const_scalar(n, 2, "constant_value") : 0.0;
    ValueId y = ir_of(x);
    for (size_t k = 0; k < axes.size(); ++k) {
      const int64_t axis = axes[k], before = pads[k], after = pads[k + axes.size()];
      if (before == 0 && after == 0) continue;
      std::vector<int64_t> dims = graph_.value(y).shape.dims();
      if (before < 0 || after < 0) {
        y = b_.slice(y, axis, std::max<int64_t>(0, -before), dims[size_t(axis)] + std::min<int64_t>(0, after));
        dims = graph_.value(y).shape.dims();
      }
      std::vector<ValueId> parts;
      auto side = [&](int64_t width) {
        if (width <= 0) return;
        std::vector<int64_t> fill = dims;
        fill[size_t(axis)] = width;
        parts.push_back(b_.fill(Shape(fill), value, graph_.value(y).dtype));
      };
      side(before);
      parts.push_back(y);
      side(after);
      if (parts.size() > 1) y = b_.concat(parts, axis);
    }
    set_ir(n, 0, y);
  } else if (op == "Split") {
    const std::vector<int64_t> shape = in_shape(0);
    const int64_t axis = axis_in(attr_int(n, "axis", 0), int64_t(shape.size()), "split axis");
    std::vector<int64_t> sizes;
    if (n.input_size() > 1 && !n.input(1).empty())
      sizes = const_of(n, 1, "split").ints();
    else
      sizes = attr_ints(n, "split");
    if (sizes.empty()) {
      const int64_t parts = n.output_size(), dim = shape[size_t(axis)];
      const int64_t each = (dim + parts - 1) / parts;
      for (int64_t k = 0; k < parts; ++k) sizes.push_back(std::min(each, dim - k * each));
    }
    FT_CHECK(int64_t(sizes.size()) == n.output_size(), sizes.size(), " split sizes for ", n.output_size(), " outputs");
    const std::vector<ValueId> ys = b_.split(ir_of(x), axis, sizes);
    for (int k = 0; k < n.output_size(); ++k) set_ir(n, k, ys[size_t(k)]);
  } else if (op == "Where") {
    const ValueId y = where(n, index);
    if (y != ir::kNone) set_ir(n, 0, y);
  } else if (op == "Tile") {
    const std::vector<int64_t> repeats = const_of(n, 1, "repeats").ints();
    FT_CHECK(repeats.size() == in_shape(0).size(), repeats.size(), " repeats for rank ", in_shape(0).size());
    for (int64_t k : repeats)  // each repeat is one more operand of a Concat
      FT_CHECK(k >= 1 && k <= 4096, "a repeat count of ", k, " (fusetrain tiles 1 to 4096 times per axis)");
    ValueId y = ir_of(x);
    for (size_t ax = 0; ax < repeats.size(); ++ax)
      if (repeats[ax] > 1) y = b_.concat(std::vector<ValueId>(size_t(repeats[ax]), y), int64_t(ax));
    set_ir(n, 0, y);
  } else if (op == "Expand") {
    const std::vector<int64_t> target = const_of(n, 1, "the shape").ints();
    const std::vector<int64_t> out = broadcast_shapes(in_shape(0), target, "Expand");
    // A broadcast add of zeros: its gradient sums back over the broadcast axes.
    set_ir(n, 0, out == in_shape(0) ? ir_of(x) : b_.add(ir_of(x), b_.fill(Shape(out), 0.0)));
  } else if (op == "SplitToSequence") {
    // torch.split as the dynamo exporter writes it: a sequence of the pieces, which SequenceAt reads back.
    const std::vector<int64_t> shape = in_shape(0);
    const int64_t axis = axis_in(attr_int(n, "axis", 0), int64_t(shape.size()), "split axis");
    FT_CHECK(n.input_size() > 1 && !n.input(1).empty(), "SplitToSequence without split sizes is not supported");
    const HostTensor& split = const_of(n, 1, "split");
    const int64_t dim = shape[size_t(axis)];
    std::vector<int64_t> sizes;
    if (split.shape.empty()) {  // a scalar: pieces of that size, the last one shorter
      const int64_t each = split.ints().at(0);
      FT_CHECK(each >= 1, "a split size of ", each);
      for (int64_t at = 0; at < dim; at += each) sizes.push_back(std::min(each, dim - at));
      FT_CHECK(sizes.size() <= 4096, dim / each, " pieces (fusetrain splits into at most 4096)");
    } else {
      sizes = split.ints();
      int64_t total = 0;
      for (int64_t k : sizes) {
        FT_CHECK(k >= 1 && k <= dim, "a split size of ", k, " for an axis of ", dim);
        total += k;
      }
      FT_CHECK(total == dim, "split sizes summing to ", total, " for an axis of ", dim);
    }
    const int v = ids_.at(n.output(0));
    sequences_[v] = b_.split(ir_of(x), axis, sizes);
    kind_[size_t(v)] = Kind::Sequence;
  } else if (op == "SequenceAt") {
    FT_CHECK(kind(x) == Kind::Sequence, "SequenceAt of a value that is not a sequence of SplitToSequence");
    const std::vector<ValueId>& items = sequences_.at(x);
    int64_t at = int64_t(const_scalar(n, 1, "position"));
    const int64_t count = int64_t(items.size());
    if (at < 0) at += count;
    FT_CHECK(at >= 0 && at < count, "position ", at, " of a sequence of ", count);
    set_ir(n, 0, items[size_t(at)]);
  } else if (op == "Conv") {
    set_ir(n, 0, conv(n));
  } else if (op == "MaxPool" || op == "AveragePool" || op == "GlobalAveragePool" || op == "GlobalMaxPool") {
    set_ir(n, 0, pool(n));
  } else {
    throw Error("no mapping to fusetrain IR for this op on values computed from parameters");
  }
}


ValueId Builder::output(int v, const std::string& name) {
  FT_CHECK(is_ir(v), "ONNX graph output \"", name, "\" does not depend on any parameter, so there is nothing to train");
  return ir_of(v);
}

// ---- the family -------------------------------------------------------------------------------------------------

// Whether b (r, c) is a (c, r) transposed.
bool is_transpose(const HostTensor& a, const HostTensor& b) {
  const int64_t rows = a.shape[0], cols = a.shape[1];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      if (a.f[size_t(i * cols + j)] != b.f[size_t(j * rows + i)]) return false;
  return true;
}

std::string dir_of(const std::string& path) {
  const std::filesystem::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : ".";
}

OnnxFamily::OnnxFamily(const std::string& path, Head head, nlohmann::json config, const ImportOptions& options)
    : dir_(dir_of(path)),
      config_(std::move(config)),
      padding_rows_(options.padding_rows),
      fuse_attention_(options.fuse_attention) {
  head_ = head;
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in.good(), "cannot open ONNX file ", path);
  FT_CHECK(proto_.ParseFromIstream(&in), path, " is not an ONNX model (its ModelProto does not parse)");
  const onnx::GraphProto& g = proto_.graph();
  FT_CHECK(g.node_size() > 0, path, ": the ONNX graph has no nodes");
  validate_model(proto_, path);
  auto add = [&](const std::string& name) {
    if (name.empty() || ids_.count(name)) return;
    ids_[name] = int(names_.size());
    names_.push_back(name);
  };
  for (const auto& t : g.initializer()) add(t.name());
  for (const auto& i : g.input()) add(i.name());
  for (const auto& n : g.node())
    for (const std::string& o : n.output()) add(o);
  std::set<std::string> frozen(options.frozen.begin(), options.frozen.end());
  std::set<std::string> unset;
  for (const auto& [name, v] : options.values) unset.insert(name);
  for (const auto& t : g.initializer()) {
    HostTensor h = read_tensor(t, dir_);
    if (const auto given = options.values.find(t.name()); given != options.values.end()) {
      FT_CHECK(h.is_float() && given->second.size() == h.f.size(), path, ": the value given for initializer \"",
               t.name(), "\" has ", given->second.size(), " elements; the graph's has ", h.numel(),
               h.is_float() ? "" : " and is not float");
      h.f = given->second;
      unset.erase(t.name());
    }
    const bool trainable = h.is_float() && h.numel() > 1 && !frozen.count(t.name());
    if (trainable) {
      const int64_t bad = [&] {
        for (size_t k = 0; k < h.f.size(); ++k)
          if (!std::isfinite(h.f[k])) return int64_t(k);
        return int64_t(-1);
      }();
      FT_CHECK(bad < 0, path, ": initializer \"", t.name(), "\" holds a non-finite value at element ", bad);
      params_.insert(t.name());
    }
    frozen.erase(t.name());
    inits_.emplace(t.name(), std::move(h));
  }
  if (options.tie_identical) {
    std::vector<const std::string*> kept;
    for (const auto& t : g.initializer()) {
      if (!params_.count(t.name())) continue;
      const HostTensor& h = inits_.at(t.name());
      // A tensor of one repeated value (a fresh bias, a fresh norm weight) is equal to others by chance.
      if (std::all_of(h.f.begin(), h.f.end(), [&](float v) { return v == h.f[0]; })) continue;
      const std::string* same = nullptr;
      bool transposed = false;
      for (const std::string* k : kept) {
        const HostTensor& o = inits_.at(*k);
        if (o.shape == h.shape && o.f == h.f) {
          same = k;
          transposed = false;
          break;
        }
        if (h.shape.size() == 2 && o.shape == std::vector<int64_t>{h.shape[1], h.shape[0]} && is_transpose(o, h)) {
          same = k;
          transposed = true;
          break;
        }
      }
      if (same) {
        tied_[t.name()] = *same;
        if (transposed) tied_transposed_.insert(t.name());
        params_.erase(t.name());
      } else {
        kept.push_back(&inits_.find(t.name())->first);
      }
    }
  }
  readers_.resize(names_.size());
  for (int k = 0; k < g.node_size(); ++k)
    for (int slot = 0; slot < g.node(k).input_size(); ++slot)
      if (!g.node(k).input(slot).empty()) readers_[size_t(ids_.at(g.node(k).input(slot)))].push_back({k, slot});
  if (options.keep_buffers_constant) keep_buffers_constant();
  for (const NodeProto& n : g.node())
    if (n.op_type() == "LayerNormalization")
      for (int slot = 1; slot < std::min(n.input_size(), 3); ++slot)
        if (is_param(n.input(slot))) layer_norm_params_.insert(param_name(n.input(slot)));
  // A weight only ever multiplied as x·W trains in Linear's (out, in) layout, so the projection runs as the
  // built models' Linear (bias and GELU fused into its GEMM by the passes).
  std::set<std::string> tied_targets;
  for (const auto& [copy, target] : tied_) tied_targets.insert(target);
  for (const std::string& name : params_) {
    HostTensor& h = inits_.at(name);
    const auto& readers = readers_[size_t(ids_.at(name))];
    if (h.shape.size() != 2 || readers.empty() || tied_targets.count(name)) continue;
    bool matmul_rhs = true;
    for (const auto& [node, slot] : readers) {
      const NodeProto& r = g.node(node);
      const bool plain_gemm = r.op_type() == "Gemm" && attr_int(r, "transA", 0) == 0 &&
                              attr_int(r, "transB", 0) == 0 && attr_float(r, "alpha", 1.0f) == 1.0f &&
                              attr_float(r, "beta", 1.0f) == 1.0f;  // x·W + c (GPT-2's Conv1D)
      matmul_rhs = matmul_rhs && (r.op_type() == "MatMul" || plain_gemm) && slot == 1;
    }
    if (!matmul_rhs) continue;
    const int64_t rows = h.shape[0], cols = h.shape[1];
    std::vector<float> t(h.f.size());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = h.f[size_t(i * cols + j)];
    h.f = std::move(t);
    h.shape = {cols, rows};
    out_in_.insert(name);
  }
  if (!unset.empty()) {
    std::string names;
    for (const std::string& s : unset) names += (names.empty() ? "" : ", ") + s;
    throw Error(str("values given for initializers not in ", path, ": ", names));
  }
  if (!frozen.empty()) {
    std::string names;
    for (const std::string& s : frozen) names += (names.empty() ? "" : ", ") + s;
    throw Error(str("frozen initializers not in ", path, ": ", names));
  }
  std::set<std::string> init_names;
  for (const auto& t : g.initializer()) init_names.insert(t.name());
  for (const auto& i : g.input()) {
    if (init_names.count(i.name())) continue;
    FT_CHECK(is_batch_input(i.name()), path, ": graph input \"", i.name(),
             "\" is not one fusetrain feeds (expected input_ids, attention_mask, token_type_ids, position_ids, "
             "decoder_input_ids, decoder_attention_mask, pixel_values, input_features or input_values)");
    const int32_t elem = i.type().tensor_type().elem_type();
    if (is_float_input(i.name())) {
      FT_CHECK(i.type().has_tensor_type() && elem == onnx::TensorProto::FLOAT, path, ": graph input \"", i.name(),
               "\" is declared ", i.type().has_tensor_type() ? data_type_name(elem) : "without a type",
               "; fusetrain feeds it as FLOAT, as transformers' image and feature processors give it");
      FT_CHECK(i.type().tensor_type().has_shape() && i.type().tensor_type().shape().dim_size() >= 1, path,
               ": graph input \"", i.name(), "\" has no declared rank");
    } else {
      FT_CHECK(i.type().has_tensor_type() && elem == onnx::TensorProto::INT64, path, ": graph input \"", i.name(),
               "\" is declared ", i.type().has_tensor_type() ? data_type_name(elem) : "without a type",
               "; fusetrain feeds it as INT64, as transformers' tokenizers give it");
    }
    inputs_.push_back(i.name());
  }
  FT_CHECK(has_input("input_ids") || std::any_of(inputs_.begin(), inputs_.end(), is_float_input), path,
           ": the graph has no input_ids, pixel_values, input_features or input_values input");
  FT_CHECK(!has_input("decoder_attention_mask") || has_input("decoder_input_ids"), path,
           ": the graph takes decoder_attention_mask but not decoder_input_ids");
  // The limit of the config's own architecture where fusetrain knows it (none for rotary positions), else the size
  // of the position table the config names.
  try {
    max_positions_ = models::max_positions(config_);
  } catch (const std::exception&) {  // no model_type fusetrain builds, or a config its family refuses
    for (const char* key : {"max_position_embeddings", "n_positions"})
      if (config_.contains(key) && config_[key].is_number_integer()) max_positions_ = config_[key].get<int64_t>();
  }
}

std::map<std::string, Tensor> OnnxFamily::initial_values() const {
  std::map<std::string, Tensor> out;
  for (const std::string& name : params_) {
    const HostTensor& h = inits_.at(name);
    out.emplace(name, Tensor::view(const_cast<float*>(h.f.data()), Shape(h.shape), DType::f32));
  }
  return out;
}

// A parameter's initializer keeps its shape (builds declare the parameter by it) but not its values: the model's
// parameters hold them, and save_onnx writes them from there.
void OnnxFamily::release_initial_values() {
  for (auto& [name, h] : inits_) {
    if (!is_param(name)) continue;
    std::vector<float>().swap(h.f);
    std::vector<int64_t>().swap(h.i);
  }
  for (onnx::TensorProto& t : *proto_.mutable_graph()->mutable_initializer()) {
    if (!is_param(t.name())) continue;
    // Swapped with empty ones, not cleared: clear() keeps a string's and a repeated field's capacity, which held
    // every weight's bytes as long as the model lived (a ViT-Base's 344 MB).
    std::string().swap(*t.mutable_raw_data());
    google::protobuf::RepeatedField<float>().Swap(t.mutable_float_data());
    t.clear_raw_data();
    t.clear_float_data();
    t.clear_external_data();
    t.set_data_location(onnx::TensorProto::DEFAULT);
  }
}

// The dummy values a build evaluates batch-dependent nodes on (their shapes are what matters).
HostTensor dummy_input(const std::string& name, int64_t B, int64_t T) {
  HostTensor t = HostTensor::zeros(HostType::I64, {B, T});
  if (name != "token_type_ids" && name != "position_ids") std::fill(t.i.begin(), t.i.end(), 1);
  if (name == "position_ids")
    for (int64_t k = 0; k < B * T; ++k) t.i[size_t(k)] = k % T;
  return t;
}

// Drops the nodes none of the built graph's results read (what a fused op replaced), so reports and passes see
// only what runs.
void drop_unread(BuiltGraph& built) {
  ir::Graph& g = built.graph;
  std::vector<bool> needed(g.values().size(), false);
  for (ValueId v : {built.logits, built.end_logits, built.hidden_states, built.loss})
    if (v != ir::kNone) needed[size_t(v)] = true;
  for (ir::NodeId id = ir::NodeId(g.nodes().size()) - 1; id >= 0; --id) {
    const ir::Node& n = g.node(id);
    bool live = false;
    for (ValueId v : n.outputs) live = live || needed[size_t(v)];
    if (!live) {
      g.remove_node(id);
      continue;
    }
    for (ValueId v : n.inputs) needed[size_t(v)] = true;
  }
  g.commit();
}

BuiltGraph OnnxFamily::build(const BatchSpec& spec) const {
  BuiltGraph out = build_graph(spec);
  drop_unread(out);
  return out;
}

void OnnxFamily::walk(Builder& bld, const BatchSpec& spec) const {
  const int64_t B = spec.batch;
  const onnx::GraphProto& g = proto_.graph();
  for (const auto& [name, h] : inits_) {
    const int v = ids_.at(name);
    if (params_.count(name))
      bld.set_param(v, h.shape);
    else if (tied_.count(name))
      bld.set_param(v, h.shape, ids_.at(tied_.at(name)), tied_transposed_.count(name) > 0);
    else
      bld.set_const(v, h);
  }
  for (const auto& i : g.input()) {
    if (!is_batch_input(i.name()) || inits_.count(i.name())) continue;
    if (is_float_input(i.name())) {
      const bool given = std::any_of(spec.shapes.begin(), spec.shapes.end(),
                                     [&](const auto& entry) { return entry.first == i.name(); });
      if (!given && is_optional_float_input(i.name())) {
        // An absent mask is zeros (nothing masked) of the batch's size, the graph's fixed sizes, and 1 on its other
        // dynamic axes (the time mask is sliced to the frames, and 1 broadcasts over them); the host folds it away.
        std::vector<int64_t> dims;
        for (const auto& dim : i.type().tensor_type().shape().dim())
          dims.push_back(dims.empty() ? spec.batch : dim.has_dim_value() ? dim.dim_value() : 1);
        bld.set_const(ids_.at(i.name()), HostTensor::zeros(HostType::F32, dims));
        continue;
      }
      bld.set_input(ids_.at(i.name()), bld.builder().input(i.name(), Shape(float_input_shape(proto_, i, spec)), DType::f32));
      continue;
    }
    const auto& dims = i.type().tensor_type().shape().dim();
    FT_CHECK(dims.size() == 2, "ONNX input \"", i.name(), "\" has rank ", dims.size(), "; expected (batch, sequence)");
    const int64_t L = sequence_of(i.name(), spec);
    const int64_t want[2] = {B, L};
    for (int k = 0; k < 2; ++k)
      FT_CHECK(!dims[k].has_dim_value() || dims[k].dim_value() == want[k], "ONNX input \"", i.name(), "\" has fixed ",
               k == 0 ? "batch size " : "sequence length ", dims[k].dim_value(), ", the batch has ", want[k],
               " (export with dynamic axes to train other shapes)");
    bld.set_batch(ids_.at(i.name()), dummy_input(i.name(), B, L));
  }
  for (int k = 0; k < g.node_size(); ++k) bld.node(g.node(k), k);
  bld.finish(g);
}

// An exporter writes a model's buffers (the rotary inv_freq) as initializers, like its weights. A float initializer
// whose every path to the outputs passes through a node only the host evaluates (the Cos and Sin of the rotary
// angles) is such a buffer: it stays a constant, so those nodes fold on the host with the position ids.
// The probe walks the graph at the parameter layout's shape; a graph that cannot be walked there is left to that
// build to report.
void OnnxFamily::keep_buffers_constant() {
  const BatchSpec probe;
  ir::Graph graph;
  HostProgram program;
  Builder bld(*this, names_, ids_, probe, graph, program);
  try {
    walk(bld, probe);
  } catch (const Error&) {
    return;
  }
  std::set<int64_t> host_only;
  for (const Unsupported& u : bld.unsupported())
    if (u.host) host_only.insert(u.index);
  if (host_only.empty()) return;
  const onnx::GraphProto& g = proto_.graph();
  std::set<int> outputs;
  for (const auto& o : g.output()) outputs.insert(ids_.at(o.name()));
  std::set<std::string> tied_targets;
  for (const auto& [copy, target] : tied_) tied_targets.insert(target);
  auto reaches_output = [&](int start) {  // other than through a host-only node
    std::vector<int> work{start};
    std::set<int> seen{start};
    while (!work.empty()) {
      const int v = work.back();
      work.pop_back();
      if (outputs.count(v)) return true;
      for (const auto& [node, slot] : readers_[size_t(v)]) {
        if (host_only.count(node)) continue;
        for (const std::string& o : g.node(node).output())
          if (!o.empty() && seen.insert(ids_.at(o)).second) work.push_back(ids_.at(o));
      }
    }
    return false;
  };
  auto embedding_table = [&](int v) {
    for (const auto& [node, slot] : readers_[size_t(v)])
      if (g.node(node).op_type() == "Gather" && slot == 0) return true;
    return false;
  };
  for (auto it = params_.begin(); it != params_.end();) {
    const int v = ids_.at(*it);
    if (!tied_targets.count(*it) && !embedding_table(v) && !reaches_output(v)) {
      constant_buffers_.push_back(*it);
      it = params_.erase(it);
    } else {
      ++it;
    }
  }
}

BuiltGraph OnnxFamily::build_graph(const BatchSpec& spec) const {
  FT_CHECK(!spec.recompute, "activation checkpointing for a graph imported from ONNX is not supported");
  BuiltGraph out;
  auto program = std::make_shared<HostProgram>();
  Builder bld(*this, names_, ids_, spec, out.graph, *program);
  const onnx::GraphProto& g = proto_.graph();
  walk(bld, spec);
  if (!bld.unsupported().empty()) {
    std::string list;
    for (const Unsupported& u : bld.unsupported()) list += str("\n  ", u.where, ": ", u.why);
    throw Error(str("the ONNX graph has ", bld.unsupported().size(), " node(s) fusetrain cannot import:", list));
  }
  // The outputs the head returns, by Optimum's names, else in order.
  std::map<std::string, int> outputs;
  for (const auto& o : g.output()) outputs[o.name()] = ids_.at(o.name());
  FT_CHECK(!outputs.empty(), "the ONNX graph has no outputs");
  auto named = [&](const char* name) { return outputs.count(name) ? bld.output(outputs[name], name) : ir::kNone; };
  programs_[host_key(spec)] = program;
  models::HeadLogits logits;
  if (head_ == Head::QuestionAnswering && outputs.count("start_logits") && outputs.count("end_logits")) {
    logits = {named("start_logits"), named("end_logits")};
  } else {
    const std::string first = g.output(0).name();
    logits.logits = outputs.count("logits") ? named("logits") : bld.output(outputs[first], first);
    if (head_ == Head::Base) out.hidden_states = logits.logits;
  }
  models::head_outputs(bld.builder(), head_, logits, spec, models::ConfigReader(config_), out);
  return out;
}

std::vector<models::InputDecl> OnnxFamily::inputs() const {
  std::vector<models::InputDecl> out;
  for (const auto& i : proto_.graph().input()) {
    if (!has_input(i.name())) continue;
    if (is_float_input(i.name())) {
      models::InputDecl d{i.name(), DType::f32, i.type().tensor_type().shape().dim_size(), -1,
                          is_optional_float_input(i.name()) ? models::InputSource::Optional
                                                            : models::InputSource::Batch,
                          {}};
      for (const auto& dim : i.type().tensor_type().shape().dim())
        d.fixed.push_back(dim.has_dim_value() ? dim.dim_value() : -1);
      d.fixed[0] = -1;
      out.push_back(std::move(d));
      continue;
    }
    const models::InputSource source = i.name() == "input_ids" || i.name() == "decoder_input_ids"
                                           ? models::InputSource::Batch
                                       : i.name() == "position_ids" ? models::InputSource::Derived
                                                                    : models::InputSource::Optional;
    out.push_back({i.name(), DType::i64, 2, 1, source, {}, is_target_input(i.name())});
  }
  return out;
}

void OnnxFamily::bind_inputs(runtime::Plan& plan, const Batch& batch, const BatchSpec& spec) const {
  const int64_t B = spec.batch, T = spec.seq;
  auto it = programs_.find(host_key(spec));
  FT_CHECK(it != programs_.end(), "no host program for batch shape (", B, ", ", T, ")");
  const HostProgram& prog = *it->second;
  std::vector<HostTensor> env(names_.size());
  std::vector<const HostTensor*> ptr(names_.size(), nullptr);
  for (size_t v = 0; v < names_.size(); ++v)
    if (prog.has_const[v]) ptr[v] = &prog.consts[v];
  for (const std::string& name : inputs_) {
    const int v = ids_.at(name);
    const Tensor& given = batch.get(name);
    if (is_float_input(name)) {  // Model::check_inputs checked its dtype and shape
      if (plan.has_input(name)) plan.upload_input(name, given.data());
      continue;
    }
    const int64_t L = sequence_of(name, spec);
    HostTensor t = dummy_input(name, B, L);
    if (given.data() != nullptr) {
      FT_CHECK(given.dtype() == DType::i64 && given.numel() == B * L, name, " must be int64 of shape (", B, ", ", L,
               ")");
      std::memcpy(t.i.data(), given.data(), size_t(B * L) * sizeof(int64_t));
    }
    env[size_t(v)] = std::move(t);
    ptr[size_t(v)] = &env[size_t(v)];
  }
  const onnx::GraphProto& g = proto_.graph();
  for (int k : prog.nodes) {
    const NodeProto& n = g.node(k);
    std::vector<const HostTensor*> in;
    for (const std::string& i : n.input()) in.push_back(i.empty() ? nullptr : ptr[size_t(ids_.at(i))]);
    std::vector<HostTensor> outs = eval_host(n, in);
    for (size_t o = 0; o < outs.size() && int(o) < n.output_size(); ++o) {
      if (n.output(int(o)).empty()) continue;
      const int v = ids_.at(n.output(int(o)));
      env[size_t(v)] = std::move(outs[o]);
      ptr[size_t(v)] = &env[size_t(v)];
    }
  }
  for (const HostFeed& f : prog.feeds) {
    if (!plan.has_input(f.input)) continue;
    if (f.constant) {
      plan.upload_input(f.input, f.as_float ? static_cast<const void*>(f.const_f.data()) : f.const_i.data());
      continue;
    }
    plan.bind_input(f.input, nullptr);
    if (f.feed == Feed::HeadKeyBias) {
      std::vector<const HostTensor*> terms;
      for (int value : f.terms) {
        FT_CHECK(ptr[size_t(value)] != nullptr, "host value \"", names_[size_t(value)], "\" was not computed");
        terms.push_back(ptr[size_t(value)]);
      }
      fill_head_key_bias(f, terms, plan.staging(f.input).data_as<float>());
      plan.upload_staging(f.input);
      continue;
    }
    const HostTensor* v = ptr[size_t(f.value)];
    FT_CHECK(v != nullptr, "host value \"", names_[size_t(f.value)], "\" was not computed");
    fill_feed(f, *v, plan.staging(f.input).data());
    plan.upload_staging(f.input);
  }
}

}  // namespace detail

using detail::OnnxFamily;

std::unique_ptr<models::Family> make_onnx_family(const std::string& path, Head head, const nlohmann::json& config,
                                                 const ImportOptions& options) {
  return std::make_unique<OnnxFamily>(path, head, config, options);
}

bool is_onnx_family(const models::Family& family) { return dynamic_cast<const OnnxFamily*>(&family) != nullptr; }

std::unique_ptr<models::Model> import_model(const std::string& path, const std::string& task,
                                           const ImportOptions& options) {
  const Head head = models::head_for_task(task);
  const std::filesystem::path config_path = std::filesystem::path(path).parent_path() / "config.json";
  const nlohmann::json config = std::filesystem::exists(config_path) ? io::read_json_file(config_path.string())
                                                                      : nlohmann::json::object();
  // A graph the command line's capture prepared names what of it does not train, and the padding rows of its
  // embedding tables, beside it (fusetrain_capture.json): the model's frozen weights and buffers, nn.Embedding's
  // padding_idx.
  ImportOptions merged = options;
  const std::filesystem::path sidecar = std::filesystem::path(path).parent_path() / "fusetrain_capture.json";
  if (std::filesystem::exists(sidecar)) {
    const nlohmann::json j = io::read_json_file(sidecar.string());
    const nlohmann::json frozen = j.is_object() ? j.value("frozen", nlohmann::json::array()) : nlohmann::json();
    const nlohmann::json rows = j.is_object() ? j.value("padding_rows", nlohmann::json::object()) : nlohmann::json();
    FT_CHECK(frozen.is_array() && rows.is_object(), sidecar.string(), ": expected {\"frozen\": [names], ",
             "\"padding_rows\": {name: row}}");
    for (const nlohmann::json& name : frozen) {
      FT_CHECK(name.is_string(), sidecar.string(), ": \"frozen\" holds ", name.dump(), "; expected names");
      merged.frozen.push_back(name.get<std::string>());
    }
    for (const auto& [name, row] : rows.items()) {
      FT_CHECK(row.is_number_integer(), sidecar.string(), ": padding row of \"", name, "\" is ", row.dump(),
               "; expected an integer");
      merged.padding_rows.emplace(name, row.get<int64_t>());
    }
  }
  return models::Model::from_family(make_onnx_family(path, head, config, merged), config, head);
}

void save_onnx(const models::Model& model, const std::string& path) {
  const auto* family = dynamic_cast<const OnnxFamily*>(&model.family());
  FT_CHECK(family != nullptr, model.architecture(), " was not imported from ONNX (use fusetrain export to write its "
                                                  "graph)");
  onnx::ModelProto proto = family->proto();
  int64_t bytes = 0;
  for (onnx::TensorProto& t : *proto.mutable_graph()->mutable_initializer()) {
    if (!family->is_param(t.name())) continue;
    Tensor p = model.host_parameter(family->param_name(t.name()));
    std::vector<float> transposed;
    if (family->tied_transposed(t.name()) || family->out_in(t.name())) {
      const int64_t rows = p.shape()[0], cols = p.shape()[1];
      transposed.resize(size_t(rows * cols));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) transposed[size_t(j * rows + i)] = p.data_as<float>()[i * cols + j];
      p = Tensor::view(transposed.data(), Shape{cols, rows}, DType::f32);
    }
    const int64_t bad = find_nonfinite(p.data(), DType::f32, p.numel());
    FT_CHECK(bad < 0, "parameter \"", t.name(), "\" holds a non-finite value at element ", bad,
             "; nothing was written to ", path);
    t.clear_float_data();
    t.clear_external_data();
    t.set_data_location(onnx::TensorProto::DEFAULT);
    t.set_data_type(onnx::TensorProto::FLOAT);
    t.set_raw_data(std::string(static_cast<const char*>(p.data()), size_t(p.nbytes())));
    bytes += p.nbytes();
  }
  FT_CHECK(bytes < (int64_t{1} << 31) - (int64_t{1} << 24), "the parameters take ", bytes,
           " bytes; an ONNX file with inline initializers must stay under 2 GiB");
  for (const onnx::TensorProto& t : proto.graph().initializer())
    FT_CHECK(t.data_location() != onnx::TensorProto::EXTERNAL, "constant initializer \"", t.name(),
             "\" is stored as external data, which writing the graph back does not copy; nothing was written to ",
             path);
  std::string data;
  FT_CHECK(proto.SerializeToString(&data), "cannot serialise the ONNX model for ", path);
  io::write_file_atomic(path, {io::ByteSpan{data.data(), data.size()}});
}

int64_t graph_nodes(const models::Model& model) {
  const auto* family = dynamic_cast<const OnnxFamily*>(&model.family());
  return family ? family->proto().graph().node_size() : 0;
}

std::vector<std::string> constant_buffers(const models::Model& model) {
  const auto* family = dynamic_cast<const OnnxFamily*>(&model.family());
  return family ? family->constant_buffers() : std::vector<std::string>{};
}

}  // namespace fusetrain::onnx_import
