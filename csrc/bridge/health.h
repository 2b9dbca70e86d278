#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/version.h>

// c10d's abort hooks and gather_single came with torch 2.14, its completion
// hooks with 2.15.
#define GROUPCOMM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace groupcomm {

// One group's state as c10d asks for it: whether it has failed (getError),
// who to tell when it does (abort hooks) and who to tell when an op finishes
// (completion hooks, which the flight recorder retires its entries with).
// Failures are reported by whichever path saw them: the native path in C++,
// the Python frontend through the callable the bridge hands it.
class GroupHealth {
 public:
  using AbortHook = std::function<void()>;
  // (the Work's completion key, its duration in ms when timing is on)
  using CompletionHook = std::function<void(uint64_t, std::optional<float>)>;

  // The group's first failure sets getError's answer and runs the abort hooks
  // (outside the hooks' lock, as c10d asks); later ones change nothing.
  void failed(bool timedOut);
  c10d::ErrorType error() const {
    return static_cast<c10d::ErrorType>(error_.load(std::memory_order_acquire));
  }

  void addAbortHook(int64_t id, AbortHook hook);
  void removeAbortHook(int64_t id);

  void addCompletionHook(int64_t id, CompletionHook hook);
  void removeCompletionHook(int64_t id);
  // Whether anybody listens: Works are followed only then.
  bool followsCompletion() const {
    return followed_.load(std::memory_order_acquire);
  }
  void completed(uint64_t key, std::optional<float> durationMs);

  // The health of the group formed anew (dist._reconfigure): no failure
  // yet, the same hooks.
  std::shared_ptr<GroupHealth> renewed() const;

 private:
  // Hooks change rarely and are read per op: readers take the current map
  // under the lock and call it outside; writers replace it with a new one.
  template <typename Hook>
  using Hooks = std::shared_ptr<const std::map<int64_t, Hook>>;

  template <typename Hook>
  Hooks<Hook> current(const Hooks<Hook>& hooks) const;
  template <typename Hook, typename Change>
  void change(Hooks<Hook>& hooks, Change edit);

  std::atomic<int> error_{static_cast<int>(c10d::ErrorType::SUCCESS)};
  std::atomic<bool> followed_{false};
  mutable std::mutex mutex_;
  Hooks<AbortHook> abortHooks_ = std::make_shared<const std::map<int64_t, AbortHook>>();
  Hooks<CompletionHook> completionHooks_ = std::make_shared<const std::map<int64_t, CompletionHook>>();
};

} // namespace groupcomm
