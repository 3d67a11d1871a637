// The host evaluator of ONNX import (see host_eval.h): numpy-style broadcasting with an odometer over the output
// (no per-element division), one function per op family.
#include "onnx/host_eval.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <google/protobuf/unknown_field_set.h>
#include <limits>
#include <map>
#include <numeric>

#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "onnx/validate.h"

namespace fusetrain::onnx_import {

using onnx::NodeProto;
using onnx::TensorProto;

namespace {

// A float as an integer the way a cast truncates it, with what C++ leaves undefined defined: NaN is 0, and values
// beyond int64's range saturate (ONNX leaves such casts to the runtime; x86 runtimes give the range's ends).
int64_t saturated_int64(double v) {
  if (std::isnan(v)) return 0;
  if (v >= 9223372036854775807.0) return std::numeric_limits<int64_t>::max();
  if (v <= -9223372036854775808.0) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(v);
}

// int64 arithmetic that wraps around on overflow, as two's complement hardware (and ONNX Runtime) computes it; signed
// overflow is undefined in C++.
int64_t wrapping(char op, int64_t x, int64_t y) {
  const auto ux = static_cast<uint64_t>(x), uy = static_cast<uint64_t>(y);
  return static_cast<int64_t>(op == '+' ? ux + uy : op == '-' ? ux - uy : ux * uy);
}

}  // namespace

void check_host_shape(const std::vector<int64_t>& shape, const std::string& what) {
  // The product of the non-zero extents: an empty tensor of shape (0, 2^62, 2^62) would overflow the strides and
  // row counts computed from it.
  int64_t n = 1;
  for (int64_t d : shape) {
    FT_CHECK(d >= 0, what, ": negative extent in its shape ", shape_string(shape));
    FT_CHECK(d == 0 || !__builtin_mul_overflow(n, d, &n), what, ": its shape ", shape_string(shape),
             " holds more elements than a 64-bit count can hold");
  }
  FT_CHECK(n <= kMaxHostElements, what, " of shape ", shape_string(shape), " is larger than fusetrain evaluates on the "
           "host (", kMaxHostElements, " elements)");
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> HostTensor::ints() const {
  if (!is_float()) return i;
  std::vector<int64_t> out(f.size());
  for (size_t k = 0; k < f.size(); ++k) out[k] = saturated_int64(f[k]);
  return out;
}

HostTensor HostTensor::zeros(HostType type, std::vector<int64_t> shape) {
  HostTensor t;
  t.type = type;
  t.shape = std::move(shape);
  check_host_shape(t.shape, "a host tensor");
  const int64_t n = t.numel();
  try {
    if (type == HostType::F32)
      t.f.assign(size_t(n), 0.0f);
    else
      t.i.assign(size_t(n), 0);
  } catch (const std::bad_alloc&) {
    throw Error(str("out of memory for a host tensor of shape ", shape_string(t.shape), " (", n, " elements)"));
  }
  return t;
}

HostTensor HostTensor::scalar_f32(float v) {
  HostTensor t = zeros(HostType::F32, {});
  t.f[0] = v;
  return t;
}

HostTensor HostTensor::vector_i64(std::vector<int64_t> v) {
  HostTensor t;
  t.type = HostType::I64;
  t.shape = {int64_t(v.size())};
  t.i = std::move(v);
  return t;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t k = 0; k < shape.size(); ++k) s += (k ? ", " : "") + std::to_string(shape[k]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

int64_t attr_int(const NodeProto& node, const std::string& name, int64_t fallback) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return a.i();
  return fallback;
}

float attr_float(const NodeProto& node, const std::string& name, float fallback) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return a.f();
  return fallback;
}

std::string attr_string(const NodeProto& node, const std::string& name, const std::string& fallback) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return a.s();
  return fallback;
}

std::vector<int64_t> attr_ints(const NodeProto& node, const std::string& name) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return {a.ints().begin(), a.ints().end()};
  return {};
}

bool has_attr(const NodeProto& node, const std::string& name) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return true;
  return false;
}

std::string node_label(const NodeProto& node, int64_t index) {
  std::string s = str("node ", index, " (", node.op_type());
  if (!node.name().empty()) s += str(" \"", node.name(), "\"");
  s += ")";
  // torch.onnx's dynamo exporter records the module path of each node: name_scopes holds the scopes from the
  // outermost, "['', 'vit', ..., 'vit.embeddings.patch_embeddings.projection', 'conv2d']", the op's own last.
  // NodeProto.metadata_props (field 9, ONNX 1.16) is newer than the system's onnx schema, so it is read from the
  // message's unknown fields: StringStringEntryProto entries, key 1, value 2.
  const google::protobuf::UnknownFieldSet& unknown = node.unknown_fields();
  for (int f = 0; f < unknown.field_count(); ++f) {
    if (unknown.field(f).number() != 9 || unknown.field(f).type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED)
      continue;
    onnx::StringStringEntryProto entry;
    if (!entry.ParseFromString(unknown.field(f).length_delimited()) || entry.key() != "pkg.torch.onnx.name_scopes")
      continue;
    std::vector<std::string> scopes;
    const std::string& v = entry.value();
    for (size_t open = v.find('\''); open != std::string::npos; open = v.find('\'', open + 1)) {
      const size_t close = v.find('\'', open + 1);
      if (close == std::string::npos) break;
      scopes.push_back(v.substr(open + 1, close - open - 1));
      open = close;
    }
    if (scopes.size() >= 2 && !scopes[scopes.size() - 2].empty()) {
      std::string module = scopes[scopes.size() - 2].substr(0, 200);
      for (char& c : module)
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
      s += str(" in module ", module);
    }
  }
  return s;
}

// ---- reading tensors --------------------------------------------------------------------------------------------

