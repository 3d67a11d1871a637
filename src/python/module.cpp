// fusetrain._core: the Python binding of models::Model and the optimizers.
//
// Inputs are numpy arrays. An aligned, C-contiguous int64 array is handed to the
// engine as a Tensor view of its own memory (no copy); anything else is converted
// once with numpy. Outputs (logits, gradients, state dicts) are copies owned by
// the returned numpy arrays, because the engine's buffers are reused by the next
// run. Runs release the GIL; a per-model mutex keeps two threads from running
// (or stepping an optimizer over) the same model at once. The mutex is only ever
// taken with the GIL released, so the two locks cannot deadlock.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fusetrain/core/cpu.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/quant.h"
#include "fusetrain/core/tensor.h"
#include "fusetrain/kernels/benchmark.h"
#include "fusetrain/models/model.h"
#include "fusetrain/models/registry.h"
#include "fusetrain/onnx/export.h"
#include "fusetrain/onnx/import.h"
#include "fusetrain/optim/optimizer.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "python/binding.h"

#ifndef FUSETRAIN_VERSION
#define FUSETRAIN_VERSION "0.0.0"
#endif

namespace py = pybind11;
using namespace pybind11::literals;

namespace fusetrain::python {

// ---------------------------------------------------------------- JSON <-> Python

nlohmann::json to_json(py::handle obj, const std::string& where) {
  if (obj.is_none()) return nullptr;
  if (py::isinstance<py::bool_>(obj)) return obj.cast<bool>();  // before int: bool is an int
  if (py::isinstance<py::int_>(obj)) {
    if (obj.cast<py::int_>() < py::int_(0)) return obj.cast<int64_t>();
    return obj.cast<uint64_t>();
  }
  if (py::isinstance<py::float_>(obj)) return obj.cast<double>();
  if (py::isinstance<py::str>(obj)) return obj.cast<std::string>();
  if (py::isinstance<py::dict>(obj)) {
    nlohmann::json out = nlohmann::json::object();
    for (auto [key, value] : obj.cast<py::dict>()) {
      // Keys become strings as json.dumps writes them: transformers' id2label has int keys.
      std::string name;
      if (py::isinstance<py::str>(key))
        name = key.cast<std::string>();
      else if (py::isinstance<py::bool_>(key))
        name = key.cast<bool>() ? "true" : "false";
      else if (py::isinstance<py::int_>(key) || py::isinstance<py::float_>(key))
        name = py::str(key).cast<std::string>();
      else
        throw Error(str(where, ": keys must be strings or numbers; found ", py::repr(key).cast<std::string>()));
      out[name] = to_json(value, where + "." + name);
    }
    return out;
  }
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    nlohmann::json out = nlohmann::json::array();
    size_t i = 0;
    for (py::handle item : obj) out.push_back(to_json(item, str(where, "[", i++, "]")));
    return out;
  }
  if (py::hasattr(obj, "item") && py::hasattr(obj, "dtype")) return to_json(obj.attr("item")(), where);  // numpy scalar
  throw Error(str(where, ": a value of type ", py::type::of(obj).attr("__name__").cast<std::string>(),
                  " cannot be written to config.json (expected None, bool, int, float, str, list or dict)"));
}

py::object to_python(const nlohmann::json& j) {
  if (j.is_boolean()) return py::bool_(j.get<bool>());
  if (j.is_number_unsigned()) return py::int_(j.get<uint64_t>());
  if (j.is_number_integer()) return py::int_(j.get<int64_t>());
  if (j.is_number_float()) return py::float_(j.get<double>());
  if (j.is_string()) return py::str(j.get<std::string>());
  if (j.is_array()) {
    py::list out;
    for (const auto& item : j) out.append(to_python(item));
    return out;
  }
  if (j.is_object()) {
    py::dict out;
    for (const auto& [key, value] : j.items()) out[py::str(key)] = to_python(value);
    return out;
  }
  return py::none();
}

// ---------------------------------------------------------------- numpy <-> Tensor

py::module_& numpy() {
  static py::module_ np = py::module_::import("numpy");
  return np;
}

// "(2, 8)", "(8,)", "()" as numpy prints shapes.
std::string shape_string(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::vector<int64_t> dims_of(const py::array& a) { return std::vector<int64_t>(a.shape(), a.shape() + a.ndim()); }

bool is_plain(const py::array& a) {
  return (a.flags() & py::array::c_style) && (a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) &&
         (a.dtype().byteorder() == '=' || a.dtype().byteorder() == '|' || a.dtype().byteorder() == '<');
}

py::array as_array(py::handle obj) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  return numpy().attr("asarray")(obj);
}

