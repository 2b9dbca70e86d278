#include "bridge/work.h"
#include "bindings.h"
#include "comm_failure.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace groupcomm {

GroupCommWork::GroupCommWork(
    c10::intrusive_ptr<c10::ivalue::Future> future,
    c10d::OpType opType,
    std::shared_ptr<const std::string> group,
    std::optional<int> sourceRank,
    std::function<void()> help)
    : c10d::Work(-1, opType),
      future_(std::move(future)),
      group_(std::move(group)),
      sourceRank_(sourceRank),
      help_(std::move(help)) {}

GroupCommWork::GroupCommWork(
    std::vector<at::Tensor> outputs,
    c10d::OpType opType,
    std::shared_ptr<const std::string> group,
    std::optional<int> sourceRank)
    : c10d::Work(-1, opType),
      done_(true),
      outputs_(std::move(outputs)),
      group_(std::move(group)),
      sourceRank_(sourceRank) {}

bool GroupCommWork::isCompleted() {
  return done_ || future_->completed();
}

bool GroupCommWork::isSuccess() const {
  return done_ || (future_->completed() && !future_->hasError());
}

std::exception_ptr GroupCommWork::exception() const {
  return !done_ && future_->completed() ? future_->exception_ptr() : nullptr;
}

int GroupCommWork::sourceRank() const {
  TORCH_CHECK(sourceRank_.has_value(), "sourceRank() is only valid for a recv from any source");
  return *sourceRank_;
}

std::vector<at::Tensor> GroupCommWork::result() {
  return done_ ? outputs_ : future_->value().toTensorVector();
}

bool GroupCommWork::completesWithin(std::chrono::milliseconds timeout) {
  if (future_->completed()) {
    return true;
  }
  struct Done {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  future_->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mutex);
    done->done = true;
    done->changed.notify_all();
  });
  std::unique_lock<std::mutex> lock(done->mutex);
  return done->changed.wait_for(lock, timeout, [&] { return done->done; });
}

bool GroupCommWork::wait(std::chrono::milliseconds timeout) {
  if (done_) {
    return true;
  }
  // The op may be finishing on a Python thread, so never block while holding
  // the GIL. The group's own timeout bounds how long the op itself can take;
  // a caller's timeout only bounds this wait (the op is then left to the
  // queue's thread rather than run here).
  const bool bounded = timeout != kNoTimeout;
  auto waitForOp = [&] {
    if (bounded) {
      if (!completesWithin(timeout)) {
        return false;
      }
    } else if (help_ && !future_->completed()) {
      help_();
    }
    future_->wait();
    return true;
  };
  bool completed = false;
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release release;
    completed = waitForOp();
  } else {
    completed = waitForOp();
  }
  if (!completed) {
    std::string op = c10d::opTypeToString(retrieveOpType());
    std::transform(op.begin(), op.end(), op.begin(), [](unsigned char c) { return std::tolower(c); });
    throwInPython(CommFailure(
        "groupcomm: " + op + " on " + *group_ + " hit Work.wait's timeout of " + std::to_string(timeout.count()) +
            " ms before completing (it goes on; wait() again for its result)",
        true, op));
  }
  if (future_->hasError()) {
    try {
      std::rethrow_exception(future_->exception_ptr());
    } catch (const CommFailure& failure) {
      throwInPython(failure);
    }
  }
  return true;
}

void GroupCommWork::synchronize() {
  if (done_) {
    return; // nothing left running, on the host or on a device
  }
  wait();
  // The current streams now wait for the op; block the host until they are done.
  for (const c10::Device& device : getFuture()->devices()) {
    c10::impl::VirtualGuardImpl guard(device.type());
    guard.getStream(device).synchronize();
  }
}

c10::intrusive_ptr<c10::ivalue::Future> GroupCommWork::getFuture() {
  if (done_) {
    std::call_once(futureMade_, [this] {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      future_->markCompleted(c10::IValue(outputs_));
    });
  }
  return future_;
}

void GroupCommWork::follow(
    const std::shared_ptr<GroupHealth>& health,
    std::optional<std::chrono::steady_clock::time_point> start) {
  // Keys are never reused: the callback may fire after this Work is gone.
  static std::atomic<uint64_t> nextKey{1};
  key_ = nextKey.fetch_add(1, std::memory_order_relaxed);
  if (start) {
    durationMs_ = std::make_shared<std::atomic<float>>(-1.0f);
  }
  auto finished = [health, start, key = key_, duration = durationMs_] {
    std::optional<float> ms;
    if (start) {
      ms = std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - *start).count();
      duration->store(*ms, std::memory_order_release);
    }
    if (health->followsCompletion()) {
      health->completed(key, ms);
    }
  };
  if (done_) {
    finished(); // a synchronous op: no future to make just for this
    return;
  }
  future_->addCallback([finished = std::move(finished)](c10::ivalue::Future& done) {
    if (!done.hasError()) { // c10d: failed work fires no completion
      finished();
    }
  });
}

float GroupCommWork::getDuration() const {
  TORCH_CHECK(
      durationMs_ != nullptr,
      "groupcomm: Work.get_duration() needs collectives timing, turned on before the op "
      "(ProcessGroup._enable_collectives_timing)");
  TORCH_CHECK(isSuccess(), "groupcomm: Work.get_duration() of an op that has not completed successfully");
  // A waiter can wake before the future's callbacks ran; the one measuring
  // the op is running now.
  float ms = durationMs_->load(std::memory_order_acquire);
  while (ms < 0) {
    std::this_thread::yield();
    ms = durationMs_->load(std::memory_order_acquire);
  }
  return ms;
}

c10::intrusive_ptr<c10::ivalue::Future> allOf(const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures) {
  auto tensorList = c10::ListType::ofTensors();
  auto all = futures.empty() ? c10::make_intrusive<c10::ivalue::Future>(tensorList)
                             : futures.front()->createInstance(tensorList);
  if (futures.empty()) {
    all->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    return all;
  }
  auto left = std::make_shared<std::atomic<size_t>>(futures.size());
  for (const auto& future : futures) {
    future->addCallback([all, left, futures](c10::ivalue::Future&) {
      if (left->fetch_sub(1, std::memory_order_acq_rel) != 1) {
        return;
      }
      std::vector<at::Tensor> outputs;
      for (const auto& done : futures) {
        if (done->hasError()) {
          all->setError(done->exception_ptr());
          return;
        }
        for (const at::Tensor& t : done->constValue().toTensorVector()) {
          outputs.push_back(t);
        }
      }
      all->markCompleted(c10::IValue(std::move(outputs)));
    });
  }
  return all;
}

} // namespace groupcomm
