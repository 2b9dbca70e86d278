#pragma once

#include <stdexcept>
#include <string>

namespace groupcomm {

// A failed transfer, raised in Python as torch_groupcomm.errors'
// CommTimeoutError when it timed out and GroupCommError otherwise.
class CommFailure : public std::runtime_error {
 public:
  CommFailure(const std::string& what, bool timedOut)
      : std::runtime_error(what), timedOut_(timedOut) {}
  bool timedOut() const {
    return timedOut_;
  }

 private:
  bool timedOut_;
};

} // namespace groupcomm
