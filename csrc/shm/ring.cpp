#include "shm/ring.h"
#include "shm/segment.h"
#include "comm_failure.h"
#include "shm/sync.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace groupcomm {
namespace {

constexpr uint64_t kMagic = 0x67636f6d6d52494eULL; // "gcommRIN"
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
// Sleeps are cut into slices so timeouts and dead peers are noticed.
constexpr int64_t kSleepSliceMs = 50;

enum PeerState : uint32_t { kAbsent = 0, kAttached = 1, kClosed = 2 };

using Clock = std::chrono::steady_clock;

size_t roundUp(size_t value, size_t to) {
  return (value + to - 1) / to * to;
}

} // namespace

struct alignas(kLine) ShmRing::Header {
  uint64_t magic;
  uint64_t nChunks;
  uint64_t chunkBytes;
  uint32_t nReaders;
};

// A futex word one side sleeps on and the count of sleepers; the other side
// bumps the word and wakes only when the count is non-zero.
struct alignas(kLine) ShmRing::Signal {
  std::atomic<uint32_t> word;
  std::atomic<uint32_t> waiters;
};

struct alignas(kLine) ShmRing::Peer {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> state;
  std::atomic<uint64_t> pidNamespace;
};

struct alignas(kLine) ShmRing::ChunkHead {
  std::atomic<uint64_t> seq; // the chunk sequence held, published last
  std::atomic<uint64_t> len; // total length of the message it belongs to
};

// Segment layout: Header | data Signal | free Signal | Peer (writer, then
// readers) | ChunkHead per chunk | read words, one line-aligned array per
// reader | chunk data from a page boundary.
namespace {
constexpr size_t kDataSignal = kLine;
constexpr size_t kFreeSignal = 2 * kLine;
constexpr size_t kPeers = 3 * kLine;
} // namespace

ShmRing::ShmRing(const std::string& name, bool create, int readerIndex, Options options)
    : name_(name), owner_(create), readerIndex_(readerIndex), options_(options) {
  if (options_.nChunks < 1 || options_.chunkBytes < 1 || options_.nReaders < 1) {
    throw std::invalid_argument(
        "groupcomm: a message ring needs at least one chunk, one byte per chunk and one reader");
  }
  if (create ? readerIndex_ != -1 : (readerIndex_ < 0 || readerIndex_ >= options_.nReaders)) {
    throw std::invalid_argument(
        "groupcomm: reader index " + std::to_string(readerIndex_) + " for a ring of " +
        std::to_string(options_.nReaders) + " readers (the writer creates it with -1)");
  }
  options_.chunkBytes = roundUp(options_.chunkBytes, kLine);
  peersOffset_ = kPeers;
  chunkHeadsOffset_ = peersOffset_ + (1 + options_.nReaders) * sizeof(Peer);
  readWordsOffset_ = chunkHeadsOffset_ + options_.nChunks * sizeof(ChunkHead);
  readStride_ = roundUp(options_.nChunks * sizeof(uint64_t), kLine);
  dataOffset_ = roundUp(readWordsOffset_ + options_.nReaders * readStride_, kPage);
  mappedBytes_ = dataOffset_ + options_.nChunks * options_.chunkBytes;

  base_ = mapSegment(name_, mappedBytes_, create);
  pidNamespace_ = currentPidNamespace();

  auto* header = reinterpret_cast<Header*>(base_);
  Peer* me = reinterpret_cast<Peer*>(base_ + peersOffset_) + (readerIndex_ + 1);
  if (create) {
    header->nChunks = options_.nChunks;
    header->chunkBytes = options_.chunkBytes;
    header->nReaders = static_cast<uint32_t>(options_.nReaders);
    __atomic_store_n(&header->magic, kMagic, __ATOMIC_RELEASE);
  } else {
    if (__atomic_load_n(&header->magic, __ATOMIC_ACQUIRE) != kMagic || header->nChunks != options_.nChunks ||
        header->chunkBytes != options_.chunkBytes || header->nReaders != static_cast<uint32_t>(options_.nReaders)) {
      munmap(base_, mappedBytes_);
      base_ = nullptr;
      throw std::runtime_error("groupcomm: shared memory " + name_ + " holds another ring layout");
    }
    if (me->state.load(std::memory_order_acquire) != kAbsent) {
      munmap(base_, mappedBytes_);
      base_ = nullptr;
      throw std::runtime_error(
          "groupcomm: reader " + std::to_string(readerIndex_) + " of " + name_ + " attached twice");
    }
  }
  me->pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  me->pidNamespace.store(pidNamespace_, std::memory_order_relaxed);
  me->state.store(kAttached, std::memory_order_release);
}

