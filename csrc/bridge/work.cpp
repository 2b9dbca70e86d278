#include "bridge/work.h"
#include "bindings.h"
#include "comm_failure.h"

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace groupcomm {

GroupCommWork::GroupCommWork(
    c10::intrusive_ptr<c10::ivalue::Future> future,
    c10d::OpType opType,
    std::optional<int> sourceRank,
    std::function<void()> help)
    : c10d::Work(-1, opType),
      future_(std::move(future)),
      sourceRank_(sourceRank),
      help_(std::move(help)) {}

bool GroupCommWork::isCompleted() {
  return future_->completed();
}

bool GroupCommWork::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr GroupCommWork::exception() const {
  return future_->completed() ? future_->exception_ptr() : nullptr;
}

int GroupCommWork::sourceRank() const {
  TORCH_CHECK(
      sourceRank_.has_value(),
      "sourceRank() is only valid for a recv from any source");
  return *sourceRank_;
}

std::vector<at::Tensor> GroupCommWork::result() {
  return future_->value().toTensorVector();
}

bool GroupCommWork::wait(std::chrono::milliseconds /*timeout*/) {
  // The op may be finishing on a Python thread, so never block while holding
  // the GIL. The group's own timeout bounds how long the op itself can take.
  auto waitForOp = [this] {
    if (help_ && !future_->completed()) {
      help_();
    }
    future_->wait();
  };
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release release;
    waitForOp();
  } else {
    waitForOp();
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
  wait();
  // The current streams now wait for the op; block the host until they are done.
  for (const c10::Device& device : future_->devices()) {
    c10::impl::VirtualGuardImpl guard(device.type());
    guard.getStream(device).synchronize();
  }
}

c10::intrusive_ptr<c10::ivalue::Future> GroupCommWork::getFuture() {
  return future_;
}

} // namespace groupcomm
