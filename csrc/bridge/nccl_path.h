#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "queue/op_queue.h"

namespace groupcomm {

// The C entry points the CUDA path calls, as the Python side found them in
// the process (torch_groupcomm/communicators/nccl.py loads NCCL at run time,
// so the build needs no CUDA or NCCL headers). Every function returns its
// library's status code, 0 for success.
struct NcclEntryPoints {
  using AllReduce = int (*)(const void*, void*, size_t, int, int, void*, void*);
  using Broadcast = int (*)(const void*, void*, size_t, int, int, void*, void*);
  using Reduce = int (*)(const void*, void*, size_t, int, int, int, void*, void*);
  using AllGather = int (*)(const void*, void*, size_t, int, void*, void*);
  using ReduceScatter = int (*)(const void*, void*, size_t, int, int, void*, void*);
  using Send = int (*)(const void*, size_t, int, int, void*, void*);
  using Recv = int (*)(void*, size_t, int, int, void*, void*);
  using Group = int (*)();
  using ErrorString = const char* (*)(int);
  using StreamIsCapturing = int (*)(void*, int*); // cudaStreamIsCapturing

  AllReduce allReduce = nullptr;
  Broadcast broadcast = nullptr;
  Reduce reduce = nullptr;
  AllGather allGather = nullptr;
  ReduceScatter reduceScatter = nullptr;
  Send send = nullptr; // these four may be missing (an NCCL before 2.7): no all-to-all here then
  Recv recv = nullptr;
  Group groupStart = nullptr;
  Group groupEnd = nullptr;
  ErrorString errorString = nullptr;
  StreamIsCapturing streamIsCapturing = nullptr;
};

// Decide once in Python, execute per op in C++, on CUDA: once a group's NCCL
// communicator and side stream exist, the CUDA communicator
// (communicators/cuda.py) hands them over, and the bridge runs the plain
// collectives on dense contiguous CUDA tensors of that device here, as the
// Python path runs them (same NCCL call, same stream order: the side stream
// waits for the caller's current stream, the caller's tensors are kept alive
// for the side stream, the returned future lives on the device), without the
// GIL. Each planning method returns null for a call it does not cover (other
// device, layout, dtype or reduce op, an empty tensor, a stream being
// captured into a CUDA graph, the path disabled); the bridge then forwards
// the call to Python.
//
// The ops it enqueued are followed here until the stream passed them: the
// communicator's watchdog asks late() and aborts the communicator when an op
// outlives its timeout, after disable() so no later op starts here.
class NcclPath {
 public:
  NcclPath(
      NcclEntryPoints nccl,
      void* comm,
      int worldSize,
      c10::Stream side,
      void* sideHandle,
      std::shared_ptr<OpQueue> queue);

  using Planned = c10::intrusive_ptr<c10::ivalue::Future>;
  Planned allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int64_t timeoutMs);
  Planned broadcast(std::vector<at::Tensor>& tensors, int64_t root, int64_t timeoutMs);
  Planned reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int64_t root, int64_t timeoutMs);
  Planned allgatherBase(at::Tensor& output, at::Tensor& input, int64_t timeoutMs);
  Planned reduceScatterBase(at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& op, int64_t timeoutMs);
  // The coalesced forms (_coalescing_manager, FSDP1): one NCCL group of the pairs' calls.
  Planned allgatherCoalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, int64_t timeoutMs);
  Planned reduceScatterCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceOp& op,
      int64_t timeoutMs);
  Planned alltoallBase(
      at::Tensor& output,
      at::Tensor& input,
      const std::vector<int64_t>& outputSplits,
      const std::vector<int64_t>& inputSplits,
      int64_t timeoutMs);

  // No op starts here from now on (the communicator failed or is going).
  void disable() {
    disabled_.store(true, std::memory_order_release);
  }
  // Forgets the ops the stream has passed; returns the timeout (ms) of the
  // oldest op still running past it (`defaultMs` for an op without its own),
  // or -1.
  int64_t late(int64_t defaultMs);
  // Whether an op enqueued here may still be running.
  bool pending();

 private:
  // How NCCL reduces a tensor: its datatype, the element count factor
  // (complex as pairs of reals) and the op; none when NCCL does not.
  struct Reduction {
    int datatype;
    int64_t perElement;
    int op;
  };
  static std::optional<Reduction> reductionFor(c10::ScalarType dtype, const c10d::ReduceOp& op);
  bool onDevice(const at::Tensor& t) const;
  // Whether `whole` holds worldSize_ times `part`'s elements, both on the device in one dtype.
  bool fits(const at::Tensor& part, const at::Tensor& whole) const;
  // Pairs of coalesced tensors that all fit (and NCCL groups to put them in).
  bool allFit(const std::vector<at::Tensor>& parts, const std::vector<at::Tensor>& wholes) const;
  // `call(i)` for i < n inside one ncclGroupStart/End; the first failing status.
  int grouped(size_t n, const std::function<int(size_t)>& call) const;
  // Runs `enqueue(stream)` on the side stream as the Python path does, for an
  // op reading and writing `used` (whose outputs are `outputs`); null when
  // the current stream is being captured or the path is disabled. A status
  // other than success is raised as a CommFailure naming `call`.
  Planned run(
      const char* call,
      const std::vector<at::Tensor>& used,
      std::vector<at::Tensor> outputs,
      int64_t timeoutMs,
      const std::function<int(void*)>& enqueue);

  NcclEntryPoints nccl_;
  void* comm_;
  int worldSize_;
  c10::Device device_;
  c10::Stream side_;
  void* sideHandle_;
  std::shared_ptr<OpQueue> queue_;
  std::atomic<bool> disabled_{false};
  c10::Event callerDone_; // recorded on the caller's stream, waited for by the side stream
  struct Enqueued {
    c10::Event done;
    std::chrono::steady_clock::time_point issued;
    int64_t timeoutMs;
  };
  std::mutex enqueuedMutex_;
  std::deque<Enqueued> enqueued_;
};

} // namespace groupcomm
