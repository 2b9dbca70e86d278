#pragma once

#include <sys/types.h>

#include <cstddef>

namespace groupcomm {

// Copies `len` bytes at `remote` in process `pid` to `local` with one kernel
// copy (process_vm_readv, "cross-memory attach"), where going through shared
// memory costs two. Returns false, with errno set, when the kernel refuses
// (no such process, no permission to trace it, a bad remote address).
bool readPeerMemory(pid_t pid, const void* remote, void* local, size_t len);

} // namespace groupcomm
