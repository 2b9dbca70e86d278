// The extension module torch_groupcomm._C: the c10d bridge, the groups'
// ordered executor, the shared-memory engine and the custom ops (namespace
// groupcomm, registered with torch's library when the module loads).
#include <torch/python.h>

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  pybind11::module_::import("torch.distributed");
  groupcomm::registerErrors(m);
  groupcomm::registerQueue(m);
  groupcomm::registerBridge(m);
  groupcomm::registerShm(m);
  groupcomm::registerOps(m);
}
