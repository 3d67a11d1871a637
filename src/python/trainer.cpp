// fusetrain._core._Dataset and fusetrain._core._Trainer: the engine side of
// fusetrain.Trainer (python/fusetrain/trainer.py). The loop, schedules, evaluation,
// checkpoints and resume are train::Trainer's, the same the CLI runs; this file
// only carries data across: datasets as flat int64 arrays (copied once), and the
// Python hooks (a transformers collator, compute_metrics, the callbacks) called
// back with the GIL taken. Training runs with the GIL released.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fusetrain/comm/communicator.h"
#include "fusetrain/core/error.h"
#include "fusetrain/data/loader.h"
#include "fusetrain/models/registry.h"
#include "fusetrain/train/trainer.h"
#include "python/binding.h"

using namespace pybind11::literals;

namespace fusetrain::python {
namespace {

// numpy's dtype for a state buffer's elements (f32, or u8 codes).
py::dtype numpy_dtype(DType dtype) {
  FT_CHECK(dtype == DType::f32 || dtype == DType::u8, "optimizer state: no numpy form for ", dtype_name(dtype));
  return dtype == DType::u8 ? py::dtype::of<uint8_t>() : py::dtype::of<float>();
}

// Where slot i's values of `buffer` lie: (offset, shape), offset -1 when the slot has none of this state.
std::pair<int64_t, Shape> state_place(const optim::StateBuffer& buffer, const runtime::ParamSlot& slot, size_t i) {
  if (buffer.per_slot.empty()) return {slot.offset, slot.shape};
  return buffer.per_slot[i];
}

/// A Python callable that may be copied and dropped on threads without the GIL: only the last owner, with the GIL
/// taken, releases the Python object.
using SharedCallable = std::shared_ptr<py::function>;

SharedCallable share(py::function fn) {
  return SharedCallable(new py::function(std::move(fn)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
}

/// A communicator whose collectives are a Python object's methods (fusetrain.distributed.TorchCommunicator over
/// torch.distributed): each method gets numpy views of the engine's own buffers, so nothing is copied here.
class PythonCommunicator final : public comm::Communicator {
 public:
  explicit PythonCommunicator(py::object impl)
      : impl_(new py::object(std::move(impl)), [](py::object* o) {
          py::gil_scoped_acquire gil;
          delete o;
        }) {
    rank_ = impl_->attr("rank").cast<int>();
    size_ = impl_->attr("size").cast<int>();
    local_rank_ = impl_->attr("local_rank").cast<int>();
    backend_ = impl_->attr("backend").cast<std::string>();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  std::string backend() const override { return backend_; }
  // Each collective takes the GIL before it makes the numpy views and calls the Python method.
  void all_reduce_sum(float* data, int64_t n) override {
    py::gil_scoped_acquire gil;
    impl_->attr("all_reduce")(view(data, n));
  }
  std::unique_ptr<comm::Request> start_all_reduce_sum(float* data, int64_t n) override {
    all_reduce_sum(data, n);  // torch.distributed's async work would need the GIL to progress; run it now
    return std::make_unique<Done>();
  }
  void all_reduce_sum(double* data, int64_t n) override {
    py::gil_scoped_acquire gil;
    impl_->attr("all_reduce")(view(data, n));
  }
  void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) override {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    py::gil_scoped_acquire gil;
    impl_->attr("reduce_scatter")(view(const_cast<float*>(in), total), view(out, counts[static_cast<size_t>(rank_)]),
                                  std::vector<int64_t>(counts.begin(), counts.end()));
  }
  void all_gather_in_place(float* data, std::span<const int64_t> counts) override {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    py::gil_scoped_acquire gil;
    impl_->attr("all_gather")(view(data, total), std::vector<int64_t>(counts.begin(), counts.end()));
  }
  void broadcast(void* data, int64_t bytes, int root) override {
    py::gil_scoped_acquire gil;
    impl_->attr("broadcast")(view(static_cast<uint8_t*>(data), bytes), root);
  }
  double sum(double value) override {
    all_reduce_sum(&value, 1);
    return value;
  }
  void send(const void* data, int64_t bytes, int dest) override {
    py::gil_scoped_acquire gil;
    impl_->attr("send")(view(static_cast<uint8_t*>(const_cast<void*>(data)), bytes), dest);
  }
  void recv(void* data, int64_t bytes, int source) override {
    py::gil_scoped_acquire gil;
    impl_->attr("recv")(view(static_cast<uint8_t*>(data), bytes), source);
  }
  void barrier() override {
    py::gil_scoped_acquire gil;
    impl_->attr("barrier")();
  }

 private:
  class Done final : public comm::Request {
   public:
    void wait() override {}
  };
  // A numpy array over engine memory (a no-op capsule as its base, so numpy neither copies nor frees it).
  template <typename T>
  static py::array view(T* data, int64_t n) {
    return py::array_t<T>({n}, {static_cast<int64_t>(sizeof(T))}, data, py::capsule(data, [](void*) {}));
  }
  std::shared_ptr<py::object> impl_;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  std::string backend_;
};

/// The integers of a 1-D array (or anything numpy.asarray accepts) as int64 values.
std::vector<int64_t> int64_values(py::handle obj, const std::string& name) {
  py::array a = as_array(obj);
  const char kind = a.dtype().kind();
  FT_CHECK(kind == 'i' || kind == 'u' || kind == 'b' || a.size() == 0, name,
           " must hold integers; got dtype ", py::str(a.dtype()).cast<std::string>());
  auto values = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  return std::vector<int64_t>(values.data(), values.data() + values.size());
}

std::vector<float> float_values(py::handle obj) {
  auto values = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(as_array(obj));
  return std::vector<float>(values.data(), values.data() + values.size());
}

/// A tokenized dataset owned by Python (train::Trainer holds datasets by pointer).
struct PyDataset {
  data::TokenizedDataset dataset;
};

/// The float inputs a batch may hold in place of input_ids: images, log-mel features (Whisper), raw audio.
const char* const kFeatureInputs[] = {"pixel_values", "input_features", "input_values", "mask_time_indices",
                                      "mask_feature_indices"};

/// A batch from a Python collator's output: a mapping of (B, T) / (B,) arrays (numpy or torch).
data::Batch batch_from_python(py::handle output) {
  FT_CHECK(py::isinstance<py::dict>(output) || py::hasattr(output, "keys"),
           "the data collator must return a mapping of arrays (input_ids, attention_mask, labels, ...); got ",
           py::type::of(output).attr("__name__").cast<std::string>());
  py::dict batch_dict = py::dict(py::reinterpret_borrow<py::object>(output));
  data::Batch b;
  if (batch_dict.contains("input_ids")) {
    py::array ids = as_array(batch_dict["input_ids"]);
    FT_CHECK(ids.ndim() == 2, "the data collator's input_ids must have shape (batch, sequence); got ", ids.ndim(),
             " dimensions");
    b.batch_size = ids.shape(0);
    b.seq_len = ids.shape(1);
  } else {
    const char* const* features = std::find_if(std::begin(kFeatureInputs), std::end(kFeatureInputs),
                                               [&](const char* name) { return batch_dict.contains(name); });
    FT_CHECK(features != std::end(kFeatureInputs), "the data collator's batch has no \"input_ids\" (or "
             "\"pixel_values\" for an image model, \"input_features\" or \"input_values\" for a speech model)");
    py::array values = as_array(batch_dict[*features]);
    FT_CHECK(values.ndim() >= 1, "the data collator's ", *features, " is a scalar; expected (batch, ...)");
    b.batch_size = values.shape(0);
  }
  const auto tokens = static_cast<size_t>(b.batch_size * b.seq_len);
  auto tokens_of = [&](const char* key) {
    std::vector<int64_t> v = int64_values(batch_dict[key], str("the data collator's ", key));
    FT_CHECK(v.size() == tokens, "the data collator's ", key, " has ", v.size(), " values; input_ids has ", tokens);
    return v;
  };
  for (auto [key, value] : batch_dict) {
    const std::string name = py::str(key).cast<std::string>();
    if (name == "input_ids") {
      b.input_ids = tokens_of("input_ids");
    } else if (name == "attention_mask") {
      b.attention_mask = tokens_of("attention_mask");
    } else if (name == "token_type_ids") {
      b.token_type_ids = tokens_of("token_type_ids");
    } else if (name == "position_ids") {
      b.position_ids = tokens_of("position_ids");
    } else if (name == "num_tokens") {  // what TRL's trainers count for their num_tokens metric
      b.counted_tokens = py::int_(py::reinterpret_borrow<py::object>(value)).cast<int64_t>();
    } else if (name == "cu_seq_lens_q" || name == "cu_seq_lens_k" || name == "max_length_q" ||
               name == "max_length_k" || name == "seq_idx") {
      // TRL's padding-free boundaries for varlen kernels: the engine reads the same boundaries from position_ids.
    } else if (name == "labels" || name == "label" || name == "label_ids") {
      py::array labels = as_array(value);
      if (labels.dtype().kind() == 'f') {
        b.float_labels = float_values(labels);
        FT_CHECK(static_cast<int64_t>(b.float_labels.size()) == b.batch_size, "the data collator's ", name, " has ",
                 b.float_labels.size(), " float values for ", b.batch_size, " examples");
      } else {
        b.labels = int64_values(labels, "the data collator's " + name);
        if (labels.ndim() == 2 && labels.shape(1) != b.seq_len) b.label_seq_len = labels.shape(1);  // seq2seq targets
        const auto per_target = static_cast<size_t>(b.batch_size * b.label_seq_len);
        FT_CHECK(static_cast<int64_t>(b.labels.size()) == b.batch_size || b.labels.size() == tokens ||
                     (b.label_seq_len > 0 && b.labels.size() == per_target),
                 "the data collator's ", name, " has ", b.labels.size(), " values; expected one per example (",
                 b.batch_size, ") or one per token (", tokens, ")");
      }
    } else if (name == "ref_logps") {  // a preference batch's reference log-probabilities
      data::FloatInput input{name, {b.batch_size}, float_values(value)};
      FT_CHECK(static_cast<int64_t>(input.values.size()) == b.batch_size, "the data collator's ref_logps has ",
               input.values.size(), " values for ", b.batch_size, " sequences");
      b.float_inputs.push_back(std::move(input));
    } else if (name == "start_positions" || name == "end_positions") {
      std::vector<int64_t> v = int64_values(value, "the data collator's " + name);
      FT_CHECK(static_cast<int64_t>(v.size()) == b.batch_size, "the data collator's ", name, " has ", v.size(),
               " values for ", b.batch_size, " examples");
      (name == "start_positions" ? b.start_positions : b.end_positions) = std::move(v);
    } else if (std::find(std::begin(kFeatureInputs), std::end(kFeatureInputs), name) != std::end(kFeatureInputs)) {
      py::array pixels = as_array(value);
      FT_CHECK(pixels.dtype().kind() == 'f', "the data collator's ", name, " must be floating point; got dtype ",
               py::str(pixels.dtype()).cast<std::string>());
      data::FloatInput input{name, {}, float_values(pixels)};
      for (py::ssize_t k = 0; k < pixels.ndim(); ++k) input.shape.push_back(pixels.shape(k));
      FT_CHECK(!input.shape.empty() && input.shape[0] == b.batch_size, "the data collator's ", name, " has ",
               input.shape.empty() ? 0 : input.shape[0], " examples; the batch has ", b.batch_size);
      b.float_inputs.push_back(std::move(input));
    } else if (name == "decoder_input_ids" || name == "decoder_attention_mask") {
      py::array values = as_array(value);
      FT_CHECK(values.ndim() == 2 && values.shape(0) == b.batch_size, "the data collator's ", name,
               " must have shape (batch, target sequence) with batch ", b.batch_size, "; got ", values.ndim(),
               " dimensions", values.ndim() >= 1 ? str(" and batch ", values.shape(0)) : std::string());
      b.token_inputs.push_back({name, {values.shape(0), values.shape(1)},
                                int64_values(values, "the data collator's " + name)});
    } else if (name != "special_tokens_mask") {
      throw Error(str("the data collator's batch has a key \"", name, "\" the model does not take (expected "
                      "input_ids, attention_mask, token_type_ids, position_ids, pixel_values, input_features, "
                      "input_values, decoder_input_ids, "
                      "decoder_attention_mask, labels, start_positions, end_positions)"));
    }
  }
  if (b.label_seq_len > 0) {
    // Labels of another length than input_ids: an encoder-decoder's targets, as long as its decoder inputs; or, in
    // a batch of audio without decoder inputs, label sequences of their own length (CTC).
    const auto decoder = std::find_if(b.token_inputs.begin(), b.token_inputs.end(),
                                      [](const data::TokenInput& t) { return t.name == "decoder_input_ids"; });
    const bool label_sequences = b.input_ids.empty() && decoder == b.token_inputs.end() && !b.float_inputs.empty();
    FT_CHECK(label_sequences || (decoder != b.token_inputs.end() && decoder->shape[1] == b.label_seq_len),
             "the data collator's labels ",
             "have shape (", b.batch_size, ", ", b.label_seq_len, "), not input_ids' (", b.batch_size, ", ", b.seq_len,
             "); only an encoder-decoder's labels differ, and then decoder_input_ids must have their shape");
  }
  // Without a mask every token counts; position_ids without one may pack several examples in a row.
  if (b.attention_mask.empty() && !b.input_ids.empty() && b.position_ids.empty()) b.attention_mask.assign(tokens, 1);
  return b;
}

py::array float_array(const std::vector<float>& v, std::vector<py::ssize_t> shape) {
  py::array_t<float> a(shape);
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::array int64_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

/// Predictions as a dict of numpy arrays: "logits" (rows, classes) (question answering: the start logits of every
/// feature, flat, with "end_logits" and "feature_offsets"), "labels" or "float_labels" (rows,), "metrics", and
/// "answers" for question answering.
py::dict predictions_to_python(const train::Predictions& p) {
  py::dict out;
  if (p.classes > 0)
    out["logits"] = float_array(p.logits, {static_cast<py::ssize_t>(p.rows), static_cast<py::ssize_t>(p.classes)});
  else
    out["logits"] = float_array(p.logits, {static_cast<py::ssize_t>(p.logits.size())});
  if (!p.end_logits.empty()) out["end_logits"] = float_array(p.end_logits, {static_cast<py::ssize_t>(p.end_logits.size())});
  if (!p.feature_offsets.empty()) out["feature_offsets"] = int64_array(p.feature_offsets);
  if (!p.labels.empty()) out["labels"] = int64_array(p.labels);
  if (!p.float_labels.empty())
    out["float_labels"] = float_array(p.float_labels, {static_cast<py::ssize_t>(p.float_labels.size())});
  if (!p.answers.empty()) out["answers"] = py::cast(p.answers);
  out["metrics"] = py::cast(p.metrics);
  return out;
}

py::dict state_to_python(const train::TrainerState& s, bool with_history) {
  py::dict out;
  out["global_step"] = s.global_step;
  out["epoch"] = s.epoch;
  out["max_steps"] = s.max_steps;
  out["best_metric"] = s.best_metric ? py::object(py::float_(*s.best_metric)) : py::none();
  out["best_model_checkpoint"] =
      s.best_model_checkpoint ? py::object(py::str(*s.best_model_checkpoint)) : py::none();
  if (with_history) out["log_history"] = to_python(s.log_history);
  const train::StepReport& r = s.last_step;
  out["last_step"] = py::dict("loss"_a = r.loss, "grad_norm"_a = r.grad_norm, "learning_rate"_a = r.learning_rate,
                              "tokens"_a = r.tokens, "samples"_a = r.samples, "micro_batches"_a = r.micro_batches,
                              "loss_sum"_a = r.loss_sum, "predicted"_a = r.predicted, "labelled"_a = r.labelled,
                              "skipped"_a = r.skipped, "counted_tokens"_a = r.counted_tokens,
                              "token_entropy"_a = r.token_entropy, "token_accuracy"_a = r.token_accuracy);
  py::list preference;
  for (const models::PreferenceStats& p : r.preference)
    preference.append(py::dict("logps"_a = p.logps, "ref_logps"_a = p.ref_logps, "tokens"_a = p.tokens,
                               "entropy_sum"_a = p.entropy_sum, "top1"_a = p.top1,
                               "mean_logit_sum"_a = p.mean_logit_sum));
  out["last_step"]["preference"] = preference;
  return out;
}

constexpr const char* kControlFlags[] = {"should_training_stop", "should_epoch_stop", "should_save",
                                         "should_evaluate", "should_log"};

bool* control_flag(train::TrainerControl& c, int i) {
  bool* flags[] = {&c.should_training_stop, &c.should_epoch_stop, &c.should_save, &c.should_evaluate, &c.should_log};
  return flags[i];
}

/// Forwards every callback event to one Python function
/// `dispatch(event, state: dict, control: dict, payload) -> dict | None`; the flags of a returned dict become the
/// loop's control. A pending Ctrl-C is raised at the end of each step.
class PythonCallbacks : public train::Callback {
 public:
  explicit PythonCallbacks(SharedCallable dispatch) : dispatch_(std::move(dispatch)) {}

  void on_train_begin(const train::TrainerState& s, train::TrainerControl& c) override {
    call("on_train_begin", s, c, [] { return py::none(); }, true);
  }
  void on_epoch_begin(const train::TrainerState& s, train::TrainerControl& c) override {
    call("on_epoch_begin", s, c, [] { return py::none(); });
  }
  void on_step_begin(const train::TrainerState& s, train::TrainerControl& c) override {
    call("on_step_begin", s, c, [] { return py::none(); });
  }
  void on_step_end(const train::TrainerState& s, train::TrainerControl& c) override {
    call("on_step_end", s, c, [] { return py::none(); });
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
  void on_epoch_end(const train::TrainerState& s, train::TrainerControl& c) override {
    call("on_epoch_end", s, c, [] { return py::none(); });
  }
  void on_log(const train::TrainerState& s, train::TrainerControl& c, const nlohmann::json& logs) override {
    call("on_log", s, c, [&] { return to_python(logs); });
  }
  void on_evaluate(const train::TrainerState& s, train::TrainerControl& c,
                   const std::map<std::string, double>& metrics) override {
    call("on_evaluate", s, c, [&] { return py::object(py::cast(metrics)); });
  }
  void on_save(const train::TrainerState& s, train::TrainerControl& c, const std::string& dir) override {
    call("on_save", s, c, [&] { return py::object(py::str(dir)); });
  }
  void on_train_end(const train::TrainerState& s, train::TrainerControl& c) override {
    call("on_train_end", s, c, [] { return py::none(); }, true);
  }

 private:
  SharedCallable dispatch_;

  /// Calls dispatch with the GIL taken; `payload` builds the event's argument (under the GIL).
  template <typename Payload>
  void call(const char* event, const train::TrainerState& s, train::TrainerControl& c, Payload payload,
            bool with_history = false) {
    py::gil_scoped_acquire gil;
    py::object argument = payload();
    py::dict control;
    for (int i = 0; i < 5; ++i) control[kControlFlags[i]] = *control_flag(c, i);
    py::object result = (*dispatch_)(event, state_to_python(s, with_history), control, argument);
    if (result.is_none()) return;
    py::dict flags = result.cast<py::dict>();
    for (int i = 0; i < 5; ++i)
      if (flags.contains(kControlFlags[i])) *control_flag(c, i) = flags[kControlFlags[i]].cast<bool>();
  }
};

/// train::Trainer over a Python-owned model and datasets (kept alive by the Python objects held here).
struct PyTrainer {
  PyModel& model;
  py::object train_dataset, eval_dataset;
  std::unique_ptr<train::Trainer> trainer;
};

const data::TokenizedDataset* dataset_of(const py::object& obj) {
  return obj.is_none() ? nullptr : &obj.cast<PyDataset&>().dataset;
}

}  // namespace

void bind_trainer(py::module_& m) {
  py::class_<PyDataset>(m, "_Dataset", R"doc(
Tokenized examples as the engine's Trainer reads them (fusetrain.Trainer builds these from
datasets, lists of dicts or map-style datasets). Example i is ids[offsets[i]:offsets[i + 1]].
)doc")
      .def(py::init([](py::handle offsets, py::handle ids, py::handle type_ids, const std::string& label_kind,
                       py::handle labels, int64_t num_labels, int64_t vocab_size, bool without_tokens) {
             data::FlatExamples e;
             e.offsets = int64_values(offsets, "offsets");
             e.ids = int64_values(ids, "input_ids");
             if (!type_ids.is_none()) e.type_ids = int64_values(type_ids, "token_type_ids");
             e.label_kind = models::parse_data_label(label_kind);
             if (e.label_kind == data::LabelKind::Regression)
               e.float_labels = float_values(labels);
             else if (!labels.is_none())
               e.labels = int64_values(labels, "labels");
             e.num_labels = num_labels;
             e.vocab_size = vocab_size;
             e.without_tokens = without_tokens;
             return std::make_unique<PyDataset>(PyDataset{data::TokenizedDataset::from_flat(std::move(e))});
           }),
           "offsets"_a, "ids"_a, "type_ids"_a = py::none(), "label_kind"_a = "none", "labels"_a = py::none(),
           "num_labels"_a = 0, "vocab_size"_a = 0, "without_tokens"_a = false)
      .def("__len__", [](const PyDataset& d) { return d.dataset.size(); })
      .def_property_readonly(
          "num_tokens", [](const PyDataset& d) { return d.dataset.num_tokens(); }, "Total tokens over all examples.")
      .def(
          "lengths",
          [](const PyDataset& d) {
            std::vector<int64_t> lengths(static_cast<size_t>(d.dataset.size()));
            for (int64_t i = 0; i < d.dataset.size(); ++i) lengths[static_cast<size_t>(i)] = d.dataset.length(i);
            return int64_array(lengths);
          },
          "The number of tokens of every example.")
      .def(
          "token_labels",
          [](const PyDataset& d) -> py::object {
            if (d.dataset.label_kind() != data::LabelKind::TokenClasses) return py::none();
            std::vector<int64_t> labels;
            labels.reserve(static_cast<size_t>(d.dataset.num_tokens()));
            for (int64_t i = 0; i < d.dataset.size(); ++i) {
              auto span = d.dataset.token_labels(i);
              labels.insert(labels.end(), span.begin(), span.end());
            }
            return int64_array(labels);
          },
          "Every token's class, example after example (token classification), else None.");

  m.def("_launched_by_mpi", &comm::launched_by_mpi,
        "True when an MPI launcher (mpirun, srun) started this process as one of several ranks.");
  m.def(
      "_training_args_defaults", [] { return to_python(train::TrainingArguments{}.to_json()); },
      "The engine's TrainingArguments fields and their defaults, as a dict.");
  m.def(
      "_check_training_args",
      [](py::dict args) { train::TrainingArguments::from_json(to_json(args, "args")).validate(); }, "args"_a,
      "Raises ValueError naming the first field the engine rejects (unknown, wrong type or out of range).");

  m.def(
      "_epoch_order",
      [](int64_t size, int64_t batch_size, uint64_t seed, int64_t epoch, std::vector<int64_t> lengths,
         int64_t group_batch_size) {
        data::LoaderOptions options;
        options.batch_size = batch_size;
        options.shuffle = true;
        options.seed = seed;
        options.lengths = std::move(lengths);
        options.group_batch_size = group_batch_size;
        return data::DataLoader(size, options, [](std::span<const int64_t>, uint64_t) { return data::Batch{}; })
            .epoch_order(epoch);
      },
      "size"_a, "batch_size"_a, "seed"_a, "epoch"_a, "lengths"_a = std::vector<int64_t>{}, "group_batch_size"_a = 0,
      "The order in which the engine's training loop visits `size` examples in epoch `epoch` (shuffled; grouped by "
      "`lengths` when given, as train_sampling_strategy=\"group_by_length\" does).");
  m.def(
      "_length_grouped_order",
      [](std::vector<int64_t> order, const std::vector<int64_t>& lengths, int64_t batch_size) {
        return data::length_grouped_order(std::move(order), lengths, batch_size);
      },
      "order"_a, "lengths"_a, "batch_size"_a,
        "`order` regrouped by `lengths` as transformers' LengthGroupedSampler groups a permutation.");

  py::class_<PyTrainer>(m, "_Trainer", R"doc(
The engine's Trainer (the loop the CLI runs) over a fusetrain.Model. fusetrain.Trainer drives it.
)doc")
      .def(py::init([](PyModel& model, py::dict args, const std::string& task, py::object train_dataset,
                       py::object eval_dataset, int64_t pad_id, std::optional<py::dict> mlm) {
             train::TrainingArguments parsed = train::TrainingArguments::from_json(to_json(args, "args"));
             train::CollationIds ids{.pad_id = pad_id, .mlm = std::nullopt};
             if (mlm) {
               data::MaskSpec spec;
               spec.mask_id = (*mlm)["mask_id"].cast<int64_t>();
               spec.vocab_size = (*mlm)["vocab_size"].cast<int64_t>();
               spec.special_ids = (*mlm)["special_ids"].cast<std::vector<int64_t>>();
               spec.probability = (*mlm)["probability"].cast<double>();
               ids.mlm = spec;
             }
             model.num_threads = static_cast<int>(parsed.fusetrain_threads);
             auto out = std::make_unique<PyTrainer>(PyTrainer{model, train_dataset, eval_dataset, nullptr});
             out->trainer = std::make_unique<train::Trainer>(*model.model, std::move(parsed), models::head_for_task(task),
                                                             dataset_of(train_dataset), dataset_of(eval_dataset), ids);
             return out;
           }),
           "model"_a, "args"_a, "task"_a, "train_dataset"_a, "eval_dataset"_a, "pad_id"_a = 0, "mlm"_a = py::none(),
           py::keep_alive<1, 2>())
      .def(
          "set_collate",
          [](PyTrainer& self, py::function collate) {
            SharedCallable fn = share(std::move(collate));
            self.trainer->set_collate([fn](std::span<const int64_t> indices, uint64_t, bool training) {
              py::gil_scoped_acquire gil;
              py::array_t<int64_t> idx(static_cast<py::ssize_t>(indices.size()));
              std::copy(indices.begin(), indices.end(), idx.mutable_data());
              return batch_from_python((*fn)(idx, training));
            });
          },
          "collate"_a, "collate(indices: int64 array, training: bool) -> mapping of arrays, called per batch.")
      .def(
          "set_train_lengths",
          [](PyTrainer& self, std::vector<int64_t> lengths) { self.trainer->set_train_lengths(std::move(lengths)); },
          "lengths"_a, "The lengths train_sampling_strategy=\"group_by_length\" groups the training examples by.")
      .def(
          "set_compute_metrics",
          [](PyTrainer& self, py::function metrics) {
            SharedCallable fn = share(std::move(metrics));
            self.trainer->set_compute_metrics([fn](const train::Predictions& p) {
              py::gil_scoped_acquire gil;
              py::object result = (*fn)(predictions_to_python(p));
              std::map<std::string, double> out;
              for (auto [key, value] : result.cast<py::dict>()) {
                const std::string name = py::str(key).cast<std::string>();
                const bool number = py::isinstance<py::float_>(value) || py::isinstance<py::int_>(value) ||
                                    (py::hasattr(value, "dtype") && py::hasattr(value, "item"));
                FT_CHECK(number, "compute_metrics must return a dict of numbers; \"", name, "\" is a ",
                         py::type::of(value).attr("__name__").cast<std::string>());
                out[name] = py::float_(py::reinterpret_borrow<py::object>(value)).cast<double>();
              }
              return out;
            });
          },
          "metrics"_a, "metrics(predictions: dict) -> dict of numbers, in place of the task's built-in metrics.")
      .def(
          "set_callbacks",
          [](PyTrainer& self, py::function dispatch) {
            self.trainer->add_callback(std::make_shared<PythonCallbacks>(share(std::move(dispatch))));
          },
          "dispatch"_a, "dispatch(event, state, control, payload) -> dict of control flags or None.")
      .def(
          "set_communicator",
          [](PyTrainer& self, py::object communicator) {
            if (communicator.is_none())
              self.trainer->set_communicator(comm::single_process());
            else if (py::isinstance<py::str>(communicator) && communicator.cast<std::string>() == "mpi")
              self.trainer->set_communicator(comm::mpi_world());
            else
              self.trainer->set_communicator(std::make_shared<PythonCommunicator>(std::move(communicator)));
          },
          "communicator"_a,
          "Trains data-parallel: \"mpi\" (Open MPI, under mpirun), an object with the collectives "
          "(fusetrain.distributed.TorchCommunicator), or None (one process).")
      .def(
          "set_checkpoint_files",
          [](PyTrainer& self, std::vector<std::string> paths) { self.trainer->set_checkpoint_files(std::move(paths)); },
          "paths"_a, "Files copied into every checkpoint (the tokenizer's).")
      .def(
          "train",
          [](PyTrainer& self) {
            return locked(self.model, [&] { return self.trainer->train(); });
          },
          "Runs training; returns the final metrics.")
      .def(
          "evaluate",
          [](PyTrainer& self, py::object dataset) {
            const data::TokenizedDataset* d = dataset_of(dataset);
            return locked(self.model, [&] { return self.trainer->evaluate(d); });
          },
          "dataset"_a = py::none(), "Metrics over `dataset` (default: the eval dataset), keys prefixed eval_.")
      .def(
          "predict",
          [](PyTrainer& self, PyDataset& dataset) {
            train::Predictions p = locked(self.model, [&] { return self.trainer->predict(dataset.dataset); });
            return predictions_to_python(p);
          },
          "dataset"_a, "Predictions over `dataset` as a dict of arrays (see predictions_to_python).")
      .def_property_readonly(
          "state", [](const PyTrainer& self) { return state_to_python(self.trainer->state(), true); },
          "The engine's TrainerState as a dict.")
      .def(
          "set_delegated", [](PyTrainer& self, bool delegated) { self.trainer->set_delegated(delegated); },
          "delegated"_a,
          "Leaves logging, evaluation, checkpoints and final metrics to the callbacks (fusetrain.Trainer's mode).")
      .def(
          "start_at",
          [](PyTrainer& self, int64_t global_step, int64_t dropout_step, int64_t nonfinite_skipped_steps) {
            self.trainer->start_at(global_step, dropout_step, nonfinite_skipped_steps);
          },
          "global_step"_a, "dropout_step"_a = 0, "nonfinite_skipped_steps"_a = 0,
          "The next train() continues a run at global_step (weights and optimizer state loaded by the caller).")
      .def(
          "optimizer_state",
          [](PyTrainer& self) {
            const runtime::ParameterStore& params = self.model.model->params();
            std::vector<std::pair<optim::StateBuffer, std::vector<uint8_t>>> buffers;
            std::string name;
            const int64_t step = locked(self.model, [&] {
              optim::Optimizer& opt = self.trainer->optimizer();
              FT_CHECK(opt.shard_numel() == params.flat_numel(),
                       "optimizer_state: this rank's optimizer holds a ZeRO shard, not every parameter's state");
              for (const optim::StateBuffer& b : opt.states()) {  // downloaded from the Device
                std::vector<uint8_t> host(static_cast<size_t>(b.numel) * dtype_size(b.dtype));
                params.device().download(host.data(), b.data, host.size());
                buffers.emplace_back(b, std::move(host));
              }
              name = opt.name();
              return opt.step_count();
            });
            py::dict states;
            for (const auto& [buffer, flat] : buffers) {
              // Two buffers may share a key (bitsandbytes' state1: 8-bit codes or f32), over different parameters.
              const py::str key(buffer.state_key());
              if (!states.contains(key)) states[key] = py::dict();
              py::dict by_param = states[key].cast<py::dict>();
              const size_t size = dtype_size(buffer.dtype);
              for (size_t i = 0; i < params.slots().size(); ++i) {
                const runtime::ParamSlot& slot = params.slots()[i];
                const auto [at, shape] = state_place(buffer, slot, i);
                if (at < 0) continue;
                py::array a(numpy_dtype(buffer.dtype), shape.dims());
                std::copy_n(flat.data() + at * static_cast<int64_t>(size), shape.numel() * static_cast<int64_t>(size),
                            static_cast<uint8_t*>(a.mutable_data()));
                by_param[py::str(slot.name)] = a;
              }
            }
            py::list parameters;
            for (const runtime::ParamSlot& slot : params.slots()) parameters.append(py::str(slot.name));
            return py::dict("optim"_a = name, "step"_a = step, "states"_a = states, "parameters"_a = parameters);
          },
          "The optimizer's state (copies): {'optim': its optim name, 'step': updates, 'parameters': the trained "
          "parameters' names, 'states': {state name: {parameter name: array}}}, the states named as the optimizer it "
          "reproduces names them ('exp_avg', 'momentum_buffer', ...); a state a parameter does not have (Adafactor's "
          "factored ones) is left out for it.")
      .def(
          "set_optimizer_state",
          [](PyTrainer& self, int64_t step, py::dict states) {
            const runtime::ParameterStore& params = self.model.model->params();
            FT_CHECK(step >= 0, "optimizer state: the update count is ", step, ", expected >= 0");
            const std::vector<optim::StateBuffer> buffers =
                locked(self.model, [&] { return self.trainer->optimizer().states(); });
            std::vector<std::vector<std::pair<int64_t, py::array>>> arrays;  // [state]: (offset, values) per slot
            for (const optim::StateBuffer& buffer : buffers) {
              const std::string& state = buffer.state_key();
              FT_CHECK(states.contains(py::str(state)), "optimizer state: no \"", state, "\" (the optimizer keeps ",
                       buffers.size(), " state", buffers.size() == 1 ? "" : "s", " per parameter)");
              py::dict by_param = states[py::str(state)].cast<py::dict>();
              arrays.emplace_back();
              const py::dtype want = numpy_dtype(buffer.dtype);
              for (size_t i = 0; i < params.slots().size(); ++i) {
                const runtime::ParamSlot& slot = params.slots()[i];
                const auto [at, shape] = state_place(buffer, slot, i);
                if (at < 0) continue;
                const py::str name(slot.name);
                FT_CHECK(by_param.contains(name), "optimizer state: no ", state, " for \"", slot.name, "\"");
                py::array given = py::array::ensure(by_param[name]);
                FT_CHECK(given, "optimizer state: ", state, " of \"", slot.name, "\" is not an array");
                // Codes must come as codes: a float array is never cast to 8-bit codes.
                FT_CHECK(want.kind() == 'f' || given.dtype().is(want), "optimizer state: ", state, " of \"",
                         slot.name, "\" holds ", dtype_name(buffer.dtype), " values, found ",
                         std::string(py::str(given.dtype())));
                py::array a = py::array::ensure(given.attr("astype")(want), py::array::c_style);
                FT_CHECK(a.size() == shape.numel(), "optimizer state: ", state, " of \"", slot.name, "\" needs ",
                         shape.numel(), " values, found ", a.size());
                const int64_t bad = find_nonfinite(a.data(), buffer.dtype, shape.numel());
                FT_CHECK(bad < 0, "optimizer state: ", state, " of \"", slot.name, "\" holds a non-finite value at ",
                         "element ", bad, "; the optimizer state of a diverged run cannot be resumed");
                arrays.back().emplace_back(at, std::move(a));
              }
            }
            locked(self.model, [&] {
              optim::Optimizer& opt = self.trainer->optimizer();
              const std::vector<optim::StateBuffer> now = opt.states();
              for (size_t k = 0; k < now.size(); ++k) {
                const int64_t size = static_cast<int64_t>(dtype_size(now[k].dtype));
                for (const auto& [at, values] : arrays[k])  // uploaded to the Device
                  params.device().upload(static_cast<uint8_t*>(now[k].data) + at * size, values.data(),
                                         static_cast<size_t>(values.size() * size));
              }
              opt.set_step_count(step);
            });
          },
          "step"_a, "states"_a, "Loads optimizer_state()'s form (every state of every parameter, by name).")
      .def_property(
          "scaler_state", [](PyTrainer& self) { return to_python(self.trainer->loss_scaler().to_json()); },
          [](PyTrainer& self, py::dict state) {
            self.trainer->loss_scaler().load_json(to_json(state, "scaler_state"), "scaler_state");
          },
          "The fp16 loss scaler's state (scale, growth_tracker, skipped_steps).")
      .def_property_readonly(
          "nonfinite_skipped_steps", [](PyTrainer& self) { return self.trainer->nonfinite_skipped_steps(); },
          "Steps the non-finite guard skipped (the schedule waits over them).")
      .def_property_readonly(
          "dropout_step", [](PyTrainer& self) { return self.model.model->rng_step(); },
          "The dropout stream's position (restored by start_at).")
      .def_property_readonly(
          "loss_scale", [](const PyTrainer& self) { return self.trainer->loss_scaler().scale(); },
          "The fp16 loss scale.");
}

}  // namespace fusetrain::python