namespace {

HostType host_type_of(int32_t elem, const std::string& name) {
  switch (elem) {
    case TensorProto::FLOAT:
    case TensorProto::DOUBLE:
    case TensorProto::FLOAT16:
    case TensorProto::BFLOAT16:
      return HostType::F32;
    case TensorProto::INT64:
    case TensorProto::INT32:
    case TensorProto::INT16:
    case TensorProto::INT8:
    case TensorProto::UINT8:
    case TensorProto::UINT16:
    case TensorProto::UINT32:
      return HostType::I64;
    case TensorProto::BOOL:
      return HostType::Bool;
    default:
      throw Error(str("ONNX tensor \"", name, "\": element type ", data_type_name(elem),
                      " is not supported (expected a float, integer or bool type)"));
  }
}

size_t elem_size(int32_t elem) {
  switch (elem) {
    case TensorProto::DOUBLE:
    case TensorProto::INT64:
      return 8;
    case TensorProto::FLOAT:
    case TensorProto::INT32:
    case TensorProto::UINT32:
      return 4;
    case TensorProto::FLOAT16:
    case TensorProto::BFLOAT16:
    case TensorProto::INT16:
    case TensorProto::UINT16:
      return 2;
    default:
      return 1;
  }
}

// Converts `n` little-endian elements of `elem` at `p` into `out`.
void convert_raw(const char* p, int64_t n, int32_t elem, HostTensor& out) {
  for (int64_t k = 0; k < n; ++k) {
    const char* e = p + size_t(k) * elem_size(elem);
    switch (elem) {
      case TensorProto::FLOAT: {
        float v;
        std::memcpy(&v, e, 4);
        out.f[size_t(k)] = v;
        break;
      }
      case TensorProto::DOUBLE: {
        double v;
        std::memcpy(&v, e, 8);
        out.f[size_t(k)] = float(v);
        break;
      }
      case TensorProto::FLOAT16:
      case TensorProto::BFLOAT16: {
        uint16_t v;
        std::memcpy(&v, e, 2);
        if (elem == TensorProto::FLOAT16)
          f16_to_float(&out.f[size_t(k)], &v, 1);
        else
          bf16_to_float(&out.f[size_t(k)], &v, 1);
        break;
      }
      case TensorProto::INT64: {
        int64_t v;
        std::memcpy(&v, e, 8);
        out.i[size_t(k)] = v;
        break;
      }
      case TensorProto::INT32: {
        int32_t v;
        std::memcpy(&v, e, 4);
        out.i[size_t(k)] = v;
        break;
      }
      case TensorProto::UINT32: {
        uint32_t v;
        std::memcpy(&v, e, 4);
        out.i[size_t(k)] = v;
        break;
      }
      case TensorProto::INT16: {
        int16_t v;
        std::memcpy(&v, e, 2);
        out.i[size_t(k)] = v;
        break;
      }
      case TensorProto::UINT16: {
        uint16_t v;
        std::memcpy(&v, e, 2);
        out.i[size_t(k)] = v;
        break;
      }
      case TensorProto::INT8:
        out.i[size_t(k)] = static_cast<int8_t>(*e);
        break;
      default:  // UINT8, BOOL
        out.i[size_t(k)] = static_cast<uint8_t>(*e);
        break;
    }
  }
}

// An external_data entry's integer value ("offset", "length"); Error naming the tensor when it is not one.
int64_t external_integer(const TensorProto& t, const std::string& key, const std::string& value) {
  int64_t out = 0;
  const char* end = value.data() + value.size();
  const auto [at, ec] = std::from_chars(value.data(), end, out);
  FT_CHECK(ec == std::errc() && at == end && !value.empty() && out >= 0, "ONNX tensor \"", t.name(),
           "\": external data \"", key, "\" is \"", value, "\", expected a non-negative integer");
  return out;
}

std::string read_external(const TensorProto& t, const std::string& dir, int64_t bytes) {
  std::string location;
  int64_t offset = 0, length = -1;
  for (const auto& kv : t.external_data()) {
    if (kv.key() == "location") location = kv.value();
    if (kv.key() == "offset") offset = external_integer(t, "offset", kv.value());
    if (kv.key() == "length") length = external_integer(t, "length", kv.value());
  }
  FT_CHECK(!location.empty(), "ONNX tensor \"", t.name(), "\": external data without a location");
  FT_CHECK(location.find("..") == std::string::npos && !std::filesystem::path(location).is_absolute(),
           "ONNX tensor \"", t.name(), "\": external data location \"", location,
           "\" must be a relative path inside the model's directory");
  if (length < 0) length = bytes;
  FT_CHECK(length == bytes, "ONNX tensor \"", t.name(), "\": external data holds ", length, " bytes, expected ",
           bytes, " for its shape");
  const std::string path = (std::filesystem::path(dir) / location).string();
  std::error_code ec;
  const auto file_size = std::filesystem::file_size(path, ec);
  FT_CHECK(!ec && std::filesystem::is_regular_file(path, ec), "ONNX tensor \"", t.name(),
           "\": cannot open its external data file ", path);
  // Checked before anything is allocated: a declared size the file does not hold is refused, not allocated.
  FT_CHECK(offset <= int64_t(file_size) && bytes <= int64_t(file_size) - offset, "ONNX tensor \"", t.name(),
           "\": external data file ", path, " (", file_size, " bytes) ends before offset ", offset, " + ", bytes,
           " bytes");
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in.good(), "ONNX tensor \"", t.name(), "\": cannot open its external data file ", path);
  in.seekg(offset);
  std::string data(size_t(bytes), '\0');
  in.read(data.data(), bytes);
  FT_CHECK(in.gcount() == bytes, "ONNX tensor \"", t.name(), "\": external data file ", path, " ends before offset ",
           offset, " + ", bytes, " bytes");
  return data;
}

// The number of values a typed field (float_data, int32_data, ...) of `t` holds for its element type.
int64_t typed_values(const TensorProto& t) {
  switch (t.data_type()) {
    case TensorProto::FLOAT:
      return t.float_data_size();
    case TensorProto::DOUBLE:
      return t.double_data_size();
    case TensorProto::INT64:
      return t.int64_data_size();
    case TensorProto::UINT32:
    case TensorProto::UINT64:
      return t.uint64_data_size();
    default:  // the int32_data types: INT32, INT16, INT8, UINT16, UINT8, BOOL, FLOAT16, BFLOAT16
      return t.int32_data_size();
  }
}

}  // namespace

std::string data_type_name(int32_t elem) {
  return TensorProto::DataType_IsValid(elem) ? TensorProto::DataType_Name(static_cast<TensorProto::DataType>(elem))
                                             : str("element type ", elem);
}

HostTensor read_tensor(const TensorProto& t, const std::string& dir) {
  HostTensor out;
  out.type = host_type_of(t.data_type(), t.name());
  out.shape.assign(t.dims().begin(), t.dims().end());
  const std::string what = str("ONNX tensor \"", t.name(), "\"");
  const int64_t n = checked_numel(out.shape, what);
  int64_t bytes = 0;
  FT_CHECK(!__builtin_mul_overflow(n, int64_t(elem_size(t.data_type())), &bytes), what, ": its shape ",
           shape_string(out.shape), " holds more bytes than a 64-bit count can hold");
  // The declared size is checked against the data present before anything is allocated for it.
  std::string external;
  if (t.data_location() == TensorProto::EXTERNAL) {
    external = read_external(t, dir, bytes);
  } else if (t.has_raw_data()) {
    FT_CHECK(int64_t(t.raw_data().size()) == bytes, what, ": raw_data holds ", t.raw_data().size(), " bytes, expected ",
             bytes, " for shape ", shape_string(out.shape));
  } else {
    FT_CHECK(typed_values(t) == n, what, " holds ", typed_values(t), " values, expected ", n, " for shape ",
             shape_string(out.shape));
  }
  check_host_shape(out.shape, what);  // after the data checks: a declared size the data lacks is named as such
  if (out.is_float())
    out.f.resize(size_t(n));
  else
    out.i.resize(size_t(n));
  if (t.data_location() == TensorProto::EXTERNAL) {
    convert_raw(external.data(), n, t.data_type(), out);
    return out;
  }
  if (t.has_raw_data()) {
    convert_raw(t.raw_data().data(), n, t.data_type(), out);
    return out;
  }
  switch (t.data_type()) {
    case TensorProto::FLOAT:
      for (int64_t k = 0; k < n; ++k) out.f[size_t(k)] = t.float_data(int(k));
      break;
    case TensorProto::DOUBLE:
      for (int64_t k = 0; k < n; ++k) out.f[size_t(k)] = float(t.double_data(int(k)));
      break;
    case TensorProto::INT64:
      for (int64_t k = 0; k < n; ++k) out.i[size_t(k)] = t.int64_data(int(k));
      break;
    case TensorProto::UINT32:
    case TensorProto::UINT64:
      for (int64_t k = 0; k < n; ++k) out.i[size_t(k)] = int64_t(t.uint64_data(int(k)));
      break;
    case TensorProto::FLOAT16:
    case TensorProto::BFLOAT16: {
      for (int64_t k = 0; k < n; ++k) {
        uint16_t v = uint16_t(t.int32_data(int(k)));
        if (t.data_type() == TensorProto::FLOAT16)
          f16_to_float(&out.f[size_t(k)], &v, 1);
        else
          bf16_to_float(&out.f[size_t(k)], &v, 1);
      }
      break;
    }
    default:  // the int32_data types: INT32, INT16, INT8, UINT16, UINT8, BOOL
      for (int64_t k = 0; k < n; ++k) out.i[size_t(k)] = t.int32_data(int(k));
      break;
  }
  return out;
}

// ---- broadcasting -----------------------------------------------------------------------------------------------

