#include "bridge/nccl_path.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <string>

#include "bridge/shapes.h"
#include "comm_failure.h"

namespace groupcomm {
namespace {

// ncclDataType_t and ncclRedOp_t values (nccl.h, stable since NCCL 2.x; the
// same table as torch_groupcomm/communicators/nccl.py).
constexpr int kNcclUint8 = 1;

std::optional<int> ncclDatatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Char:
      return 0;
    case c10::ScalarType::Byte:
      return 1;
    case c10::ScalarType::Int:
      return 2;
    case c10::ScalarType::Long:
      return 4;
    case c10::ScalarType::Half:
      return 6;
    case c10::ScalarType::Float:
      return 7;
    case c10::ScalarType::Double:
      return 8;
    case c10::ScalarType::BFloat16:
      return 9;
    default:
      return std::nullopt;
  }
}

std::optional<int> ncclOp(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return 0;
    case c10d::ReduceOp::PRODUCT:
      return 1;
    case c10d::ReduceOp::MAX:
      return 2;
    case c10d::ReduceOp::MIN:
      return 3;
    case c10d::ReduceOp::AVG:
      return 4;
    default:
      return std::nullopt; // bitwise ops and PREMUL_SUM: the Python path
  }
}

} // namespace

NcclPath::NcclPath(
    NcclEntryPoints nccl,
    void* comm,
    int worldSize,
    c10::Stream side,
    void* sideHandle,
    std::shared_ptr<OpQueue> queue)
    : nccl_(nccl),
      comm_(comm),
      worldSize_(worldSize),
      device_(side.device()),
      side_(side),
      sideHandle_(sideHandle),
      queue_(std::move(queue)),
      callerDone_(c10::DeviceType::CUDA) {}

std::optional<NcclPath::Reduction> NcclPath::reductionFor(c10::ScalarType dtype, const c10d::ReduceOp& op) {
  auto nccl = ncclOp(op);
  if (!nccl) {
    return std::nullopt;
  }
  if (c10::isComplexType(dtype)) {
    // (re, im) pairs, where the op acts on each part alone (reduction.py's wire_plan)
    if (dtype == c10::ScalarType::ComplexHalf || (op.op_ != c10d::ReduceOp::SUM && op.op_ != c10d::ReduceOp::AVG)) {
      return std::nullopt;
    }
    return Reduction{*ncclDatatype(c10::toRealValueType(dtype)), 2, *nccl};
  }
  auto datatype = ncclDatatype(dtype);
  if (!datatype) {
    return std::nullopt;
  }
  return Reduction{*datatype, 1, *nccl};
}

bool NcclPath::onDevice(const at::Tensor& t) const {
  return t.device() == device_ && t.layout() == c10::kStrided && t.is_contiguous() && t.numel() > 0;
}

NcclPath::Planned NcclPath::run(
    const char* call,
    const std::vector<at::Tensor>& used,
    std::vector<at::Tensor> outputs,
    int64_t timeoutMs,
    const std::function<int(void*)>& enqueue) {
  OpQueue::Exclusive hold(*queue_); // after the group's earlier ops, as the Python path
  if (disabled_.load(std::memory_order_acquire)) {
    return {};
  }
  const c10::DeviceGuard guard(device_); // NCCL's device and the future's
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  const c10::Stream current = cuda.getStream(device_);
  void* handle = nullptr;
  try {
    handle = current.native_handle();
  } catch (const c10::Error&) {
    disable(); // this torch cannot name its CUDA streams: Python runs every op
    return {};
  }
  int capture = 0;
  if (nccl_.streamIsCapturing(handle, &capture) != 0 || capture != 0) {
    return {}; // a graph capture (or no answer): the Python path runs the op on the capturing stream
  }
  callerDone_.record(current);
  callerDone_.block(side_);
  const int status = enqueue(sideHandle_);
  if (status != 0) {
    const char* text = nccl_.errorString != nullptr ? nccl_.errorString(status) : nullptr;
    throw CommFailure(
        std::string("groupcomm: NCCL ") + call + " failed: " + (text != nullptr ? text : "unknown error") +
            " (ncclResult " + std::to_string(status) + ")",
        false);
  }
  for (const auto& t : used) {
    cuda.recordDataPtrOnStream(t.storage().data_ptr(), side_);
  }
  c10::Event done(c10::DeviceType::CUDA);
  done.record(side_);
  {
    std::lock_guard<std::mutex> lock(enqueuedMutex_);
    enqueued_.push_back(Enqueued{std::move(done), std::chrono::steady_clock::now(), timeoutMs});
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), std::vector<c10::Device>{device_});
  // the future's events go on the side stream: a waiter's stream waits for the op
  const c10::Stream previous = cuda.exchangeStream(side_);
  future->markCompleted(c10::IValue(std::move(outputs)));
  cuda.exchangeStream(previous);
  return future;
}

