#include "ops/python_path.h"

#include <c10/util/Exception.h>

namespace groupcomm {
namespace {

// Set once at import and never released: kernels may run until the process ends.
PyObject* path_ = nullptr;

} // namespace

void setPythonPath(pybind11::object path) {
  PyObject* old = path_;
  path_ = path.release().ptr();
  Py_XDECREF(old);
}

pybind11::handle pythonPath() {
  TORCH_CHECK(
      path_ != nullptr,
      "groupcomm: the custom ops' Python path is not set; import torch_groupcomm.custom_ops (GroupCoordinator does)");
  return path_;
}

} // namespace groupcomm