std::vector<int64_t> broadcast_shapes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                                      const std::string& where) {
  const size_t r = std::max(a.size(), b.size());
  std::vector<int64_t> out(r);
  for (size_t k = 0; k < r; ++k) {
    const int64_t da = k < r - a.size() ? 1 : a[k - (r - a.size())];
    const int64_t db = k < r - b.size() ? 1 : b[k - (r - b.size())];
    FT_CHECK(da == db || da == 1 || db == 1, where, ": shapes ", shape_string(a), " and ", shape_string(b),
             " do not broadcast");
    out[k] = da == 1 ? db : da;
  }
  return out;
}

namespace {

// Strides of `shape` read as broadcast to `out` (0 along broadcast axes).
std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& shape, const std::vector<int64_t>& out) {
  std::vector<int64_t> strides(out.size(), 0);
  int64_t s = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    const size_t o = k + out.size() - shape.size();
    strides[o] = shape[k] == 1 ? 0 : s;
    s *= shape[k];
  }
  return strides;
}

// Calls f(out_index, offsets of each operand) over `out` in row-major order.
template <typename F>
void for_each_broadcast(const std::vector<int64_t>& out, const std::vector<const std::vector<int64_t>*>& shapes, F f) {
  const size_t n_ops = shapes.size();
  std::vector<std::vector<int64_t>> strides;
  for (const auto* s : shapes) strides.push_back(broadcast_strides(*s, out));
  int64_t total = 1;
  for (int64_t d : out) total *= d;
  if (total == 0) return;
  std::vector<int64_t> idx(out.size(), 0), off(n_ops, 0);
  for (int64_t k = 0; k < total; ++k) {
    f(k, off);
    for (size_t ax = out.size(); ax-- > 0;) {
      ++idx[ax];
      for (size_t o = 0; o < n_ops; ++o) off[o] += strides[o][ax];
      if (idx[ax] < out[ax]) break;
      for (size_t o = 0; o < n_ops; ++o) off[o] -= strides[o][ax] * out[ax];
      idx[ax] = 0;
    }
  }
}

const HostTensor& need(const std::vector<const HostTensor*>& in, size_t k, const NodeProto& node) {
  FT_CHECK(k < in.size() && in[k] != nullptr, node.op_type(), " \"", node.name(), "\": input ", k,
           " is missing");
  return *in[k];
}

int64_t norm_axis(int64_t axis, int64_t rank, const NodeProto& node) {
  const int64_t a = axis < 0 ? axis + rank : axis;
  FT_CHECK(a >= 0 && a < rank, node.op_type(), " \"", node.name(), "\": axis ", axis, " is out of range for rank ",
           rank);
  return a;
}

// Result type of arithmetic between a and b: float if either is.
HostType arith_type(const HostTensor& a, const HostTensor& b) {
  return a.is_float() || b.is_float() ? HostType::F32 : HostType::I64;
}

HostTensor binary(const NodeProto& node, const HostTensor& a, const HostTensor& b) {
  const std::string& op = node.op_type();
  const std::vector<int64_t> shape = broadcast_shapes(a.shape, b.shape, op + " \"" + node.name() + "\"");
  const bool compare = op == "Equal" || op == "Less" || op == "LessOrEqual" || op == "Greater" ||
                       op == "GreaterOrEqual" || op == "And" || op == "Or" || op == "Xor";
  const HostType type = compare ? HostType::Bool : arith_type(a, b);
  HostTensor out = HostTensor::zeros(type, shape);
  using Fn = std::function<double(double, double)>;
  static const std::map<std::string, Fn> kOps = {
      {"Add", [](double x, double y) { return x + y; }},
      {"Sub", [](double x, double y) { return x - y; }},
      {"Mul", [](double x, double y) { return x * y; }},
      {"Div", [](double x, double y) { return x / y; }},
      {"Pow", [](double x, double y) { return std::pow(x, y); }},
      {"Max", [](double x, double y) { return std::max(x, y); }},
      {"Min", [](double x, double y) { return std::min(x, y); }},
      {"Equal", [](double x, double y) { return double(x == y); }},
      {"Less", [](double x, double y) { return double(x < y); }},
      {"LessOrEqual", [](double x, double y) { return double(x <= y); }},
      {"Greater", [](double x, double y) { return double(x > y); }},
      {"GreaterOrEqual", [](double x, double y) { return double(x >= y); }},
      {"And", [](double x, double y) { return double(x != 0 && y != 0); }},
      {"Or", [](double x, double y) { return double(x != 0 || y != 0); }},
      {"Xor", [](double x, double y) { return double((x != 0) != (y != 0)); }},
      {"Mod", [](double x, double y) { return x - y * std::floor(x / y); }},
  };
  if (type == HostType::F32) {
    // Float arithmetic in f32, as ONNX Runtime and PyTorch compute it.
    const bool fa = a.is_float(), fb = b.is_float();
    auto get = [](const HostTensor& t, bool is_f, int64_t o) { return is_f ? t.f[size_t(o)] : float(t.i[size_t(o)]); };
    std::function<float(float, float)> fn;
    if (op == "Add") fn = [](float x, float y) { return x + y; };
    else if (op == "Sub") fn = [](float x, float y) { return x - y; };
    else if (op == "Mul") fn = [](float x, float y) { return x * y; };
    else if (op == "Div") fn = [](float x, float y) { return x / y; };
    else if (op == "Pow") fn = [](float x, float y) { return std::pow(x, y); };
    else if (op == "Max") fn = [](float x, float y) { return std::max(x, y); };
    else if (op == "Min") fn = [](float x, float y) { return std::min(x, y); };
    else if (op == "Mod") fn = [](float x, float y) { return std::fmod(x, y); };
    else throw Error(str(op, " \"", node.name(), "\": not defined on float tensors"));
    for_each_broadcast(shape, {&a.shape, &b.shape}, [&](int64_t k, const std::vector<int64_t>& o) {
      out.f[size_t(k)] = fn(get(a, fa, o[0]), get(b, fb, o[1]));
    });
    return out;
  }
  if (op == "Div" || op == "Mod") {  // integer division truncates (ONNX Div), Mod takes the divisor's sign
    for_each_broadcast(shape, {&a.shape, &b.shape}, [&](int64_t k, const std::vector<int64_t>& o) {
      const int64_t x = a.i[size_t(o[0])], y = b.i[size_t(o[1])];
      FT_CHECK(y != 0, op, " \"", node.name(), "\": integer division by zero");
      // INT64_MIN / -1 overflows: it wraps to INT64_MIN, its remainder is 0.
      int64_t r = y == -1 ? (op == "Div" ? wrapping('-', 0, x) : 0) : op == "Div" ? x / y : x % y;
      if (op == "Mod" && r != 0 && ((r < 0) != (y < 0))) r += y;
      out.i[size_t(k)] = r;
    });
    return out;
  }
  if (compare && (a.is_float() || b.is_float())) {
    const Fn& fn = kOps.at(op);
    for_each_broadcast(shape, {&a.shape, &b.shape}, [&](int64_t k, const std::vector<int64_t>& o) {
      out.i[size_t(k)] = fn(a.at(o[0]), b.at(o[1])) != 0;
    });
    return out;
  }
  auto it = kOps.find(op);
  FT_CHECK(it != kOps.end(), op, " is not a binary op");
  const bool exact = op == "Add" || op == "Sub" || op == "Mul" || op == "Max" || op == "Min";
  for_each_broadcast(shape, {&a.shape, &b.shape}, [&](int64_t k, const std::vector<int64_t>& o) {
    const int64_t x = a.i[size_t(o[0])], y = b.i[size_t(o[1])];
    if (exact) {  // in integers: values such as INT64_MAX are not exact as doubles
      out.i[size_t(k)] = op == "Add"   ? wrapping('+', x, y)
                         : op == "Sub" ? wrapping('-', x, y)
                         : op == "Mul" ? wrapping('*', x, y)
                         : op == "Max" ? std::max(x, y)
                                       : std::min(x, y);
    } else {
      out.i[size_t(k)] = saturated_int64(it->second(double(x), double(y)));
    }
  });
  return out;
}