ShmRing::~ShmRing() {
  if (owner_) {
    unlink();
  }
  if (base_ != nullptr) {
    Peer* me = reinterpret_cast<Peer*>(base_ + peersOffset_) + (readerIndex_ + 1);
    me->state.store(kClosed, std::memory_order_release);
    // Wake anyone asleep on us so they see the closing now, not a slice later.
    for (size_t at : {kDataSignal, kFreeSignal}) {
      auto* signal = reinterpret_cast<Signal*>(base_ + at);
      signal->word.fetch_add(1, std::memory_order_release);
      futexWakeAll(&signal->word);
    }
    munmap(base_, mappedBytes_);
  }
}

void ShmRing::unlink() {
  if (!unlinked_) {
    unlinked_ = true;
    unlinkSegment(name_);
  }
}

int ShmRing::attachedReaders() const {
  const Peer* readers = reinterpret_cast<const Peer*>(base_ + peersOffset_) + 1;
  int n = 0;
  for (int r = 0; r < options_.nReaders; ++r) {
    n += readers[r].state.load(std::memory_order_acquire) != kAbsent;
  }
  return n;
}

ShmRing::ChunkHead* ShmRing::chunkHead(size_t slot) const {
  return reinterpret_cast<ChunkHead*>(base_ + chunkHeadsOffset_) + slot;
}

std::atomic<uint64_t>* ShmRing::readWord(int reader, size_t slot) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(base_ + readWordsOffset_ + reader * readStride_) + slot;
}

char* ShmRing::chunkData(size_t slot) const {
  return base_ + dataOffset_ + slot * options_.chunkBytes;
}

size_t ShmRing::chunksFor(size_t len) const {
  return len == 0 ? 1 : (len + options_.chunkBytes - 1) / options_.chunkBytes;
}

void ShmRing::checkUsable() const {
  if (broken_) {
    throw CommFailure(
        "groupcomm: message queue " + name_ + " unusable after a failure in the middle of a message", false);
  }
}

bool ShmRing::peerGone(const Peer* peer) const {
  const int32_t pid = peer->pid.load(std::memory_order_relaxed);
  return pid > 0 && peer->pidNamespace.load(std::memory_order_relaxed) == pidNamespace_ && processGone(pid);
}

void ShmRing::peerExited(const std::string& who, int32_t pid) {
  broken_ = true;
  throw CommFailure("groupcomm: message queue " + who + " process " + std::to_string(pid) + " exited", false);
}

bool ShmRing::chunkFree(uint64_t seq) const {
  if (seq <= options_.nChunks) {
    return true;
  }
  const uint64_t previous = seq - options_.nChunks;
  const size_t slot = slotOf(seq);
  for (int r = 0; r < options_.nReaders; ++r) {
    if (readWord(r, slot)->load(std::memory_order_acquire) < previous) {
      return false;
    }
  }
  return true;
}

bool ShmRing::chunkReady(uint64_t seq) const {
  return chunkHead(slotOf(seq))->seq.load(std::memory_order_acquire) == seq;
}

// A waiter registers in `waiters`, then reads the word, then checks its
// condition; a notifier stores its data, then reads `waiters`. The two
// seq_cst fences order these so that either the waiter sees the data or the
// notifier sees the waiter (and bumps the word, so the futex does not sleep).
void ShmRing::publish(uint64_t seq, uint64_t len) {
  ChunkHead* head = chunkHead(slotOf(seq));
  head->len.store(len, std::memory_order_relaxed);
  head->seq.store(seq, std::memory_order_release);
  auto* signal = reinterpret_cast<Signal*>(base_ + kDataSignal);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (signal->waiters.load(std::memory_order_relaxed) != 0) {
    signal->word.fetch_add(1, std::memory_order_release);
    futexWakeAll(&signal->word);
  }
}

void ShmRing::release(uint64_t seq) {
  readWord(readerIndex_, slotOf(seq))->store(seq, std::memory_order_release);
  auto* signal = reinterpret_cast<Signal*>(base_ + kFreeSignal);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (signal->waiters.load(std::memory_order_relaxed) != 0) {
    signal->word.fetch_add(1, std::memory_order_release);
    futexWakeAll(&signal->word);
  }
}

template <typename Ready, typename Check>
void ShmRing::waitOn(Signal* signal, Ready ready, Check check, int64_t timeoutMs, const char* what) {
  if (ready()) {
    return;
  }
  const auto start = Clock::now();
  if (options_.spinUs > 0) {
    if (spinUntil(ready, start + std::chrono::microseconds(options_.spinUs))) {
      return;
    }
  }
  const bool bounded = timeoutMs >= 0;
  const auto deadline = start + std::chrono::milliseconds(bounded ? timeoutMs : 0);
  while (true) {
    int64_t slice = kSleepSliceMs;
    if (bounded) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      slice = std::clamp<int64_t>(left + 1, 1, kSleepSliceMs);
    }
    signal->waiters.fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const uint32_t seen = signal->word.load(std::memory_order_acquire);
    const bool done = ready();
    if (!done) {
      futexWait(&signal->word, seen, slice);
    }
    signal->waiters.fetch_sub(1, std::memory_order_relaxed);
    if (done || ready()) {
      return;
    }
    check();
    // The peer may have delivered and then gone while we looked.
    if (ready()) {
      return;
    }
    if (interruptCheck_ && interruptCheck_()) {
      throw Interrupted();
    }
    if (bounded && Clock::now() >= deadline) {
      throw CommFailure(
          std::string("groupcomm: message queue ") + what + " timed out after " + std::to_string(timeoutMs) + " ms",
          true);
    }
  }
}

