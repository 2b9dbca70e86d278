#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace groupcomm {

// A one-writer, many-reader message ring in a POSIX shared-memory segment.
//
// The segment holds `nChunks` chunks of `chunkBytes` each. Every chunk has a
// sequence word (the number of the ring chunk it holds, counting from 1) and
// each reader has one read word per chunk (the last sequence it read there).
// The writer fills chunk s only once every reader's read word for that slot
// has reached s - nChunks; a reader takes chunk s once its sequence word says
// s. A message longer than a chunk occupies consecutive chunks; the first
// carries the total length. Both sides spin briefly, then sleep on a futex
// word that the other side wakes only when its waiter count says someone
// sleeps. Every wait also watches the peer's pid, so a dead peer is reported
// instead of waited out.
class ShmRing {
 public:
  struct Options {
    size_t nChunks;
    size_t chunkBytes;
    int nReaders;
    int64_t spinUs;    // busy-wait this long before sleeping
    int64_t timeoutMs; // for calls given kDefaultTimeout; negative: none
  };
  // A call's timeoutMs: this one means Options::timeoutMs, negative none.
  static constexpr int64_t kDefaultTimeout = INT64_MIN;

  // Thrown when the interrupt check (below) asks a wait to stop.
  struct Interrupted : std::runtime_error {
    Interrupted() : std::runtime_error("groupcomm: message queue wait interrupted") {}
  };

  // create: the writer makes the segment (mode 0600, the name must be
  // fresh) and readerIndex must be -1; readers attach with their index.
  ShmRing(const std::string& name, bool create, int readerIndex, Options options);
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  // Writer. Timeouts bound each wait for progress, not the whole call.
  // True when `len` bytes would go out without waiting.
  bool writeReady(size_t len) const;
  void write(const char* data, size_t len, int64_t timeoutMs);

  // Reader, in two steps so the caller can allocate the destination between
  // them. poll: the next message's length, if its first chunk is there.
  bool poll(size_t* len);
  // begin: wait for the next message and return its length (the same one
  // again until finish consumes it).
  size_t begin(int64_t timeoutMs);
  // finish: copy the begun message (its full length) into dst.
  void finish(char* dst, int64_t timeoutMs);
  // Whether finish will wait (a message spanning several chunks).
  bool finishMayWait() const;
  std::string read(int64_t timeoutMs);

  // Called between sleeps of a long wait (not while spinning); returning
  // true ends the wait with Interrupted. Lets Python deliver Ctrl-C.
  void setInterruptCheck(std::function<bool()> check) {
    interruptCheck_ = std::move(check);
  }

  // Remove the name from /dev/shm (mappings stay valid). Idempotent.
  void unlink();
  // Readers that attached so far (the writer waits for all before unlink).
  int attachedReaders() const;
  size_t mappedBytes() const {
    return mappedBytes_;
  }
  size_t chunkBytes() const {
    return options_.chunkBytes;
  }
  int readerIndex() const {
    return readerIndex_;
  }

 private:
  struct Header;
  struct Peer;
  struct Signal;
  struct ChunkHead;

  ChunkHead* chunkHead(size_t slot) const;
  std::atomic<uint64_t>* readWord(int reader, size_t slot) const;
  char* chunkData(size_t slot) const;
  size_t slotOf(uint64_t seq) const {
    return static_cast<size_t>((seq - 1) % options_.nChunks);
  }
  size_t chunksFor(size_t len) const;

  bool chunkFree(uint64_t seq) const;
  bool chunkReady(uint64_t seq) const;
  void waitFree(uint64_t seq, int64_t timeoutMs);
  void waitReady(uint64_t seq, int64_t timeoutMs);
  void publish(uint64_t seq, uint64_t len);
  void release(uint64_t seq);
  template <typename Ready, typename Check>
  void waitOn(Signal* signal, Ready ready, Check check, int64_t timeoutMs, const char* what);
  int64_t resolve(int64_t timeoutMs) const {
    return timeoutMs == kDefaultTimeout ? options_.timeoutMs : timeoutMs;
  }
  void checkUsable() const;
  [[noreturn]] void peerExited(const std::string& who, int32_t pid);
  bool peerGone(const Peer* peer) const;

  std::string name_;
  bool owner_;
  int readerIndex_;
  Options options_;
  char* base_ = nullptr;
  size_t mappedBytes_ = 0;
  size_t peersOffset_ = 0;
  size_t chunkHeadsOffset_ = 0;
  size_t readWordsOffset_ = 0;
  size_t readStride_ = 0;
  size_t dataOffset_ = 0;
  uint64_t pidNamespace_ = 0;
  uint64_t next_ = 1; // next chunk sequence to write or read
  bool begun_ = false;
  size_t begunLen_ = 0;
  bool broken_ = false;
  bool unlinked_ = false;
  std::function<bool()> interruptCheck_;
};

} // namespace groupcomm
