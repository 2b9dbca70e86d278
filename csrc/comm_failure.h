#pragma once

#include <stdexcept>
#include <string>

namespace groupcomm {

// A failed transfer, raised in Python as torch_groupcomm.errors'
// CommTimeoutError when it timed out and GroupCommError otherwise; `op` is
// the c10d op it failed (GroupCommError.op), when known.
class CommFailure : public std::runtime_error {
 public:
  CommFailure(const std::string& what, bool timedOut, std::string op = {})
      : std::runtime_error(what), timedOut_(timedOut), op_(std::move(op)) {}
  bool timedOut() const {
    return timedOut_;
  }
  const std::string& op() const {
    return op_;
  }

 private:
  bool timedOut_;
  std::string op_;
};

} // namespace groupcomm
