#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace groupcomm {

// Waits for c10d works (gloo's) on the caller's thread until they complete or
// abort() is called, so that gloo's own threads never need the GIL: a Python
// that finalizes after the wait returned ends a thread that asks for it
// mid-frame, and the process aborts. Two things would make them ask:
// - a Python callback on the work's future: the wake-up here is C++;
// - dropping the last reference to the work, whose tensors have Python
//   wrappers (dropping a tensor's second-to-last reference releases its
//   wrapper): keep() holds every work until gloo is done with it, and drops
//   it on a thread that holds the GIL.
class AbortableWait {
 public:
  AbortableWait() = default;
  AbortableWait(const AbortableWait&) = delete;
  AbortableWait& operator=(const AbortableWait&) = delete;
  // Drops the kept works that gloo gave back within a moment; leaks the
  // others (an op an abort left running), which gloo may still be using.
  // Needs the GIL.
  ~AbortableWait();

  // Keeps ``work`` until no one else (gloo's threads) refers to it, and drops
  // the kept works that only this waiter refers to any more. Needs the GIL.
  void keep(c10::intrusive_ptr<c10d::Work> work);
  // Drops every kept work now, for a caller that knows gloo is done with
  // them: a kept work holds its group's gloo context, and so its
  // connections, open. Needs the GIL.
  void forget() {
    kept_.clear();
  }
  // true once the work's future completed, false when abort() came first
  // (abort is final: later waits return false unless already completed);
  // raises the work's failure, as Work::wait() would. Called without the GIL.
  bool wait(const c10::intrusive_ptr<c10d::Work>& work);
  void abort();
  // Whether a wait returned before its work completed: gloo may still be
  // running that op, and freeing its group would wait for the op's end.
  bool cutShort() const {
    return cutShort_.load(std::memory_order_acquire);
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool aborted = false;
  };
  // Shared with the callbacks, which may run after this waiter is gone.
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::vector<c10::intrusive_ptr<c10d::Work>> kept_;
  std::atomic<bool> cutShort_{false};
};

} // namespace groupcomm
