#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "queue/op_queue.h"
#include "shm/group.h"

namespace groupcomm {

// What the custom ops (ops/kernels.cpp) run a group's call on, found by the
// group's unique name: the shared-memory engine of its CPU communicator and
// the group's op queue, so a call runs in order with the group's queued c10d
// work. The coordinator publishes a group once its CPU communicator is built
// and has such an engine (GroupCoordinator.communicator_for), and withdraws
// it when the group is renamed or destroyed; a group not published here
// takes the coordinator's Python path.
struct OpsGroup {
  std::shared_ptr<ShmGroup> engine;
  std::shared_ptr<OpQueue> queue;
};

class OpsRegistry {
 public:
  static OpsRegistry& instance();

  // `name` now runs on `group` (replacing what it ran on before).
  void publish(const std::string& name, OpsGroup group);
  // Forgets `name` if it still runs in `queue` (a newer group of that name stays).
  void withdraw(const std::string& name, const std::shared_ptr<OpQueue>& queue);
  // The group published as `name`; its engine is null when there is none.
  OpsGroup find(const std::string& name);

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, OpsGroup> groups_;
};

} // namespace groupcomm