HostTensor unary(const NodeProto& node, const HostTensor& x) {
  const std::string& op = node.op_type();
  if (op == "Not") {
    HostTensor out = x;
    out.type = HostType::Bool;
    for (auto& v : out.i) v = v == 0;
    return out;
  }
  if (op == "IsNaN" || op == "IsInf") {
    HostTensor out = HostTensor::zeros(HostType::Bool, x.shape);
    if (x.is_float())
      for (size_t k = 0; k < x.f.size(); ++k) out.i[k] = op == "IsNaN" ? std::isnan(x.f[k]) : std::isinf(x.f[k]);
    return out;
  }
  if (!x.is_float()) {
    HostTensor out = x;
    for (auto& v : out.i) {
      if (op == "Neg") v = -v;
      else if (op == "Abs") v = v < 0 ? -v : v;
      else if (op == "Sign") v = (v > 0) - (v < 0);
      else if (op == "Relu") v = std::max<int64_t>(v, 0);
      else if (op == "Identity" || op == "Floor" || op == "Ceil" || op == "Round") {
      } else
        throw Error(str(op, " \"", node.name(), "\": not defined on integer tensors"));
    }
    return out;
  }
  HostTensor out = x;
  for (float& v : out.f) {
    if (op == "Neg") v = -v;
    else if (op == "Abs") v = std::fabs(v);
    else if (op == "Log") v = std::log(v);
    else if (op == "Exp") v = std::exp(v);
    else if (op == "Sqrt") v = std::sqrt(v);
    else if (op == "Reciprocal") v = 1.0f / v;
    else if (op == "Floor") v = std::floor(v);
    else if (op == "Ceil") v = std::ceil(v);
    else if (op == "Round") v = std::nearbyint(v);
    else if (op == "Sign") v = float((v > 0) - (v < 0));
    else if (op == "Relu") v = std::max(v, 0.0f);
    else if (op == "Erf") v = std::erf(v);
    else if (op == "Tanh") v = std::tanh(v);
    else if (op == "Sigmoid") v = 1.0f / (1.0f + std::exp(-v));
    else if (op == "Cos") v = std::cos(v);
    else if (op == "Sin") v = std::sin(v);
    else if (op == "Identity") {
    } else
      throw Error(str(op, " is not a unary op"));
  }
  return out;
}

HostTensor cast(const HostTensor& x, int32_t to, const std::string& where) {
  const HostType type = host_type_of(to, where);
  HostTensor out = HostTensor::zeros(type, x.shape);
  const int64_t n = x.numel();
  for (int64_t k = 0; k < n; ++k) {
    const double v = x.at(k);
    if (type == HostType::F32)
      out.f[size_t(k)] = x.is_float() ? x.f[size_t(k)] : float(x.i[size_t(k)]);
    else if (type == HostType::Bool)
      out.i[size_t(k)] = v != 0;
    else
      out.i[size_t(k)] = x.is_float() ? saturated_int64(x.f[size_t(k)]) : x.i[size_t(k)];
  }
  return out;
}

// Copies element `src_off` of `src` to `dst_off` of `dst` (same type).
inline void copy_elem(const HostTensor& src, int64_t src_off, HostTensor& dst, int64_t dst_off) {
  if (src.is_float())
    dst.f[size_t(dst_off)] = src.f[size_t(src_off)];
  else
    dst.i[size_t(dst_off)] = src.i[size_t(src_off)];
}

HostTensor reshape_to(HostTensor x, std::vector<int64_t> shape) {
  x.shape = std::move(shape);
  return x;
}

// ONNX Reshape's target: 0 copies the input's extent (unless allowzero), one -1 is inferred.
std::vector<int64_t> reshape_target(const std::vector<int64_t>& in, std::vector<int64_t> target, bool allowzero,
                                    const NodeProto& node) {
  int64_t known = 1, infer = -1, total = 1;
  for (int64_t d : in) total *= d;  // the shape of a value that exists: no overflow
  for (size_t k = 0; k < target.size(); ++k) {
    if (target[k] == 0 && !allowzero) {
      FT_CHECK(k < in.size(), "Reshape \"", node.name(), "\": 0 at axis ", k, " copies no input extent");
      target[k] = in[k];
    }
    FT_CHECK(target[k] >= -1, "Reshape \"", node.name(), "\": extent ", target[k], " in ", shape_string(target));
    if (target[k] == -1) {
      FT_CHECK(infer < 0, "Reshape \"", node.name(), "\": more than one -1 in ", shape_string(target));
      infer = int64_t(k);
    } else {
      FT_CHECK(!__builtin_mul_overflow(known, target[k], &known), "Reshape \"", node.name(), "\": ",
               shape_string(target), " holds more elements than a 64-bit count can hold");
    }
  }
  if (infer >= 0) {
    FT_CHECK(known != 0 && total % known == 0, "Reshape \"", node.name(), "\": ", shape_string(in),
             " cannot become ", shape_string(target));
    target[size_t(infer)] = total / known;
  }
  FT_CHECK(known * (infer >= 0 ? target[size_t(infer)] : 1) == total, "Reshape \"", node.name(), "\": ",
           shape_string(in), " has ", total, " elements, ", shape_string(target), " does not");
  return target;
}

}  // namespace

std::vector<int64_t> onnx_reshape_target(const std::vector<int64_t>& in, const std::vector<int64_t>& target,
                                         bool allowzero, const NodeProto& node) {
  return reshape_target(in, target, allowzero, node);
}

namespace {

HostTensor transpose(const HostTensor& x, std::vector<int64_t> perm) {
  const size_t r = x.shape.size();
  if (perm.empty())
    for (size_t k = 0; k < r; ++k) perm.push_back(int64_t(r - 1 - k));
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 0; k < sorted.size(); ++k)
    FT_CHECK(sorted.size() == r && sorted[k] == int64_t(k), "Transpose: perm ", shape_string(perm),
             " is not a permutation of the ", r, " axes");
  std::vector<int64_t> out_shape(r), in_strides(r);
  int64_t s = 1;
  for (size_t k = r; k-- > 0;) {
    in_strides[k] = s;
    s *= x.shape[k];
  }
  for (size_t k = 0; k < r; ++k) out_shape[k] = x.shape[size_t(perm[k])];
  HostTensor out = HostTensor::zeros(x.type, out_shape);
  // Read `x` through permuted strides as a broadcast-free walk.
  std::vector<int64_t> strides(r);
  for (size_t k = 0; k < r; ++k) strides[k] = in_strides[size_t(perm[k])];
  std::vector<int64_t> idx(r, 0);
  int64_t off = 0;
  const int64_t n = out.numel();
  for (int64_t k = 0; k < n; ++k) {
    copy_elem(x, off, out, k);
    for (size_t ax = r; ax-- > 0;) {
      ++idx[ax];
      off += strides[ax];
      if (idx[ax] < out_shape[ax]) break;
      off -= strides[ax] * out_shape[ax];
      idx[ax] = 0;
    }
  }
  return out;
}

