#include "shm/peer_memory.h"

#include <sys/uio.h>

#include <cerrno>

namespace groupcomm {

bool readPeerMemory(pid_t pid, const void* remote, void* local, size_t len) {
  auto* to = static_cast<char*>(local);
  auto* from = static_cast<const char*>(remote);
  while (len > 0) {
    iovec here{to, len};
    iovec there{const_cast<char*>(from), len};
    const ssize_t got = process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      return false;
    }
    if (got == 0) {
      errno = EFAULT;
      return false;
    }
    to += got;
    from += got;
    len -= static_cast<size_t>(got);
  }
  return true;
}

} // namespace groupcomm
