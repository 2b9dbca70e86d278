#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "bridge/health.h"
#include "bridge/work.h"
#include "queue/op_queue.h"
#include "shm/group.h"

namespace groupcomm {

// One op the native path runs: which engine call (`run`, given the op
// itself), its arguments, and the tensors its Work hands back. Plain data:
// planning an op allocates nothing beyond the outputs' vector.
struct NativeOp {
  const char* label;
  void (*run)(ShmGroup& group, NativeOp& op);
  std::vector<at::Tensor> outputs;        // also the tensors the call writes
  at::Tensor input;                       // the separate input, where the op has one
  std::vector<at::Tensor> inputs;         // a coalesced op's inputs, one per output; a list form's inputs
  std::vector<int64_t> outBytes, inBytes; // an uneven all-to-all's bytes per peer
  int root = -1;
  RedKind kind = RedKind::Sum;
  int64_t timeoutMs = -1; // c10d's per-op timeout; -1: the group's
};

// The ops the bridge runs without entering Python: calls on dense contiguous
// CPU tensors that the group's shared-memory engine carries as they are (the
// Python frontend hands the engine and the group's op queue over once they
// are built, see C10dFrontend.native_plan). Each planning method returns
// nothing for a call it does not cover; the bridge then forwards that call to
// Python, which also owns every argument error. An op runs now on the
// caller's thread or is queued behind the group's earlier ops (Python's
// included); its failure reads as the frontend words it: CommTimeoutError /
// GroupCommError naming op, group and rank.
class NativePath : public std::enable_shared_from_this<NativePath> {
 public:
  // `where`: "group '<name>' (rank r of n)", for failures' messages.
  // `health` hears of every failure.
  // `p2p`: the engine is also the group's send/recv transport.
  NativePath(
      std::shared_ptr<ShmGroup> group,
      std::shared_ptr<OpQueue> queue,
      std::shared_ptr<const std::string> where,
      std::shared_ptr<GroupHealth> health,
      bool p2p);

  std::optional<NativeOp> allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);
  std::optional<NativeOp> broadcast(std::vector<at::Tensor>& tensors, int64_t root);
  std::optional<NativeOp> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int64_t root);
  std::optional<NativeOp> allgatherBase(at::Tensor& output, at::Tensor& input);
  std::optional<NativeOp> reduceScatterBase(at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& op);
  std::optional<NativeOp> alltoallBase(
      at::Tensor& output,
      at::Tensor& input,
      const std::vector<int64_t>& outputSplits,
      const std::vector<int64_t>& inputSplits);
  std::optional<NativeOp> barrier();
  // gather and scatter: the root's list holds one tensor per rank, the others pass none.
  std::optional<NativeOp> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      int64_t root);
  std::optional<NativeOp> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      int64_t root);
  // The list forms (one tensor per rank, any sizes the ranks agree on): the
  // engine's op straight from and into the list's tensors, or through one
  // flat buffer where an output overlaps an input.
  std::optional<NativeOp> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs);
  std::optional<NativeOp> reduceScatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceOp& op);
  std::optional<NativeOp> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs);
  // The coalesced forms torch issues for a _coalescing_manager block: the
  // engine's op for each tensor (pair), one after another, as one op.
  std::optional<NativeOp> allreduceCoalesced(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);
  std::optional<NativeOp> allgatherCoalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs);
  std::optional<NativeOp> reduceScatterCoalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceOp& op);

  // A send (`isSend`) or recv of one dense tensor to or from another rank,
  // posted to the engine now (point-to-point ops are not queued behind the
  // collectives); nullopt for a call it does not cover. A transfer refused
  // at once raises here; a waiter's help moves messages on its thread for a
  // while first.
  std::optional<PostedTransfer> transfer(
      bool isSend,
      const std::vector<at::Tensor>& tensors,
      int64_t peer,
      int64_t tag);

  // Runs `op` on this thread once the group's earlier ops are done; its
  // failure is raised in Python.
  void runNow(NativeOp& op);
  // Queues `op` behind the group's earlier ops; `future` gets its outputs or
  // its failure. Returns the op's ticket in the queue.
  OpQueue::Ticket post(NativeOp op, c10::intrusive_ptr<c10::ivalue::Future> future);
  const std::shared_ptr<OpQueue>& queue() const {
    return queue_;
  }
  ShmGroup& group() const {
    return *group_;
  }

 private:
  // Runs op.run; a failure is rethrown as a CommFailure worded as the
  // frontend words it.
  void execute(NativeOp& op) const;
  // A reduce op the engine computes on `dtype` with no factor: its kind.
  std::optional<RedKind> kindFor(const c10d::ReduceOp& op, c10::ScalarType dtype) const;
  // Whether `whole` holds worldSize times `part`'s elements, both dense, in one dtype.
  bool fits(const at::Tensor& part, const at::Tensor& whole) const;
  // The same for every pair of a coalesced call (at least one).
  bool allFit(const std::vector<at::Tensor>& parts, const std::vector<at::Tensor>& wholes) const;
  // Whether `list` holds `count` dense tensors of `like`'s dtype (and numel, with `sameNumel`).
  static bool alike(const std::vector<at::Tensor>& list, const at::Tensor& like, size_t count, bool sameNumel);

  std::shared_ptr<ShmGroup> group_;
  std::shared_ptr<OpQueue> queue_;
  std::shared_ptr<const std::string> where_;
  std::shared_ptr<GroupHealth> health_;
  bool p2p_;
};

} // namespace groupcomm
