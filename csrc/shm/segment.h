#pragma once

#include <cstddef>
#include <string>

namespace groupcomm {

// Maps the POSIX shared-memory segment `name` of exactly `bytes` bytes,
// read-write and shared. The creator makes it (mode 0600, failing if the name
// exists) and reserves its pages, so that a /dev/shm too small fails here
// rather than with SIGBUS mid-collective; a creator that fails removes the
// name again. An attacher checks the size. Throws std::runtime_error naming
// the segment and the system error.
char* mapSegment(const std::string& name, size_t bytes, bool create);

// Removes the name (a peer may have removed it already); mappings stay valid.
void unlinkSegment(const std::string& name);

} // namespace groupcomm
