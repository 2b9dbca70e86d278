#include "bridge/backend.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/python.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>
#include <variant>

#include "bindings.h"
#include "bridge/work.h"
#include "comm_failure.h"
#include "shm/group.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace groupcomm {
namespace {

// torch 2.13 renamed c10d's NCCLPreMulSumSupplement (an alias of the new name since).
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#endif

// A ReduceOp as (kind, premul factor): kind is c10d::ReduceOp::RedOpType's
// value; the factor is None, a float or a scalar tensor.
py::tuple unpackReduceOp(const c10d::ReduceOp& op) {
  py::object factor = py::none();
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM && op.supplement_) {
    auto* premul = dynamic_cast<PreMulSumSupplement*>(op.supplement_.get());
    TORCH_INTERNAL_ASSERT(premul != nullptr, "PREMUL_SUM without a factor");
    factor = premul->tensor_factor.defined() ? py::cast(premul->tensor_factor) : py::cast(premul->double_factor);
  }
  return py::make_tuple(static_cast<int>(op.op_), factor);
}

// c10d's per-op timeout as the frontend and the engine take it: -1 when the
// op has none (the group's applies).
int64_t timeoutMs(std::chrono::milliseconds timeout) {
  return timeout == c10d::kUnsetTimeout ? -1 : timeout.count();
}

// The frontend's exception travels on as itself: torch restores it when it
// crosses back into Python, so callers see the original type and message.
[[noreturn]] void rethrowPython(py::error_already_set& e) {
  e.restore();
  python_error error;
  error.persist();
  throw error;
}

// The frontend answers with the op's output tensors when it already ran the
// op (synchronous calls), or with a torch.futures.Future whose value will be
// that list (a native one typed List[Tensor] is used as it is); either may
// come paired with a source rank (recv from any source).
// c10d consumers such as DDP's reducer read the value as a TensorList, so it is
// re-published as one.
c10::intrusive_ptr<GroupCommWork> toWork(
    const py::object& result,
    c10d::OpType opType,
    const std::shared_ptr<const std::string>& group) {
  std::optional<int> sourceRank;
  py::object pyFuture = result;
  if (py::isinstance<py::tuple>(result)) {
    auto pair = result.cast<py::tuple>();
    pyFuture = pair[0];
    sourceRank = pair[1].cast<int>();
  }
  if (py::isinstance<py::list>(pyFuture)) {
    return c10::make_intrusive<GroupCommWork>(pyFuture.cast<std::vector<at::Tensor>>(), opType, group, sourceRank);
  }
  auto tensorList = c10::ListType::ofTensors();
  auto source = pyFuture.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  if (source->elementType()->isSubtypeOf(*tensorList)) {
    return c10::make_intrusive<GroupCommWork>(source, opType, group, sourceRank);
  }
  // A future on devices (CUDA ops) stays on them: waiting on it makes the
  // waiter's current streams wait for the op's streams.
  auto future = source->createInstance(tensorList);
  source->addCallback([future](c10::ivalue::Future& done) {
    if (done.hasError()) {
      future->setError(done.exception_ptr());
      return;
    }
    // torch.futures.Future.set_exception stores the exception as the value,
    // so an exception instance here is the op's failure.
    std::exception_ptr error;
    std::vector<at::Tensor> tensors;
    {
      py::gil_scoped_acquire gil;
      try {
        auto value = py::reinterpret_borrow<py::object>(done.constValue().toPyObject());
        if (PyExceptionInstance_Check(value.ptr())) {
          PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(value.ptr())), value.ptr());
          python_error failure;
          failure.persist();
          error = std::make_exception_ptr(failure);
        } else {
          tensors = value.cast<std::vector<at::Tensor>>();
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) {
      future->setError(error);
    } else {
      future->markCompleted(c10::IValue(std::move(tensors)));
    }
  });
  return c10::make_intrusive<GroupCommWork>(future, opType, group, sourceRank);
}

} // namespace

GroupCommBackend::GroupCommBackend(int rank, int size, PyObject* frontend)
    : c10d::Backend(rank, size), frontend_(nullptr) {
  attach(frontend);
}

