#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "bridge/gloo_path.h"
#include "bridge/health.h"
#include "bridge/native.h"
#include "bridge/nccl_path.h"
#include "bridge/work.h"

namespace groupcomm {

constexpr const char* kBackendName = "groupcomm";

// A c10d::Backend that owns no logic: every op takes the GIL and is forwarded,
// with its options unpacked into plain values, to the group's Python frontend
// (torch_groupcomm/c10d/frontend.py). The calls and their arguments are the
// rows of torch_groupcomm/c10d/ops.py (tests/test_op_contract.py holds this
// file to them). The frontend returns the op's output tensors, a
// torch.futures.Future of them, or such a result paired with a source rank
// (recvAnysource), which becomes the returned GroupCommWork.
//
// Python exceptions raised by the frontend are rethrown as the c10 error type
// torch maps back to the same Python class (TypeError, ValueError,
// NotImplementedError, RuntimeError), keeping their message.
//
// Decide once in Python, execute per op in C++: once the frontend hands over
// the group's shared-memory engine and op queue (C10dFrontend.native_plan),
// the ops NativePath covers run without the GIL: synchronous ones on the
// caller's thread, asynchronous ones queued in the same queue as the ops
// Python runs (issue order across both kinds of op is kept), completing
// their future from C++. Likewise on CUDA (C10dFrontend.cuda_plan): the
// plain collectives on the NCCL communicator's device are enqueued by
// NcclPath, without the GIL.
class GroupCommBackend : public c10d::Backend {
 public:
  GroupCommBackend(int rank, int size, PyObject* frontend);
  ~GroupCommBackend() override;

  const std::string getBackendName() const override {
    return kBackendName;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts)
      override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts)
      override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
#if GROUPCOMM_TORCH_AT_LEAST(2, 14)
  // dist.gather_single (torch 2.14+): gather into one flat tensor on the
  // root, run as gather into that tensor's world_size consecutive parts.
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts)
      override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // gloo's semantics, run by the frontend on the group's gloo cpu_group.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  void abort() override;
  void shutdown() override;

  // dist.shrink_group, on the survivors of a failure: a new backend for them
  // alone (its own shared-memory segment and gloo cpu_group, built from this
  // group's store), with this group's settings; SHRINK_ABORT first aborts
  // this group's ops in flight. torch then retires this group.
  bool supportsShrinking() const override {
    return true;
  }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude,
      int shrinkFlags,
      const c10::intrusive_ptr<Options>& optsOverride) override;

  // dist.split_group: a new backend for the ranks of this group listed in
  // `ranks` (in that order), built by them alone from torch's `store`
  // (private to the new group), with `opts`' name and timeout; none on a
  // rank outside them. getBackendOptions gives the group's current timeout,
  // which the new group keeps unless split_group is given one.
  bool supportsSplitting() const override {
    return true;
  }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;

#ifdef C10D_BACKEND_HAS_RECONFIGURE
  // torch's fault tolerance (dist._reconfigure, torch 2.14.1+): the processes whose
  // handles the peers exchanged form the group anew (ranks by the handles'
  // order; this generation's ops in flight fail, its resources go). A group
  // made with enable_reconfigure=True has no members until then.
  bool supportsReconfigure() const override {
    return true;
  }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif

  // FSDP2's opt-in (set_allocate_memory_from_process_group_for_comm): on a
  // group whose CPU ops run natively on a shared-memory engine that every
  // rank may map, CPU buffers come from its shared blocks, and the peers
  // read an all-gather's or reduce-scatter's input there in place.
  // Elsewhere (other devices, small sizes, the plan not known yet) a plain
  // tensor.
  bool supportsTensorAlloc(c10::DeviceIndex deviceIdx) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;

  // torch names a group after its backends exist (a shrunk group's name is
  // only known then): the coordinator is found under it from now on.
  void setGroupUid(const std::string& pgUid) override;

  // dist.set_timeout: the ops issued from now on use `timeout`, on every
  // path (the engine's waits, send/recv, gloo, CUDA's watchdog).
  void setTimeout(std::chrono::milliseconds timeout) override;

  // batch_isend_irecv and _coalescing_manager: the ops issued between start
  // and end progress together (each is posted without waiting for the
  // others, so a ring of sends and receives cannot deadlock) and end's Work
  // completes when all of them have, with all their outputs. On CUDA the
  // batch's ops go through Python, whose sends and receives end launches as
  // one NCCL group (the frontend's start_coalescing, told when the batch's
  // first op reaches it, and end_coalescing).
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // getError: SUCCESS until an op of the group times out (TIMEOUT) or fails
  // (COMM_ERROR); abort hooks run once, at that first failure.
  c10d::ErrorType getError() override {
    return health_->error();
  }
#if GROUPCOMM_TORCH_AT_LEAST(2, 14)
  void registerAbortHook(int64_t hookId, c10d::AbortHook hook) override {
    health_->addAbortHook(hookId, std::move(hook));
  }
  void unregisterAbortHook(int64_t hookId) override {
    health_->removeAbortHook(hookId);
  }
