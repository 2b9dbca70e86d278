#include "queue/op_queue.h"

#include <pthread.h>
#include <sched.h>

#include <stdexcept>

#include <Python.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

namespace groupcomm {

OpQueue::OpQueue(std::string name) : name_(std::move(name)) {}

OpQueue::~OpQueue() {
  // The worker keeps the queue alive until it stops, so it is done (or was
  // never started) here; it may be the thread dropping the last reference.
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }
}

void OpQueue::waitUntil(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready) {
  while (!ready()) {
    if (!(Py_IsInitialized() && PyGILState_Check())) {
      changed_.wait(lock, ready);
      continue;
    }
    // A Python task on another thread may need the GIL to finish; the GIL
    // is taken back before the lock (the order every thread keeps).
    lock.unlock();
    {
      pybind11::gil_scoped_release release;
      std::unique_lock<std::mutex> waiting(mutex_);
      changed_.wait(waiting, ready);
    }
    lock.lock();
  }
}

OpQueue::Ticket OpQueue::post(Task task) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) {
    throw std::runtime_error("groupcomm: group " + name_ + " is shut down");
  }
  pending_.push_back(std::move(task));
  const Ticket ticket = ++posted_;
  if (!worker_.joinable()) {
    worker_ = std::thread(&OpQueue::work, this, shared_from_this());
  }
  lock.unlock();
  work_.notify_one();
  return ticket;
}

void OpQueue::runFirst(std::unique_lock<std::mutex>& lock) {
  Task task = std::move(pending_.front());
  pending_.pop_front();
  running_ = true;
  lock.unlock();
  try {
    task();
  } catch (const std::exception& error) {
    // Tasks report their own failures; this one escaped, and the queue
    // must go on.
    TORCH_WARN("groupcomm: an op of group ", name_, " failed outside its Work: ", error.what());
  }
  task = nullptr; // what it holds is released outside the lock
  lock.lock();
  ++finished_;
  released();
}

void OpQueue::released() {
  running_ = false;
  changed_.notify_all();
  if (!pending_.empty() || closed_) {
    work_.notify_one(); // a task to take, or a closed queue to leave
  }
}

void OpQueue::help(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (finished_ < ticket) {
    waitUntil(lock, [&] { return finished_ >= ticket || (!running_ && !pending_.empty()); });
    if (finished_ < ticket) {
      runFirst(lock);
    }
  }
}

bool OpQueue::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.empty() && !running_;
}

void OpQueue::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  waitUntil(lock, [&] { return finished_ == posted_; });
}

void OpQueue::close(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  closed_ = true;
  work_.notify_one();
  if (!worker_.joinable() || worker_.get_id() == std::this_thread::get_id()) {
    return;
  }
  // A worker still busy after `timeout` (a hung op) ends on its own once
  // the op times out.
  auto done = [&] { return workerDone_; };
  if (Py_IsInitialized() && PyGILState_Check()) {
    lock.unlock();
    pybind11::gil_scoped_release release;
    std::unique_lock<std::mutex> waiting(mutex_);
    changed_.wait_for(waiting, timeout, done);
  } else {
    changed_.wait_for(lock, timeout, done);
  }
}

OpQueue::Exclusive::Exclusive(OpQueue& queue) : queue_(queue) {
  std::unique_lock<std::mutex> lock(queue_.mutex_);
  queue_.waitUntil(lock, [&] { return queue_.pending_.empty() && !queue_.running_; });
  queue_.running_ = true;
}

OpQueue::Exclusive::~Exclusive() {
  std::lock_guard<std::mutex> lock(queue_.mutex_);
  queue_.released();
}

void OpQueue::work(std::shared_ptr<OpQueue> self) {
  const std::string title = ("gc-" + name_).substr(0, 15);
  pthread_setname_np(pthread_self(), title.c_str());
  // Woken by a post, the worker does not preempt the thread that posted:
  // that thread may wait for the op next and run it itself (help), or
  // go on computing (DDP's backward) while the worker runs when its turn
  // comes.
  sched_param param{};
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [&] { return (!running_ && !pending_.empty()) || (closed_ && pending_.empty() && !running_); });
    if (pending_.empty()) {
      break; // closed and drained
    }
    runFirst(lock);
  }
  workerDone_ = true;
  lock.unlock();
  changed_.notify_all();
  self.reset(); // may destroy the queue: nothing of it is touched after this
}

} // namespace groupcomm