NcclPath::Planned NcclPath::allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int64_t timeoutMs) {
  if (tensors.size() != 1 || !onDevice(tensors[0])) {
    return {};
  }
  auto how = reductionFor(tensors[0].scalar_type(), op);
  if (!how) {
    return {};
  }
  at::Tensor& t = tensors[0];
  return run("ncclAllReduce", tensors, tensors, timeoutMs, [&](void* stream) {
    return nccl_.allReduce(
        t.data_ptr(), t.data_ptr(), t.numel() * how->perElement, how->datatype, how->op, comm_, stream);
  });
}

NcclPath::Planned NcclPath::broadcast(std::vector<at::Tensor>& tensors, int64_t root, int64_t timeoutMs) {
  if (tensors.size() != 1 || !onDevice(tensors[0]) || root < 0 || root >= worldSize_) {
    return {};
  }
  at::Tensor& t = tensors[0];
  return run("ncclBroadcast", tensors, tensors, timeoutMs, [&](void* stream) {
    return nccl_.broadcast(t.data_ptr(), t.data_ptr(), t.nbytes(), kNcclUint8, static_cast<int>(root), comm_, stream);
  });
}

NcclPath::Planned NcclPath::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int64_t root,
    int64_t timeoutMs) {
  if (tensors.size() != 1 || !onDevice(tensors[0]) || root < 0 || root >= worldSize_) {
    return {};
  }
  auto how = reductionFor(tensors[0].scalar_type(), op);
  if (!how) {
    return {};
  }
  at::Tensor& t = tensors[0];
  return run("ncclReduce", tensors, tensors, timeoutMs, [&](void* stream) {
    return nccl_.reduce(
        t.data_ptr(), t.data_ptr(), t.numel() * how->perElement, how->datatype, how->op, static_cast<int>(root), comm_,
        stream);
  });
}

bool NcclPath::fits(const at::Tensor& part, const at::Tensor& whole) const {
  return onDevice(part) && onDevice(whole) && onePartPerRank(part, whole, worldSize_);
}

bool NcclPath::allFit(const std::vector<at::Tensor>& parts, const std::vector<at::Tensor>& wholes) const {
  return nccl_.groupStart != nullptr && nccl_.groupEnd != nullptr &&
      everyPairFits(parts, wholes, [this](const at::Tensor& p, const at::Tensor& w) { return fits(p, w); });
}

int NcclPath::grouped(size_t n, const std::function<int(size_t)>& call) const {
  int status = nccl_.groupStart();
  if (status != 0) {
    return status;
  }
  for (size_t i = 0; i < n && status == 0; ++i) {
    status = call(i);
  }
  const int ended = nccl_.groupEnd(); // a group once started is always ended
  return status != 0 ? status : ended;
}

NcclPath::Planned NcclPath::allgatherBase(at::Tensor& output, at::Tensor& input, int64_t timeoutMs) {
  if (!fits(input, output)) {
    return {};
  }
  return run("ncclAllGather", {output, input}, {output}, timeoutMs, [&](void* stream) {
    return nccl_.allGather(input.data_ptr(), output.data_ptr(), input.nbytes(), kNcclUint8, comm_, stream);
  });
}