namespace {

/// An input of a batch: the numpy array that owns the memory and the engine's view of it.
struct Input {
  py::array array;
  Tensor tensor;
};

/// Integer ids or positions as i64 (zero copy when already int64, contiguous and aligned);
/// `allow_bool` admits boolean masks.
Input int64_input(py::handle obj, const char* name, bool allow_bool = false) {
  py::array a = as_array(obj);
  char kind = a.dtype().kind();
  FT_CHECK(kind == 'i' || kind == 'u' || (allow_bool && kind == 'b'), name, " must be an integer array; got dtype ",
           py::str(a.dtype()).cast<std::string>());
  if (!(py::array_t<int64_t>::check_(a) && is_plain(a)))
    a = numpy().attr("ascontiguousarray")(a, "dtype"_a = numpy().attr("int64"));
  return {a, Tensor::view(const_cast<void*>(a.data()), Shape(dims_of(a)), DType::i64)};
}

/// Labels: integer class or token ids become i64; floating values (regression,
/// multi-label) become f32, and a (B) vector becomes (B, 1).
Input label_input(py::handle obj) {
  py::array a = as_array(obj);
  char kind = a.dtype().kind();
  if (kind != 'f') return int64_input(a, "labels");
  if (!(py::array_t<float>::check_(a) && is_plain(a)))
    a = numpy().attr("ascontiguousarray")(a, "dtype"_a = numpy().attr("float32"));
  std::vector<int64_t> dims = dims_of(a);
  if (dims.size() == 1) dims.push_back(1);
  return {a, Tensor::view(const_cast<void*>(a.data()), Shape(dims), DType::f32)};
}

/// A batch's arrays (kept alive for the run) and the engine's views of them.
struct PreparedBatch {
  models::Batch batch;
  std::vector<py::array> keep_alive;
  bool has_labels = false;
};

/// A float input (pixel_values) as f32 (zero copy when already float32, contiguous and aligned).
Input float_input(py::handle obj, const std::string& name) {
  py::array a = as_array(obj);
  FT_CHECK(a.dtype().kind() == 'f', name, " must be a floating-point array; got dtype ",
           py::str(a.dtype()).cast<std::string>());
  if (!(py::array_t<float>::check_(a) && is_plain(a)))
    a = numpy().attr("ascontiguousarray")(a, "dtype"_a = numpy().attr("float32"));
  return {a, Tensor::view(const_cast<void*>(a.data()), Shape(dims_of(a)), DType::f32)};
}

/// Converts the keyword arguments of forward / loss_and_grads into a batch; the model checks the inputs against
/// what it declares (Model::check_inputs), this the arrays' types and the labels' layout.
PreparedBatch prepare_batch(const models::Model& model, py::handle input_ids, py::handle attention_mask,
                            py::handle token_type_ids, py::handle position_ids, py::handle labels,
                            py::handle start_positions, py::handle end_positions, const py::kwargs& others) {
  PreparedBatch out;
  auto keep = [&](const std::string& name, Input in) {
    out.batch.set(name, in.tensor);
    out.keep_alive.push_back(in.array);
  };
  if (!input_ids.is_none()) keep("input_ids", int64_input(input_ids, "input_ids"));
  if (!attention_mask.is_none()) keep("attention_mask", int64_input(attention_mask, "attention_mask", true));
  if (!token_type_ids.is_none()) keep("token_type_ids", int64_input(token_type_ids, "token_type_ids"));
  if (!position_ids.is_none()) keep("position_ids", int64_input(position_ids, "position_ids"));
  for (auto [key, value] : others) {
    const std::string name = py::str(key).cast<std::string>();
    if (name == "ref_logps") {  // a preference batch's reference log-probabilities (Model::set_preference)
      keep(name, float_input(value, name));
      continue;
    }
    const auto input = std::find_if(model.inputs().begin(), model.inputs().end(),
                                    [&](const models::InputDecl& d) { return d.name == name; });
    if (input == model.inputs().end()) {
      std::string takes;
      for (const models::InputDecl& d : model.inputs()) takes += (takes.empty() ? "" : ", ") + d.name;
      throw Error(str(model.architecture(), " does not take ", name, " (it takes ", takes, ")"));
    }
    keep(name, input->dtype == DType::f32 ? float_input(value, name) : int64_input(value, name.c_str()));
  }
  model.check_inputs(out.batch);  // the inputs first: the labels are checked against their batch size
  int64_t batch = 0;
  for (const models::InputDecl& d : model.inputs())
    if (batch == 0 && out.batch.has(d.name)) batch = out.batch.get(d.name).shape()[0];

  if (!labels.is_none()) {
    Input in = label_input(labels);
    FT_CHECK((in.array.ndim() == 1 || in.array.ndim() == 2) && in.array.shape(0) == batch,
             "labels must have shape (batch,) or (batch, n) with batch ", batch, "; got shape ",
             shape_string(in.array));
    keep("labels", in);
    out.has_labels = true;
  }

  auto position = [&](py::handle obj, const char* name) {
    Input in = int64_input(obj, name);
    FT_CHECK((in.array.ndim() == 1 || (in.array.ndim() == 2 && in.array.shape(1) == 1)) && in.array.shape(0) == batch,
             name, " must have shape (batch,) with batch ", batch, "; got shape ", shape_string(in.array));
    in.tensor = in.tensor.reshaped(Shape{batch});
    keep(name, in);
  };
  FT_CHECK(start_positions.is_none() == end_positions.is_none(),
           "start_positions and end_positions must be given together");
  if (!start_positions.is_none()) {
    FT_CHECK(labels.is_none(), "give either labels or start_positions/end_positions, not both");
    position(start_positions, "start_positions");
    position(end_positions, "end_positions");
    out.has_labels = true;
  }
  return out;
}

/// An owning f32 copy of an engine tensor (which the next run overwrites).
Tensor f32_copy(const Tensor& t) {
  if (t.dtype() == DType::f32) return t.clone();
  Tensor out = Tensor::zeros(t.shape(), DType::f32);
  const auto n = static_cast<size_t>(t.numel());
  if (t.dtype() == DType::bf16)
    bf16_to_float(out.data_as<float>(), t.data_as<uint16_t>(), n);
  else if (t.dtype() == DType::f16)
    f16_to_float(out.data_as<float>(), t.data_as<uint16_t>(), n);
  else
    for (int64_t i = 0; i < t.numel(); ++i) out.data_as<float>()[i] = static_cast<float>(t.item(i));
  return out;
}

/// A numpy array over an owning f32 Tensor's memory; the array keeps the Tensor alive.
py::array to_numpy(Tensor t) {
  auto holder = std::make_unique<Tensor>(std::move(t));
  float* data = holder->data_as<float>();
  std::vector<py::ssize_t> shape(holder->shape().dims().begin(), holder->shape().dims().end());
  py::capsule owner(holder.get(), [](void* p) { delete static_cast<Tensor*>(p); });
  holder.release();
  return py::array_t<float>(shape, data, owner);
}

/// A state-dict value as a Tensor view: float32 / float16 / bfloat16 pass through,
/// other floating types become float32. Torch tensors are accepted directly.
Input weight_input(py::handle obj, const std::string& name) {
  py::object value = py::reinterpret_borrow<py::object>(obj);
  bool torch_bf16 = false;
  if (py::hasattr(value, "detach") && py::hasattr(value, "cpu") && py::hasattr(value, "numpy")) {
    value = value.attr("detach")().attr("cpu")();
    if (py::str(value.attr("dtype")).cast<std::string>() == "torch.bfloat16") {
      value = value.attr("view")(py::module_::import("torch").attr("int16"));
      torch_bf16 = true;
    }
    value = value.attr("numpy")();
  }
  py::array a = as_array(value);
  if (!is_plain(a)) a = numpy().attr("ascontiguousarray")(a);
  const std::string dtype = py::str(a.dtype()).cast<std::string>();
  DType type;
  if (torch_bf16 || dtype == "bfloat16")
    type = DType::bf16;  // ml_dtypes.bfloat16 shows as "bfloat16"
  else if (dtype == "float32")
    type = DType::f32;
  else if (dtype == "float16")
    type = DType::f16;
  else if (dtype == "uint8")
    type = DType::u8;  // a quantised weight's packed codes (QLoRA)
  else if (a.dtype().kind() == 'f') {
    a = numpy().attr("ascontiguousarray")(a, "dtype"_a = numpy().attr("float32"));
    type = DType::f32;
  } else {
    throw Error(str("state_dict[\"", name, "\"]: expected a floating-point array (float32, float16 or bfloat16); got ",
                    dtype, " with shape ", shape_string(a)));
  }
  return {a, Tensor::view(const_cast<void*>(a.data()), Shape(dims_of(a)), type)};
}

// ---------------------------------------------------------------- Model

// The registry's architectures with their heads' rows, as fusetrain.architectures() returns them.
py::list architecture_rows() {
  py::list rows;
  for (const models::ArchitectureInfo& a : models::architectures()) {
    const models::HeadInfo& head = a.head_info();
    py::list label_kinds;
    for (data::LabelKind kind : head.data_labels) label_kinds.append(models::data_label_name(kind));
    py::dict row;
    row["architecture"] = a.name;
    row["model_type"] = a.model_type;
    row["head"] = head.name;
    row["task"] = head.task;
    row["problem"] = head.problem;
    row["outputs"] = models::output_names(head.outputs);
    row["label_kinds"] = label_kinds;
    row["language_model"] = head.language_model;
    rows.append(row);
  }
  return rows;
}

nlohmann::json config_argument(py::handle config) {
  if (py::isinstance<py::str>(config) || py::hasattr(config, "__fspath__"))
    return py::str(py::module_::import("os").attr("fspath")(config)).cast<std::string>();  // a config.json path
  FT_CHECK(py::isinstance<py::dict>(config), "config must be a dict or the path of a config.json; got ",
           py::type::of(config).attr("__name__").cast<std::string>());
  return to_json(config, "config");
}

std::unique_ptr<PyModel> wrap(std::unique_ptr<models::Model> model) {
  auto out = std::make_unique<PyModel>();
  out->model = std::move(model);
  return out;
}

py::dict forward(PyModel& self, const PreparedBatch& prepared) {
  auto [logits, end_logits, hidden, loss] = locked(self, [&] {
    models::ModelOutput out = self.model->forward(prepared.batch, self.training);
    Tensor logits = out.logits.defined() ? f32_copy(out.logits) : Tensor();
    Tensor end = out.end_logits.defined() ? f32_copy(out.end_logits) : Tensor();
    // A model without a head (BertModel, GPT2Model, ...) returns its last hidden states.
    bool base = self.model->architecture_info().head_info().outputs == models::Outputs::HiddenStates;
    Tensor hidden = base ? logits : Tensor();
    if (base) logits = Tensor();
    return std::make_tuple(logits, end, hidden, out.loss);
  });
  py::dict result;
  if (loss) result["loss"] = py::float_(*loss);
  if (end_logits.defined()) {
    result["start_logits"] = to_numpy(std::move(logits));
    result["end_logits"] = to_numpy(std::move(end_logits));
  } else if (logits.defined()) {
    result["logits"] = to_numpy(std::move(logits));
  } else if (hidden.defined()) {
    result["last_hidden_state"] = to_numpy(std::move(hidden));
  }
  return result;
}

/// Parameters (or their gradients) as a dict of float32 copies in state_dict_names order.
py::dict named_copies(const std::vector<std::string>& names, std::vector<Tensor>& values) {
  py::dict out;
  for (size_t i = 0; i < names.size(); ++i) out[py::str(names[i])] = to_numpy(std::move(values[i]));
  return out;
}

py::tuple loss_and_grads(PyModel& self, const PreparedBatch& prepared) {
  FT_CHECK(prepared.has_labels, "loss_and_grads needs labels (or start_positions and end_positions)");
  std::vector<std::string> names;
  std::vector<Tensor> grads;
  double loss = locked(self, [&] {
    double value = self.model->loss_and_grads(prepared.batch, self.training);
    names = self.model->trainable_names();
    for (const auto& name : names) grads.push_back(self.model->host_gradient(name).clone());
    return value;
  });
  return py::make_tuple(loss, named_copies(names, grads));
}

double accumulate_grads(PyModel& self, const PreparedBatch& prepared) {
  FT_CHECK(prepared.has_labels, "accumulate_grads needs labels (or start_positions and end_positions)");
  return locked(self, [&] { return self.model->accumulate_grads(prepared.batch, self.training); });
}

py::dict state_dict(PyModel& self) {
  std::vector<std::string> names;
  std::vector<Tensor> values;
  locked(self, [&] {
    names = self.model->state_dict_names();
    for (const auto& name : names) values.push_back(f32_copy(self.model->host_parameter(name)));
  });
  return named_copies(names, values);
}

void load_state_dict(PyModel& self, const py::dict& tensors, bool strict) {
  std::vector<py::array> keep_alive;
  std::map<std::string, Tensor> views;
  for (auto [key, value] : tensors) {
    FT_CHECK(py::isinstance<py::str>(key), "state_dict keys must be parameter names (str); found ",
             py::repr(key).cast<std::string>());
    std::string name = key.cast<std::string>();
    Input in = weight_input(value, name);
    views.emplace(name, in.tensor);
    keep_alive.push_back(std::move(in.array));
  }
  locked(self, [&] { self.model->load_state_dict(views, strict); });
}

std::string model_repr(const PyModel& self) {
  const auto n = static_cast<double>(self.model->params().num_parameters());
  std::ostringstream count;
  count.precision(3);
  if (n >= 1e6)
    count << n / 1e6 << "M";
  else if (n >= 1e3)
    count << n / 1e3 << "K";
  else
    count << n;
  return str("<fusetrain.Model ", self.model->architecture(), " (", self.model->model_type(), "), ", count.str(),
             " parameters, ", self.training ? "training" : "eval", ">");
}

/// Defines a method taking a batch's keyword arguments (input_ids, ..., end_positions, and any other input the
/// model declares, such as pixel_values); `f(model, prepared_batch)` does the work.
template <typename F>
void def_batch_method(py::class_<PyModel>& cls, const char* name, F f, const char* doc) {
  auto method = [f](PyModel& self, py::handle input_ids, py::handle attention_mask, py::handle token_type_ids,
                    py::handle position_ids, py::handle labels, py::handle start_positions, py::handle end_positions,
                    const py::kwargs& others) {
    return f(self, prepare_batch(*self.model, input_ids, attention_mask, token_type_ids, position_ids, labels,
                                 start_positions, end_positions, others));
  };
  cls.def(name, method, "input_ids"_a = py::none(), "attention_mask"_a = py::none(), "token_type_ids"_a = py::none(),
          "position_ids"_a = py::none(), "labels"_a = py::none(), "start_positions"_a = py::none(),
          "end_positions"_a = py::none(), doc);
}

// ---------------------------------------------------------------- optimizers

/// optim::AdamW over a model's flat buffers; holds the model (keep_alive) for its lock.
struct PyAdamW {
  PyAdamW(PyModel& m, optim::AdamWConfig config) : model(m), optimizer(m.model->params(), config) {}
  PyModel& model;
  optim::AdamW optimizer;
};

/// optim::Sgd over a model's flat buffers.
struct PySgd {
  PySgd(PyModel& m, optim::SgdConfig config) : model(m), optimizer(m.model->params(), config) {}
  PyModel& model;
  optim::Sgd optimizer;
};

/// Any engine optimizer (optim::make_optimizer, by transformers' `optim` name) over a model's flat buffers, its
/// decay groups the model's (Model::decays), as the Trainer sets them.
struct PyOptimizer {
  PyOptimizer(PyModel& m, const optim::OptimizerSpec& spec) : model(m) {
    runtime::ParameterStore& params = m.model->params();
    for (size_t i = 0; i < params.slots().size(); ++i)
      params.set_weight_decay(i, m.model->decays(params.slots()[i].name));
    optimizer = optim::make_optimizer(params, spec);
  }
  PyModel& model;
  std::unique_ptr<optim::Optimizer> optimizer;
};

void check_hyperparameters(double lr, double weight_decay) {
  FT_CHECK(lr >= 0 && std::isfinite(lr), "lr must be a non-negative number; got ", lr);
  FT_CHECK(weight_decay >= 0, "weight_decay must be non-negative; got ", weight_decay);
}

void zero_grads(PyModel& model) {
  locked(model, [&] { model.model->params().zero_grads(); });
}

void adamw_step(PyAdamW& self) {
  locked(self.model, [&] {
    self.optimizer.set_num_threads(self.model.num_threads);
    self.optimizer.step();
  });
}

// With an fp16 model the gradients carry its loss scale: they are divided by it in
// the same pass, and a step whose gradients overflowed is skipped (norm not finite).
double adamw_clip_and_step(PyAdamW& self, double max_norm) {
  return locked(self.model, [&] {
    self.optimizer.set_num_threads(self.model.num_threads);
    return self.optimizer.clip_and_step(max_norm, -1.0,
                                        self.model.model->fp16() ? 1.0 / self.model.model->loss_scale() : 1.0);
  });
}

void optimizer_step(PyOptimizer& self) {
  locked(self.model, [&] {
    self.optimizer->set_num_threads(self.model.num_threads);
    self.optimizer->step();
  });
}

void sgd_step(PySgd& self) {
  locked(self.model, [&] {
    self.optimizer.set_num_threads(self.model.num_threads);
    self.optimizer.step();
  });
}

}  // namespace
}  // namespace fusetrain::python