HostTensor slice(const NodeProto& node, const HostTensor& x, const std::vector<const HostTensor*>& in) {
  const std::vector<int64_t> starts = need(in, 1, node).ints(), ends = need(in, 2, node).ints();
  std::vector<int64_t> axes, steps;
  if (in.size() > 3 && in[3]) axes = in[3]->ints();
  if (in.size() > 4 && in[4]) steps = in[4]->ints();
  if (axes.empty())
    for (size_t k = 0; k < starts.size(); ++k) axes.push_back(int64_t(k));
  FT_CHECK(ends.size() == starts.size() && axes.size() == starts.size() &&
               (steps.empty() || steps.size() == starts.size()),
           "Slice \"", node.name(), "\": starts, ends, axes and steps of different lengths (", starts.size(), ", ",
           ends.size(), ", ", axes.size(), ", ", steps.size(), ")");
  const int64_t r = int64_t(x.shape.size());
  std::vector<int64_t> begin(size_t(r), 0), step(size_t(r), 1), out_shape = x.shape;
  for (size_t k = 0; k < axes.size(); ++k) {
    const int64_t ax = norm_axis(axes[k], r, node), dim = x.shape[size_t(ax)];
    const int64_t st = steps.empty() ? 1 : steps[k];
    FT_CHECK(st != 0, "Slice \"", node.name(), "\": step 0");
    int64_t s = starts[k], e = ends[k];
    if (s < 0) s += dim;
    if (e < 0 && e > std::numeric_limits<int64_t>::min() / 2) e += dim;
    if (st > 0) {
      s = std::clamp<int64_t>(s, 0, dim);
      e = std::clamp<int64_t>(e, 0, dim);
      out_shape[size_t(ax)] = e > s ? 1 + (e - s - 1) / st : 0;
    } else {
      s = std::clamp<int64_t>(s, 0, dim - 1);
      e = std::clamp<int64_t>(e, -1, dim - 1);
      out_shape[size_t(ax)] = s > e ? int64_t(1 + (__int128(s) - e - 1) / -__int128(st)) : 0;
    }
    begin[size_t(ax)] = s;
    step[size_t(ax)] = st;
  }
  HostTensor out = HostTensor::zeros(x.type, out_shape);
  std::vector<int64_t> in_strides(static_cast<size_t>(r));
  int64_t s = 1;
  for (int64_t k = r; k-- > 0;) {
    in_strides[size_t(k)] = s;
    s *= x.shape[size_t(k)];
  }
  const int64_t n = out.numel();
  std::vector<int64_t> idx(size_t(r), 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t off = 0;
    for (int64_t ax = 0; ax < r; ++ax)
      off += (begin[size_t(ax)] + idx[size_t(ax)] * step[size_t(ax)]) * in_strides[size_t(ax)];
    copy_elem(x, off, out, k);
    for (int64_t ax = r; ax-- > 0;) {
      if (++idx[size_t(ax)] < out_shape[size_t(ax)]) break;
      idx[size_t(ax)] = 0;
    }
  }
  return out;
}

HostTensor gather(const NodeProto& node, const HostTensor& data, const HostTensor& indices) {
  const int64_t r = int64_t(data.shape.size());
  const int64_t axis = norm_axis(attr_int(node, "axis", 0), r, node);
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < axis; ++k) outer *= data.shape[size_t(k)];
  for (int64_t k = axis + 1; k < r; ++k) inner *= data.shape[size_t(k)];
  const int64_t dim = data.shape[size_t(axis)];
  std::vector<int64_t> out_shape(data.shape.begin(), data.shape.begin() + axis);
  out_shape.insert(out_shape.end(), indices.shape.begin(), indices.shape.end());
  out_shape.insert(out_shape.end(), data.shape.begin() + axis + 1, data.shape.end());
  HostTensor out = HostTensor::zeros(data.type, out_shape);
  const std::vector<int64_t> idx = indices.ints();
  const int64_t n_idx = int64_t(idx.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < n_idx; ++j) {
      int64_t v = idx[size_t(j)];
      if (v < 0) v += dim;
      FT_CHECK(v >= 0 && v < dim, "Gather \"", node.name(), "\": index ", idx[size_t(j)],
               " is out of range for an axis of ", dim);
      for (int64_t q = 0; q < inner; ++q) copy_elem(data, (o * dim + v) * inner + q, out, (o * n_idx + j) * inner + q);
    }
  return out;
}

HostTensor gather_elements(const NodeProto& node, const HostTensor& data, const HostTensor& indices) {
  const int64_t r = int64_t(data.shape.size());
  FT_CHECK(int64_t(indices.shape.size()) == r, "GatherElements \"", node.name(), "\": indices rank ",
           indices.shape.size(), " differs from data rank ", r);
  const int64_t axis = norm_axis(attr_int(node, "axis", 0), r, node);
  for (int64_t ax = 0; ax < r; ++ax)
    FT_CHECK(ax == axis || indices.shape[size_t(ax)] <= data.shape[size_t(ax)], "GatherElements \"", node.name(),
             "\": indices of shape ", shape_string(indices.shape), " reach outside data of shape ",
             shape_string(data.shape));
  HostTensor out = HostTensor::zeros(data.type, indices.shape);
  std::vector<int64_t> strides(static_cast<size_t>(r));
  int64_t s = 1;
  for (int64_t k = r; k-- > 0;) {
    strides[size_t(k)] = s;
    s *= data.shape[size_t(k)];
  }
  const std::vector<int64_t> idx = indices.ints();
  std::vector<int64_t> pos(size_t(r), 0);
  for (int64_t k = 0; k < out.numel(); ++k) {
    int64_t off = 0;
    for (int64_t ax = 0; ax < r; ++ax) {
      int64_t p = pos[size_t(ax)];
      if (ax == axis) {
        p = idx[size_t(k)];
        const int64_t dim = data.shape[size_t(ax)];
        if (p < 0) p += dim;
        FT_CHECK(p >= 0 && p < dim, "GatherElements \"", node.name(), "\": index ", idx[size_t(k)],
                 " is out of range for an axis of ", dim);
      }
      off += p * strides[size_t(ax)];
    }
    copy_elem(data, off, out, k);
    for (int64_t ax = r; ax-- > 0;) {
      if (++pos[size_t(ax)] < indices.shape[size_t(ax)]) break;
      pos[size_t(ax)] = 0;
    }
  }
  return out;
}

HostTensor gather_nd(const NodeProto& node, const HostTensor& data, const HostTensor& indices) {
  FT_CHECK(attr_int(node, "batch_dims", 0) == 0, "GatherND \"", node.name(), "\": batch_dims other than 0");
  const int64_t m = indices.shape.empty() ? 0 : indices.shape.back();
  const int64_t r = int64_t(data.shape.size());
  FT_CHECK(m >= 1 && m <= r, "GatherND \"", node.name(), "\": index tuples of length ", m, " for data of rank ", r);
  std::vector<int64_t> out_shape(indices.shape.begin(), indices.shape.end() - 1);
  int64_t inner = 1;
  for (int64_t k = m; k < r; ++k) {
    out_shape.push_back(data.shape[size_t(k)]);
    inner *= data.shape[size_t(k)];
  }
  HostTensor out = HostTensor::zeros(data.type, out_shape);
  const std::vector<int64_t> idx = indices.ints();
  const int64_t tuples = m ? int64_t(idx.size()) / m : 0;
  for (int64_t t = 0; t < tuples; ++t) {
    int64_t off = 0;
    for (int64_t k = 0; k < m; ++k) {
      const int64_t dim = data.shape[size_t(k)];
      int64_t v = idx[size_t(t * m + k)];
      if (v < 0) v += dim;
      FT_CHECK(v >= 0 && v < dim, "GatherND \"", node.name(), "\": index ", v, " is out of range for ", dim);
      off = off * dim + v;
    }
    for (int64_t q = 0; q < inner; ++q) copy_elem(data, off * inner + q, out, t * inner + q);
  }
  return out;
}