void ShmRing::waitFree(uint64_t seq, int64_t timeoutMs) {
  waitOn(
      reinterpret_cast<Signal*>(base_ + kFreeSignal), [&] { return chunkFree(seq); },
      [&] {
        const uint64_t previous = seq - options_.nChunks;
        const Peer* readers = reinterpret_cast<const Peer*>(base_ + peersOffset_) + 1;
        for (int r = 0; r < options_.nReaders; ++r) {
          if (readWord(r, slotOf(seq))->load(std::memory_order_acquire) >= previous) {
            continue;
          }
          if (readers[r].state.load(std::memory_order_acquire) == kClosed) {
            broken_ = true;
            throw CommFailure(
                "groupcomm: message queue reader " + std::to_string(r) + " closed the queue with messages unread",
                false);
          }
          if (peerGone(&readers[r])) {
            if (chunkFree(seq)) {
              return;
            }
            peerExited("reader " + std::to_string(r), readers[r].pid.load(std::memory_order_relaxed));
          }
        }
      },
      timeoutMs, "write (waiting for slow readers)");
}

void ShmRing::waitReady(uint64_t seq, int64_t timeoutMs) {
  waitOn(
      reinterpret_cast<Signal*>(base_ + kDataSignal), [&] { return chunkReady(seq); },
      [&] {
        const Peer* writer = reinterpret_cast<const Peer*>(base_ + peersOffset_);
        if (chunkReady(seq)) {
          return;
        }
        if (writer->state.load(std::memory_order_acquire) == kClosed) {
          broken_ = true;
          throw CommFailure("groupcomm: message queue writer closed the queue", false);
        }
        if (peerGone(writer)) {
          if (chunkReady(seq)) {
            return;
          }
          peerExited("writer", writer->pid.load(std::memory_order_relaxed));
        }
      },
      timeoutMs, "read (waiting for the writer)");
}

bool ShmRing::writeReady(size_t len) const {
  return readerIndex_ == -1 && !broken_ && len <= options_.chunkBytes && chunkFree(next_);
}

void ShmRing::write(const char* data, size_t len, int64_t timeoutMs) {
  if (readerIndex_ != -1) {
    throw std::logic_error("groupcomm: write on the reader side of a message queue");
  }
  checkUsable();
  timeoutMs = resolve(timeoutMs);
  const size_t n = chunksFor(len);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t seq = next_;
    try {
      waitFree(seq, timeoutMs);
    } catch (...) {
      broken_ = broken_ || i > 0; // readers hold part of a message
      throw;
    }
    const size_t offset = i * options_.chunkBytes;
    const size_t part = std::min(options_.chunkBytes, len - offset);
    if (part != 0) {
      std::memcpy(chunkData(slotOf(seq)), data + offset, part);
    }
    publish(seq, len);
    ++next_;
  }
}

bool ShmRing::poll(size_t* len) {
  if (readerIndex_ == -1) {
    throw std::logic_error("groupcomm: read on the writer side of a message queue");
  }
  checkUsable();
  if (!begun_) {
    if (!chunkReady(next_)) {
      return false;
    }
    begunLen_ = chunkHead(slotOf(next_))->len.load(std::memory_order_relaxed);
    begun_ = true;
  }
  *len = begunLen_;
  return true;
}

size_t ShmRing::begin(int64_t timeoutMs) {
  size_t len = 0;
  if (!poll(&len)) {
    waitReady(next_, resolve(timeoutMs));
    poll(&len);
  }
  return len;
}

bool ShmRing::finishMayWait() const {
  return chunksFor(begunLen_) > 1;
}

void ShmRing::finish(char* dst, int64_t timeoutMs) {
  if (!begun_) {
    throw std::logic_error("groupcomm: message queue finish without begin");
  }
  checkUsable();
  timeoutMs = resolve(timeoutMs);
  const size_t len = begunLen_;
  const size_t n = chunksFor(len);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t seq = next_;
    if (i > 0) {
      try {
        waitReady(seq, timeoutMs);
      } catch (...) {
        broken_ = true;
        throw;
      }
    }
    const size_t offset = i * options_.chunkBytes;
    const size_t part = std::min(options_.chunkBytes, len - offset);
    if (part != 0) {
      std::memcpy(dst + offset, chunkData(slotOf(seq)), part);
    }
    release(seq);
    ++next_;
  }
  begun_ = false;
}

std::string ShmRing::read(int64_t timeoutMs) {
  std::string out(begin(timeoutMs), '\0');
  finish(out.data(), timeoutMs);
  return out;
}

} // namespace groupcomm