// ---------------------------------------------------------------- module

PYBIND11_MODULE(_core, m) {
  using namespace fusetrain;
  using namespace fusetrain::python;
  m.doc() = "fusetrain's C++ engine: Hugging Face transformer models compiled into static training plans.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::set_error(PyExc_ValueError, e.what());
    } catch (const nlohmann::json::exception& e) {
      py::set_error(PyExc_ValueError, str("invalid config: ", e.what()).c_str());
    }
    // Anything else falls through to pybind11's own translators (std::exception -> RuntimeError).
  });

  m.attr("__version__") = FUSETRAIN_VERSION;
  m.def(
      "cpu_features", [] { return cpu_features().to_string(); },
      "Instruction-set features the kernels use on this CPU, e.g. \"avx2 fma avx512f avx512_bf16\".");
  m.def(
      "measure_matmul_gflops",
      [](int64_t m, int64_t n, int64_t k, const std::string& dtype, int num_threads, int repeats) {
        FT_CHECK(dtype == "float32" || dtype == "bfloat16", "measure_matmul_gflops: dtype must be \"float32\" or "
                 "\"bfloat16\", got \"", dtype, "\"");
        py::gil_scoped_release release;
        return kernels::measure_matmul_gflops(m, n, k, dtype == "bfloat16", num_threads, repeats);
      },
      "m"_a, "n"_a, "k"_a, "dtype"_a = "float32", "num_threads"_a = 0, "repeats"_a = 5,
      "Best GFLOP/s of fusetrain's GEMM for an (m, k) x (k, n) product in float32 or bfloat16 (float32 "
      "accumulation) on num_threads threads (0: all cores): the matmul peak benchmarks divide model FLOPs by.");
  m.def(
      "measure_weight_matmul_gflops",
      [](int64_t m, int64_t n, int64_t k, bool trans_b, const std::string& weight, int num_threads, int repeats) {
        FT_CHECK(weight == "bfloat16" || weight == "nf4", "measure_weight_matmul_gflops: weight must be \"bfloat16\" "
                 "or \"nf4\", got \"", weight, "\"");
        py::gil_scoped_release release;
        return kernels::measure_weight_matmul_gflops(m, n, k, trans_b, weight == "nf4", num_threads, repeats);
      },
      "m"_a, "n"_a, "k"_a, "trans_b"_a = true, "weight"_a = "nf4", "num_threads"_a = 0, "repeats"_a = 5,
      "Best GFLOP/s of an (m, k) bfloat16 activation times a weight held in bfloat16 or NF4 (dequantised inside the "
      "GEMM): trans_b a Linear's forward x·Wᵀ with W (n, k), else its input gradient dy·W with W (k, n).");
  m.def(
      "_cli_main",
      [](std::vector<std::string> argv, std::optional<py::function> report) {
        std::vector<char*> pointers;
        for (std::string& arg : argv) pointers.push_back(arg.data());
        pointers.push_back(nullptr);
        if (report) {
          auto fn = std::make_shared<py::function>(*report);
          cli::set_report_sink([fn](const nlohmann::json& entry, const std::string& output_dir) {
            py::gil_scoped_acquire gil;
            (*fn)(to_python(entry), output_dir);
          });
        }
        int status;
        {
          py::gil_scoped_release release;
          status = cli::main(static_cast<int>(argv.size()), pointers.data());
        }
        if (report) cli::set_report_sink(nullptr);  // drops the Python function with the GIL held
        return status;
      },
      "argv"_a, "report"_a = py::none(),
      "Runs the fusetrain command line (argv[0] is the program name); returns the exit status. `report(entry, "
      "output_dir)` receives every training log entry (--report-to).");
  m.def("optimizer_names", &optim::optimizer_names,
        "transformers' `optim` values the engine runs, each the update of the optimizer transformers makes for it.");
  m.def(
      "check_optimizer",
      [](const std::string& optim, const std::string& optim_args) {
        optim::check_optimizer({.name = optim, .options = optim::parse_optim_args(optim_args)});
      },
      "optim"_a, "optim_args"_a = "",
      "Raises ValueError naming the problem unless the engine runs `optim` with `optim_args` (transformers' form, "
      "\"key=value,...\").");
  m.def("supported_architectures", &models::supported_architectures,
        "The transformers classes fusetrain implements, e.g. [\"BertForSequenceClassification\", ...].");
  m.def("architectures", &architecture_rows, R"doc(
The registry of architectures fusetrain builds, one dict per transformers class, in registry order:
architecture ("BertForSequenceClassification"), model_type ("bert"), head ("SequenceClassification";
"Base" for a model without a head), task (the Trainer's and the CLI's task, "seq-cls"; "" for Base),
problem (what the head solves, in words), outputs (the keys forward returns: ["logits"],
["start_logits", "end_logits"] or ["last_hidden_state"]), label_kinds (the dataset labels it trains on:
"class", "regression", "token_classes", "tokens", "spans") and language_model (evaluation reports perplexity).
)doc");
  m.def(
      "_dequantize_4bit",
      [](py::array_t<uint8_t, py::array::c_style | py::array::forcecast> data,
         py::array_t<float, py::array::c_style | py::array::forcecast> absmax,
         py::array_t<float, py::array::c_style | py::array::forcecast> code, int64_t blocksize, int64_t rows,
         int64_t cols, bool bf16) {
        const int shift = quant::block_shift(blocksize);
        FT_CHECK(shift >= 0, "blocksize ", blocksize, ": expected a power of two from 32 to 4096");
        FT_CHECK(rows > 0 && cols > 0 && rows * cols % 2 == 0, "rows x cols must be a positive even count; got ",
                 rows, " x ", cols);
        FT_CHECK(data.size() == rows * cols / 2, "data holds ", data.size(), " bytes; ", rows, " x ", cols,
                 " 4-bit codes need ", rows * cols / 2);
        FT_CHECK(absmax.size() == (rows * cols + blocksize - 1) / blocksize, "absmax holds ", absmax.size(),
                 " values; ", rows * cols, " elements in blocks of ", blocksize, " need ",
                 (rows * cols + blocksize - 1) / blocksize);
        FT_CHECK(code.size() == 16, "code holds ", code.size(), " values; a 4-bit format has 16");
        const quant::QuantMatrix w{data.data(), absmax.data(), code.data(), rows, cols, shift, bf16};
        py::array_t<float> out({rows, cols});
        for (int64_t r = 0; r < rows; ++r) w.dequantize_row(r, 0, cols, out.mutable_data() + r * cols);
        return out;
      },
      "data"_a, "absmax"_a, "code"_a, "blocksize"_a, "rows"_a, "cols"_a, "bf16"_a,
      "The engine's dequantisation of a 4-bit weight in bitsandbytes' layout (float32 (rows, cols); values rounded "
      "to bf16 when bf16). For tests against bitsandbytes' dequantize_4bit.");
  m.def(
      "_dequantize_int8",
      [](py::array_t<int8_t, py::array::c_style | py::array::forcecast> data,
         py::array_t<float, py::array::c_style | py::array::forcecast> absmax) {
        FT_CHECK(data.ndim() == 2, "data should be int8 (rows, cols), found ", data.ndim(), " dimensions");
        const int64_t rows = data.shape(0), cols = data.shape(1);
        FT_CHECK(absmax.size() == rows, "absmax holds ", absmax.size(), " values; ", rows, " rows need ", rows);
        const quant::QuantMatrix w{reinterpret_cast<const uint8_t*>(data.data()), absmax.data(), nullptr, rows, cols,
                                   0, false, true};
        py::array_t<float> out({rows, cols});
        for (int64_t r = 0; r < rows; ++r) w.dequantize_row(r, 0, cols, out.mutable_data() + r * cols);
        return out;
      },
      "data"_a, "absmax"_a,
      "The engine's dequantisation of an LLM.int8 weight (int8 (rows, cols) and the absmax of each row, bitsandbytes' "
      "CB and SCB) to float32. For tests against bitsandbytes' int8_vectorwise_dequant.");
  m.def(
      "_quantize_4bit",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x, int64_t blocksize,
         const std::string& quant_type) {
        const int shift = quant::block_shift(blocksize);
        FT_CHECK(shift >= 0, "blocksize ", blocksize, ": expected a power of two from 32 to 4096");
        const float* code = quant::code_4bit(quant_type);
        FT_CHECK(code != nullptr, "quant_type \"", quant_type, "\": expected nf4 or fp4");
        const int64_t n = x.size();
        FT_CHECK(n > 0 && n % blocksize == 0, "x holds ", n, " values; expected a whole number of blocks of ",
                 blocksize);
        py::array_t<uint8_t> packed(n / 2);
        py::array_t<float> absmax(n / blocksize);
        quant::quantize_4bit(x.data(), n, shift, code, packed.mutable_data(), absmax.mutable_data());
        return py::make_tuple(packed, absmax);
      },
      "x"_a, "blocksize"_a, "quant_type"_a,
      "The engine's 4-bit quantisation (the CLI's --base-dtype nf4/fp4): x flattened -> (packed codes uint8, absmax "
      "float32), as bitsandbytes' quantize_4bit. For tests against it.");
  m.def(
      "_quantize_int8",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        FT_CHECK(x.ndim() == 2, "x should be (rows, cols), found ", x.ndim(), " dimensions");
        const int64_t rows = x.shape(0), cols = x.shape(1);
        py::array_t<int8_t> q({rows, cols});
        py::array_t<float> absmax(rows);
        quant::quantize_int8_rows(x.data(), rows, cols, q.mutable_data(), absmax.mutable_data());
        return py::make_tuple(q, absmax);
      },
      "x"_a,
      "The engine's LLM.int8 quantisation (the CLI's --base-dtype int8): x (rows, cols) -> (int8 codes, absmax of each "
      "row), as bitsandbytes' Int8Params quantises a weight. For tests against it.");
  m.def(
      "_input_address",
      [](py::handle array, const char* name) {
        return reinterpret_cast<uintptr_t>(int64_input(array, name).tensor.data());
      },
      "array"_a, "name"_a = "input_ids",
      "Address of the memory the engine would read for an id array (equal to the array's own "
      "address when it is passed without a copy). For tests.");

  py::class_<PyModel> model_class(m, "Model", R"doc(
A Hugging Face transformer (BERT, RoBERTa, DistilBERT, GPT-2 and their heads) run by
fusetrain. Parameters live under their Hugging Face names; a plan is compiled per batch
shape on first use and cached. Create one with Model.from_pretrained or Model.from_config.
The model starts in eval mode (no dropout), as transformers models do after from_pretrained.
)doc");
  model_class
      .def_static(
          "from_pretrained",
          [](const std::filesystem::path& path, std::optional<std::string> architecture, py::kwargs overrides) {
            nlohmann::json config_overrides = to_json(overrides, "config_overrides");
            std::unique_ptr<models::Model> model;
            {
              py::gil_scoped_release release;
              model = models::Model::from_pretrained(path.string(), architecture.value_or(""), config_overrides);
            }
            return wrap(std::move(model));
          },
          "path"_a, "architecture"_a = py::none(), R"doc(
Loads config.json and *.safetensors from a local model directory.

architecture: the transformers class to build (e.g. "BertForSequenceClassification");
    defaults to config["architectures"][0].
**config_overrides: merged into the config first, e.g. num_labels=2.
Head weights missing from the checkpoint are freshly initialised and listed in missing_keys.
)doc")
      .def_static(
          "from_config",
          [](py::handle config, uint64_t seed, std::optional<std::string> architecture) {
            nlohmann::json json = config_argument(config);
            std::unique_ptr<models::Model> model;
            {
              py::gil_scoped_release release;
              model = models::Model::from_config(json, seed, architecture.value_or(""));
            }
            return wrap(std::move(model));
          },
          "config"_a, "seed"_a = 0, "architecture"_a = py::none(), R"doc(
A model with fresh weights, initialised as transformers does.

config: a dict (the contents of a config.json) or the path of a config.json.
seed: seeds the initialisation.
architecture: the transformers class to build; defaults to config["architectures"][0].
)doc")
      .def_static(
          "from_onnx",
          [](const std::filesystem::path& path, const std::string& task, std::vector<std::string> frozen,
             bool tie_identical, bool fuse_attention, bool keep_buffers_constant, const py::dict& values,
             std::map<std::string, int64_t> padding_rows) {
            std::unique_ptr<models::Model> model;
            onnx_import::ImportOptions options;
            options.frozen = std::move(frozen);
            options.padding_rows = std::move(padding_rows);
            for (auto [key, value] : values) {
              const auto array = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(value);
              FT_CHECK(array, "values[\"", py::str(key).cast<std::string>(), "\"] is not an array of numbers");
              options.values.emplace(py::str(key).cast<std::string>(),
                                     std::vector<float>(array.data(), array.data() + array.size()));
            }
            options.tie_identical = tie_identical;
            options.fuse_attention = fuse_attention;
            options.keep_buffers_constant = keep_buffers_constant;
            {
              py::gil_scoped_release release;
              model = onnx_import::import_model(path.string(), task, options);
            }
            return wrap(std::move(model));
          },
          "path"_a, "task"_a, "frozen"_a = std::vector<std::string>{}, "tie_identical"_a = true, "fuse_attention"_a = true,
          "keep_buffers_constant"_a = true, "values"_a = py::dict(),
          "padding_rows"_a = std::map<std::string, int64_t>{}, R"doc(
Trains a graph exported to ONNX (torch.onnx.export with either exporter, fusetrain export, Optimum).

task: what to train it for: "seq-cls", "token-cls", "qa", "mlm" or "clm"; its loss is appended to
    the graph's logits output (start_logits and end_logits for "qa").
frozen: names of float initializers to keep fixed; every other float initializer with more than
    one element is a parameter, under its initializer name. A weight the graph only ever multiplies
    as x·W is held in Linear's (out, in) layout, the transpose of the initializer (export_onnx writes
    it back as the graph holds it).
