// The one translation of the engine's failures into Python's exceptions.
#include <torch/csrc/Exceptions.h>
#include <torch/python.h>

#include "bindings.h"
#include "comm_failure.h"

namespace py = pybind11;

namespace groupcomm {

void setPythonError(const CommFailure& failure, const char* op) {
  if (op == nullptr && !failure.op().empty()) {
    op = failure.op().c_str();
  }
  auto type =
      py::module_::import("torch_groupcomm.errors").attr(failure.timedOut() ? "CommTimeoutError" : "GroupCommError");
  py::object error = op == nullptr ? type(failure.what()) : type(failure.what(), py::arg("op") = op);
  PyErr_SetObject(type.ptr(), error.ptr());
}

void throwInPython(const CommFailure& failure, const char* op) {
  if (!Py_IsInitialized()) {
    throw failure;
  }
  py::gil_scoped_acquire gil;
  setPythonError(failure, op);
  python_error error;
  error.persist();
  throw error;
}

void registerErrors(py::module_& m) {
  (void)m;
  py::register_local_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) {
        std::rethrow_exception(thrown);
      }
    } catch (const CommFailure& failure) {
      setPythonError(failure);
    }
  });
}

} // namespace groupcomm