void GroupCommBackend::attach(PyObject* frontend) {
  Py_INCREF(frontend);
  Py_XDECREF(frontend_);
  frontend_ = frontend;
  const auto name = py::handle(frontend_).attr("coordinator").attr("unique_name").cast<std::string>();
  group_ = std::make_shared<const std::string>(
      "group '" + name + "' (rank " + std::to_string(getRank()) + " of " + std::to_string(getSize()) + ")");
  // The frontend reports the failures of the ops it runs (Submission._reraise).
  py::handle(frontend_).attr("report_failure") = py::cpp_function(
      [health = health_](bool timedOut) { health->failed(timedOut); }, py::arg("timed_out"),
      py::call_guard<py::gil_scoped_release>());
  learnNativePlan();
  learnGlooPlan();
  learnCudaPlan();
}

void GroupCommBackend::learnCudaPlan() {
  if (cudaDecided_.load(std::memory_order_acquire)) {
    return;
  }
  py::object plan = py::handle(frontend_).attr("cuda_plan")();
  if (plan.is_none()) {
    return; // not decided yet: the NCCL communicator is made by a later op
  }
  if (!py::isinstance<py::bool_>(plan)) {
    cuda_ = plan.cast<std::shared_ptr<NcclPath>>();
  }
  cudaDecided_.store(true, std::memory_order_release);
}

void GroupCommBackend::learnGlooPlan() {
  if (glooDecided_.load(std::memory_order_acquire)) {
    return;
  }
  py::object plan = py::handle(frontend_).attr("gloo_plan")();
  if (plan.is_none()) {
    return; // not decided yet: the CPU communicator is built by a later op
  }
  if (!py::isinstance<py::bool_>(plan)) {
    glooPath_ = plan.cast<std::shared_ptr<GlooPath>>();
    glooPath_->bind(group_, health_);
  }
  glooDecided_.store(true, std::memory_order_release);
}

GlooPath* GroupCommBackend::glooPath() const {
  if (!glooDecided_.load(std::memory_order_acquire) || nativeDropped_.load(std::memory_order_acquire)) {
    return nullptr;
  }
  return glooPath_.get();
}

