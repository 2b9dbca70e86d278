#pragma once

#include <pybind11/pybind11.h>

namespace groupcomm {

// Each layer binds its own classes and functions into the extension module.
void registerBridge(pybind11::module_& m); // bridge/bindings.cpp: the c10d backend
void registerShm(pybind11::module_& m); // shm/bindings.cpp: shared-memory group and ring

} // namespace groupcomm