HostTensor concat(const NodeProto& node, const std::vector<const HostTensor*>& in) {
  FT_CHECK(!in.empty(), "Concat \"", node.name(), "\": no inputs");
  const HostTensor& first = need(in, 0, node);
  const int64_t r = int64_t(first.shape.size());
  const int64_t axis = norm_axis(attr_int(node, "axis", 0), r, node);
  std::vector<int64_t> out_shape = first.shape;
  out_shape[size_t(axis)] = 0;
  HostType type = first.type;
  for (size_t k = 0; k < in.size(); ++k) {
    const HostTensor& t = need(in, k, node);
    FT_CHECK(int64_t(t.shape.size()) == r, "Concat \"", node.name(), "\": inputs of different ranks");
    for (int64_t ax = 0; ax < r; ++ax)
      FT_CHECK(ax == axis || t.shape[size_t(ax)] == first.shape[size_t(ax)], "Concat \"", node.name(),
               "\": inputs of shapes ", shape_string(first.shape), " and ", shape_string(t.shape),
               " differ outside axis ", axis);
    out_shape[size_t(axis)] += t.shape[size_t(axis)];
    // Mixed inputs widen: any float makes the result float, bool beside int64 makes it int64.
    if (t.is_float())
      type = HostType::F32;
    else if (t.type != type && type != HostType::F32)
      type = HostType::I64;
  }
  const int32_t to = type == HostType::F32 ? TensorProto::FLOAT : type == HostType::Bool ? TensorProto::BOOL
                                                                                          : TensorProto::INT64;
  HostTensor out = HostTensor::zeros(type, out_shape);
  int64_t outer = 1;
  for (int64_t k = 0; k < axis; ++k) outer *= out_shape[size_t(k)];
  int64_t out_row = out.numel() / std::max<int64_t>(outer, 1), pos = 0;
  for (const HostTensor* t : in) {
    const HostTensor c = t->type == type ? *t : cast(*t, to, node.name());
    const int64_t row = outer ? c.numel() / outer : 0;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t q = 0; q < row; ++q) copy_elem(c, o * row + q, out, o * out_row + pos + q);
    pos += row;
  }
  return out;
}

HostTensor expand(const NodeProto& node, const HostTensor& x, const std::vector<int64_t>& shape) {
  const std::vector<int64_t> out_shape = broadcast_shapes(x.shape, shape, "Expand \"" + node.name() + "\"");
  HostTensor out = HostTensor::zeros(x.type, out_shape);
  for_each_broadcast(out_shape, {&x.shape}, [&](int64_t k, const std::vector<int64_t>& o) { copy_elem(x, o[0], out, k); });
  return out;
}

HostTensor where(const NodeProto& node, const HostTensor& c, const HostTensor& x, const HostTensor& y) {
  FT_CHECK(!c.is_float(), "Where \"", node.name(), "\": the condition should be bool, found a float tensor");
  std::vector<int64_t> shape = broadcast_shapes(c.shape, x.shape, "Where \"" + node.name() + "\"");
  shape = broadcast_shapes(shape, y.shape, "Where \"" + node.name() + "\"");
  const HostType type = arith_type(x, y);
  HostTensor xc = x.type == type || type != HostType::F32 ? x : cast(x, TensorProto::FLOAT, node.name());
  HostTensor yc = y.type == type || type != HostType::F32 ? y : cast(y, TensorProto::FLOAT, node.name());
  HostTensor out = HostTensor::zeros(x.type == HostType::Bool && y.type == HostType::Bool ? HostType::Bool : type, shape);
  for_each_broadcast(shape, {&c.shape, &xc.shape, &yc.shape}, [&](int64_t k, const std::vector<int64_t>& o) {
    const bool take_x = c.i[size_t(o[0])] != 0;
    copy_elem(take_x ? xc : yc, take_x ? o[1] : o[2], out, k);
  });
  return out;
}

// An operand the op reads as a scalar (Range's bounds, CumSum's axis, Trilu's k, ConstantOfShape's value): one
// element, else a clear error rather than a read past an empty tensor.
const HostTensor& one_element(const HostTensor& t, const NodeProto& node, const char* what) {
  FT_CHECK(t.numel() == 1, node.op_type(), " \"", node.name(), "\": ", what, " should hold one element, found shape ",
           shape_string(t.shape));
  return t;
}

HostTensor range(const HostTensor& start, const HostTensor& limit, const HostTensor& delta, const NodeProto& node) {
  one_element(start, node, "start");
  one_element(limit, node, "limit");
  one_element(delta, node, "delta");
  if (start.is_float() || limit.is_float() || delta.is_float()) {
    const double s = start.at(0), l = limit.at(0), d = delta.at(0);
    FT_CHECK(d != 0, "Range \"", node.name(), "\": delta 0");
    const double count = std::ceil((l - s) / d);
    FT_CHECK(std::isfinite(count) && count <= double(kMaxHostElements), "Range \"", node.name(), "\": from ", s, " to ",
             l, " by ", d, " is not a range of at most ", kMaxHostElements, " elements");
    const int64_t n = std::max<int64_t>(int64_t(count), 0);
    HostTensor out = HostTensor::zeros(HostType::F32, {n});
    for (int64_t k = 0; k < n; ++k) out.f[size_t(k)] = float(s + double(k) * d);
    return out;
  }
  const int64_t s = start.i[0], l = limit.i[0], d = delta.i[0];
  FT_CHECK(d != 0, "Range \"", node.name(), "\": delta 0");
  // In 128 bits: limit − start overflows int64 for the extreme ends.
  const __int128 span = __int128(l) - s + d + (d > 0 ? -1 : 1);
  const __int128 count = std::max<__int128>(span / d, 0);
  FT_CHECK(count <= kMaxHostElements, "Range \"", node.name(), "\": from ", s, " to ", l, " by ", d,
           " is not a range of at most ", kMaxHostElements, " elements");
  const int64_t n = int64_t(count);
  HostTensor out = HostTensor::zeros(HostType::I64, {n});
  for (int64_t k = 0; k < n; ++k) out.i[size_t(k)] = wrapping('+', s, wrapping('*', k, d));  // each lies in [s, l)
  return out;
}

HostTensor cumsum(const NodeProto& node, const HostTensor& x, int64_t axis_in) {
  const int64_t r = int64_t(x.shape.size());
  const int64_t axis = norm_axis(axis_in, r, node);
  const bool exclusive = attr_int(node, "exclusive", 0) != 0, reverse = attr_int(node, "reverse", 0) != 0;
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < axis; ++k) outer *= x.shape[size_t(k)];
  for (int64_t k = axis + 1; k < r; ++k) inner *= x.shape[size_t(k)];
  const int64_t dim = x.shape[size_t(axis)];
  HostTensor out = HostTensor::zeros(x.type == HostType::Bool ? HostType::I64 : x.type, x.shape);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t q = 0; q < inner; ++q) {
      double acc_f = 0;
      int64_t acc_i = 0;
      for (int64_t j0 = 0; j0 < dim; ++j0) {
        const int64_t j = reverse ? dim - 1 - j0 : j0;
        const int64_t off = (o * dim + j) * inner + q;
        if (exclusive) {
          if (x.is_float()) out.f[size_t(off)] = float(acc_f); else out.i[size_t(off)] = acc_i;
        }
        if (x.is_float()) acc_f += x.f[size_t(off)]; else acc_i = wrapping('+', acc_i, x.i[size_t(off)]);
        if (!exclusive) {
          if (x.is_float()) out.f[size_t(off)] = float(acc_f); else out.i[size_t(off)] = acc_i;
        }
      }
    }
  return out;
}

