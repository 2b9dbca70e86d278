#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace groupcomm {

char* mapSegment(const std::string& name, size_t bytes, bool create) {
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    throw std::runtime_error("groupcomm: cannot open shared memory " + name + ": " + std::strerror(errno));
  }
  auto fail = [&](const std::string& what, int err) {
    close(fd);
    if (create) {
      shm_unlink(name.c_str());
    }
    std::string message = "groupcomm: " + what + " " + name;
    throw std::runtime_error(err != 0 ? message + ": " + std::strerror(err) : message);
  };
  if (create) {
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      fail("cannot size shared memory", errno);
    }
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      fail("cannot reserve " + std::to_string(bytes) + " bytes of shared memory for", rc);
    }
  } else {
    struct stat st{};
    if (fstat(fd, &st) != 0) {
      fail("cannot stat shared memory", errno);
    }
    if (static_cast<size_t>(st.st_size) != bytes) {
      fail(
          "unexpected size (" + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes) +
              ") of shared memory",
          0);
    }
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    fail("cannot map shared memory", errno);
  }
  close(fd);
  return static_cast<char*>(mapped);
}

void unlinkSegment(const std::string& name) {
  shm_unlink(name.c_str()); // ENOENT: a peer got there first
}

} // namespace groupcomm
