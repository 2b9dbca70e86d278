#include <torch/python.h>

#include "bindings.h"
#include "queue/op_queue.h"

#include <atomic>
#include <chrono>
#include <thread>

namespace py = pybind11;

namespace groupcomm {
namespace {

bool interpreterAlive() {
  return Py_IsInitialized() && !_Py_IsFinalizing();
}

// Once the interpreter starts to exit, no queue thread may begin to take the
// GIL: a C++ thread that asks for it after finalization began is ended by
// Python in the middle of its frames (pthread_exit), which aborts the
// process. At exit (an atexit hook, before finalization) the gate closes and
// waits for the calls already inside.
struct PythonGate {
  std::atomic<bool> closed{false};
  std::atomic<int> inside{0};
};

PythonGate& gate() {
  static PythonGate* instance = new PythonGate(); // outlives static destructors
  return *instance;
}

// Holds the gate open for one call; false when it is closed.
class GateEntry {
 public:
  GateEntry() {
    gate().inside.fetch_add(1);
    open_ = !gate().closed.load() && interpreterAlive();
  }
  ~GateEntry() {
    gate().inside.fetch_sub(1);
  }
  explicit operator bool() const {
    return open_;
  }

 private:
  bool open_;
};

void closeGate() {
  gate().closed.store(true);
  py::gil_scoped_release release; // the calls inside may be waiting for the GIL
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (gate().inside.load() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// A Python task and the torch Future it completes. Both references are
// dropped with the GIL held; a task that never ran (the interpreter went
// away) leaks them rather than touching a dead interpreter.
class PythonCall {
 public:
  PythonCall(py::object task, py::object future) : task_(std::move(task)), future_(std::move(future)) {}
  ~PythonCall() {
    if (!task_ && !future_) {
      return;
    }
    GateEntry entry;
    if (!entry) {
      task_.release();
      future_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    task_ = py::object();
    future_ = py::object();
  }

  // The value (None becomes []) or the exception goes to the future, as
  // torch.futures.Future takes them.
  void operator()() {
    GateEntry entry;
    if (!entry) {
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      py::object result = task_();
      future_.attr("set_result")(result.is_none() ? py::list() : result);
    } catch (py::error_already_set& failure) {
      try {
        future_.attr("set_exception")(failure.value());
      } catch (py::error_already_set& again) {
        again.discard_as_unraisable("groupcomm: completing a queued op");
      }
    }
    task_ = py::object();
    future_ = py::object();
  }

 private:
  py::object task_;
  py::object future_;
};

py::object futureType() {
  static py::handle type = py::object(py::module_::import("torch.futures").attr("Future")).release();
  return py::reinterpret_borrow<py::object>(type);
}

} // namespace

void registerQueue(py::module_& m) {
  py::module_::import("atexit").attr("register")(py::cpp_function(&closeGate));
  py::class_<OpQueue, std::shared_ptr<OpQueue>>(
      m, "OpQueue",
      "A group's ordered executor: ops run one at a time in issue order, the "
      "C++ bridge's native ops and Python tasks in one queue (csrc/queue/op_queue.h).")
      .def(py::init<std::string>(), py::arg("name"))
      .def(
          "submit",
          [](const std::shared_ptr<OpQueue>& queue, py::function task, bool asyncOp) -> py::object {
            if (!asyncOp) {
              OpQueue::Exclusive hold(*queue);
              py::object result = task();
              return result.is_none() ? py::list() : result;
            }
            py::object future = futureType()();
            auto call = std::make_shared<PythonCall>(std::move(task), future);
            queue->post([call] { (*call)(); });
            return future;
          },
          py::arg("task"), py::arg("async_op") = true,
          "Run `task` after everything submitted before it. Asynchronously: return a "
          "torch Future that gets its value (None becomes []) or its exception. "
          "Otherwise: run it on this thread and return its value.")
      .def(
          "run",
          [](OpQueue& queue, py::function task, py::args args) -> py::object {
            OpQueue::Exclusive hold(queue);
            return task(*args);
          },
          py::arg("task"), "Run `task(*args)` on this thread after everything submitted before it; return its value.")
      .def("idle", &OpQueue::idle, "Whether nothing is queued or running.")
      .def("drain", &OpQueue::drain, "Block until every submitted task has finished.")
      .def(
          "close",
          [](OpQueue& queue, double timeout) {
            queue.close(std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
          },
          py::arg("timeout") = 5.0, "Finish queued tasks, then stop the worker thread.")
      .def_property_readonly("name", &OpQueue::name);
}

} // namespace groupcomm
