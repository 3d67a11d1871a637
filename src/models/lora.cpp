// LoRA: the configuration (PEFT's adapter_config.json) and the graph rewrite that adds the adapters.
#include <algorithm>
#include <cmath>
#include <map>

#include "fusetrain/core/error.h"
#include "fusetrain/core/quant.h"
#include "fusetrain/io/json_fields.h"
#include "models/family.h"
#include "models/lora_graph.h"

namespace fusetrain::models {

using ir::NodeId;
using ir::OpKind;
using ir::ValueId;

double LoraConfig::scaling() const { return use_rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

bool LoraConfig::matches(const std::vector<std::string>& patterns, const std::string& name) {
  for (const std::string& p : patterns)
    if (name == p || (name.size() > p.size() && ends_with(name, "." + p))) return true;
  return false;
}

void LoraConfig::validate() const {
  FT_CHECK(r > 0, "LoRA: r must be a positive integer, found ", r);
  FT_CHECK(std::isfinite(alpha) && alpha > 0, "LoRA: lora_alpha must be a positive number, found ", alpha);
  FT_CHECK(dropout >= 0 && dropout < 1, "LoRA: lora_dropout must be in [0, 1), found ", dropout);
  FT_CHECK(!target_modules.empty(), "LoRA: target_modules is empty (name the projections to adapt, e.g. q_proj,v_proj)");
  for (const std::string& t : target_modules) FT_CHECK(!t.empty(), "LoRA: target_modules holds an empty name");
  FT_CHECK(base_dtype == DType::f32 || base_dtype == DType::bf16, "LoRA: the base weights can be kept in f32 or bf16, ",
           "not ", dtype_name(base_dtype));
  FT_CHECK(quant_type.empty() || quant_type == "nf4" || quant_type == "fp4" || quant_type == "int8",
           "LoRA: quant_type \"", quant_type, "\": expected nf4, fp4 or int8");
  FT_CHECK(quant_type != "int8" || !quant_bf16, "LoRA: an int8 (LLM.int8) base dequantises to f32; quant_bf16 must be "
           "false");
  FT_CHECK(quant_type.empty() == quantized.empty(), "LoRA: quant_type and the quantised weights go together (",
           quant_type.empty() ? "no quant_type" : "quant_type " + quant_type, ", ", quantized.size(), " weights)");
  FT_CHECK(quant::block_shift(quant_blocksize) >= 0, "LoRA: quant_blocksize ", quant_blocksize,
           ": expected a power of two from 32 to 4096");
}

nlohmann::json LoraConfig::to_peft_json(const std::string& task_type, const std::string& base_model) const {
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"task_type", task_type.empty() ? nlohmann::json(nullptr) : nlohmann::json(task_type)},
                      {"base_model_name_or_path", base_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(base_model)},
                      {"r", r},
                      {"lora_alpha", alpha},
                      {"lora_dropout", dropout},
                      {"target_modules", target_modules},
                      {"modules_to_save", modules_to_save.empty() ? nlohmann::json(nullptr)
                                                                  : nlohmann::json(modules_to_save)},
                      {"use_rslora", use_rslora},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"inference_mode", true},
                      {"init_lora_weights", true},
                      {"use_dora", false},
                      {"layers_to_transform", nullptr},
                      {"layers_pattern", nullptr},
                      {"rank_pattern", nlohmann::json::object()},
                      {"alpha_pattern", nlohmann::json::object()}};
  // lora_alpha as an integer when it is one, as PEFT writes it.
  if (alpha == std::floor(alpha) && std::abs(alpha) < 1e15) j["lora_alpha"] = static_cast<int64_t>(alpha);
  return j;
}

