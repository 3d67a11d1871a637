// What the files of fusetrain._core share: the JSON <-> Python conversions and the
// Python-side model (the engine model, its training flag and its run lock).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "fusetrain/models/model.h"

namespace fusetrain::python {

namespace py = pybind11;

/// A Python value (None, bool, int, float, str, list, tuple, dict, numpy scalar) as JSON; `where` names it in errors.
nlohmann::json to_json(py::handle obj, const std::string& where);
/// JSON as plain Python values.
py::object to_python(const nlohmann::json& j);
/// The numpy module.
py::module_& numpy();
/// `obj` as a numpy array (no copy when it already is one).
py::array as_array(py::handle obj);

/// models::Model plus the Python-side state: the training flag and the run lock. The lock is recursive so that a
/// callback of a running Trainer may use the model it trains from the training thread.
struct PyModel {
  std::unique_ptr<models::Model> model;
  bool training = false;
  int num_threads = 0;
  std::recursive_mutex mutex;
};

/// Runs `f` with the GIL released and the model's lock held (in that order, always).
template <typename F>
auto locked(PyModel& self, F&& f) {
  py::gil_scoped_release release;
  std::lock_guard<std::recursive_mutex> lock(self.mutex);
  self.model->set_num_threads(self.num_threads);
  return f();
}

/// Defines fusetrain._core._Dataset and fusetrain._core._Trainer (the engine side of fusetrain.Trainer).
void bind_trainer(py::module_& m);

}  // namespace fusetrain::python
