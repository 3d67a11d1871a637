// ONNX import's validator (see validate.h). Operator schemas come from the ONNX project's registry through the
// generated table schemas.inc: Debian's libonnx (1.12) knows opsets up to 17 only, while torch's dynamo exporter
// writes opset 18 and fusetrain exports up to 20 (docs/architecture.md, "ONNX import").
#include "onnx/validate.h"

#include <algorithm>
#include <map>
#include <set>
#include <string_view>

#include "fusetrain/core/error.h"
#include "onnx/host_eval.h"

namespace fusetrain::onnx_import {

namespace {

/// One version of one operator of the default domain (the row layout of schemas.inc).
struct SchemaRow {
  const char* name;
  int since_version;
  bool deprecated;
  int min_input, max_input, min_output, max_output;
  const char* input_options;   ///< one letter per formal input: S single, O optional, V variadic
  const char* output_options;  ///< the same for the outputs
  const char* attributes;      ///< "name:type[!]" separated by spaces; type as AttributeProto.AttributeType, ! required
};

#include "onnx/schemas.inc"

struct AttributeRule {
  int type = 0;
  bool required = false;
};

/// A row with its attributes parsed.
struct Schema {
  const SchemaRow* row = nullptr;
  std::map<std::string, AttributeRule, std::less<>> attributes;
};

/// Every operator's versions, oldest first.
const std::map<std::string, std::vector<Schema>, std::less<>>& schemas() {
  static const auto* const table = [] {
    auto* out = new std::map<std::string, std::vector<Schema>, std::less<>>();
    for (const SchemaRow& row : kSchemaRows) {
      Schema s;
      s.row = &row;
      std::string_view rest = row.attributes;
      while (!rest.empty()) {
        const size_t end = std::min(rest.find(' '), rest.size());
        const std::string_view item = rest.substr(0, end);
        const size_t colon = item.find(':');
        AttributeRule rule;
        rule.required = item.back() == '!';
        rule.type = std::stoi(std::string(item.substr(colon + 1, item.size() - colon - 1 - (rule.required ? 1 : 0))));
        s.attributes.emplace(std::string(item.substr(0, colon)), rule);
        rest.remove_prefix(std::min(end + 1, rest.size()));
      }
      (*out)[row.name].push_back(std::move(s));
    }
    return out;
  }();
  return *table;
}

/// The version of `op` a graph of default-domain opset `opset` runs, as ONNX resolves it: the newest whose
/// since_version is at most the opset. Null when the operator does not exist at that opset.
const Schema* resolve(const std::string& op, int64_t opset) {
  auto it = schemas().find(op);
  if (it == schemas().end()) return nullptr;
  const Schema* found = nullptr;
  for (const Schema& s : it->second)
    if (s.row->since_version <= opset) found = &s;
  return found;
}

std::string attribute_type_name(int type) {
  return onnx::AttributeProto::AttributeType_IsValid(type)
             ? onnx::AttributeProto::AttributeType_Name(static_cast<onnx::AttributeProto::AttributeType>(type))
             : str("type ", type);
}

std::string range(int lo, int hi) {
  if (hi == std::numeric_limits<int32_t>::max()) return str(lo, " or more");
  return lo == hi ? str(lo) : str(lo, " to ", hi);
}

std::string plural(int n, const char* what) { return str(n, " ", what, n == 1 ? "" : "s"); }

// The formal parameter an actual position binds to: the last one is variadic when its letter is V.
char option_at(const char* options, int k) {
  const int n = int(std::string_view(options).size());
  if (n == 0) return 'S';
  if (k < n) return options[k];
  return options[n - 1];
}

void check_node(const onnx::NodeProto& n, int64_t index, int64_t opset, const std::string& path) {
  const std::string where = str(path, ": ", node_label(n, index));
  FT_CHECK(!n.op_type().empty(), where, " has no op_type");
  FT_CHECK(n.domain().empty() || n.domain() == "ai.onnx", where, " is an operator of domain \"", n.domain(),
           "\"; fusetrain imports operators of the default ONNX domain only");
  const Schema* schema = resolve(n.op_type(), opset);
  FT_CHECK(schema != nullptr, where, ": ", n.op_type(), " is not an operator of ONNX opset ", opset);
  const SchemaRow& row = *schema->row;
  const std::string op = str(n.op_type(), "-", row.since_version, " (the version opset ", opset, " runs)");
  FT_CHECK(!row.deprecated, where, ": ", op, " is deprecated");
  FT_CHECK(n.input_size() >= row.min_input && n.input_size() <= row.max_input, where, " has ",
           plural(n.input_size(), "input"), "; ", op, " takes ", range(row.min_input, row.max_input));
  FT_CHECK(n.output_size() >= row.min_output && n.output_size() <= row.max_output, where, " has ",
           plural(n.output_size(), "output"), "; ", op, " has ", range(row.min_output, row.max_output));
  for (int k = 0; k < n.input_size(); ++k)
    FT_CHECK(!n.input(k).empty() || option_at(row.input_options, k) != 'S', where, ": input ", k,
             " is empty, but ", op, " requires it");
  for (int k = 0; k < n.output_size(); ++k)
    FT_CHECK(!n.output(k).empty() || option_at(row.output_options, k) != 'S', where, ": output ", k,
             " is empty, but ", op, " requires it");
  std::set<std::string> seen;
  for (const onnx::AttributeProto& a : n.attribute()) {
    FT_CHECK(!a.name().empty(), where, " has an attribute without a name");
    FT_CHECK(seen.insert(a.name()).second, where, " has attribute \"", a.name(), "\" twice");
    FT_CHECK(a.ref_attr_name().empty(), where, ": attribute \"", a.name(), "\" refers to a function's attribute \"",
             a.ref_attr_name(), "\", which only a function body may");
    auto rule = schema->attributes.find(a.name());
    if (rule == schema->attributes.end()) {
      std::vector<std::string> known;
      for (const auto& [name, r] : schema->attributes) known.push_back(name);
      throw Error(str(where, " has attribute \"", a.name(), "\", which ", op, " does not define",
                      known.empty() ? std::string(" (it takes none)") : str(" (it defines ", join(known), ")")));
    }
    FT_CHECK(a.type() == rule->second.type, where, ": attribute \"", a.name(), "\" is ",
             a.type() == onnx::AttributeProto::UNDEFINED ? std::string("of no declared type")
                                                          : str("a ", attribute_type_name(a.type())),
             "; ", op, " expects a ", attribute_type_name(rule->second.type));
  }
  for (const auto& [name, r] : schema->attributes)
    FT_CHECK(!r.required || seen.count(name), where, ": ", op, " requires attribute \"", name, "\"");
}

}  // namespace

int max_supported_opset() { return kMaxOpset; }

int64_t checked_numel(const std::vector<int64_t>& dims, const std::string& what) {
  int64_t n = 1;
  for (int64_t d : dims) FT_CHECK(d >= 0, what, ": negative extent in its shape ", shape_string(dims));
  for (int64_t d : dims)
    FT_CHECK(!__builtin_mul_overflow(n, d, &n), what, ": its shape ", shape_string(dims),
             " holds more elements than a 64-bit count can hold");
  return n;
}

void validate_model(const onnx::ModelProto& model, const std::string& path) {
  FT_CHECK(model.ir_version() >= 3 && model.ir_version() <= kSchemaIrVersion, path, ": IR version ",
           model.ir_version(), "; fusetrain reads ONNX IR versions 3 to ", kSchemaIrVersion);
  int64_t opset = -1;
  for (const onnx::OperatorSetIdProto& o : model.opset_import()) {
    if (!o.domain().empty() && o.domain() != "ai.onnx") continue;
    FT_CHECK(opset < 0, path, ": the default ONNX domain is imported twice (opsets ", opset, " and ", o.version(), ")");
    opset = o.version();
    FT_CHECK(opset >= kMinSupportedOpset && opset <= kMaxOpset, path, ": opset ", opset, "; fusetrain imports opsets ",
             kMinSupportedOpset, " to ", kMaxOpset, " of the default ONNX domain (re-export with opset_version=",
             opset < kMinSupportedOpset ? 17 : kMaxOpset, ")");
  }
  FT_CHECK(opset >= 0, path, ": the model imports no opset of the default ONNX domain");

  const onnx::GraphProto& g = model.graph();
  FT_CHECK(g.sparse_initializer_size() == 0, path, ": sparse initializer \"",
           g.sparse_initializer_size() ? g.sparse_initializer(0).values().name() : "",
           "\" (fusetrain reads dense initializers only)");
  // Where each value is defined: -2 an initializer, -1 a graph input, k node k.
  std::map<std::string, int64_t> defined;
  for (const onnx::TensorProto& t : g.initializer()) {
    FT_CHECK(!t.name().empty(), path, ": an initializer has no name");
    FT_CHECK(defined.emplace(t.name(), -2).second, path, ": two initializers are named \"", t.name(), "\"");
  }
  std::set<std::string> inputs;
  for (const onnx::ValueInfoProto& i : g.input()) {
    FT_CHECK(!i.name().empty(), path, ": a graph input has no name");
    FT_CHECK(inputs.insert(i.name()).second, path, ": two graph inputs are named \"", i.name(), "\"");
    defined.emplace(i.name(), -1);  // an input may also be an initializer (its default value)
  }
  for (int k = 0; k < g.node_size(); ++k)
    for (const std::string& o : g.node(k).output()) {
      if (o.empty()) continue;
      auto [it, fresh] = defined.emplace(o, k);
      if (fresh) continue;
      const int64_t first = it->second;
      throw Error(str(path, ": ", node_label(g.node(k), k), " writes \"", o, "\", which ",
                      first == -2   ? std::string("an initializer")
                      : first == -1 ? std::string("a graph input")
                                    : node_label(g.node(int(first)), first),
                      " already defines (every value is written once)"));
    }
  for (int k = 0; k < g.node_size(); ++k) {
    const onnx::NodeProto& n = g.node(k);
    for (const std::string& i : n.input()) {
      if (i.empty()) continue;
      auto it = defined.find(i);
      FT_CHECK(it != defined.end(), path, ": ", node_label(n, k), " reads \"", i,
               "\", which no initializer, graph input or node defines");
      FT_CHECK(it->second != k, path, ": ", node_label(n, k), " reads its own output \"", i, "\" (a cycle)");
      FT_CHECK(it->second < k, path, ": ", node_label(n, k), " reads \"", i, "\", which ",
               node_label(g.node(int(it->second)), it->second),
               " writes after it (the nodes are not in topological order, or form a cycle)");
    }
    check_node(n, k, opset, path);
  }
  std::set<std::string> outputs;
  for (const onnx::ValueInfoProto& o : g.output()) {
    FT_CHECK(!o.name().empty(), path, ": a graph output has no name");
    FT_CHECK(outputs.insert(o.name()).second, path, ": two graph outputs are named \"", o.name(), "\"");
    FT_CHECK(defined.count(o.name()), path, ": graph output \"", o.name(), "\" is not computed by any node");
  }
}

}  // namespace fusetrain::onnx_import