LoraConfig LoraConfig::from_peft_json(const nlohmann::json& json, const std::string& file) {
  FT_CHECK(json.is_object(), file, ": expected a JSON object (PEFT's adapter_config.json)");
  const std::string type = json.value("peft_type", std::string());
  FT_CHECK(type == "LORA", file, ": \"peft_type\" is \"", type, "\"; fusetrain trains LORA adapters");
  auto refuse_if = [&](const char* key, bool set, const char* what) {
    FT_CHECK(!set, file, ": \"", key, "\" is ", json[key].dump(), "; fusetrain does not implement ", what);
  };
  auto non_empty = [&](const char* key) {
    return json.contains(key) && !json[key].is_null() && !(json[key].is_object() && json[key].empty()) &&
           !(json[key].is_array() && json[key].empty());
  };
  refuse_if("use_dora", json.value("use_dora", false), "DoRA");
  refuse_if("rank_pattern", non_empty("rank_pattern"), "per-module ranks");
  refuse_if("alpha_pattern", non_empty("alpha_pattern"), "per-module alphas");
  refuse_if("layers_to_transform", non_empty("layers_to_transform"), "adapters on some layers only");
  refuse_if("fan_in_fan_out", json.value("fan_in_fan_out", false), "fan_in_fan_out weights");
  const std::string bias = json.value("bias", std::string("none"));
  FT_CHECK(bias == "none", file, ": \"bias\" is \"", bias, "\"; fusetrain trains LoRA with bias \"none\"");
  LoraConfig c;
  FT_CHECK(json.contains("r") && json["r"].is_number_integer(), file, ": \"r\" must be an integer");
  c.r = json["r"].get<int64_t>();
  FT_CHECK(json.contains("lora_alpha") && json["lora_alpha"].is_number(), file, ": \"lora_alpha\" must be a number");
  c.alpha = json["lora_alpha"].get<double>();
  if (json.contains("lora_dropout") && !json["lora_dropout"].is_null()) {
    FT_CHECK(json["lora_dropout"].is_number(), file, ": \"lora_dropout\" must be a number");
    c.dropout = json["lora_dropout"].get<double>();
  }
  c.use_rslora = json.value("use_rslora", false);
  const nlohmann::json& targets = json.contains("target_modules") ? json["target_modules"] : nlohmann::json();
  if (targets.is_string()) {
    c.target_modules = {targets.get<std::string>()};
  } else {
    FT_CHECK(targets.is_array(), file, ": \"target_modules\" must be a list of module names");
    for (const auto& t : targets) {
      FT_CHECK(t.is_string(), file, ": \"target_modules\" must be a list of module names, found ", t.dump());
      c.target_modules.push_back(t.get<std::string>());
    }
  }
  if (non_empty("modules_to_save")) {
    FT_CHECK(json["modules_to_save"].is_array(), file, ": \"modules_to_save\" must be a list of module names");
    for (const auto& t : json["modules_to_save"]) {
      FT_CHECK(t.is_string(), file, ": \"modules_to_save\" must be a list of module names, found ", t.dump());
      c.modules_to_save.push_back(t.get<std::string>());
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(str(file, ": ", e.what()));
  }
  return c;
}

namespace lora {

std::string a_name(const std::string& module) { return module + ".lora_A.weight"; }
std::string b_name(const std::string& module) { return module + ".lora_B.weight"; }

namespace {

// A projection reading a weight: node `node` multiplies its input 0 by `operand` (the weight or a cast of it).
struct Use {
  NodeId node;
  ValueId operand;
  bool in_out;  // the weight is (in, out): MatMul without trans_b
};

// Whether node `n` multiplies input 0 by `operand` as a projection; sets in_out.
bool projects(const ir::Node& n, ValueId operand, bool& in_out) {
  if (n.op == OpKind::Linear && n.inputs.size() >= 2 && n.inputs[1] == operand && n.inputs[0] != operand) {
    in_out = false;
    return true;
  }
  if (n.op == OpKind::MatMul && n.inputs[1] == operand && n.inputs[0] != operand &&
      n.attrs.get_int("trans_a", 0) == 0) {
    in_out = n.attrs.get_int("trans_b", 0) == 0;
    return true;
  }
  return false;
}

// The projections reading `w` directly or through one Cast; `other` names a reader of another kind.
std::vector<Use> projection_uses(const ir::Graph& g, const std::vector<std::vector<NodeId>>& readers, ValueId w,
                                 std::string& other) {
  std::vector<Use> uses;
  auto classify = [&](NodeId r, ValueId operand) {
    bool in_out = false;
    if (projects(g.node(r), operand, in_out))
      uses.push_back({r, operand, in_out});
    else if (other.empty())
      other = ir::op_name(g.node(r).op);
  };
  for (NodeId r : readers[size_t(w)]) {
    const ir::Node& n = g.node(r);
    if (n.op == OpKind::Cast) {
      for (NodeId r2 : readers[size_t(n.outputs[0])]) classify(r2, n.outputs[0]);
    } else {
      classify(r, w);
    }
  }
  return uses;
}

std::string module_of(const std::string& param) {
  const size_t dot = param.rfind('.');
  return dot == std::string::npos ? std::string() : param.substr(0, dot);
}

bool starts_with_any(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes)
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

ValueId cast_before(ir::Graph& g, NodeId anchor, ValueId x, DType dtype) {
  if (g.value(x).dtype == dtype) return x;
  return g.insert_before(anchor, OpKind::Cast, {x}, {{"dtype", std::string(dtype_name(dtype))}})[0];
}

// Adds s·(dropout(x)·Aᵀ)·Bᵀ to the output of projection `use`.
void add_adapter(ir::Graph& g, const Use& use, ValueId a, ValueId b, const LoraConfig& c, bool training,
                 int64_t stream, const std::vector<ValueId*>& watched) {
  const ir::Node& p = g.node(use.node);
  const NodeId id = p.id;
  const ValueId x = p.inputs[0], y = p.outputs[0];
  const DType dt = g.value(use.operand).dtype;
  const std::string name = g.value(a).name;
  ValueId in = x;
  if (training && c.dropout > 0) {
    // Dropout on the f32 input (the one a bf16 projection's cast reads), as PEFT's lora_dropout sees it.
    ValueId src = x;
    const ir::Value& xv = g.value(x);
    if (xv.dtype != DType::f32) {
      if (xv.producer != ir::kNone && g.node(xv.producer).op == OpKind::Cast &&
          g.value(g.node(xv.producer).inputs[0]).dtype == DType::f32)
        src = g.node(xv.producer).inputs[0];
      else
        src = cast_before(g, id, x, DType::f32);
    }
    in = g.insert_before(id, OpKind::Dropout, {src}, {{"p", c.dropout}, {"seed", stream}}, name + ":dropout")[0];
  }
  in = cast_before(g, id, in, dt);
  ValueId h = g.insert_before(id, OpKind::Linear, {in, cast_before(g, id, a, dt)}, {}, name)[0];
  ValueId u = g.insert_before(id, OpKind::Linear, {cast_before(g, id, h, dt), cast_before(g, id, b, dt)}, {},
                              module_of(g.value(b).name) + ".lora_B")[0];
  ValueId scaled = g.insert_before(id, OpKind::Scale, {u}, {{"alpha", c.scaling()}})[0];
  scaled = cast_before(g, id + 1, scaled, g.value(y).dtype);
  const ValueId sum =
      g.insert_before(id + 1, OpKind::Add, {y, scaled}, {}, module_of(g.value(a).name) + ":lora")[0];
  g.replace_uses_if(y, sum, [&](const ir::Node& reader) {
    return !(reader.outputs.size() == 1 && reader.outputs[0] == sum);
  });
  for (ValueId* w : watched)
    if (*w == y) *w = sum;
}

}  // namespace

namespace {

// QLoRA: each quantised weight (frozen, (N, K)) becomes its codes (4-bit: N·K/2 u8, with "<w>.absmax" per block
// and "<w>.quant_map" beside it; int8: N·K u8 with "<w>.absmax" per row), and every projection reading it (directly,
// or through its cast to bf16) a QuantizedLinear of the same x and bias.
void quantize_weights(ir::Graph& g, const LoraConfig& c, const std::set<std::string>& quantized) {
  std::set<std::string> found;
  const std::vector<std::vector<NodeId>> readers = g.consumers();
  for (ValueId w : g.frozen()) {
    const std::string name = g.value(w).name;
    if (!quantized.count(name)) continue;
    found.insert(name);
    const Shape shape = g.value(w).shape;
    FT_CHECK(shape.rank() == 2, "QLoRA: ", name, " has shape ", shape.to_string(), "; a quantised weight is a ",
             "projection's (out, in)");
    const int64_t N = shape[0], K = shape[1];
    const bool int8 = c.quant_type == "int8";
    FT_CHECK(int8 || N * K % c.quant_blocksize == 0, "QLoRA: ", name, " holds ", N * K, " elements, not a whole number "
             "of blocks of ", c.quant_blocksize);
    std::vector<NodeId> linears;
    for (NodeId r : readers[size_t(w)]) {
      const ir::Node& n = g.node(r);
      if (n.op == OpKind::Linear && n.inputs[1] == w) {
        linears.push_back(r);
      } else if (n.op == OpKind::Cast && !g.is_output(n.outputs[0])) {  // a bf16 projection's copy of the weight
        for (NodeId rr : readers[size_t(n.outputs[0])]) {
          FT_CHECK(g.node(rr).op == OpKind::Linear && g.node(rr).inputs[1] == n.outputs[0], "QLoRA: ", name,
                   " is read by ", ir::op_name(g.node(rr).op), ", not a projection");
          linears.push_back(rr);
        }
        g.remove_node(r);
      } else {
        throw Error(str("QLoRA: ", name, " is read by ", ir::op_name(n.op), ", not a projection"));
      }
    }
    g.freeze_packed(w, Shape{int8 ? N * K : N * K / 2});
    const ValueId absmax = g.add_param(name + ".absmax", {int8 ? N : N * K / c.quant_blocksize});
    g.freeze(absmax, DType::f32);
    std::vector<ValueId> weight{w, absmax};
    if (!int8) {
      const ValueId code = g.add_param(name + ".quant_map", {16});
      g.freeze(code, DType::f32);
      weight.push_back(code);
    }
    for (NodeId id : linears) {
      ValueId x = g.node(id).inputs[0];
      // bitsandbytes' bf16 compute: x rounded to bf16 for the product, which comes back rounded to bf16.
      const bool round = c.quant_bf16 && g.value(x).dtype == DType::f32;
      if (round) x = g.insert_before(id, OpKind::Cast, {x}, {{"dtype", std::string("bf16")}})[0];
      ir::Node& n = g.node(id);
      std::vector<ValueId> inputs{x};
      inputs.insert(inputs.end(), weight.begin(), weight.end());
      if (n.inputs.size() == 3) inputs.push_back(n.inputs[2]);
      n.op = OpKind::QuantizedLinear;
      n.inputs = inputs;
      n.attrs = {{"rows", N}, {"cols", K}, {"bits", int64_t{int8 ? 8 : 4}}, {"blocksize", c.quant_blocksize},
                 {"bf16", int64_t{c.quant_bf16}}, {"round_output", int64_t{round}}};
    }
  }
  g.commit();
  std::string missing;
  for (const std::string& name : quantized)
    if (!found.count(name)) missing += (missing.empty() ? "" : ", ") + name;
  FT_CHECK(missing.empty(), "QLoRA: no frozen weight called ", missing, " (adapters and modules_to_save are not ",
           "quantised)");
}

}  // namespace

std::vector<Adapter> apply(ir::Graph& g, const LoraConfig& c, bool training, const std::set<std::string>& bf16_weights,
                           const std::vector<std::string>& head_prefixes, const std::vector<ValueId*>& watched,
                           bool with_adapters) {
  const bool all_linear = c.target_modules.size() == 1 && c.target_modules[0] == "all-linear";
  std::vector<Adapter> adapters;
  std::set<std::string> hit;
  if (with_adapters) {
    const std::vector<std::vector<NodeId>> readers = g.consumers();
    const std::vector<ValueId> params = g.params();
    int64_t stream = 0x10a5;
    for (ValueId w : params) {
      const ir::Value wv = g.value(w);
      const std::string module = module_of(wv.name);
      if (module.empty()) continue;
      if (!all_linear && ends_with(wv.name, ".weight") && LoraConfig::matches(c.target_modules, module))
        FT_CHECK(wv.shape.rank() == 2, "LoRA: target module \"", module,
                 "\" is not a linear layer (it holds ", wv.name, " of shape ", wv.shape.to_string(),
                 "); LoRA adapts Linear and Conv1D projections");
      if (!ends_with(wv.name, ".weight") || wv.shape.rank() != 2) continue;
      std::string other;
      std::vector<Use> uses;
      if (all_linear) {
        uses = projection_uses(g, readers, w, other);
        if (uses.empty() || !other.empty() || starts_with_any(wv.name, head_prefixes)) continue;
      } else {
        if (!LoraConfig::matches(c.target_modules, module)) continue;
        uses = projection_uses(g, readers, w, other);
        FT_CHECK(!uses.empty() && other.empty(), "LoRA: target module \"", module,
                 "\" is not a linear layer (its weight is read by ", other.empty() ? "no projection" : other,
                 "); LoRA adapts Linear and Conv1D projections");
      }
      for (const std::string& t : c.target_modules)
        if (module == t || ends_with(module, "." + t)) hit.insert(t);
      Adapter ad;
      ad.module = module;
      ad.weight = wv.name;
      ad.in_out = uses[0].in_out;
      ad.in = ad.in_out ? wv.shape[0] : wv.shape[1];
      ad.out = ad.in_out ? wv.shape[1] : wv.shape[0];
      const ValueId a = g.add_param(a_name(module), {c.r, ad.in});
      const ValueId b = g.add_param(b_name(module), {ad.out, c.r});
      for (const Use& u : uses) add_adapter(g, u, a, b, c, training, stream++, watched);
      adapters.push_back(ad);
    }
  }
  if (with_adapters && !all_linear) {
    std::string missing;
    for (const std::string& t : c.target_modules)
      if (!hit.count(t)) missing += (missing.empty() ? "" : ", ") + t;
    FT_CHECK(missing.empty(), "LoRA: target modules not found in the model: ", missing);
  } else if (with_adapters) {
    FT_CHECK(!adapters.empty(), "LoRA: \"all-linear\" found no linear layer to adapt");
  }
  g.commit();

  // Freeze the base; weights kept in bf16 are read as they are by bf16 projections, through a cast by others.
  const std::set<std::string> quantized(c.quantized.begin(), c.quantized.end());
  std::set<std::string> adapter_params;
  for (const Adapter& ad : adapters) adapter_params.insert({a_name(ad.module), b_name(ad.module)});
  std::vector<ValueId> bf16_frozen;
  for (ValueId v : g.params()) {
    const std::string& name = g.value(v).name;
    if (adapter_params.count(name) || LoraConfig::matches(c.modules_to_save, module_of(name))) continue;
    const bool bf16 = bf16_weights.count(name) > 0 && !quantized.count(name);
    g.freeze(v, bf16 ? DType::bf16 : DType::f32);
    if (bf16) bf16_frozen.push_back(v);
  }
  if (!bf16_frozen.empty()) {
    const std::vector<std::vector<NodeId>> readers = g.consumers();
    for (ValueId w : bf16_frozen) {
      for (NodeId r : readers[size_t(w)]) {
        const ir::Node& n = g.node(r);
        if (n.op == OpKind::Cast && g.value(n.outputs[0]).dtype == DType::bf16 && !g.is_output(n.outputs[0])) {
          g.replace_all_uses(n.outputs[0], w);
          g.remove_node(r);
        } else if (n.op == OpKind::Embedding && n.inputs[0] == w) {
          // The lookup gathers bf16 rows; the node becomes their cast to f32, so its readers are unchanged.
          const ValueId rows = g.insert_before(r, OpKind::Embedding, n.inputs, n.attrs)[0];
          g.set_op(r, OpKind::Cast, {rows}, {{"dtype", std::string("f32")}});
        } else {
          // The reader reads an f32 copy (its input is repointed directly: the dtypes differ).
          const ValueId f = g.insert_before(r, OpKind::Cast, {w}, {{"dtype", std::string("f32")}})[0];
          for (ValueId& in : g.node(r).inputs)
            if (in == w) in = f;
        }
      }
    }
    g.commit();
  }
  if (!quantized.empty()) quantize_weights(g, c, quantized);
  return adapters;
}

std::vector<std::string> quantizable(const ir::Graph& g, const std::vector<std::string>& head_prefixes) {
  const std::vector<std::vector<NodeId>> readers = g.consumers();
  std::vector<std::string> out;
  for (ValueId w : g.frozen()) {
    const std::string& name = g.value(w).name;
    if (g.value(w).shape.rank() != 2 || starts_with_any(name, head_prefixes)) continue;
    std::string other;
    const std::vector<Use> uses = projection_uses(g, readers, w, other);
    const bool linear = std::all_of(uses.begin(), uses.end(), [](const Use& u) { return !u.in_out; });
    if (!uses.empty() && other.empty() && linear) out.push_back(name);
  }
  return out;
}

std::set<std::string> bf16_candidates(const ir::Graph& g) {
  const std::vector<std::vector<NodeId>> readers = g.consumers();
  std::set<std::string> out;
  for (ValueId w : g.frozen()) {
    if (g.value(w).shape.rank() != 2) continue;
    // Projections read a bf16 weight directly (or through its cast); an embedding table's lookups gather bf16 rows,
    // which apply casts to f32. Any other reader keeps the weight in f32.
    bool read = false, other = false;
    auto classify = [&](NodeId r, ValueId operand) {
      bool in_out = false;
      (projects(g.node(r), operand, in_out) ? read : other) = true;
    };
    for (NodeId r : readers[size_t(w)]) {
      const ir::Node& n = g.node(r);
      if (n.op == OpKind::Embedding && n.inputs[0] == w) {
        read = true;
      } else if (n.op == OpKind::Cast) {
        for (NodeId r2 : readers[size_t(n.outputs[0])]) classify(r2, n.outputs[0]);
      } else {
        classify(r, w);
      }
    }
    if (read && !other) out.insert(g.value(w).name);
  }
  return out;
}

}  // namespace lora
}  // namespace fusetrain::models
