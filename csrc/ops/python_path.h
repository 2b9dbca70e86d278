#pragma once

#include <string>

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>

namespace groupcomm {

// The custom ops' way into Python for a call the engine does not run (no
// engine for the group, another device, a dtype or shape it declines):
// torch_groupcomm.custom_ops hands over one function at import
// (setPythonPath), which finds the group's coordinator by name and runs the
// call on its Python path, which also words every argument error.
void setPythonPath(pybind11::object path);
pybind11::handle pythonPath();

// `path(op, group, input, *args)`, with the GIL; its exception travels on as itself.
template <typename... Args>
at::Tensor viaPython(const char* op, const std::string& group, const at::Tensor& input, const Args&... args) {
  pybind11::gil_scoped_acquire gil;
  try {
    return pythonPath()(op, group, input, args...).template cast<at::Tensor>();
  } catch (pybind11::error_already_set& e) {
    e.restore();
    python_error error;
    error.persist();
    throw error;
  }
}

} // namespace groupcomm
