#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace groupcomm {

// A group's ordered executor: its ops run one at a time, in issue order.
//
// Every rank issues a group's collectives in the same order; running them in
// that order keeps the ranks matched while callers go on (async_op=True).
// One queue holds both kinds of task: the C++ bridge's native ops, which run
// without the GIL, and the Python frontend's ops, which take it (see
// queue/bindings.cpp), so issue order across both is kept.
//
// Tasks run on a worker thread started on the first post, or on a thread
// that waits for one of them (help): a caller that waits for an op nobody
// has started runs it itself instead of waking the worker and sleeping. A
// synchronous op runs on its caller's thread once everything before it is
// done (Exclusive).
class OpQueue : public std::enable_shared_from_this<OpQueue> {
 public:
  using Ticket = uint64_t;
  // Runs one queued op; must not throw (a task reports its own failure).
  using Task = std::function<void()>;

  explicit OpQueue(std::string name);
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Queues `task` behind everything posted before it; returns its ticket.
  // Throws std::runtime_error once the queue is closed.
  Ticket post(Task task);
  // Returns once the task with `ticket` has run, running queued tasks on this
  // thread while no other thread runs one.
  void help(Ticket ticket);
  // Whether nothing is queued or running.
  bool idle();
  // Blocks until every posted task has finished.
  void drain();
  // Lets queued tasks finish, then stops the worker; gives up waiting for it
  // after `timeout` (a hung op), leaving it to end on its own.
  void close(std::chrono::milliseconds timeout);
  const std::string& name() const {
    return name_;
  }

  // Holds the queue for a synchronous op on this thread: everything posted
  // before has finished and nothing else runs until it is released.
  class Exclusive {
   public:
    explicit Exclusive(OpQueue& queue);
    ~Exclusive();
    Exclusive(const Exclusive&) = delete;
    Exclusive& operator=(const Exclusive&) = delete;

   private:
    OpQueue& queue_;
  };

 private:
  // Waits on changed_ until `ready`, without the GIL if this thread holds it.
  void waitUntil(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready);
  // Pops the first task and runs it with the lock released.
  void runFirst(std::unique_lock<std::mutex>& lock);
  // After a task or an Exclusive holder is done (lock held): whoever waits
  // for that, and the worker if a task is waiting to be taken.
  void released();
  void work(std::shared_ptr<OpQueue> self);

  const std::string name_;
  std::mutex mutex_;
  std::condition_variable work_;    // the worker's: a task may be taken
  std::condition_variable changed_; // everyone else's: a task finished or the queue was released
  std::deque<Task> pending_;
  Ticket posted_ = 0;    // tickets are 1, 2, ...; a task's ticket is posted_ after its post
  Ticket finished_ = 0;  // tasks run in ticket order, so ticket t is done when finished_ >= t
  bool running_ = false; // a task (or an Exclusive holder) is running
  bool closed_ = false;
  bool workerDone_ = false;
  std::thread worker_;
};

} // namespace groupcomm
