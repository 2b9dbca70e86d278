#pragma once

#include <pybind11/pybind11.h>

namespace groupcomm {

class CommFailure;

// Each layer binds its own classes and functions into the extension module.
void registerBridge(pybind11::module_& m); // bridge/bindings.cpp: the c10d backend
void registerShm(pybind11::module_& m);    // shm/bindings.cpp: shared-memory group and ring
void registerErrors(pybind11::module_& m); // errors.cpp: CommFailure -> Python exceptions
void registerQueue(pybind11::module_& m);  // queue/bindings.cpp: the ordered executor
void registerOps(pybind11::module_& m);    // ops/bindings.cpp: the custom ops' groups and Python path

// Sets the Python error for ``failure``: torch_groupcomm.errors.CommTimeoutError
// when it timed out, GroupCommError otherwise (with ``op`` set when given or
// carried by the failure).
// Needs the GIL.
void setPythonError(const CommFailure& failure, const char* op = nullptr);
// Throws ``failure`` as that Python error (torch's python_error), taking the
// GIL; as itself once the interpreter is gone.
[[noreturn]] void throwInPython(const CommFailure& failure, const char* op = nullptr);

} // namespace groupcomm
