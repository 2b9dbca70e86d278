#pragma once

// Waiting and liveness helpers shared by the shared-memory transports.

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace groupcomm {

// Pids are only comparable within one pid namespace: 0 when unknown.
inline uint64_t currentPidNamespace() {
  struct stat st{};
  if (stat("/proc/self/ns/pid", &st) != 0) {
    return 0;
  }
  return static_cast<uint64_t>(st.st_ino);
}

// A process that exited but was not reaped yet (a zombie) still answers
// kill(pid, 0), so its state is read as well.
inline bool processGone(int32_t pid) {
  if (kill(pid, 0) != 0) {
    return errno == ESRCH;
  }
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) {
    return false;
  }
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')'); // the name may hold spaces
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

inline void futexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ms) {
  struct timespec ts{};
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Busy-waits until ready() or the clock passes `end`; true if ready. ready()
// is polled after every pause: a pause costs ~25 ns on current x86 cores,
// and the peer's store arrives in ~250 ns, so polling after a batch of them
// made every wait up to a few microseconds too long. The clock is read
// every few polls only (it costs about as much as a pause).
template <typename Ready>
bool spinUntil(Ready ready, std::chrono::steady_clock::time_point end) {
  while (true) {
    for (int i = 0; i < 16; ++i) {
      if (ready()) {
        return true;
      }
      cpuRelax();
    }
    if (std::chrono::steady_clock::now() >= end) {
      return ready();
    }
  }
}

} // namespace groupcomm
