#include "ops/registry.h"

namespace groupcomm {

OpsRegistry& OpsRegistry::instance() {
  static OpsRegistry* registry = new OpsRegistry(); // outlives static destructors
  return *registry;
}

void OpsRegistry::publish(const std::string& name, OpsGroup group) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_[name] = std::move(group);
}

void OpsRegistry::withdraw(const std::string& name, const std::shared_ptr<OpQueue>& queue) {
  OpsGroup gone; // released outside the lock
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = groups_.find(name);
  if (found != groups_.end() && found->second.queue == queue) {
    gone = std::move(found->second);
    groups_.erase(found);
  }
}

OpsGroup OpsRegistry::find(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = groups_.find(name);
  return found == groups_.end() ? OpsGroup{} : found->second;
}

} // namespace groupcomm
