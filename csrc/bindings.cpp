#include <torch/python.h>

#include "backend.h"
#include "shm_group.h"

namespace py = pybind11;

namespace groupcomm {
namespace {

// Destroys the backend with the GIL released: its destructor takes the GIL
// itself, and c10d may also drop the last reference from a C++ thread.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  explicit NoGilHolder(T* p) : impl_(c10::intrusive_ptr<T>::reclaim(p)) {}
  explicit NoGilHolder(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) = default;
  ~NoGilHolder() {
    if (impl_ && Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      impl_.reset();
    }
  }
  T* get() const noexcept {
    return impl_.get();
  }

 private:
  c10::intrusive_ptr<T> impl_;
};

} // namespace
} // namespace groupcomm

PYBIND11_DECLARE_HOLDER_TYPE(T, groupcomm::NoGilHolder<T>, true)

namespace groupcomm {

void registerBackend(py::module_& m) {
  py::class_<GroupCommBackend, c10d::Backend, NoGilHolder<GroupCommBackend>>(
      m, "GroupCommBackend", "c10d backend forwarding every op to a frontend")
      .def(
          py::init([](int rank, int size, py::object frontend) {
            return NoGilHolder<GroupCommBackend>(
                c10::make_intrusive<GroupCommBackend>(
                    rank, size, frontend.ptr()));
          }),
          py::arg("rank"),
          py::arg("size"),
          py::arg("frontend"));
  m.attr("BACKEND_NAME") = kBackendName;
}

// Reductions take the c10d RedOpType value and the premul factor.
void registerShmGroup(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<P2PRequest, std::shared_ptr<P2PRequest>>(m, "P2PRequest", "a posted shared-memory send or recv")
      .def("wait", &P2PRequest::wait, py::arg("timeout_ms"), Release())
      .def("is_completed", &P2PRequest::completed)
      .def_property_readonly("source", &P2PRequest::source);
  py::class_<ShmGroup>(m, "ShmGroup", "collectives through one host's shared memory")
      .def(
          py::init([](const std::string& name, bool create, int rank, int worldSize,
                      size_t slotBytes, int64_t spinUs, int64_t yieldUs,
                      int64_t timeoutMs, size_t ringBytes) {
            return std::make_unique<ShmGroup>(
                name, create, rank, worldSize,
                ShmGroup::Options{slotBytes, spinUs, yieldUs, timeoutMs, ringBytes});
          }),
          py::arg("name"), py::arg("create"), py::arg("rank"),
          py::arg("world_size"), py::arg("slot_bytes"), py::arg("spin_us"),
          py::arg("yield_us"), py::arg("timeout_ms"), py::arg("ring_bytes") = 65536,
          Release())
      .def("send", &ShmGroup::send, Release())
      .def("recv", &ShmGroup::recv, Release())
      .def("unlink", &ShmGroup::unlink, Release())
      .def_property_readonly("mapped_bytes", &ShmGroup::mappedBytes)
      .def("barrier", &ShmGroup::barrier, Release())
      .def("broadcast", &ShmGroup::broadcast, Release())
      .def("all_gather", &ShmGroup::allGather, Release())
      .def("all_to_all", &ShmGroup::allToAll, Release())
      .def("gather", &ShmGroup::gather, Release())
      .def("scatter", &ShmGroup::scatter, Release())
      .def(
          "all_reduce",
          [](ShmGroup& g, at::Tensor& t, int kind, double factor) {
            g.allReduce(t, static_cast<RedKind>(kind), factor);
          },
          Release())
      .def(
          "reduce",
          [](ShmGroup& g, at::Tensor& t, int root, int kind, double factor) {
            g.reduce(t, root, static_cast<RedKind>(kind), factor);
          },
          Release())
      .def(
          "reduce_scatter",
          [](ShmGroup& g, at::Tensor& out, const at::Tensor& input,
             const std::vector<int64_t>& sizes, int kind, double factor) {
            g.reduceScatter(out, input, sizes, static_cast<RedKind>(kind), factor);
          },
          Release())
      .def_static(
          "supports",
          [](py::object dtype, int kind) {
            auto scalar = torch::python::detail::py_object_to_dtype(dtype);
            return reduceSupported(scalar, static_cast<RedKind>(kind));
          });
}

} // namespace groupcomm

PYBIND11_MODULE(_C, m) {
  py::module_::import("torch.distributed");
  groupcomm::registerBackend(m);
  groupcomm::registerShmGroup(m);
}
