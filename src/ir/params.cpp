// decode_params: the one place that reads attribute names. The switch has no default, so a
// new op in ops.def fails to compile until its attributes are decoded here (-Werror=switch);
// each case fills ParamsOf<op>, so a Params column naming another struct fails to compile too.
#include "fusetrain/core/quant.h"
#include <cmath>
#include "fusetrain/ir/params.h"

#include <vector>

#include "fusetrain/core/error.h"

namespace fusetrain::ir {
namespace {

using namespace ops;

const char* type_name(const AttrValue& v) {
  switch (v.index()) {
    case 0:
      return "an integer";
    case 1:
      return "a number";
    case 2:
      return "a list of integers";
    default:
      return "a string";
  }
}

// Reads attributes by name, remembering which ones it has looked at, so that finish() can
// reject the rest.
class AttrReader {
 public:
  AttrReader(OpKind op, const Attrs& attrs, const std::string& node_name)
      : op_(op), attrs_(attrs), node_name_(node_name), known_(attrs.items().size(), false) {}

  bool has(const char* name) { return find(name) != nullptr; }
  int64_t integer(const char* name) { return get<int64_t>(require(name, "an integer"), name, "an integer"); }
  int64_t integer(const char* name, int64_t fallback) { return has(name) ? integer(name) : fallback; }
  bool flag(const char* name, bool fallback) { return integer(name, fallback ? 1 : 0) != 0; }
  double number(const char* name) {
    const AttrValue& v = require(name, "a number");
    if (const int64_t* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
    return get<double>(v, name, "a number");
  }
  double number(const char* name, double fallback) { return has(name) ? number(name) : fallback; }
  std::vector<int64_t> integers(const char* name) {
    return get<std::vector<int64_t>>(require(name, "a list of integers"), name, "a list of integers");
  }
  std::string string(const char* name) { return get<std::string>(require(name, "a string"), name, "a string"); }
  std::string string(const char* name, const std::string& fallback) { return has(name) ? string(name) : fallback; }

  /// A dtype name (any dtype).
  DType dtype(const char* name, DType fallback) {
    if (!has(name)) return fallback;
    const std::string text = string(name);
    std::optional<DType> t = parse_dtype(text);
    if (!t) fail(str(name, " names an unknown dtype \"", text, "\""));
    return *t;
  }
  DType dtype(const char* name) {
    require(name, "a dtype name");
    return dtype(name, DType::f32);
  }
  /// "f32" or "bf16": ops that compute in f32 and may round their result.
  DType f32_or_bf16(const char* name) {
    const std::string text = string(name, "f32");
    if (text != "f32" && text != "bf16") fail(str(name, " must be \"f32\" or \"bf16\", found \"", text, "\""));
    return text == "bf16" ? DType::bf16 : DType::f32;
  }
  GeluApproximation approximation() {
    const std::string text = string("approximate", "none");
    if (text != "none" && text != "tanh")
      fail(str("approximate must be \"none\" or \"tanh\", found \"", text, "\""));
    return text == "tanh" ? GeluApproximation::Tanh : GeluApproximation::None;
  }

  /// Rejects attributes that were not read; returns `params`.
  template <typename P>
  OpParams finish(P params) {
    for (size_t i = 0; i < known_.size(); ++i)
      if (!known_[i])
        fail(str("unknown attribute \"", attrs_.items()[i].first, "\" (", op_name(op_), " takes ",
                 read_names_.empty() ? std::string("no attributes") : read_names_, ")"));
    return OpParams(std::move(params));
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(str(op_name(op_), node_name_.empty() ? "" : str(" \"", node_name_, "\""), ": ", what));
  }

 private:
  const AttrValue* find(const char* name) {
    note(name);
    const auto& items = attrs_.items();
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].first == name) {
        known_[i] = true;
        return &items[i].second;
      }
    return nullptr;
  }
  void note(const char* name) {
    for (const char* seen : seen_)
      if (std::string_view(seen) == name) return;
    seen_.push_back(name);
    read_names_ += str(read_names_.empty() ? "" : ", ", name);
  }
  const AttrValue& require(const char* name, const char* expected) {
    const AttrValue* v = find(name);
    if (v == nullptr) fail(str("missing attribute \"", name, "\" (", expected, ")"));
    return *v;
  }
  template <typename T>
  const T& get(const AttrValue& v, const char* name, const char* expected) const {
    const T* p = std::get_if<T>(&v);
    if (p == nullptr) fail(str("attribute \"", name, "\" should be ", expected, ", found ", type_name(v)));
    return *p;
  }

