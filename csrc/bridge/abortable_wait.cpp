#include "bridge/abortable_wait.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace groupcomm {

AbortableWait::~AbortableWait() {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  for (auto& work : kept_) {
    while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (work.use_count() > 1) {
      work.release(); // gloo's thread would drop it last
    }
  }
}

void AbortableWait::keep(c10::intrusive_ptr<c10d::Work> work) {
  kept_.erase(
      std::remove_if(kept_.begin(), kept_.end(), [](const auto& w) { return w.use_count() == 1; }), kept_.end());
  kept_.push_back(std::move(work));
}

bool AbortableWait::wait(const c10::intrusive_ptr<c10d::Work>& work) {
  auto future = work->getFuture();
  if (!future->completed()) {
    future->addCallback([state = state_](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> lock(state->mu);
      }
      state->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return future->completed() || state_->aborted; });
    if (!future->completed()) {
      cutShort_.store(true, std::memory_order_release);
      return false;
    }
  }
  // The future completes before the work does: Work::wait() here would
  // often sleep a second time, until gloo's thread marks the work done.
  if (future->hasError()) {
    std::rethrow_exception(future->exception_ptr());
  }
  return true;
}

void AbortableWait::abort() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->aborted = true;
  }
  state_->cv.notify_all();
}

} // namespace groupcomm
