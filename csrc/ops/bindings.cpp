#include <torch/python.h>

#include "bindings.h"
#include "ops/output_pool.h"
#include "ops/python_path.h"
#include "ops/registry.h"

namespace py = pybind11;

namespace groupcomm {

void registerOps(py::module_& m) {
  m.def(
      "publish_ops_group",
      [](const std::string& name, std::shared_ptr<ShmGroup> engine, std::shared_ptr<OpQueue> queue) {
        OpsRegistry::instance().publish(name, OpsGroup{std::move(engine), std::move(queue)});
      },
      py::arg("name"), py::arg("engine"), py::arg("queue"),
      "the custom ops run group `name`'s CPU calls on `engine`, in `queue`'s order (csrc/ops/registry.h)");
  m.def(
      "withdraw_ops_group",
      [](const std::string& name, const std::shared_ptr<OpQueue>& queue) {
        OpsRegistry::instance().withdraw(name, queue);
      },
      py::arg("name"), py::arg("queue"), "group `name` (if still the one of `queue`) goes back to the Python path");
  m.def(
      "set_ops_python_path", [](py::object path) { setPythonPath(std::move(path)); }, py::arg("path"),
      "path(op, group_name, input, *args) runs a custom op's call the engine does not");
  m.def(
      "output_pool_idle_bytes", [] { return OutputPool::instance().idleBytes(); },
      "bytes of freed custom-op outputs kept for reuse (csrc/ops/output_pool.h)");
}

} // namespace groupcomm