  OpKind op_;
  const Attrs& attrs_;
  const std::string& node_name_;
  std::vector<bool> known_;
  std::vector<const char*> seen_;
  std::string read_names_;
};

void read_dropout(AttrReader& r, DropoutParams& p, bool required) {
  p.p = required ? r.number("p") : r.number("p", p.p);
  p.seed = static_cast<uint64_t>(required ? r.integer("seed") : r.integer("seed", static_cast<int64_t>(p.seed)));
  p.index_block = r.integer("index_block", p.index_block);
  p.index_stride = r.integer("index_stride", p.index_stride);
  p.index_start = r.integer("index_start", p.index_start);
}

OpParams decode(OpKind op, AttrReader& r) {
  switch (op) {
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Mul:
    case OpKind::Div:
    case OpKind::Tanh:
    case OpKind::Relu:
    case OpKind::Sqrt:
    case OpKind::Erf:
    case OpKind::Softmax:
    case OpKind::SigmoidCrossEntropy:
    case OpKind::Copy:
    case OpKind::TanhBackward:
    case OpKind::ReluBackward:
    case OpKind::ErfBackward:
    case OpKind::SoftmaxBackward:
    case OpKind::LayerNormBackward:
    case OpKind::RMSNormBackward:
    case OpKind::SwiGLU:
    case OpKind::SwiGLUBackward:
    case OpKind::SigmoidCrossEntropyBackward:
      return r.finish(NoParams{});
    case OpKind::Fill: {
      ParamsOf<OpKind::Fill> p;
      p.shape = r.integers("shape");
      p.value = r.number("value");
      p.dtype = r.dtype("dtype", p.dtype);
      return r.finish(p);
    }
    case OpKind::MatMul: {
      ParamsOf<OpKind::MatMul> p;
      p.trans_a = r.flag("trans_a", p.trans_a);
      p.trans_b = r.flag("trans_b", p.trans_b);
      p.out_dtype = r.dtype("out_dtype", p.out_dtype);
      return r.finish(p);
    }
    case OpKind::Linear: {
      ParamsOf<OpKind::Linear> p;
      p.out_dtype = r.f32_or_bf16("out_dtype");
      return r.finish(p);
    }
    case OpKind::LinearGelu: {
      ParamsOf<OpKind::LinearGelu> p;
      p.approximate = r.approximation();
      p.z_dtype = r.f32_or_bf16("z_dtype");
      p.out_dtype = r.f32_or_bf16("out_dtype");
      return r.finish(p);
    }
    case OpKind::Scale: {
      ParamsOf<OpKind::Scale> p;
      p.alpha = r.number("alpha");
      return r.finish(p);
    }
    case OpKind::Gelu: {
      ParamsOf<OpKind::Gelu> p;
      p.approximate = r.approximation();
      p.out_dtype = r.f32_or_bf16("out_dtype");
      return r.finish(p);
    }
    case OpKind::GeluBackward: {
      ParamsOf<OpKind::GeluBackward> p;
      p.approximate = r.approximation();
      return r.finish(p);
    }
    case OpKind::MatMulGeluBackward: {
      ParamsOf<OpKind::MatMulGeluBackward> p;
      p.trans_a = r.flag("trans_a", p.trans_a);
      p.trans_b = r.flag("trans_b", p.trans_b);
      p.approximate = r.approximation();
      p.out_dtype = r.f32_or_bf16("out_dtype");
      p.column_sum = r.flag("column_sum", p.column_sum);
      p.gelu_out = r.flag("gelu_out", p.gelu_out);
      p.gelu_dtype = r.f32_or_bf16("gelu_dtype");
      return r.finish(p);
    }
    case OpKind::Pow: {
      ParamsOf<OpKind::Pow> p;
      p.exponent = r.number("exponent");
      return r.finish(p);
    }
    case OpKind::Conv:
    case OpKind::ConvBackwardData:
    case OpKind::ConvBackwardWeight: {
      ParamsOf<OpKind::Conv> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::Conv>, ParamsOf<OpKind::ConvBackwardData>> &&
                    std::is_same_v<ParamsOf<OpKind::Conv>, ParamsOf<OpKind::ConvBackwardWeight>>);
      if (r.has("strides")) p.strides = r.integers("strides");
      if (r.has("pads")) p.pads = r.integers("pads");
      if (r.has("dilations")) p.dilations = r.integers("dilations");
      p.group = r.integer("group", p.group);
      if (op != OpKind::Conv) p.shape = r.integers("shape");
      return r.finish(p);
    }
    case OpKind::Pool:
    case OpKind::PoolBackward: {
      ParamsOf<OpKind::Pool> p;
      p.max = r.flag("max", p.max);
      p.kernel = r.integers("kernel");
      if (r.has("strides")) p.strides = r.integers("strides");
      if (r.has("pads")) p.pads = r.integers("pads");
      if (r.has("dilations")) p.dilations = r.integers("dilations");
      p.ceil_mode = r.flag("ceil_mode", p.ceil_mode);
      p.count_include_pad = r.flag("count_include_pad", p.count_include_pad);
      return r.finish(p);
    }
    case OpKind::RoPE: {
      ParamsOf<OpKind::RoPE> p;
      p.inverse = r.flag("inverse", p.inverse);
      return r.finish(p);
    }
    case OpKind::LayerNorm:
    case OpKind::RMSNorm: {
      ParamsOf<OpKind::LayerNorm> p;
      p.eps = r.number("eps");
      return r.finish(p);
    }
    case OpKind::AddLayerNorm: {
      ParamsOf<OpKind::AddLayerNorm> p;
      p.eps = r.number("eps");
      read_dropout(r, p.dropout, false);
      return r.finish(p);
    }
    case OpKind::Embedding: {
      ParamsOf<OpKind::Embedding> p;
      p.padding_idx = r.integer("padding_idx", p.padding_idx);
      return r.finish(p);
    }
    case OpKind::EmbeddingBackward: {
      ParamsOf<OpKind::EmbeddingBackward> p;
      p.num_embeddings = r.integer("num_embeddings");
      p.padding_idx = r.integer("padding_idx", p.padding_idx);
      return r.finish(p);
    }
    case OpKind::Dropout:
    case OpKind::DropoutAdd: {
      ParamsOf<OpKind::Dropout> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::Dropout>, ParamsOf<OpKind::DropoutAdd>>);
      read_dropout(r, p, true);
      return r.finish(p);
    }
    case OpKind::Reshape:
    case OpKind::ExpandTo:
    case OpKind::ReduceSumTo: {
      ParamsOf<OpKind::Reshape> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::Reshape>, ParamsOf<OpKind::ExpandTo>> &&
                    std::is_same_v<ParamsOf<OpKind::Reshape>, ParamsOf<OpKind::ReduceSumTo>>);
      p.shape = r.integers("shape");
      return r.finish(p);
    }
    case OpKind::Transpose: {
      ParamsOf<OpKind::Transpose> p;
      p.perm = r.integers("perm");
      return r.finish(p);
    }
    case OpKind::Split: {
      ParamsOf<OpKind::Split> p;
      p.axis = r.integer("axis");
      p.sizes = r.integers("sizes");
      return r.finish(p);
    }
    case OpKind::Concat: {
      ParamsOf<OpKind::Concat> p;
      p.axis = r.integer("axis");
      return r.finish(p);
    }
    case OpKind::Slice: {
      ParamsOf<OpKind::Slice> p;
      p.axis = r.integer("axis");
      p.start = r.integer("start");
      p.end = r.integer("end");
      return r.finish(p);
    }
    case OpKind::SliceBackward: {
      ParamsOf<OpKind::SliceBackward> p;
      p.shape = r.integers("shape");
      p.axis = r.integer("axis");
      p.start = r.integer("start");
      p.end = r.integer("end");
      return r.finish(p);
    }
    case OpKind::ReduceSum:
    case OpKind::ReduceMean: {
      ParamsOf<OpKind::ReduceSum> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::ReduceSum>, ParamsOf<OpKind::ReduceMean>>);
      p.axes = r.integers("axes");
      p.keepdims = r.flag("keepdims", p.keepdims);
      return r.finish(p);
    }
    case OpKind::Cast:
    case OpKind::CastColumnSum: {
      ParamsOf<OpKind::Cast> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::Cast>, ParamsOf<OpKind::CastColumnSum>>);
      p.dtype = r.dtype("dtype");
      return r.finish(p);
    }
    case OpKind::SoftmaxCrossEntropy:
    case OpKind::SoftmaxCrossEntropyBackward:
    case OpKind::TokenStats: {
      ParamsOf<OpKind::SoftmaxCrossEntropy> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::SoftmaxCrossEntropy>,
                                   ParamsOf<OpKind::SoftmaxCrossEntropyBackward>>);
      p.ignore_index = r.integer("ignore_index", p.ignore_index);
      return r.finish(p);
    }
    case OpKind::LinearCrossEntropy: {
      ParamsOf<OpKind::LinearCrossEntropy> p;
      p.ignore_index = r.integer("ignore_index", p.ignore_index);
      p.chunk_rows = r.integer("chunk_rows", p.chunk_rows);
      p.weight_grad = r.flag("weight_grad", p.weight_grad);
      p.token_stats = r.flag("token_stats", p.token_stats);
      return r.finish(p);
    }
    case OpKind::TokenLogProbs:
    case OpKind::TokenLogProbsBackward:
    case OpKind::LinearLogProbs:
    case OpKind::LinearLogProbsWeightGrad: {
      ParamsOf<OpKind::TokenLogProbs> p;
      p.ignore_index = r.integer("ignore_index", p.ignore_index);
      p.chunk_rows = r.integer("chunk_rows", p.chunk_rows);
      p.input_grad = r.flag("input_grad", p.input_grad);
      p.row_stats = r.flag("row_stats", p.row_stats);
      return r.finish(p);
    }
    case OpKind::QuantizedLinear:
    case OpKind::QuantizedLinearBackward: {
      ParamsOf<OpKind::QuantizedLinear> p;
      p.rows = r.integer("rows");
      p.cols = r.integer("cols");
      p.bits = r.integer("bits", p.bits);
      p.blocksize = r.integer("blocksize", p.blocksize);
      p.bf16 = r.flag("bf16", p.bf16);
      p.round_output = r.flag("round_output", p.round_output);
      if (p.rows <= 0 || p.cols <= 0) r.fail(str("rows ", p.rows, " and cols ", p.cols, ": expected positive sizes"));
      if (quant::block_shift(p.blocksize) < 0)
        r.fail(str("blocksize ", p.blocksize, ": expected a power of two from 32 to 4096"));
      if (p.bits != 4 && p.bits != 8) r.fail(str("bits ", p.bits, ": expected 4 (NF4, FP4) or 8 (LLM.int8)"));
      if (p.bits == 8 && p.bf16) r.fail("bits 8: an int8 weight dequantises to f32 (bf16 0)");
      if (p.bits == 4 && p.rows * p.cols % 2 != 0) r.fail(str("rows x cols = ", p.rows * p.cols, ": two 4-bit codes a byte need an even count"));
      return r.finish(p);
    }
    case OpKind::PreferenceLoss:
    case OpKind::PreferenceLossBackward: {
      ParamsOf<OpKind::PreferenceLoss> p;
      p.loss_type = r.string("loss_type", p.loss_type);
      if (p.loss_type != "sigmoid" && p.loss_type != "hinge" && p.loss_type != "ipo")
        r.fail(str("loss_type \"", p.loss_type, "\": expected sigmoid, hinge or ipo"));
      p.beta = r.number("beta", p.beta);
      if (!(p.beta > 0.0) || !std::isfinite(p.beta)) r.fail(str("beta ", p.beta, ": expected a finite number > 0"));
      return r.finish(p);
    }
    case OpKind::CtcLoss:
    case OpKind::CtcLossBackward: {
      ParamsOf<OpKind::CtcLoss> p;
      p.blank = r.integer("blank", p.blank);
      if (p.blank < 0) r.fail(str("blank ", p.blank, ": expected a class index >= 0"));
      p.zero_infinity = r.flag("zero_infinity", p.zero_infinity);
      p.per_target = r.flag("per_target", p.per_target);
      return r.finish(p);
    }
    case OpKind::Attention:
    case OpKind::AttentionBackward: {
      ParamsOf<OpKind::Attention> p;
      static_assert(std::is_same_v<ParamsOf<OpKind::Attention>, ParamsOf<OpKind::AttentionBackward>>);
      p.scale = r.number("scale");
      p.causal = r.flag("causal", p.causal);
      p.window = r.integer("window", p.window);
      p.softcap = r.number("softcap", p.softcap);
      p.seq_major = r.flag("seq_major", p.seq_major);
      p.dropout_p = r.number("dropout_p", p.dropout_p);
      p.seed = static_cast<uint64_t>(r.integer("seed", static_cast<int64_t>(p.seed)));
      if (r.has("rng_rows")) p.rng_rows = r.integer("rng_rows");
      p.rng_row_start = r.integer("rng_row_start", p.rng_row_start);
      p.out_dtype = r.f32_or_bf16("out_dtype");
      p.score_bias = r.flag("score_bias", p.score_bias);
      return r.finish(p);
    }
  }
  r.fail("no attribute decoder for this op");
}

}  // namespace

OpParams decode_params(OpKind op, const Attrs& attrs, const std::string& node_name) {
  AttrReader reader(op, attrs, node_name);
  OpParams params = decode(op, reader);
  if (params.index() != ops::params_index(op))
    reader.fail(str("decoded ", ops::params_name(params.index()), " but ops.def names ",
                    ops::params_name(ops::params_index(op))));
  return params;
}

}  // namespace fusetrain::ir
