#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/python.h>

#include "bindings.h"
#include "shm/group.h"
#include "shm/ring.h"

namespace py = pybind11;

namespace groupcomm {
namespace {

// Runs a message-ring wait without the GIL; a Ctrl-C noticed meanwhile is
// raised here.
template <typename Wait>
auto withoutGil(Wait&& wait) {
  try {
    py::gil_scoped_release release;
    return wait();
  } catch (const ShmRing::Interrupted&) {
    throw py::error_already_set(); // the signal handler's exception
  }
}

} // namespace

// Reductions take the c10d RedOpType value and the premul factor.
void registerShm(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<P2PRequest, std::shared_ptr<P2PRequest>>(m, "P2PRequest", "a posted shared-memory send or recv")
      .def("wait", &P2PRequest::wait, py::arg("timeout_ms"), Release())
      .def("is_completed", &P2PRequest::completed)
      .def(
          "future",
          [](P2PRequest& request, std::vector<at::Tensor> outputs, std::string context, int64_t timeoutMs) {
            return std::make_shared<torch::jit::PythonFutureWrapper>(
                request.future(std::move(outputs), std::move(context), timeoutMs));
          },
          py::arg("outputs"), py::arg("context"), py::arg("timeout_ms"),
          "a torch future completed with `outputs` by the progress thread itself")
      .def_property_readonly("source", &P2PRequest::source);
  // Held by shared_ptr: the c10d bridge runs ops on the same engine.
  py::class_<ShmGroup, std::shared_ptr<ShmGroup>>(m, "ShmGroup", "collectives through one host's shared memory")
      .def(
          py::init([](const std::string& name, bool create, int rank, int worldSize, size_t slotBytes, int64_t spinUs,
                      int64_t yieldUs, int64_t timeoutMs, size_t ringBytes, bool crowded, std::vector<int> rankNames) {
            return std::make_shared<ShmGroup>(
                name, create, rank, worldSize,
                ShmGroup::Options{slotBytes, spinUs, yieldUs, timeoutMs, ringBytes, crowded, std::move(rankNames)});
          }),
          py::arg("name"), py::arg("create"), py::arg("rank"), py::arg("world_size"), py::arg("slot_bytes"),
          py::arg("spin_us"), py::arg("yield_us"), py::arg("timeout_ms"), py::arg("ring_bytes") = 65536,
          py::arg("crowded") = false, py::arg("rank_names") = std::vector<int>{}, Release())
      .def("send", &ShmGroup::send, Release())
      .def("recv", &ShmGroup::recv, Release())
      .def("unlink", &ShmGroup::unlink, Release())
      .def("abort", &ShmGroup::abort, Release())
      .def(
          "set_timeout", &ShmGroup::setTimeout, py::arg("timeout_ms"),
          "the timeout of the waits that start from now on")
      .def(
          "set_op_timeout", &ShmGroup::setOpTimeout, py::arg("timeout_ms"),
          "the ops run from now on wait this long instead, until -1 restores the group's timeout")
      .def_property_readonly("mapped_bytes", &ShmGroup::mappedBytes)
      .def(
          "probe_direct", &ShmGroup::probeDirect, Release(),
          "whether this rank can read every peer's memory (call once all have attached)")
      .def_property(
          "direct", &ShmGroup::direct, &ShmGroup::setDirect,
          "large messages go from memory to memory (every rank the same, before the first op)")
      .def(
          "probe_shared", &ShmGroup::probeShared, Release(),
          "whether every peer can map this rank's shared blocks (call once all have attached)")
      .def_property(
          "shared", &ShmGroup::shared, &ShmGroup::setShared,
          "allocate_tensor hands out blocks the peers read in place (every rank the same, before the first op)")
      .def(
          "adopt", &ShmGroup::adopt, py::arg("tensor"), Release(),
          "moves the tensor's storage into a shared block, contents and other views kept (only its owner may ask)")
      .def_property_readonly("shared_bytes", &ShmGroup::sharedBytes, "bytes this rank holds in shared blocks")
      .def_property_readonly(
          "peer_block_bytes", &ShmGroup::peerBlockBytes, "bytes of the peers' shared blocks this rank has mapped")
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
          [](ShmGroup& g, at::Tensor& out, const at::Tensor& input, const std::vector<int64_t>& sizes, int kind,
             double factor) { g.reduceScatter(out, input, sizes, static_cast<RedKind>(kind), factor); },
          Release())
      .def_static("supports", [](py::object dtype, int kind) {
        auto scalar = torch::python::detail::py_object_to_dtype(dtype);
        return reduceSupported(scalar, static_cast<RedKind>(kind));
      });
  // Messages up to this size are copied with the GIL held when no wait is
  // needed: cheaper than handing the GIL over and taking it back.
  constexpr size_t kCopyWithGil = 64 * 1024;
  py::class_<ShmRing>(m, "ShmRing", "one writer, many readers: a message ring in shared memory")
      .def(
          py::init([](const std::string& name, bool create, size_t nChunks, size_t chunkBytes, int nReaders,
                      int readerIndex, int64_t spinUs, int64_t timeoutMs) {
            auto ring = std::make_unique<ShmRing>(
                name, create, readerIndex, ShmRing::Options{nChunks, chunkBytes, nReaders, spinUs, timeoutMs});
            ring->setInterruptCheck([] {
              py::gil_scoped_acquire acquire;
              return PyErr_CheckSignals() != 0;
            });
            return ring;
          }),
          py::arg("name"), py::arg("create"), py::arg("n_chunks"), py::arg("chunk_bytes"), py::arg("n_readers"),
          py::arg("reader_index") = -1, py::arg("spin_us") = 20, py::arg("timeout_ms") = -1, Release())
      .def(
          "write",
          [](ShmRing& ring, const py::bytes& data, std::optional<int64_t> timeoutMs) {
            char* ptr = nullptr;
            Py_ssize_t len = 0;
            if (PyBytes_AsStringAndSize(data.ptr(), &ptr, &len) != 0) {
              throw py::error_already_set();
            }
            const int64_t ms = timeoutMs.value_or(ShmRing::kDefaultTimeout);
            const auto n = static_cast<size_t>(len);
            if (n <= kCopyWithGil && ring.writeReady(n)) {
              ring.write(ptr, n, ms);
              return;
            }
            // `data` stays referenced by the caller meanwhile
            withoutGil([&] { ring.write(ptr, n, ms); });
          },
          py::arg("data"), py::arg("timeout_ms") = py::none())
      .def(
          "read",
          [](ShmRing& ring, std::optional<int64_t> timeoutMs) {
            const int64_t ms = timeoutMs.value_or(ShmRing::kDefaultTimeout);
            size_t len = 0;
            if (!ring.poll(&len)) {
              len = withoutGil([&] { return ring.begin(ms); });
            }
            PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(len));
            if (raw == nullptr) {
              throw py::error_already_set();
            }
            auto out = py::reinterpret_steal<py::bytes>(raw);
            char* dst = PyBytes_AS_STRING(raw); // not shared with anyone yet
            if (len <= kCopyWithGil && !ring.finishMayWait()) {
              ring.finish(dst, ms);
            } else {
              withoutGil([&] { ring.finish(dst, ms); });
            }
            return out;
          },
          py::arg("timeout_ms") = py::none())
      .def("unlink", &ShmRing::unlink)
      .def_property_readonly("attached_readers", &ShmRing::attachedReaders)
      .def_property_readonly("mapped_bytes", &ShmRing::mappedBytes)
      .def_property_readonly("chunk_bytes", &ShmRing::chunkBytes);
}

} // namespace groupcomm