template <typename Path, typename Plan>
c10::intrusive_ptr<c10d::Work> GroupCommBackend::runOn(
    Path* path,
    c10d::OpType opType,
    bool asyncOp,
    std::chrono::milliseconds timeout,
    const Plan& plan) {
  if (path == nullptr) {
    return {};
  }
  auto op = plan(*path);
  if (!op) {
    return {};
  }
  ++sequence_;
  op->timeoutMs = timeoutMs(timeout);
  const auto start = issueTime();
  if (!asyncOp) {
    path->runNow(*op);
    return made(c10::make_intrusive<GroupCommWork>(std::move(op->outputs), opType, group_), start);
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  const OpQueue::Ticket ticket = path->post(std::move(*op), future);
  // A caller waiting for the op before the queue's thread took it runs it.
  auto help = [queue = path->queue(), ticket] { queue->help(ticket); };
  return made(c10::make_intrusive<GroupCommWork>(future, opType, group_, std::nullopt, std::move(help)), start);
}

void GroupCommBackend::learnNativePlan() {
  if (nativeDecided_.load(std::memory_order_acquire)) {
    return;
  }
  py::object plan = py::handle(frontend_).attr("native_plan")();
  if (plan.is_none()) {
    return; // not decided yet: the CPU communicator is built by a later op
  }
  std::shared_ptr<NativePath> native;
  if (!(py::isinstance<py::bool_>(plan) && !plan.cast<bool>())) {
    auto parts = plan.cast<py::tuple>();
    native = std::make_shared<NativePath>(
        parts[0].cast<std::shared_ptr<ShmGroup>>(), parts[1].cast<std::shared_ptr<OpQueue>>(), group_, health_,
        parts[2].cast<bool>());
  }
  native_ = std::move(native);
  nativeDecided_.store(true, std::memory_order_release);
}

NativePath* GroupCommBackend::nativePath() const {
  if (!nativeDecided_.load(std::memory_order_acquire) || nativeDropped_.load(std::memory_order_acquire)) {
    return nullptr;
  }
  return native_.get();
}

NcclPath* GroupCommBackend::cudaPath() const {
  // A coalescing batch's CUDA ops are grouped by Python (openBatch).
  if (!cudaDecided_.load(std::memory_order_acquire) || nativeDropped_.load(std::memory_order_acquire) ||
      coalescing_.load(std::memory_order_relaxed)) {
    return nullptr;
  }
  return cuda_.get();
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::onCuda(
    c10d::OpType opType,
    const char* label,
    std::chrono::milliseconds timeout,
    const CudaPlanner& plan) {
  NcclPath* path = cudaPath();
  if (path == nullptr) {
    return {};
  }
  const auto start = issueTime();
  NcclPath::Planned future;
  try {
    future = plan(*path, timeoutMs(timeout));
  } catch (const CommFailure& failure) {
    // As the frontend words it (Submission._reraise).
    health_->failed(false);
    throwInPython(CommFailure(
        std::string("groupcomm: ") + label + " on " + *group_ + " failed: " + failure.what(), false, label));
  }
  if (!future) {
    return {};
  }
  ++sequence_;
  return made(c10::make_intrusive<GroupCommWork>(std::move(future), opType, group_), start);
}

bool GroupCommBackend::supportsTensorAlloc(c10::DeviceIndex deviceIdx) {
  NativePath* path = nativePath();
  return deviceIdx < 0 && path != nullptr && path->group().shared();
}

at::Tensor GroupCommBackend::allocateTensor(long size, at::TensorOptions options) {
  if (NativePath* path = nativePath()) {
    if (auto tensor = path->group().allocate(size, options)) {
      return *std::move(tensor);
    }
  }
  return at::empty({size}, options);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::bridgedTransfer(
    c10d::OpType opType,
    std::vector<at::Tensor>& tensors,
    int peer,
    int tag) {
  const bool isSend = opType == c10d::OpType::SEND;
  const auto start = issueTime();
  std::optional<PostedTransfer> transfer;
  if (NativePath* path = nativePath()) {
    transfer = path->transfer(isSend, tensors, peer, tag);
  } else if (GlooPath* path = glooPath()) {
    transfer = path->transfer(isSend, tensors, peer, tag);
  }
  if (!transfer) {
    return {};
  }
  auto& [future, help] = *transfer;
  if (future->completed()) {
    return made(c10::make_intrusive<GroupCommWork>(std::move(future), opType, group_), start);
  }
  {
    std::lock_guard<std::mutex> lock(transfersMutex_);
    while (!transfers_.empty() && transfers_.front()->completed()) {
      transfers_.pop_front();
    }
    transfers_.push_back(future);
  }
  return made(
      c10::make_intrusive<GroupCommWork>(std::move(future), opType, group_, std::nullopt, std::move(help)), start);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::made(
    c10::intrusive_ptr<GroupCommWork> work,
    std::optional<std::chrono::steady_clock::time_point> start) {
  if (start || health_->followsCompletion()) {
    work->follow(health_, start);
  }
  if (coalescing_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(coalescedMutex_);
    coalesced_.push_back(work->getFuture());
  }
  return work;
}

void GroupCommBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_.exchange(true), "groupcomm: startCoalescing called twice without endCoalescing in between");
}

void GroupCommBackend::openBatch() {
  py::handle(frontend_).attr("start_coalescing")();
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::endCoalescing() {
  TORCH_CHECK(coalescing_.load(), "groupcomm: endCoalescing called without startCoalescing");
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> batch;
  {
    std::lock_guard<std::mutex> lock(coalescedMutex_);
    batch.swap(coalesced_);
    coalescing_.store(false);
  }
  if (batchOpen_.exchange(false)) {
    // Launches what Python held back; its failure also fails the batch's futures.
    py::gil_scoped_acquire gil;
    try {
      py::handle(frontend_).attr("end_coalescing")();
    } catch (py::error_already_set& e) {
      rethrowPython(e);
    }
  }
  return c10::make_intrusive<GroupCommWork>(allOf(batch), c10d::OpType::COALESCED, group_);
}

#if GROUPCOMM_TORCH_AT_LEAST(2, 15)
void GroupCommBackend::registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) {
  health_->addCompletionHook(hookId, [hook = std::move(hook)](uint64_t key, std::optional<float> ms) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    args.duration_ms = ms;
    hook(args);
  });
}
#endif

c10::intrusive_ptr<c10d::Backend> GroupCommBackend::shrink(
    const std::vector<int64_t>& ranksToExclude,
    int shrinkFlags,
    const c10::intrusive_ptr<Options>& optsOverride) {
  const int64_t timeout = optsOverride ? optsOverride->timeout.count() : -1;
  py::gil_scoped_acquire gil;
  try {
    auto made = py::handle(frontend_).attr("shrink")(ranksToExclude, shrinkFlags, timeout).cast<py::tuple>();
    return c10::make_intrusive<GroupCommBackend>(made[0].cast<int>(), made[1].cast<int>(), made[2].ptr());
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

c10::intrusive_ptr<c10d::Backend::Options> GroupCommBackend::getBackendOptions() {
  py::gil_scoped_acquire gil;
  try {
    py::object ms = py::handle(frontend_).attr("current_timeout")();
    return c10::make_intrusive<Options>(kBackendName, std::chrono::milliseconds(ms.cast<int64_t>()));
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

#ifdef C10D_BACKEND_HAS_RECONFIGURE
c10d::ReconfigureHandle GroupCommBackend::get_reconfigure_handle() const {
  py::gil_scoped_acquire gil;
  try {
    py::object handle = py::handle(frontend_).attr("reconfigure_handle")();
    return handle.cast<std::string>();
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  TORCH_CHECK(!coalescing_.load(), "groupcomm: reconfigure inside a coalescing batch");
  const bool ordered = std::holds_alternative<std::vector<c10d::ReconfigureHandle>>(opts.handles);
  std::vector<std::string> handles;
  std::visit([&](const auto& given) { handles.assign(given.begin(), given.end()); }, opts.handles);
  const int64_t timeout = opts.timeout ? opts.timeout->count() : -1;
  py::gil_scoped_acquire gil;
  try {
    // Checks the handles and claims the uuid; `form` then replaces this generation.
    py::object form = py::handle(frontend_).attr("reconfigure")(handles, ordered, opts.uuid, timeout);
    dropNativePath(); // this generation's ops go to Python, which fails them once it is gone
    auto made = form().cast<py::tuple>();
    rank_ = made[0].cast<int>();
    size_ = made[1].cast<int>();
    sequence_ = 0;
    health_ = health_->renewed();
    native_.reset();
    glooPath_.reset();
    cuda_.reset();
    nativeDecided_.store(false);
    glooDecided_.store(false);
    cudaDecided_.store(false);
    nativeDropped_.store(false);
    attach(made[2].ptr());
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
  return c10::make_intrusive<GroupCommWork>(std::vector<at::Tensor>{}, c10d::OpType::UNKNOWN, group_);
}
#endif

c10::intrusive_ptr<c10d::Backend> GroupCommBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  if (std::find(ranks.begin(), ranks.end(), getRank()) == ranks.end()) {
    return nullptr; // torch makes no group on this rank
  }
  const std::string& name = opts->group_name;
  const int64_t timeout = opts->timeout.count();
  py::gil_scoped_acquire gil;
  try {
    auto made = py::handle(frontend_).attr("split")(store, ranks, name, timeout).cast<py::tuple>();
    return c10::make_intrusive<GroupCommBackend>(made[0].cast<int>(), made[1].cast<int>(), made[2].ptr());
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

void GroupCommBackend::setGroupUid(const std::string& pgUid) {
  c10d::Backend::setGroupUid(pgUid);
  py::gil_scoped_acquire gil;
  try {
    py::handle(frontend_).attr("named")(pgUid);
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

void GroupCommBackend::setTimeout(std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  try {
    py::handle(frontend_).attr("set_timeout")(timeout.count());
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

GroupCommBackend::~GroupCommBackend() {
  // May run on a C++ thread without the GIL, or after the interpreter is gone
  // (then the reference is deliberately leaked: there is nobody to free it).
  if (frontend_ != nullptr && Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    Py_DECREF(frontend_);
  }
}

// Every Python object, keyword arguments included, is built inside `call`,
// after the GIL is taken: ops arrive from C++ with the GIL released. The
// frontend runs the op in the group's op queue or queues it there.
c10::intrusive_ptr<c10d::Work> GroupCommBackend::forward(
    c10d::OpType opType,
    const std::function<py::object(py::handle)>& call) {
  const bool collective = opType != c10d::OpType::SEND && opType != c10d::OpType::RECV &&
      opType != c10d::OpType::RECVANYSOURCE;
  if (collective) {
    ++sequence_;
  }
  const auto start = issueTime();
  py::gil_scoped_acquire gil;
  try {
    if (coalescing_.load(std::memory_order_relaxed) && !batchOpen_.exchange(true)) {
      openBatch();
    }
    auto work = toWork(call(py::handle(frontend_)), opType, group_);
    learnNativePlan();
    learnGlooPlan();
    learnCudaPlan();
    return made(std::move(work), start);
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::BROADCAST, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.broadcast(tensors, opts.rootRank);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::BROADCAST, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.broadcast(tensors, opts.rootRank);
      })) {
    return work;
  }
  if (auto work = onCuda(c10d::OpType::BROADCAST, "broadcast", opts.timeout, [&](NcclPath& path, int64_t ms) {
        return path.broadcast(tensors, opts.rootRank, ms);
      })) {
    return work;
  }
  return forward(c10d::OpType::BROADCAST, [&](py::handle frontend) {
    return frontend.attr("broadcast")(tensors, opts.rootRank, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::ALLREDUCE, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.allreduce(tensors, opts.reduceOp);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::ALLREDUCE, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.allreduce(tensors, opts.reduceOp);
      })) {
    return work;
  }
  if (auto work = onCuda(c10d::OpType::ALLREDUCE, "allreduce", opts.timeout, [&](NcclPath& path, int64_t ms) {
        return path.allreduce(tensors, opts.reduceOp, ms);
      })) {
    return work;
  }
  return forward(c10d::OpType::ALLREDUCE, [&](py::handle frontend) {
    return frontend.attr("allreduce")(tensors, unpackReduceOp(opts.reduceOp), opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  if (auto work = runOn(
          nativePath(), c10d::OpType::ALLREDUCE_COALESCED, opts.asyncOp, opts.timeout,
          [&](NativePath& path) { return path.allreduceCoalesced(tensors, opts.reduceOp); })) {
    return work;
  }
  return forward(c10d::OpType::ALLREDUCE_COALESCED, [&](py::handle frontend) {
    return frontend.attr("allreduce_coalesced")(
        tensors, unpackReduceOp(opts.reduceOp), opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::REDUCE, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.reduce(tensors, opts.reduceOp, opts.rootRank);
      })) {
    return work;
  }
  if (auto work = onCuda(c10d::OpType::REDUCE, "reduce", opts.timeout, [&](NcclPath& path, int64_t ms) {
        return path.reduce(tensors, opts.reduceOp, opts.rootRank, ms);
      })) {
    return work;
  }
  return forward(c10d::OpType::REDUCE, [&](py::handle frontend) {
    return frontend.attr("reduce")(
        tensors, unpackReduceOp(opts.reduceOp), opts.rootRank, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::ALLGATHER, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.allgather(outputs, inputs);
      })) {
    return work;
  }
  return forward(c10d::OpType::ALLGATHER, [&](py::handle frontend) {
    return frontend.attr("allgather")(outputs, inputs, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::_ALLGATHER_BASE, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.allgatherBase(output, input);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::_ALLGATHER_BASE, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.allgatherBase(output, input);
      })) {
    return work;
  }
  if (auto work = onCuda(
          c10d::OpType::_ALLGATHER_BASE, "_allgather_base", opts.timeout,
          [&](NcclPath& path, int64_t ms) { return path.allgatherBase(output, input, ms); })) {
    return work;
  }
  return forward(c10d::OpType::_ALLGATHER_BASE, [&](py::handle frontend) {
    return frontend.attr("_allgather_base")(output, input, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return forward(c10d::OpType::ALLGATHER_COALESCED, [&](py::handle frontend) {
    return frontend.attr("allgather_coalesced")(outputs, inputs, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::COALESCED, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.allgatherCoalesced(outputs, inputs);
      })) {
    return work;
  }
  if (auto work = onCuda(
          c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", opts.timeout,
          [&](NcclPath& path, int64_t ms) { return path.allgatherCoalesced(outputs, inputs, ms); })) {
    return work;
  }
  return forward(c10d::OpType::COALESCED, [&](py::handle frontend) {
    return frontend.attr("allgather_into_tensor_coalesced")(outputs, inputs, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::GATHER, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.gather(outputs, inputs, opts.rootRank);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::GATHER, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.gather(outputs, inputs, opts.rootRank);
      })) {
    return work;
  }
  return forward(c10d::OpType::GATHER, [&](py::handle frontend) {
    return frontend.attr("gather")(outputs, inputs, opts.rootRank, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

#if GROUPCOMM_TORCH_AT_LEAST(2, 14)
c10::intrusive_ptr<c10d::Work> GroupCommBackend::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  std::vector<std::vector<at::Tensor>> outputs; // none off the root, as dist.gather passes
  if (opts.rootRank == getRank()) {
    TORCH_CHECK_VALUE(
        output.numel() == input.numel() * getSize(), "groupcomm: gather_single on the root needs an output of ",
        input.numel() * getSize(), " elements (", getSize(), " x the input's ", input.numel(), "), got ",
        output.numel());
    TORCH_CHECK_VALUE(output.is_contiguous(), "groupcomm: gather_single's output must be contiguous");
    outputs.emplace_back();
    for (const auto& part : output.view({getSize(), input.numel()}).unbind(0)) {
      outputs.back().push_back(part.view(input.sizes()));
    }
  }
  std::vector<at::Tensor> inputs{input};
  return gather(outputs, inputs, opts);
}
#endif

c10::intrusive_ptr<c10d::Work> GroupCommBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::SCATTER, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.scatter(outputs, inputs, opts.rootRank);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::SCATTER, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.scatter(outputs, inputs, opts.rootRank);
      })) {
    return work;
  }
  return forward(c10d::OpType::SCATTER, [&](py::handle frontend) {
    return frontend.attr("scatter")(outputs, inputs, opts.rootRank, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::REDUCE_SCATTER, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.reduceScatter(outputs, inputs, opts.reduceOp);
      })) {
    return work;
  }
  return forward(c10d::OpType::REDUCE_SCATTER, [&](py::handle frontend) {
    return frontend.attr("reduce_scatter")(
        outputs, inputs, unpackReduceOp(opts.reduceOp), opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  if (auto work = runOn(
          nativePath(), c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, opts.timeout,
          [&](NativePath& path) { return path.reduceScatterBase(output, input, opts.reduceOp); })) {
    return work;
  }
  if (auto work = onCuda(
          c10d::OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", opts.timeout,
          [&](NcclPath& path, int64_t ms) { return path.reduceScatterBase(output, input, opts.reduceOp, ms); })) {
    return work;
  }
  return forward(c10d::OpType::_REDUCE_SCATTER_BASE, [&](py::handle frontend) {
    return frontend.attr("_reduce_scatter_base")(
        output, input, unpackReduceOp(opts.reduceOp), opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::COALESCED, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.reduceScatterCoalesced(outputs, inputs, opts.reduceOp);
      })) {
    return work;
  }
  if (auto work = onCuda(
          c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", opts.timeout, [&](NcclPath& path, int64_t ms) {
            return path.reduceScatterCoalesced(outputs, inputs, opts.reduceOp, ms);
          })) {
    return work;
  }
  return forward(c10d::OpType::COALESCED, [&](py::handle frontend) {
    return frontend.attr("reduce_scatter_tensor_coalesced")(
        outputs, inputs, unpackReduceOp(opts.reduceOp), opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::ALLTOALL_BASE, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.alltoallBase(output, input, outputSplitSizes, inputSplitSizes);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::ALLTOALL_BASE, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.alltoallBase(output, input, outputSplitSizes, inputSplitSizes);
      })) {
    return work;
  }
  if (auto work = onCuda(c10d::OpType::ALLTOALL_BASE, "alltoall_base", opts.timeout, [&](NcclPath& path, int64_t ms) {
        return path.alltoallBase(output, input, outputSplitSizes, inputSplitSizes, ms);
      })) {
    return work;
  }
  return forward(c10d::OpType::ALLTOALL_BASE, [&](py::handle frontend) {
    return frontend.attr("alltoall_base")(
        output, input, outputSplitSizes, inputSplitSizes, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::ALLTOALL, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.alltoall(outputs, inputs);
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::ALLTOALL, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.alltoall(outputs, inputs);
      })) {
    return work;
  }
  return forward(c10d::OpType::ALLTOALL, [&](py::handle frontend) {
    return frontend.attr("alltoall")(outputs, inputs, opts.asyncOp, timeoutMs(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  if (auto work = bridgedTransfer(c10d::OpType::SEND, tensors, dstRank, tag)) {
    return work;
  }
  return forward(c10d::OpType::SEND, [&](py::handle frontend) { return frontend.attr("send")(tensors, dstRank, tag); });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  if (auto work = bridgedTransfer(c10d::OpType::RECV, tensors, srcRank, tag)) {
    return work;
  }
  return forward(c10d::OpType::RECV, [&](py::handle frontend) { return frontend.attr("recv")(tensors, srcRank, tag); });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return forward(
      c10d::OpType::RECVANYSOURCE, [&](py::handle frontend) { return frontend.attr("recv_anysource")(tensors, tag); });
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::barrier(const c10d::BarrierOptions& opts) {
  if (auto work = runOn(nativePath(), c10d::OpType::BARRIER, opts.asyncOp, opts.timeout, [&](NativePath& path) {
        return path.barrier();
      })) {
    return work;
  }
  if (auto work = runOn(glooPath(), c10d::OpType::BARRIER, opts.asyncOp, opts.timeout, [&](GlooPath& path) {
        return path.barrier();
      })) {
    return work;
  }
  return forward(c10d::OpType::BARRIER, [&](py::handle frontend) {
    return frontend.attr("barrier")(opts.asyncOp, timeoutMs(opts.timeout));
  });
}

void GroupCommBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  py::gil_scoped_acquire gil;
  try {
    py::handle(frontend_).attr("monitored_barrier")(timeoutMs(opts.timeout), waitAllRanks);
  } catch (py::error_already_set& e) {
    rethrowPython(e);
  }
}

void GroupCommBackend::dropNativePath() {
  // Every later op goes to Python, which knows the group is gone. The path
  // itself stays until the backend goes: an op may be planning on it now.
  nativeDropped_.store(true, std::memory_order_release);
}

void GroupCommBackend::abort() {
  dropNativePath();
  py::gil_scoped_acquire gil;
  py::handle(frontend_).attr("abort")();
}

void GroupCommBackend::shutdown() {
  dropNativePath();
  {
    // Never block holding the GIL: a transfer's callbacks may need it.
    std::optional<py::gil_scoped_release> release;
    if (Py_IsInitialized() && PyGILState_Check()) {
      release.emplace();
    }
    // As long as the frontend gives its own queued work.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::lock_guard<std::mutex> lock(transfersMutex_);
    for (const auto& future : transfers_) {
      while (!future->completed() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    transfers_.clear();
  }
  py::gil_scoped_acquire gil;
  py::handle(frontend_).attr("shutdown")();
}

} // namespace groupcomm