HostTensor arg_reduce(const NodeProto& node, const HostTensor& x) {
  const bool is_max = node.op_type() == "ArgMax";
  const int64_t r = int64_t(x.shape.size());
  const int64_t axis = norm_axis(attr_int(node, "axis", 0), r, node);
  const bool keep = attr_int(node, "keepdims", 1) != 0, last = attr_int(node, "select_last_index", 0) != 0;
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < axis; ++k) outer *= x.shape[size_t(k)];
  for (int64_t k = axis + 1; k < r; ++k) inner *= x.shape[size_t(k)];
  const int64_t dim = x.shape[size_t(axis)];
  FT_CHECK(dim > 0, node.op_type(), " \"", node.name(), "\": an empty axis has no ", is_max ? "maximum" : "minimum");
  std::vector<int64_t> shape = x.shape;
  if (keep) shape[size_t(axis)] = 1; else shape.erase(shape.begin() + axis);
  HostTensor out = HostTensor::zeros(HostType::I64, shape);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t q = 0; q < inner; ++q) {
      int64_t best = 0;
      double best_v = x.at(o * dim * inner + q);
      for (int64_t j = 1; j < dim; ++j) {
        const double v = x.at((o * dim + j) * inner + q);
        if ((is_max ? v > best_v : v < best_v) || (last && v == best_v)) {
          best = j;
          best_v = v;
        }
      }
      out.i[size_t(o * inner + q)] = best;
    }
  return out;
}

HostTensor reduce(const NodeProto& node, const HostTensor& x, std::vector<int64_t> axes) {
  const std::string& op = node.op_type();
  const int64_t r = int64_t(x.shape.size());
  const bool keep = attr_int(node, "keepdims", 1) != 0;
  if (axes.empty()) {
    if (attr_int(node, "noop_with_empty_axes", 0)) return x;
    for (int64_t k = 0; k < r; ++k) axes.push_back(k);
  }
  std::vector<bool> reduced(size_t(r), false);
  for (int64_t a : axes) reduced[size_t(norm_axis(a, r, node))] = true;
  std::vector<int64_t> keep_shape = x.shape;
  for (int64_t k = 0; k < r; ++k)
    if (reduced[size_t(k)]) keep_shape[size_t(k)] = 1;
  HostTensor acc = HostTensor::zeros(HostType::F32, keep_shape);
  std::vector<int64_t> count_shape = keep_shape;
  const bool is_max = op == "ReduceMax", is_min = op == "ReduceMin";
  std::vector<bool> seen(size_t(acc.numel()), false);
  // Walk the input and accumulate into the broadcast position of keep_shape.
  std::vector<int64_t> strides = broadcast_strides(keep_shape, x.shape);
  std::vector<int64_t> idx(size_t(r), 0);
  int64_t off = 0;
  for (int64_t k = 0; k < x.numel(); ++k) {
    const float v = float(x.at(k));
    float& a = acc.f[size_t(off)];
    if (is_max || is_min) {
      a = !seen[size_t(off)] ? v : is_max ? std::max(a, v) : std::min(a, v);
      seen[size_t(off)] = true;
    } else {
      a += v;
    }
    for (int64_t ax = r; ax-- > 0;) {
      ++idx[size_t(ax)];
      off += strides[size_t(ax)];
      if (idx[size_t(ax)] < x.shape[size_t(ax)]) break;
      off -= strides[size_t(ax)] * x.shape[size_t(ax)];
      idx[size_t(ax)] = 0;
    }
  }
  if (op == "ReduceMean") {
    const float n = float(x.numel() / std::max<int64_t>(acc.numel(), 1));
    for (float& v : acc.f) v /= n;
  }
  HostTensor out = x.is_float() ? acc : cast(acc, TensorProto::INT64, node.name());
  if (!keep) {
    std::vector<int64_t> s;
    for (int64_t k = 0; k < r; ++k)
      if (!reduced[size_t(k)]) s.push_back(x.shape[size_t(k)]);
    out.shape = s;
  }
  return out;
}

HostTensor trilu(const NodeProto& node, const HostTensor& x, int64_t k) {
  const bool upper = attr_int(node, "upper", 1) != 0;
  const int64_t r = int64_t(x.shape.size());
  FT_CHECK(r >= 2, "Trilu \"", node.name(), "\": rank ", r, " (expected at least 2)");
  const int64_t rows = x.shape[size_t(r - 2)], cols = x.shape[size_t(r - 1)];
  HostTensor out = x;
  for (int64_t m = 0; m < x.numel(); ++m) {
    const int64_t i = (m / cols) % rows, j = m % cols;
    const bool keep = upper ? j - i >= k : j - i <= k;
    if (!keep) {
      if (out.is_float()) out.f[size_t(m)] = 0; else out.i[size_t(m)] = 0;
    }
  }
  return out;
}

HostTensor clip(const HostTensor& x, const HostTensor* lo, const HostTensor* hi) {
  HostTensor out = x;
  const int64_t n = out.numel();
  for (int64_t k = 0; k < n; ++k) {
    if (out.is_float()) {
      float& v = out.f[size_t(k)];
      if (lo) v = std::max(v, float(lo->at(0)));
      if (hi) v = std::min(v, float(hi->at(0)));
    } else {
      int64_t& v = out.i[size_t(k)];
      if (lo) v = std::max(v, lo->ints().at(0));
      if (hi) v = std::min(v, hi->ints().at(0));
    }
  }
  return out;
}

HostTensor tile(const NodeProto& node, const HostTensor& x, const std::vector<int64_t>& repeats) {
  FT_CHECK(repeats.size() == x.shape.size(), "Tile \"", node.name(), "\": ", repeats.size(),
           " repeats for rank ", x.shape.size());
  std::vector<int64_t> out_shape = x.shape;
  for (size_t k = 0; k < repeats.size(); ++k) out_shape[k] *= repeats[k];
  HostTensor out = HostTensor::zeros(x.type, out_shape);
  const size_t r = x.shape.size();
  std::vector<int64_t> idx(r, 0);
  for (int64_t k = 0; k < out.numel(); ++k) {
    int64_t off = 0;
    for (size_t ax = 0; ax < r; ++ax) off = off * x.shape[ax] + idx[ax] % x.shape[ax];
    copy_elem(x, off, out, k);
    for (size_t ax = r; ax-- > 0;) {
      if (++idx[ax] < out_shape[ax]) break;
      idx[ax] = 0;
    }
  }
  return out;
}

HostTensor constant(const NodeProto& node) {
  for (const auto& a : node.attribute()) {
    if (a.name() == "value") return read_tensor(a.t(), "");
    if (a.name() == "value_float") return HostTensor::scalar_f32(a.f());
    if (a.name() == "value_int") {
      HostTensor t = HostTensor::zeros(HostType::I64, {});
      t.i[0] = a.i();
      return t;
    }
    if (a.name() == "value_floats") {
      HostTensor t = HostTensor::zeros(HostType::F32, {a.floats_size()});
      for (int k = 0; k < a.floats_size(); ++k) t.f[size_t(k)] = a.floats(k);
      return t;
    }
    if (a.name() == "value_ints") return HostTensor::vector_i64({a.ints().begin(), a.ints().end()});
  }
  throw Error(str("Constant \"", node.name(), "\": no value, value_float(s) or value_int(s) attribute"));
}

// Axes of Squeeze/Unsqueeze/Reduce*: an input from opset 13 (18 for reductions), an attribute before.
std::vector<int64_t> axes_operand(const NodeProto& node, const std::vector<const HostTensor*>& in, size_t slot) {
  if (in.size() > slot && in[slot]) return in[slot]->ints();
  return attr_ints(node, "axes");
}

}  // namespace

std::vector<int64_t> squeeze_shape(const std::vector<int64_t>& shape, const std::vector<int64_t>& axes_in,
                                   const NodeProto& node) {
  const int64_t r = int64_t(shape.size());
  std::vector<bool> drop(size_t(r), false);
  if (axes_in.empty()) {
    for (int64_t k = 0; k < r; ++k) drop[size_t(k)] = shape[size_t(k)] == 1;
  } else {
    for (int64_t a : axes_in) {
      const int64_t ax = norm_axis(a, r, node);
      FT_CHECK(shape[size_t(ax)] == 1, "Squeeze \"", node.name(), "\": axis ", a, " has extent ",
               shape[size_t(ax)], ", not 1");
      drop[size_t(ax)] = true;
    }
  }
  std::vector<int64_t> out;
  for (int64_t k = 0; k < r; ++k)
    if (!drop[size_t(k)]) out.push_back(shape[size_t(k)]);
  return out;
}

