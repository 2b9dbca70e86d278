#include "bridge/health.h"

#include <c10/util/Exception.h>

namespace groupcomm {

template <typename Hook>
GroupHealth::Hooks<Hook> GroupHealth::current(const Hooks<Hook>& hooks) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hooks;
}

template <typename Hook, typename Change>
void GroupHealth::change(Hooks<Hook>& hooks, Change edit) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto next = std::make_shared<std::map<int64_t, Hook>>(*hooks);
  edit(*next);
  hooks = std::move(next);
}

void GroupHealth::failed(bool timedOut) {
  int expected = static_cast<int>(c10d::ErrorType::SUCCESS);
  const int now = static_cast<int>(timedOut ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR);
  if (!error_.compare_exchange_strong(expected, now, std::memory_order_acq_rel)) {
    return;
  }
  for (const auto& entry : *current(abortHooks_)) {
    try {
      entry.second();
    } catch (const std::exception& error) {
      TORCH_WARN("groupcomm: an abort hook failed: ", error.what());
    }
  }
}

void GroupHealth::addAbortHook(int64_t id, AbortHook hook) {
  change(abortHooks_, [&](auto& hooks) { hooks[id] = std::move(hook); });
}

void GroupHealth::removeAbortHook(int64_t id) {
  change(abortHooks_, [&](auto& hooks) { hooks.erase(id); });
}

void GroupHealth::addCompletionHook(int64_t id, CompletionHook hook) {
  change(completionHooks_, [&](auto& hooks) {
    hooks[id] = std::move(hook);
    followed_.store(true, std::memory_order_release);
  });
}

void GroupHealth::removeCompletionHook(int64_t id) {
  change(completionHooks_, [&](auto& hooks) {
    hooks.erase(id);
    followed_.store(!hooks.empty(), std::memory_order_release);
  });
}

void GroupHealth::completed(uint64_t key, std::optional<float> durationMs) {
  for (const auto& entry : *current(completionHooks_)) {
    entry.second(key, durationMs);
  }
}

std::shared_ptr<GroupHealth> GroupHealth::renewed() const {
  auto next = std::make_shared<GroupHealth>();
  std::lock_guard<std::mutex> lock(mutex_);
  next->abortHooks_ = abortHooks_;
  next->completionHooks_ = completionHooks_;
  next->followed_.store(followed_.load(std::memory_order_acquire), std::memory_order_release);
  return next;
}

} // namespace groupcomm
