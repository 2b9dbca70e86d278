#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/python.h>

#include "bindings.h"
#include "bridge/abortable_wait.h"
#include "bridge/backend.h"
#include "bridge/gloo_path.h"
#include "bridge/nccl_path.h"
#include "bridge/tuner.h"

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

void registerBridge(py::module_& m) {
  py::class_<GroupCommBackend, c10d::Backend, NoGilHolder<GroupCommBackend>>(
      m, "GroupCommBackend", "c10d backend forwarding every op to a frontend")
      .def(
          py::init([](int rank, int size, py::object frontend) {
            return NoGilHolder<GroupCommBackend>(c10::make_intrusive<GroupCommBackend>(rank, size, frontend.ptr()));
          }),
          py::arg("rank"), py::arg("size"), py::arg("frontend"));
  m.attr("BACKEND_NAME") = kBackendName;
  // torch binds no Work.abort(); gloo's send/recv work implements it (a
  // thread blocked in that work's wait() wakes up).
  m.def(
      "abort_work", [](const c10::intrusive_ptr<c10d::Work>& work) { work->abort(); }, py::arg("work"),
      "call c10d Work::abort() on a work object");
  // The Python torch.futures.Future(devices=...) finds a value's tensors by
  // pickling it and the bridge then re-types it through a callback; made here,
  // a CUDA op's future is typed List[Tensor] from the start (docs/benchmarks.md,
  // "Per-call cost at world 1").
  m.def(
      "device_future",
      [](std::vector<at::Tensor> tensors, const c10::Device& device) {
        auto future = c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::ofTensors(), std::vector<c10::Device>{device});
        future->markCompleted(c10::IValue(std::move(tensors)));
        return std::make_shared<torch::jit::PythonFutureWrapper>(std::move(future));
      },
      py::arg("tensors"), py::arg("device"),
      "a completed future on `device` holding `tensors`: waiting on it orders "
      "the waiter's current stream after this thread's current stream");
  py::class_<NcclPath, std::shared_ptr<NcclPath>>(
      m, "NcclPath",
      "the plain CUDA collectives of one NCCL communicator, enqueued by the "
      "bridge without Python (csrc/bridge/nccl_path.h)")
      .def(
          py::init([](uintptr_t allReduce, uintptr_t broadcast, uintptr_t reduce, uintptr_t allGather,
                      uintptr_t reduceScatter, uintptr_t send, uintptr_t recv, uintptr_t groupStart, uintptr_t groupEnd,
                      uintptr_t errorString, uintptr_t streamIsCapturing, uintptr_t comm, int worldSize,
                      int64_t streamId, int64_t deviceIndex, int64_t deviceType, uintptr_t streamHandle,
                      std::shared_ptr<OpQueue> queue) {
            NcclEntryPoints nccl;
            nccl.allReduce = reinterpret_cast<NcclEntryPoints::AllReduce>(allReduce);
            nccl.broadcast = reinterpret_cast<NcclEntryPoints::Broadcast>(broadcast);
            nccl.reduce = reinterpret_cast<NcclEntryPoints::Reduce>(reduce);
            nccl.allGather = reinterpret_cast<NcclEntryPoints::AllGather>(allGather);
            nccl.reduceScatter = reinterpret_cast<NcclEntryPoints::ReduceScatter>(reduceScatter);
            nccl.send = reinterpret_cast<NcclEntryPoints::Send>(send);
            nccl.recv = reinterpret_cast<NcclEntryPoints::Recv>(recv);
            nccl.groupStart = reinterpret_cast<NcclEntryPoints::Group>(groupStart);
            nccl.groupEnd = reinterpret_cast<NcclEntryPoints::Group>(groupEnd);
            nccl.errorString = reinterpret_cast<NcclEntryPoints::ErrorString>(errorString);
            nccl.streamIsCapturing = reinterpret_cast<NcclEntryPoints::StreamIsCapturing>(streamIsCapturing);
            TORCH_CHECK(
                allReduce && broadcast && reduce && allGather && reduceScatter && streamIsCapturing,
                "groupcomm: NcclPath needs every entry point");
            const auto side = c10::Stream::unpack3(
                streamId, static_cast<c10::DeviceIndex>(deviceIndex), static_cast<c10::DeviceType>(deviceType));
            return std::make_shared<NcclPath>(
                nccl, reinterpret_cast<void*>(comm), worldSize, side, reinterpret_cast<void*>(streamHandle),
                std::move(queue));
          }),
          py::kw_only(), py::arg("all_reduce"), py::arg("broadcast"), py::arg("reduce"), py::arg("all_gather"),
          py::arg("reduce_scatter"), py::arg("send"), py::arg("recv"), py::arg("group_start"), py::arg("group_end"),
          py::arg("error_string"), py::arg("stream_is_capturing"), py::arg("comm"), py::arg("world_size"),
          py::arg("stream_id"), py::arg("device_index"), py::arg("device_type"), py::arg("stream_handle"),
          py::arg("queue"))
      .def("disable", &NcclPath::disable, "no op starts on this path from now on")
      .def(
          "late", &NcclPath::late, py::arg("default_ms"),
          "the timeout (ms) of the oldest op still running past it, or -1")
      .def("pending", &NcclPath::pending, "whether an op enqueued here may still be running");
  py::class_<AbortableWait, std::shared_ptr<AbortableWait>>(
      m, "AbortableWait",
      "waits for c10d works until they complete or abort() is called, so that "
      "the threads completing them never need the GIL")
      .def(py::init<>())
      .def(
          "keep", &AbortableWait::keep, py::arg("work"),
          "hold the work until its other owners dropped it; drop it here then")
      .def("forget", &AbortableWait::forget, "drop every kept work now")
      .def(
          "cut_short", &AbortableWait::cutShort,
          "whether a wait ended before its work did (gloo may still be running that op)")
      .def(
          "wait",
          [](AbortableWait& self, const c10::intrusive_ptr<c10d::Work>& work) {
            self.keep(work);
            py::gil_scoped_release release;
            return self.wait(work);
          },
          py::arg("work"), "keep the work; True once it completed, False when abort() came first")
      .def(
          "abort", &AbortableWait::abort, py::call_guard<py::gil_scoped_release>(),
          "wake every wait now and later ones at once");
  py::class_<Tuner, std::shared_ptr<Tuner>>(
      m, "Tuner",
      "which of two ways of running an op is faster on these hosts, for each size class, chosen from "
      "the first calls' times summed over the ranks (csrc/bridge/tuner.h)")
      .def(
          py::init<int64_t, int64_t>(), py::arg("from_bytes"),
          py::arg("to_bytes") = std::numeric_limits<int64_t>::max())
      .def_readonly_static("trials", &Tuner::kTrials)
      .def(
          "choose",
          [](Tuner& self, int64_t bytes) {
            const auto choice = self.choose(bytes);
            return py::make_tuple(choice.way, choice.trial);
          },
          py::arg("bytes"), "(way: 0 the planned one, 1 the other; trial or -1) for a message of `bytes`")
      .def(
          "record", &Tuner::record, py::arg("bytes"), py::arg("trial"), py::arg("nanos"),
          "the trial's time here; True when the ranks must now agree (totals, all-reduced, to decide)")
      .def("totals", &Tuner::totals, py::arg("bytes"), "this rank's times of the class's two ways")
      .def("decide", &Tuner::decide, py::arg("bytes"), py::arg("summed"), "keep the faster way");
  py::class_<GlooPath, std::shared_ptr<GlooPath>>(
      m, "GlooPath",
      "the ops of a gloo-carried CPU group that the bridge runs on gloo "
      "without Python (csrc/bridge/gloo_path.h)")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo, std::shared_ptr<AbortableWait> waiter,
                      std::shared_ptr<Tuner> pieces, std::shared_ptr<Tuner> reduceWays, std::shared_ptr<OpQueue> queue,
                      bool barrier, bool broadcast, bool rooted, bool allToAll, bool allGather, bool allReduce,
                      int64_t gatherReduceMaxBytes, int64_t chainMinBytes, int64_t chainPieceBytes, int64_t chainPieces,
                      int64_t onePeerAtATimeBytes, int64_t ringMinBytes, int64_t pairExchangeMaxBytes,
                      int64_t pairAllToAllMaxBytes, int64_t sendFirstMaxBytes, int64_t pythonAllToAllMinBytes,
                      int64_t timeoutMs, int tag, std::vector<int64_t> rankNames) {
            GlooRoutes routes;
            routes.barrier = barrier;
            routes.broadcast = broadcast;
            routes.rooted = rooted;
            routes.allToAll = allToAll;
            routes.allGather = allGather;
            routes.allReduce = allReduce;
            routes.gatherReduceMaxBytes = gatherReduceMaxBytes;
            routes.ringMinBytes = ringMinBytes;
            routes.chainMinBytes = chainMinBytes;
            routes.chainPieceBytes = chainPieceBytes;
            routes.chainPieces = chainPieces;
            routes.onePeerAtATimeBytes = onePeerAtATimeBytes;
            routes.pairExchangeMaxBytes = pairExchangeMaxBytes;
            routes.pairAllToAllMaxBytes = pairAllToAllMaxBytes;
            routes.sendFirstMaxBytes = sendFirstMaxBytes;
            routes.pythonAllToAllMinBytes = pythonAllToAllMinBytes;
            return std::make_shared<GlooPath>(
                gloo, std::move(waiter), std::move(pieces), std::move(reduceWays), std::move(queue), routes, timeoutMs,
                tag, std::move(rankNames));
          }),
          py::kw_only(), py::arg("gloo"), py::arg("waiter"), py::arg("pieces"), py::arg("all_reduce_ways"),
          py::arg("queue"), py::arg("barrier"), py::arg("broadcast"), py::arg("rooted"), py::arg("all_to_all"),
          py::arg("all_gather"), py::arg("all_reduce"), py::arg("gather_reduce_max_bytes"), py::arg("chain_min_bytes"),
          py::arg("chain_piece_bytes"), py::arg("chain_pieces"), py::arg("one_peer_at_a_time_bytes"),
          py::arg("ring_min_bytes"), py::arg("pair_exchange_max_bytes"), py::arg("pair_all_to_all_max_bytes"),
          py::arg("send_first_max_bytes"), py::arg("python_all_to_all_min_bytes"), py::arg("timeout_ms"),
          py::arg("tag"), py::arg("rank_names"))
      .def("set_timeout", &GlooPath::setTimeout, py::arg("ms"), "the group's timeout for the ops issued from now on")
      .def(
          "carry_transfers", &GlooPath::carryTransfers, py::arg("completions"),
          "post the group's send/recv here from now on, completing them in `completions` (in the order posted)")
      .def(
          "abort", &GlooPath::abort, py::call_guard<py::gil_scoped_release>(),
          "end the waits of the transfers in flight now and fail later ones")
      .def(
          "release", &GlooPath::release, py::call_guard<py::gil_scoped_release>(),
          "plan no op here from now on and let gloo's group go");
}

} // namespace groupcomm