NcclPath::Planned NcclPath::allgatherCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    int64_t timeoutMs) {
  if (!allFit(inputs, outputs)) {
    return {};
  }
  std::vector<at::Tensor> used(outputs);
  used.insert(used.end(), inputs.begin(), inputs.end());
  return run("ncclAllGather", used, outputs, timeoutMs, [&](void* stream) {
    return grouped(inputs.size(), [&](size_t i) {
      return nccl_.allGather(
          inputs[i].data_ptr(), outputs[i].data_ptr(), inputs[i].nbytes(), kNcclUint8, comm_, stream);
    });
  });
}

NcclPath::Planned NcclPath::reduceScatterBase(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceOp& op,
    int64_t timeoutMs) {
  auto how = reductionFor(output.scalar_type(), op);
  if (!how || !fits(output, input)) {
    return {};
  }
  return run("ncclReduceScatter", {output, input}, {output}, timeoutMs, [&](void* stream) {
    return nccl_.reduceScatter(
        input.data_ptr(), output.data_ptr(), output.numel() * how->perElement, how->datatype, how->op, comm_, stream);
  });
}

NcclPath::Planned NcclPath::reduceScatterCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceOp& op,
    int64_t timeoutMs) {
  if (!allFit(outputs, inputs)) {
    return {};
  }
  std::vector<Reduction> hows;
  for (const auto& t : outputs) {
    auto how = reductionFor(t.scalar_type(), op);
    if (!how) {
      return {};
    }
    hows.push_back(*how);
  }
  std::vector<at::Tensor> used(outputs);
  used.insert(used.end(), inputs.begin(), inputs.end());
  return run("ncclReduceScatter", used, outputs, timeoutMs, [&](void* stream) {
    return grouped(outputs.size(), [&](size_t i) {
      return nccl_.reduceScatter(
          inputs[i].data_ptr(), outputs[i].data_ptr(), outputs[i].numel() * hows[i].perElement, hows[i].datatype,
          hows[i].op, comm_, stream);
    });
  });
}

NcclPath::Planned NcclPath::alltoallBase(
    at::Tensor& output,
    at::Tensor& input,
    const std::vector<int64_t>& outputSplits,
    const std::vector<int64_t>& inputSplits,
    int64_t timeoutMs) {
  if (nccl_.send == nullptr || nccl_.recv == nullptr || nccl_.groupStart == nullptr || nccl_.groupEnd == nullptr ||
      !onDevice(output) || !onDevice(input) || output.scalar_type() != input.scalar_type() ||
      (outputSplits.empty() && inputSplits.empty() && output.numel() != input.numel())) {
    return {};
  }
  auto received = splitBytes(output, outputSplits, worldSize_);
  auto sent = splitBytes(input, inputSplits, worldSize_);
  if (!received || !sent) {
    return {};
  }
  return run("ncclSend/ncclRecv", {output, input}, {output}, timeoutMs, [&](void* stream) {
    const auto* from = static_cast<const char*>(input.data_ptr());
    auto* to = static_cast<char*>(output.data_ptr());
    return grouped(worldSize_, [&](size_t peer) {
      int status = 0;
      if ((*sent)[peer] != 0) {
        status = nccl_.send(from, (*sent)[peer], kNcclUint8, static_cast<int>(peer), comm_, stream);
      }
      if (status == 0 && (*received)[peer] != 0) {
        status = nccl_.recv(to, (*received)[peer], kNcclUint8, static_cast<int>(peer), comm_, stream);
      }
      from += (*sent)[peer];
      to += (*received)[peer];
      return status;
    });
  });
}

int64_t NcclPath::late(int64_t defaultMs) {
  std::lock_guard<std::mutex> lock(enqueuedMutex_);
  while (!enqueued_.empty() && enqueued_.front().done.query()) {
    enqueued_.pop_front();
  }
  if (enqueued_.empty()) {
    return -1;
  }
  const Enqueued& oldest = enqueued_.front();
  const int64_t timeoutMs = oldest.timeoutMs >= 0 ? oldest.timeoutMs : defaultMs;
  const bool past = std::chrono::steady_clock::now() - oldest.issued > std::chrono::milliseconds(timeoutMs);
  return past ? timeoutMs : -1;
}

bool NcclPath::pending() {
  std::lock_guard<std::mutex> lock(enqueuedMutex_);
  return !enqueued_.empty();
}

} // namespace groupcomm
