#pragma once

#include <exception>
#include <string>
#include <utility>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "bindings.h"
#include "bridge/health.h"
#include "comm_failure.h"
#include "queue/op_queue.h"

// How the bridge's C++ paths (native.h, gloo_path.h) run an op they planned:
// in the group's op queue, now on the caller's thread or queued with a
// future, its failure worded as the Python frontend words it.
namespace groupcomm {

// Runs `run()`; its failure is rethrown as a CommFailure worded as the
// frontend words it (Submission._where / _reraise): op `label` on `where`
// ("group '<name>' (rank r of n)"), timed out if the failure says so
// (`timedOutText` reads the words of an error another library threw).
// `health` hears of it.
template <typename Run, typename TimedOutText>
void runWorded(
    const char* label,
    const std::string& where,
    GroupHealth& health,
    Run&& run,
    TimedOutText&& timedOutText) {
  std::string why;
  bool timedOut = false;
  try {
    run();
    return;
  } catch (const CommFailure& failure) {
    why = failure.what();
    timedOut = failure.timedOut();
  } catch (const std::exception& error) {
    why = error.what();
    timedOut = timedOutText(why);
  }
  const std::string prefix = std::string("groupcomm: ") + label + " on " + where;
  health.failed(timedOut);
  throw CommFailure(
      timedOut ? prefix + " hit its timeout before completing (" + why + ")" : prefix + " failed: " + why, timedOut,
      label);
}

// Runs `execute()` on this thread once the queue's earlier ops are done; a
// CommFailure it throws is raised in Python.
template <typename Execute>
void runExclusive(OpQueue& queue, Execute&& execute) {
  try {
    OpQueue::Exclusive hold(queue);
    execute();
  } catch (const CommFailure& failure) {
    throwInPython(failure);
  }
}

// Queues `op` behind the queue's earlier ops: `execute(op)` runs on the
// queue's thread, then `future` completes with op.outputs or its failure.
// `execute` holds what the op needs alive (its path: the group may be
// destroyed meanwhile).
template <typename Op, typename Execute>
OpQueue::Ticket postCompleting(OpQueue& queue, Op op, c10::intrusive_ptr<c10::ivalue::Future> future, Execute execute) {
  return queue.post([op = std::move(op), future = std::move(future), execute = std::move(execute)]() mutable {
    std::exception_ptr failure;
    try {
      execute(op);
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
    // The future's callbacks (DDP's, torch's) run here; one that throws
    // must not take the queue's thread down.
    try {
      if (failure) {
        future->setError(failure);
      } else {
        future->markCompleted(c10::IValue(op.outputs));
      }
    } catch (const std::exception& error) {
      TORCH_WARN("groupcomm: a callback of ", op.label, "'s future failed: ", error.what());
    }
  });
}

} // namespace groupcomm
