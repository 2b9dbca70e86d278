#include "backend.h"

#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/python.h>

#include "work.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace groupcomm {
namespace {

// A ReduceOp as (kind, premul factor): kind is c10d::ReduceOp::RedOpType's
// value; the factor is None, a float or a scalar tensor.
py::tuple unpackReduceOp(const c10d::ReduceOp& op) {
  py::object factor = py::none();
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM && op.supplement_) {
    auto* premul =
        dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_INTERNAL_ASSERT(premul != nullptr, "PREMUL_SUM without a factor");
    factor = premul->tensor_factor.defined()
        ? py::cast(premul->tensor_factor)
        : py::cast(premul->double_factor);
  }
  return py::make_tuple(static_cast<int>(op.op_), factor);
}

int64_t timeoutMs(std::chrono::milliseconds timeout) {
  return timeout == c10d::kUnsetTimeout ? -1 : timeout.count();
}

[[noreturn]] void rethrowAsTorchError(py::error_already_set& e) {
  std::string message = py::str(e.value());
  if (e.matches(PyExc_TypeError)) {
    TORCH_CHECK_TYPE(false, message);
  }
  if (e.matches(PyExc_ValueError)) {
    TORCH_CHECK_VALUE(false, message);
  }
  if (e.matches(PyExc_NotImplementedError)) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, message);
  }
  std::string type = py::str(e.type().attr("__name__"));
  C10_THROW_ERROR(DistBackendError, type + ": " + message);
}

c10::intrusive_ptr<c10d::Work> toWork(
    const py::object& result,
    c10d::OpType opType) {
  std::optional<int> sourceRank;
  py::object future = result;
  if (py::isinstance<py::tuple>(result)) {
    auto pair = result.cast<py::tuple>();
    future = pair[0];
    sourceRank = pair[1].cast<int>();
  }
  auto wrapper =
      future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>();
  return c10::make_intrusive<GroupCommWork>(
      wrapper->fut, opType, sourceRank);
}

} // namespace

GroupCommBackend::GroupCommBackend(int rank, int size, PyObject* frontend)
    : c10d::Backend(rank, size), frontend_(frontend) {
  Py_INCREF(frontend_);
}

GroupCommBackend::~GroupCommBackend() {
  // May run on a C++ thread without the GIL, or after the interpreter is gone
  // (then the reference is deliberately leaked: there is nobody to free it).
  if (frontend_ != nullptr && Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    Py_DECREF(frontend_);
  }
}

template <typename... Args>
c10::intrusive_ptr<c10d::Work> GroupCommBackend::forward(
    const char* method,
    c10d::OpType opType,
    Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    py::object result = py::handle(frontend_).attr(method)(
        std::forward<Args>(args)...);
    return toWork(result, opType);
  } catch (py::error_already_set& e) {
    rethrowAsTorchError(e);
  }
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return forward(
      "broadcast",
      c10d::OpType::BROADCAST,
      tensors,
      opts.rootRank,
      opts.rootTensor,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return forward(
      "allreduce",
      c10d::OpType::ALLREDUCE,
      tensors,
      unpackReduceOp(opts.reduceOp),
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return forward(
      "allreduce_coalesced",
      c10d::OpType::ALLREDUCE_COALESCED,
      tensors,
      unpackReduceOp(opts.reduceOp),
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return forward(
      "reduce",
      c10d::OpType::REDUCE,
      tensors,
      unpackReduceOp(opts.reduceOp),
      opts.rootRank,
      opts.rootTensor,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return forward(
      "allgather",
      c10d::OpType::ALLGATHER,
      outputs,
      inputs,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return forward(
      "_allgather_base",
      c10d::OpType::_ALLGATHER_BASE,
      output,
      input,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return forward(
      "allgather_coalesced",
      c10d::OpType::ALLGATHER_COALESCED,
      outputs,
      inputs,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::
    allgather_into_tensor_coalesced(
        std::vector<at::Tensor>& outputs,
        std::vector<at::Tensor>& inputs,
        const c10d::AllgatherOptions& opts) {
  return forward(
      "allgather_into_tensor_coalesced",
      c10d::OpType::COALESCED,
      outputs,
      inputs,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return forward(
      "gather",
      c10d::OpType::GATHER,
      outputs,
      inputs,
      opts.rootRank,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return forward(
      "scatter",
      c10d::OpType::SCATTER,
      outputs,
      inputs,
      opts.rootRank,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return forward(
      "reduce_scatter",
      c10d::OpType::REDUCE_SCATTER,
      outputs,
      inputs,
      unpackReduceOp(opts.reduceOp),
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return forward(
      "_reduce_scatter_base",
      c10d::OpType::_REDUCE_SCATTER_BASE,
      output,
      input,
      unpackReduceOp(opts.reduceOp),
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::
    reduce_scatter_tensor_coalesced(
        std::vector<at::Tensor>& outputs,
        std::vector<at::Tensor>& inputs,
        const c10d::ReduceScatterOptions& opts) {
  return forward(
      "reduce_scatter_tensor_coalesced",
      c10d::OpType::COALESCED,
      outputs,
      inputs,
      unpackReduceOp(opts.reduceOp),
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  return forward(
      "alltoall_base",
      c10d::OpType::ALLTOALL_BASE,
      output,
      input,
      outputSplitSizes,
      inputSplitSizes,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return forward(
      "alltoall",
      c10d::OpType::ALLTOALL,
      outputs,
      inputs,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  return forward("send", c10d::OpType::SEND, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  return forward("recv", c10d::OpType::RECV, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  return forward("recv_anysource", c10d::OpType::RECVANYSOURCE, tensors, tag);
}

c10::intrusive_ptr<c10d::Work> GroupCommBackend::barrier(
    const c10d::BarrierOptions& opts) {
  return forward(
      "barrier",
      c10d::OpType::BARRIER,
      "timeout_ms"_a = timeoutMs(opts.timeout),
      "async_op"_a = opts.asyncOp);
}

void GroupCommBackend::abort() {
  py::gil_scoped_acquire gil;
  py::handle(frontend_).attr("abort")();
}

void GroupCommBackend::shutdown() {
  py::gil_scoped_acquire gil;
  py::handle(frontend_).attr("shutdown")();
}

} // namespace groupcomm
