#include <torch/python.h>

#include "backend.h"

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

} // namespace groupcomm

PYBIND11_MODULE(_C, m) {
  py::module_::import("torch.distributed");
  groupcomm::registerBackend(m);
}