tie_identical: train a float initializer equal to an earlier one, or to its transpose, as that
    parameter: exporters fold the transpose of a shared weight into a copy per use (a tied LM head,
    ALBERT's shared layer). Tensors of one repeated value are never tied.
fuse_attention: run attention as exporters decompose it (MatMul, scale, mask, Softmax, MatMul)
    as one fused op; its mask must then be key padding (plus causal). Off runs the ops as written.
keep_buffers_constant: keep constant a float initializer whose every path to the outputs passes
    through an op only the host evaluates (an exporter's buffer, such as the rotary inv_freq the
    dynamo exporter writes for Llama); an embedding table stays a parameter. They are listed in
    constant_buffers. Off, such a graph is refused.
values: {initializer name: array} replacing those initializers' values (same element count), e.g.
    the frozen weights and buffers of the model a cached capture is trained for.
padding_rows: {embedding table name: row} the row whose gradient the table's lookups leave out
    (nn.Embedding's padding_idx; -1: none). A table not named takes config.json's pad_token_id
    where transformers declares padding_idx on such a table.
config.json beside the file, when present, gives num_labels, problem_type and the longest sequence.
Raises ValueError listing every node whose op cannot be imported. export_onnx then writes the same
graph with the trained initializers.
)doc")
      .def("zero_grad", &zero_grads, "Sets every gradient to zero.")
      .def(
          "state_dict_names", [](const PyModel& self) { return self.model->state_dict_names(); },
          "The names state_dict() returns, in its order, without copying any weight.")
      .def("state_dict", &state_dict,
           "Every parameter as a float32 numpy copy, keyed by its Hugging Face name, in transformers' order "
           "(tied weights appear under each of their names).")
      .def("load_state_dict", &load_state_dict, "state_dict"_a, "strict"_a = true, R"doc(
Copies arrays into the parameters by Hugging Face name. Values may be numpy arrays (float32,
float16, bfloat16 via ml_dtypes, or other floats, converted), anything numpy.asarray accepts,
or torch tensors. With strict, missing or unexpected names raise ValueError listing them.
)doc")
      .def(
          "save_pretrained",
          [](PyModel& self, const std::filesystem::path& path) {
            locked(self, [&] { self.model->save_pretrained(path.string()); });
          },
          "path"_a,
          "Writes config.json and model.safetensors (float32) in transformers' layout; a LoRA model writes its "
          "adapters in PEFT's format (save_adapter), as PeftModel.save_pretrained does.")
      .def(
          "decays", [](const PyModel& self, const std::string& name) { return self.model->decays(name); }, "name"_a,
          "Whether trained parameter `name` (its stored name) gets weight decay.")
      .def(
          "set_decayed",
          [](PyModel& self, const std::set<std::string>& names) {
            locked(self, [&] { self.model->set_decayed(names); });
          },
          "names"_a,
          "The trained parameters that get weight decay (stored names), in place of transformers' rule that "
          "Model.decays applies by default.")
      .def(
          "trainable_names", [](const PyModel& self) { return self.model->trainable_names(); },
          "The names of the parameters that train: all of them, or a LoRA model's adapters and modules_to_save.")
      .def(
          "enable_lora",
          [](PyModel& self, int64_t r, double alpha, double dropout, std::vector<std::string> target_modules,
             std::vector<std::string> modules_to_save, bool use_rslora, const std::string& base_dtype,
             uint64_t seed, const std::string& quant_type, int64_t quant_blocksize, bool quant_bf16,
             std::vector<std::string> quantized, bool quantize_base) {
            models::LoraConfig c;
            c.r = r;
            c.alpha = alpha;
            c.dropout = dropout;
            c.target_modules = std::move(target_modules);
            c.modules_to_save = std::move(modules_to_save);
            c.use_rslora = use_rslora;
            FT_CHECK(base_dtype == "float32" || base_dtype == "bfloat16" || base_dtype == "f32" || base_dtype == "bf16",
                     "base_dtype must be \"float32\" or \"bfloat16\", found \"", base_dtype, "\"");
            c.base_dtype = base_dtype == "bfloat16" || base_dtype == "bf16" ? DType::bf16 : DType::f32;
            c.seed = seed;
            c.quant_type = quant_type;
            c.quant_blocksize = quant_blocksize;
            c.quant_bf16 = quant_bf16;
            c.quantized = std::move(quantized);
            c.quantize_base = quantize_base;
            locked(self, [&] {
              if (quantize_base && c.quantized.empty()) c.quantized = self.model->quantizable_weights(c);
              self.model->enable_lora(c);
            });
          },
          "r"_a = 8, "lora_alpha"_a = 8.0, "lora_dropout"_a = 0.0, "target_modules"_a, "modules_to_save"_a =
          std::vector<std::string>{}, "use_rslora"_a = false, "base_dtype"_a = "float32", "seed"_a = 0,
          "quant_type"_a = "", "quant_blocksize"_a = 64, "quant_bf16"_a = true,
          "quantized"_a = std::vector<std::string>{}, "quantize_base"_a = false, R"doc(
Turns the model into a LoRA model, as peft.get_peft_model(model, LoraConfig(...)) does: an adapter
(lora_A (r, in) kaiming-uniform, lora_B (out, r) zero, scale lora_alpha / r) beside every Linear
whose module name or name suffix is in target_modules ("all-linear": every projection but the
output layer); every other weight frozen (no gradient, no optimizer state) but modules_to_save.
base_dtype="bfloat16" keeps the frozen projection weights in bf16, half their memory.
QLoRA: quant_type "nf4" or "fp4" holds the frozen weights named in `quantized` in bitsandbytes' 4-bit layout
(blocks of quant_blocksize): each as "<weight>" (packed codes, uint8), "<weight>.absmax" and
"<weight>.quant_map"; "int8" (LLM.int8) as "<weight>" (int8 codes as uint8) and "<weight>.absmax" (one a row).
Their values load_state_dict then gives (a bitsandbytes model's own), or with quantize_base=True the model
quantises its own weights as bitsandbytes would (`quantized` empty: every projection but the output layer);
their GEMMs dequantise them, 4-bit values rounded to bf16 when quant_bf16 (bitsandbytes' compute dtype).
)doc")
      .def_property_readonly(
          "lora",
          [](const PyModel& self) -> py::object {
            const models::LoraConfig* c = self.model->lora();
            if (c == nullptr) return py::none();
            py::dict d;
            d["r"] = c->r;
            d["lora_alpha"] = c->alpha;
            d["lora_dropout"] = c->dropout;
            d["target_modules"] = c->target_modules;
            d["modules_to_save"] = c->modules_to_save;
            d["use_rslora"] = c->use_rslora;
            d["base_dtype"] = c->base_dtype == DType::bf16 ? "bfloat16" : "float32";
            if (!c->quant_type.empty()) {
              d["quant_type"] = c->quant_type;
              d["quant_blocksize"] = c->quant_blocksize;
              d["quant_bf16"] = c->quant_bf16;
              d["quantized"] = c->quantized;
            }
            return py::object(d);
          },
          "The LoRA settings (a dict) of a model enable_lora was called on, else None.")
      .def(
          "merge_lora", [](PyModel& self) { locked(self, [&] { self.model->merge_lora(); }); },
          "Folds every adapter into its base weight (W += scale·B·A) and makes the model a plain one, every "
          "weight trainable in float32 (PEFT's merge_and_unload).")
      .def(
          "save_adapter",
          [](PyModel& self, const std::filesystem::path& path, const std::string& base_model) {
            locked(self, [&] { self.model->save_adapter(path.string(), base_model); });
          },
          "path"_a, "base_model_name_or_path"_a = "",
          "Writes adapter_config.json and adapter_model.safetensors in PEFT's format (peft.PeftModel.from_pretrained "
          "loads them).")
      .def(
          "load_adapter",
          [](PyModel& self, const std::filesystem::path& path) {
            locked(self, [&] { self.model->load_adapter(path.string()); });
          },
          "path"_a,
          "Reads a PEFT adapter directory (adapter_config.json, adapter_model.safetensors): enables LoRA with its "
          "settings and loads its weights.")
      .def(
          "export_onnx",
          [](PyModel& self, const std::filesystem::path& path, int64_t opset,
             std::optional<int64_t> external_data_threshold) {
            onnx_export::ExportOptions options;
            options.opset = opset;
            if (external_data_threshold) options.external_data_threshold = *external_data_threshold;
            return locked(self, [&] { return onnx_export::export_onnx(*self.model, path.string(), options).path; });
          },
          "path"_a, "opset"_a = 17, "external_data_threshold"_a = py::none(), R"doc(
Writes the inference graph (no dropout, no loss) to `path` as an ONNX model: inputs input_ids,
attention_mask (and token_type_ids for BERT, position_ids for Llama, Mistral and Qwen2 causal LMs and
base models), int64 with dynamic batch_size and sequence_length;
outputs named as Optimum names them (logits; start_logits and end_logits for question answering;
last_hidden_state for a base model); the weights as initializers under their transformers names.
opset 17 to 20 (20 writes the Gelu op). Initializers totalling more than external_data_threshold
bytes (default 2 GiB, protobuf's limit) go to "<file>_data" beside it. Returns the path written.
)doc")
      .def(
          "train",
          [](PyModel& self, bool mode) -> PyModel& {
            self.training = mode;
            return self;
          },
          "mode"_a = true, py::return_value_policy::reference,
          "Training mode (dropout active) when mode is true, eval otherwise; returns the model.")
      .def(
          "eval",
          [](PyModel& self) -> PyModel& {
            self.training = false;
            return self;
          },
          py::return_value_policy::reference, "Eval mode (no dropout); returns the model.")
      .def_property_readonly(
          "training", [](const PyModel& self) { return self.training; }, "True in train() mode (dropout active).")
      .def_property(
          "bf16", [](const PyModel& self) { return self.model->bf16(); },
          [](PyModel& self, bool on) { locked(self, [&] { self.model->set_bf16(on); }); },
          "bf16 mixed precision: matmuls in bfloat16 with float32 accumulation, float32 master weights, "
          "optimizer state, norms, softmax and loss. On CPUs without AVX512-BF16 or AMX the bf16 operands are "
          "widened to float32 inside the GEMM (float32 speed, half the activation memory). Off by default.")
      .def_property(
          "fp16", [](const PyModel& self) { return self.model->fp16(); },
          [](PyModel& self, bool on) { locked(self, [&] { self.model->set_fp16(on); }); },
          "fp16 mixed precision: projection operands in IEEE half with float32 accumulation (at float32 speed "
          "on CPUs without fp16 arithmetic), float32 master weights. Gradients come out multiplied by "
          "loss_scale. Off by default; turning it on turns bf16 off.")
      .def_property(
          "loss_scale", [](const PyModel& self) { return self.model->loss_scale(); },
          [](PyModel& self, double scale) {
            FT_CHECK(scale > 0 && std::isfinite(scale), "loss_scale must be positive and finite; got ", scale);
            self.model->set_loss_scale(scale);
          },
          "fp16 only: backward starts from this value instead of 1, so every gradient is multiplied by it "
          "(AdamW.clip_and_step divides it out).")
      .def_property(
          "recompute", [](const PyModel& self) { return self.model->recompute(); },
          [](PyModel& self, bool on) { locked(self, [&] { self.model->set_recompute(on); }); },
          "Activation checkpointing: backward recomputes each transformer layer's activations instead of "
          "keeping them from forward (a smaller activation peak for one extra forward; same gradients). Off by "
          "default.")
      .def_property(
          "unpad", [](const PyModel& self) { return self.model->unpad(); },
          [](PyModel& self, bool on) { locked(self, [&] { self.model->set_unpad(on); }); },
          "Runs padded batches unpadded where the model can (BERT and RoBERTa sequence classification): the "
          "layers outside attention compute only the tokens attention_mask keeps, when that drops at least a "
          "quarter of the positions. The same math as padded; float rounding and dropout masks differ. On by "
          "default.")
      .def_property_readonly(
          "last_token_rows", [](const PyModel& self) { return self.model->last_token_rows(); },
          "The rows the token-wise layers computed in the most recent run: the kept tokens rounded up when it ran "
          "unpadded, else batch x sequence; 0 before the first run.")
      .def_property(
          "token_stats", [](const PyModel& self) { return self.model->token_stats(); },
          [](PyModel& self, bool on) { locked(self, [&] { self.model->set_token_stats(on); }); },
          "Causal and masked LMs with token labels: each run also sums the softmax entropy and the top-1 hits over "
          "the positions the loss counts (TRL's entropy and mean_token_accuracy), from the fused LM head's logits "
          "chunks; read them with last_token_stats(). Off by default.")
      .def(
          "last_token_stats",
          [](const PyModel& self) -> py::object {
            const auto& s = self.model->last_token_stats();
            if (!s) return py::none();
            return py::dict("entropy_sum"_a = s->entropy_sum, "top1"_a = s->top1, "counted"_a = s->counted);
          },
          "The most recent run's token statistics (a dict: entropy_sum, top1, counted), or None.")
      .def(
          "set_preference",
          [](PyModel& self, std::optional<std::string> loss_type, double beta) {
            locked(self, [&] {
              if (!loss_type) return self.model->set_preference(std::nullopt);
              FT_CHECK(*loss_type == "sigmoid" || *loss_type == "hinge" || *loss_type == "ipo", "loss_type \"",
                       *loss_type, "\": fusetrain runs sigmoid, hinge and ipo");
              FT_CHECK(beta > 0 && std::isfinite(beta), "beta must be a finite number > 0; got ", beta);
              self.model->set_preference(models::PreferenceConfig{*loss_type, beta});
            });
          },
          "loss_type"_a, "beta"_a = 0.1, R"doc(
Trains a causal LM on TRL's DPO loss (loss_type "sigmoid", "hinge" or "ipo"; None: back to cross-entropy).
A batch then holds 2P sequences, the P chosen completions then the P rejected ones, labelled on the
completion tokens (-100 elsewhere). The reference log-probabilities come from the batch (ref_logps,
shape (2P,)), else from set_reference's model, else, for a LoRA model, from the base with the adapters
left out (a second program on the same weights). The log-probabilities are formed by the LM head in
chunks of rows: the (tokens x vocabulary) logits never exist whole.
)doc")
      .def(
          "set_reference",
          [](PyModel& self, PyModel* reference) {
            locked(self, [&] { self.model->set_reference(reference ? reference->model.get() : nullptr); });
          },
          "reference"_a, py::keep_alive<1, 2>(),
          "The frozen model a preference loss compares against (None: none). It is kept alive by this model.")
      .def(
          "sequence_log_probs",
          [](PyModel& self, py::handle input_ids, py::handle attention_mask, py::handle labels) {
            PreparedBatch prepared = prepare_batch(*self.model, input_ids, attention_mask, py::none(), py::none(),
                                                   labels, py::none(), py::none(), py::kwargs());
            std::vector<double> out = locked(self, [&] { return self.model->sequence_log_probs(prepared.batch); });
            return py::array_t<float>(static_cast<py::ssize_t>(out.size()),
                                      std::vector<float>(out.begin(), out.end()).data());
          },
          "input_ids"_a, "attention_mask"_a = py::none(), "labels"_a,
          "Each sequence's summed log-probability of its labels (-100 ignored; the causal shift applied), with LoRA "
          "adapters left out and no dropout: the reference log-probabilities (float32 (batch,)).")
      .def(
          "last_preference_stats",
          [](const PyModel& self) -> py::object {
            const auto& s = self.model->last_preference_stats();
            if (!s) return py::none();
            return py::dict("logps"_a = s->logps, "ref_logps"_a = s->ref_logps, "tokens"_a = s->tokens,
                            "entropy_sum"_a = s->entropy_sum, "top1"_a = s->top1,
                            "mean_logit_sum"_a = s->mean_logit_sum);
          },
          "The most recent preference run's per-sequence figures (a dict of lists: logps, ref_logps, tokens, and "
          "with token_stats entropy_sum, top1, mean_logit_sum), or None.")
      .def(
          "last_memory_report",
          [](const PyModel& self) -> py::object {
            const runtime::Plan* plan = self.model->last_plan();
            if (plan == nullptr) return py::none();
            const memory::MemoryReport& r = plan->memory_report();
            return py::dict("parameter_bytes"_a = r.parameter_bytes, "frozen_parameter_bytes"_a = r.frozen_parameter_bytes,
                            "gradient_bytes"_a = r.gradient_bytes, "input_bytes"_a = r.input_bytes,
                            "activation_peak_bytes"_a = r.activation_peak_bytes,
                            "activation_naive_bytes"_a = r.activation_naive_bytes);
          },
          "The memory of the most recent run's program (a dict of byte counts: parameter, frozen_parameter, gradient, "
          "input, activation_peak: the planned arena, activation_naive: every activation in its own buffer), or "
          "None before the first run.")
      .def(
          "set_num_threads",
          [](PyModel& self, int n) {
            FT_CHECK(n >= 0, "set_num_threads: n must be >= 0 (0 means all cores); got ", n);
            self.num_threads = n;
          },
          "n"_a, "Threads the kernels and optimizers use; 0 means all cores.")
      .def_property_readonly(
          "config", [](const PyModel& self) { return to_python(self.model->config()); },
          "The model's config as a dict (a copy).")
      .def_property_readonly(
          "architecture", [](const PyModel& self) { return self.model->architecture(); },
          "The transformers class this model mirrors, e.g. \"BertForSequenceClassification\".")
      .def_property_readonly(
          "model_type", [](const PyModel& self) { return self.model->model_type(); },
          "\"bert\", \"roberta\", \"distilbert\", \"gpt2\", \"llama\", \"mistral\" or \"qwen2\" (an ONNX graph: its "
          "config.json's, else \"onnx\").")
      .def_property_readonly(
          "missing_keys", [](const PyModel& self) { return self.model->missing_keys(); },
          "Parameters the checkpoint did not provide (freshly initialised).")
      .def_property_readonly(
          "constant_buffers", [](const PyModel& self) { return onnx_import::constant_buffers(*self.model); },
          "Float initializers an ONNX import kept constant (from_onnx's keep_buffers_constant); empty otherwise.")
      .def_property_readonly(
          "inputs",
          [](const PyModel& self) {
            py::list rows;
            for (const models::InputDecl& d : self.model->inputs()) {
              static const char* kSource[] = {"batch", "optional", "derived"};
              py::dict row;
              row["name"] = d.name;
              row["dtype"] = models::element_type_name(d.dtype);
              row["rank"] = d.rank;
              row["sequence_axis"] = d.seq_axis < 0 ? py::object(py::none()) : py::int_(d.seq_axis);
              row["source"] = kSource[int(d.source)];
              row["shape"] = models::describe(d);
              rows.append(row);
            }
            return rows;
          },
          "The inputs the model reads, as dicts: name, dtype (\"int64\", \"float32\"), rank, sequence_axis (None "
          "for none; axis 0 is the batch), source (\"batch\": the batch must give it, \"optional\", \"derived\": "
          "computed when left out) and shape, e.g. \"float32 (batch, 3, 224, 224)\".")
      .def_property_readonly(
          "num_parameters", [](const PyModel& self) { return self.model->params().num_parameters(); },
          "Number of parameters (tied weights counted once).")
      .def("__repr__", &model_repr);

  constexpr const char* kForwardDoc = R"doc(
Runs the model on one batch and returns a dict.

input_ids, attention_mask, token_type_ids, position_ids: integer arrays of shape (batch, sequence).
    int64 C-contiguous arrays are read in place; other integer types are converted.
Other inputs the model declares (Model.inputs) by name, e.g. pixel_values: float (batch, channels, height,
    width) for an image model; float32 C-contiguous arrays are read in place.
labels: int (batch,) class ids or (batch, sequence) token ids (-100 ignored), or float
    (batch,) / (batch, n) values for regression and multi-label classification.
start_positions, end_positions: (batch,) for question answering.
Returns {"logits": float32 array} ({"start_logits", "end_logits"} for question answering)
plus "loss" (a float) when labels are given. Dropout is active in train() mode.
)doc";
  def_batch_method(model_class, "forward", &forward, kForwardDoc);
  def_batch_method(model_class, "__call__", &forward, "Same as forward.");
  def_batch_method(model_class, "loss_and_grads", &loss_and_grads, R"doc(
Zeroes the gradients, runs forward and backward, and returns (loss, grads): grads maps every
name in state_dict() to a float32 copy of its gradient. The gradients also stay in the model
for an optimizer's step(). Arguments as for forward; labels (or spans) are required.
)doc");
  def_batch_method(model_class, "accumulate_grads", &accumulate_grads,
                   "Forward and backward adding into the current gradients (gradient accumulation); returns the loss.");

  py::class_<PyAdamW>(m, "AdamW", R"doc(
AdamW over all of a model's parameters, the same update as torch.optim.AdamW, fused into one
pass over the flat parameter, gradient and state buffers. step() uses the gradients currently
in the model (from loss_and_grads or accumulate_grads).
)doc")
      .def(py::init([](PyModel& model, double lr, std::pair<double, double> betas, double eps, double weight_decay) {
             check_hyperparameters(lr, weight_decay);
             FT_CHECK(betas.first >= 0 && betas.first < 1 && betas.second >= 0 && betas.second < 1,
                      "betas must lie in [0, 1); got (", betas.first, ", ", betas.second, ")");
             FT_CHECK(eps >= 0, "eps must be non-negative; got ", eps);
             return std::make_unique<PyAdamW>(
                 model,
                 optim::AdamWConfig{
                     .lr = lr, .beta1 = betas.first, .beta2 = betas.second, .eps = eps, .weight_decay = weight_decay});
           }),
           "model"_a, "lr"_a = 1e-3, "betas"_a = std::make_pair(0.9, 0.999), "eps"_a = 1e-8, "weight_decay"_a = 0.01,
           py::keep_alive<1, 2>())
      .def("step", &adamw_step, "One update of every parameter with the current gradients.")
      .def("clip_and_step", &adamw_clip_and_step, "max_norm"_a,
           "Clips the gradients to a global norm of max_norm (if > 0) and steps; returns the norm before clipping. "
           "For an fp16 model it first divides out model.loss_scale and skips the step (returning inf or nan) "
           "when a gradient overflowed: adjust loss_scale then, as a GradScaler would.")
      .def(
          "zero_grad", [](PyAdamW& self) { zero_grads(self.model); }, "Sets the model's gradients to zero.")
      .def_property(
          "lr", [](const PyAdamW& self) { return self.optimizer.lr(); },
          [](PyAdamW& self, double lr) {
            check_hyperparameters(lr, 0);
            self.optimizer.set_lr(lr);
          },
          "The learning rate of the next step (settable, for schedules).")
      .def_property_readonly(
          "step_count", [](const PyAdamW& self) { return self.optimizer.step_count(); },
          "Steps taken so far (drives bias correction).");

  bind_trainer(m);

  py::class_<PyOptimizer>(m, "Optimizer", R"doc(
Any optimizer the engine runs, chosen as transformers' TrainingArguments choose it: optim
("adamw_torch", "sgd", "adafactor", "rmsprop", "adagrad", "lion_32bit", "adamw_8bit", ...),
the learning rate, the weight decay of the decayed parameters (the model's decay groups,
Model.decays: transformers' Trainer's, or what set_decayed chose), the Adam betas and eps, and
optim_args ("momentum=0.9,...").
step() uses the gradients currently in the model, in one fused pass over the flat buffers.
)doc")
      .def(py::init([](PyModel& model, const std::string& optim, double lr, double weight_decay,
                       std::pair<double, double> betas, double eps, const std::string& optim_args) {
             check_hyperparameters(lr, weight_decay);
             const optim::OptimizerSpec spec{optim, lr, weight_decay, betas.first, betas.second, eps,
                                             optim::parse_optim_args(optim_args)};
             return std::make_unique<PyOptimizer>(model, spec);
           }),
           "model"_a, "optim"_a, "lr"_a = 1e-3, "weight_decay"_a = 0.0, "betas"_a = std::make_pair(0.9, 0.999),
           "eps"_a = 1e-8, "optim_args"_a = "", py::keep_alive<1, 2>())
      .def("step", &optimizer_step, "One update of every parameter with the current gradients.")
      .def(
          "zero_grad", [](PyOptimizer& self) { zero_grads(self.model); }, "Sets the model's gradients to zero.")
      .def_property(
          "lr", [](const PyOptimizer& self) { return self.optimizer->lr(); },
          [](PyOptimizer& self, double lr) {
            check_hyperparameters(lr, 0);
            self.optimizer->set_lr(lr);
          },
          "The learning rate of the next step (settable, for schedules).")
      .def_property_readonly(
          "name", [](const PyOptimizer& self) { return self.optimizer->name(); }, "The optim value it runs.")
      .def_property_readonly(
          "state_bytes", [](const PyOptimizer& self) { return self.optimizer->state_bytes(); },
          "Bytes of optimizer state it keeps.")
      .def_property_readonly(
          "step_count", [](const PyOptimizer& self) { return self.optimizer->step_count(); }, "Steps taken so far.");

  py::class_<PySgd>(m, "SGD", R"doc(
SGD with momentum over all of a model's parameters, the same update as torch.optim.SGD, fused
into one pass over the flat buffers. step() uses the gradients currently in the model.
)doc")
      .def(py::init(
               [](PyModel& model, double lr, double momentum, double dampening, double weight_decay, bool nesterov) {
                 check_hyperparameters(lr, weight_decay);
                 FT_CHECK(momentum >= 0, "momentum must be non-negative; got ", momentum);
                 FT_CHECK(!nesterov || (momentum > 0 && dampening == 0),
                          "nesterov momentum requires a momentum > 0 and zero dampening; got momentum ", momentum,
                          ", dampening ", dampening);
                 return std::make_unique<PySgd>(model, optim::SgdConfig{.lr = lr,
                                                                        .momentum = momentum,
                                                                        .dampening = dampening,
                                                                        .weight_decay = weight_decay,
                                                                        .nesterov = nesterov});
               }),
           "model"_a, "lr"_a, "momentum"_a = 0.0, "dampening"_a = 0.0, "weight_decay"_a = 0.0, "nesterov"_a = false,
           py::keep_alive<1, 2>())
      .def("step", &sgd_step, "One update of every parameter with the current gradients.")
      .def(
          "zero_grad", [](PySgd& self) { zero_grads(self.model); }, "Sets the model's gradients to zero.")
      .def_property(
          "lr", [](const PySgd& self) { return self.optimizer.lr(); },
          [](PySgd& self, double lr) {
            check_hyperparameters(lr, 0);
            self.optimizer.set_lr(lr);
          },
          "The learning rate of the next step (settable, for schedules).")
      .def_property_readonly(
          "step_count", [](const PySgd& self) { return self.optimizer.step_count(); }, "Steps taken so far.");
}
