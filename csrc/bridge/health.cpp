#include "bridge/health.h"

#include <vector>

#include <c10/util/Exception.h>

namespace groupcomm {

void GroupHealth::failed(bool timedOut) {
  int expected = static_cast<int>(c10d::ErrorType::SUCCESS);
  const int now = static_cast<int>(timedOut ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR);
  if (!error_.compare_exchange_strong(expected, now, std::memory_order_acq_rel)) {
    return;
  }
  std::vector<AbortHook> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& entry : abortHooks_) {
      hooks.push_back(entry.second);
    }
  }
  for (const auto& hook : hooks) {
    try {
      hook();
    } catch (const std::exception& error) {
      TORCH_WARN("groupcomm: an abort hook failed: ", error.what());
    }
  }
}

void GroupHealth::addAbortHook(int64_t id, AbortHook hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  abortHooks_[id] = std::move(hook);
}

void GroupHealth::removeAbortHook(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  abortHooks_.erase(id);
}

void GroupHealth::addCompletionHook(int64_t id, CompletionHook hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  completionHooks_[id] = std::move(hook);
  followed_.store(true, std::memory_order_release);
}

void GroupHealth::removeCompletionHook(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  completionHooks_.erase(id);
  followed_.store(!completionHooks_.empty(), std::memory_order_release);
}

void GroupHealth::completed(uint64_t key, std::optional<float> durationMs) {
  std::vector<CompletionHook> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& entry : completionHooks_) {
      hooks.push_back(entry.second);
    }
  }
  for (const auto& hook : hooks) {
    hook(key, durationMs);
  }
}

} // namespace groupcomm
