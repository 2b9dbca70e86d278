#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "bridge/health.h"

namespace groupcomm {

// A c10d::Work backed by the future the coordinator hands back. The future's
// value is the op's output tensors (DDP reads them through getFuture()); an
// error set on the future is rethrown by wait(). For a future on CUDA devices,
// wait() makes the caller's current streams wait for the op (no host sync)
// and synchronize() also blocks the host. recvAnysource also knows which rank
// it heard from. An op queued natively comes with `help`, which wait() calls
// first: it runs the op on the waiting thread if the queue has not started it.
//
// wait(timeout) has gloo's semantics: when the op is not done within
// `timeout` it raises (CommTimeoutError naming op, group, rank and the
// timeout) and the op goes on; a later wait() returns its result. `group`
// says which group and rank, for that message.
class GroupCommWork : public c10d::Work {
 public:
  GroupCommWork(
      c10::intrusive_ptr<c10::ivalue::Future> future,
      c10d::OpType opType,
      std::shared_ptr<const std::string> group,
      std::optional<int> sourceRank = std::nullopt,
      std::function<void()> help = nullptr);
  // An op that has already succeeded with `outputs` (a synchronous op):
  // its future is made only if someone asks for it, which most callers
  // (dist.all_reduce and the like) never do.
  GroupCommWork(
      std::vector<at::Tensor> outputs,
      c10d::OpType opType,
      std::shared_ptr<const std::string> group,
      std::optional<int> sourceRank = std::nullopt);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Waits, then blocks the host until the op's device work is done.
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Tells `health`'s completion hooks when the op has succeeded, under a key
  // of its own (getCompletionKey); with `start` (collectives timing is on)
  // it also measures the op, for getDuration.
  void follow(const std::shared_ptr<GroupHealth>& health, std::optional<std::chrono::steady_clock::time_point> start);
  // Milliseconds from issue to completion; only with collectives timing on.
  float getDuration() const override;
#if GROUPCOMM_TORCH_AT_LEAST(2, 15)
  uint64_t getCompletionKey() const override {
    return key_;
  }
#endif

 private:
  // Whether the op completed within `timeout` (it is left running if not).
  bool completesWithin(std::chrono::milliseconds timeout);

  // Set from the start, or for an op that succeeded before its Work was made
  // (done_), on the first getFuture().
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  const bool done_ = false;
  std::vector<at::Tensor> outputs_; // done_: the op's outputs
  std::once_flag futureMade_;
  std::shared_ptr<const std::string> group_;
  std::optional<int> sourceRank_;
  std::function<void()> help_;
  uint64_t key_ = 0;
  // Set once the op completed, when it is timed; negative until then.
  std::shared_ptr<std::atomic<float>> durationMs_;
};

// A send or recv a bridge path posted (NativePath, GlooPath): its future
// completes with the tensors once the transfer is done, or fails worded as
// the frontend words it; `help` is what a waiting thread runs first
// (GroupCommWork's help).
struct PostedTransfer {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::function<void()> help;
};

// One future for the ops of a coalesced batch: it completes once all of
// theirs have, with all their output tensors in issue order, or fails with the
// first failure among them.
c10::intrusive_ptr<c10::ivalue::Future> allOf(const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures);

} // namespace groupcomm