#endif
#if GROUPCOMM_TORCH_AT_LEAST(2, 15)
  // Completion hooks fire when an op has succeeded (the flight recorder
  // retires its entries with them), with its duration when timing is on.
  bool supportsAbortHooks() const override {
    return true;
  }
  bool supportsCompletionHooks() const override {
    return true;
  }
  void registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t hookId) override {
    health_->removeCompletionHook(hookId);
  }
#endif
  // Work.get_duration for the ops issued from now on.
  void enableCollectivesTiming() override {
    timing_.store(true, std::memory_order_relaxed);
  }

  // Counts collectives (not point-to-point), which is what torch's debug
  // wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares across ranks.
  void setSequenceNumberForGroup() override {
    sequence_ = 0;
  }
  uint64_t getSequenceNumberForGroup() override {
    return sequence_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> forward(
      c10d::OpType opType,
      const std::function<pybind11::object(pybind11::handle)>& call);
  // The native path once decided and while not dropped; null otherwise.
  NativePath* nativePath() const;
  // The Work of a send or recv the native or gloo path posts: null when
  // neither covers the call and it must go through Python.
  c10::intrusive_ptr<c10d::Work> bridgedTransfer(
      c10d::OpType opType,
      std::vector<at::Tensor>& tensors,
      int peer,
      int tag);
  // Every Work the bridge makes passes here, `start` being when its op was
  // issued: completion hooks and timing follow it, a coalesced batch keeps it.
  c10::intrusive_ptr<c10d::Work> made(
      c10::intrusive_ptr<GroupCommWork> work,
      std::optional<std::chrono::steady_clock::time_point> start);
  // When an op issued now started, if anybody asks (timing is on).
  std::optional<std::chrono::steady_clock::time_point> issueTime() const {
    if (!timing_.load(std::memory_order_relaxed)) {
      return std::nullopt;
    }
    return std::chrono::steady_clock::now();
  }
  // The gloo path once decided and while not dropped; null otherwise.
  GlooPath* glooPath() const;
  // The Work of the op `plan` makes on `path` (the native or the gloo
  // path), run now or queued when async: null without a path, or when `plan`
  // does not cover the call and it must go through Python.
  template <typename Path, typename Plan>
  c10::intrusive_ptr<c10d::Work> runOn(
      Path* path,
      c10d::OpType opType,
      bool asyncOp,
      std::chrono::milliseconds timeout,
      const Plan& plan);
  // The CUDA path once decided and while not dropped; null otherwise.
  NcclPath* cudaPath() const;
  using CudaPlanner = std::function<NcclPath::Planned(NcclPath&, int64_t timeoutMs)>;
  // The Work of an op the CUDA path enqueued (`label` names it in a
  // failure): null when `plan` does not cover it and it must go through Python.
  c10::intrusive_ptr<c10d::Work> onCuda(
      c10d::OpType opType,
      const char* label,
      std::chrono::milliseconds timeout,
      const CudaPlanner& plan);
  // Serve the group through `frontend` (borrowed: the backend takes its own
  // reference; GIL held): its name for messages, its failure reports, its
  // native plans.
  void attach(PyObject* frontend);
  // Ask the frontend for its native plans, CPU and CUDA, until each is decided (GIL held).
  void learnNativePlan();
  void learnGlooPlan();
  void learnCudaPlan();
  void dropNativePath();
  // The first op of a coalescing batch that reaches Python tells the frontend (GIL held).
  void openBatch();

  // Owned reference; released only while the interpreter is alive.
  PyObject* frontend_;
  // "group '<name>' (rank r of n)", for the messages of this group's Works.
  std::shared_ptr<const std::string> group_;
  std::atomic<uint64_t> sequence_{0};
  // native_ is written once (GIL held) before nativeDecided_ publishes it.
  std::atomic<bool> nativeDecided_{false};
  std::atomic<bool> nativeDropped_{false};
  std::shared_ptr<NativePath> native_;
  // glooPath_ and cuda_ likewise, published by glooDecided_ and
  // cudaDecided_; nativeDropped_ drops all three.
  std::atomic<bool> glooDecided_{false};
  std::shared_ptr<GlooPath> glooPath_;
  std::atomic<bool> cudaDecided_{false};
  std::shared_ptr<NcclPath> cuda_;
  std::shared_ptr<GroupHealth> health_ = std::make_shared<GroupHealth>();
  std::atomic<bool> timing_{false};
  std::atomic<bool> coalescing_{false};
  std::atomic<bool> batchOpen_{false}; // the frontend knows of the current batch
  std::mutex coalescedMutex_;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> coalesced_;
  // Native sends and recvs not known to be done: shutdown gives them a
  // while to finish (a send whose Work was dropped still arrives).
  std::mutex transfersMutex_;
  std::deque<c10::intrusive_ptr<c10::ivalue::Future>> transfers_;
};

} // namespace groupcomm