std::vector<int64_t> unsqueeze_shape(const std::vector<int64_t>& shape, const std::vector<int64_t>& axes_in,
                                     const NodeProto& node) {
  const int64_t r = int64_t(shape.size() + axes_in.size());
  std::vector<bool> ins(size_t(r), false);
  for (int64_t a : axes_in) {
    const int64_t ax = norm_axis(a, r, node);
    FT_CHECK(!ins[size_t(ax)], "Unsqueeze \"", node.name(), "\": axis ", a, " is given twice");
    ins[size_t(ax)] = true;
  }
  std::vector<int64_t> out;
  size_t src = 0;
  for (int64_t k = 0; k < r; ++k) out.push_back(ins[size_t(k)] ? 1 : shape[src++]);
  return out;
}

std::vector<int64_t> flatten_shape(const std::vector<int64_t>& shape, int64_t axis_in, const NodeProto& node) {
  const int64_t r = int64_t(shape.size());
  const int64_t axis = axis_in < 0 ? axis_in + r : axis_in;
  FT_CHECK(axis >= 0 && axis <= r, "Flatten \"", node.name(), "\": axis ", axis_in, " for rank ", r);
  int64_t a = 1, b = 1;
  for (int64_t k = 0; k < r; ++k) (k < axis ? a : b) *= shape[size_t(k)];
  return {a, b};
}

bool host_supports(const std::string& op) {
  static const char* kOps[] = {
      "Constant", "ConstantOfShape", "Shape", "Size", "Identity", "Cast", "CastLike", "Reshape", "Squeeze",
      "Unsqueeze", "Flatten", "Transpose", "Slice", "Gather", "GatherElements", "GatherND", "Concat", "Expand",
      "Range", "Where", "CumSum", "ArgMax", "ArgMin", "Trilu", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
      "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Equal", "Less", "LessOrEqual", "Greater",
      "GreaterOrEqual", "And", "Or", "Xor", "Not", "Neg", "Abs", "Log", "Exp", "Sqrt", "Reciprocal", "Floor",
      "Ceil", "Round", "Sign", "Relu", "Erf", "Tanh", "Sigmoid", "Cos", "Sin", "IsNaN", "IsInf", "Dropout", "Clip",
      "Tile"};
  for (const char* s : kOps)
    if (op == s) return true;
  return false;
}

std::vector<HostTensor> eval_host(const NodeProto& node, const std::vector<const HostTensor*>& in) {
  const std::string& op = node.op_type();
  auto one = [](HostTensor t) { return std::vector<HostTensor>{std::move(t)}; };
  if (op == "Constant") return one(constant(node));
  if (op == "Identity" || op == "Dropout") return one(need(in, 0, node));
  if (op == "ConstantOfShape") {
    const std::vector<int64_t> shape = need(in, 0, node).ints();
    HostTensor value = HostTensor::scalar_f32(0.0f);
    for (const auto& a : node.attribute())
      if (a.name() == "value") value = read_tensor(a.t(), "");
    one_element(value, node, "its value");
    HostTensor out = HostTensor::zeros(value.type, shape);
    for (int64_t k = 0; k < out.numel(); ++k) copy_elem(value, 0, out, k);
    return one(out);
  }
  if (op == "Shape") {
    const HostTensor& x = need(in, 0, node);
    const int64_t r = int64_t(x.shape.size());
    int64_t s = attr_int(node, "start", 0), e = attr_int(node, "end", r);
    if (s < 0) s += r;
    if (e < 0) e += r;
    s = std::clamp<int64_t>(s, 0, r);
    e = std::clamp<int64_t>(e, s, r);
    return one(HostTensor::vector_i64({x.shape.begin() + s, x.shape.begin() + e}));
  }
  if (op == "Size") {
    HostTensor t = HostTensor::zeros(HostType::I64, {});
    t.i[0] = need(in, 0, node).numel();
    return one(t);
  }
  if (op == "Cast") return one(cast(need(in, 0, node), int32_t(attr_int(node, "to", 1)), node.name()));
  if (op == "CastLike") {
    const HostTensor& like = need(in, 1, node);
    const int32_t to = like.is_float() ? TensorProto::FLOAT : like.type == HostType::Bool ? TensorProto::BOOL
                                                                                           : TensorProto::INT64;
    return one(cast(need(in, 0, node), to, node.name()));
  }
  if (op == "Reshape") {
    const HostTensor& x = need(in, 0, node);
    return one(reshape_to(x, reshape_target(x.shape, need(in, 1, node).ints(), attr_int(node, "allowzero", 0), node)));
  }
  if (op == "Squeeze") return one(reshape_to(need(in, 0, node), squeeze_shape(need(in, 0, node).shape, axes_operand(node, in, 1), node)));
  if (op == "Unsqueeze")
    return one(reshape_to(need(in, 0, node), unsqueeze_shape(need(in, 0, node).shape, axes_operand(node, in, 1), node)));
  if (op == "Flatten")
    return one(reshape_to(need(in, 0, node), flatten_shape(need(in, 0, node).shape, attr_int(node, "axis", 1), node)));
  if (op == "Transpose") return one(transpose(need(in, 0, node), attr_ints(node, "perm")));
  if (op == "Slice") return one(slice(node, need(in, 0, node), in));
  if (op == "Gather") return one(gather(node, need(in, 0, node), need(in, 1, node)));
  if (op == "GatherElements") return one(gather_elements(node, need(in, 0, node), need(in, 1, node)));
  if (op == "GatherND") return one(gather_nd(node, need(in, 0, node), need(in, 1, node)));
  if (op == "Concat") return one(concat(node, in));
  if (op == "Expand") return one(expand(node, need(in, 0, node), need(in, 1, node).ints()));
  if (op == "Range") return one(range(need(in, 0, node), need(in, 1, node), need(in, 2, node), node));
  if (op == "Where") return one(where(node, need(in, 0, node), need(in, 1, node), need(in, 2, node)));
  if (op == "CumSum") return one(cumsum(node, need(in, 0, node), one_element(need(in, 1, node), node, "axis").ints()[0]));
  if (op == "Clip") {
    if (in.size() > 1 && in[1]) one_element(*in[1], node, "min");
    if (in.size() > 2 && in[2]) one_element(*in[2], node, "max");
    return one(clip(need(in, 0, node), in.size() > 1 ? in[1] : nullptr, in.size() > 2 ? in[2] : nullptr));
  }
  if (op == "Tile") return one(tile(node, need(in, 0, node), need(in, 1, node).ints()));
  if (op == "ArgMax" || op == "ArgMin") return one(arg_reduce(node, need(in, 0, node)));
  if (op == "Trilu") return one(trilu(node, need(in, 0, node), in.size() > 1 && in[1] ? one_element(*in[1], node, "k").ints()[0] : 0));
  if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax" || op == "ReduceMin")
    return one(reduce(node, need(in, 0, node), axes_operand(node, in, 1)));
  if (op == "Max" || op == "Min" || op == "Add" || op == "Sub" || op == "Mul" || op == "Div" || op == "Pow" ||
      op == "Mod" || op == "Equal" || op == "Less" || op == "LessOrEqual" || op == "Greater" ||
      op == "GreaterOrEqual" || op == "And" || op == "Or" || op == "Xor") {
    HostTensor acc = need(in, 0, node);
    if ((op == "Max" || op == "Min") && in.size() == 1) return one(acc);
    for (size_t k = 1; k < in.size(); ++k) acc = binary(node, acc, need(in, k, node));
    return one(acc);
  }
  return one(unary(node, need(in, 0, node)));
}

}  // namespace fusetrain::onnx_import
