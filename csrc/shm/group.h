#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <cstdint>
#include <string>
#include <vector>

#include "comm_failure.h"
#include "shm/p2p.h"
#include "shm/reduce.h"
#include "shm/shared_blocks.h"

namespace groupcomm {

// Collectives among the ranks of one host through a shared-memory segment.
//
// Each rank owns two slots (double buffering) in the segment and one control
// line holding a step counter. A sync point is: publish my counter, wait until
// every peer's counter has reached it. A rank writes only its own slots, and
// it reuses a slot two chunk-steps later, by which time every peer has passed
// a sync point proving it finished reading it. Every rank runs the same ops in
// the same order, so the counters stay in step without any reset.
class ShmGroup {
 public:
  // From this many bytes per message a direct group (setDirect) reads the
  // peer's memory (one kernel copy, about 70% of memcpy's speed here, against
  // two copies through the segment); below it the system call and page
  // pinning cost more than the copy they save.
  static constexpr size_t kDirectMinBytes = 1 << 20;

  struct Options {
    size_t slotBytes;
    int64_t spinUs;    // busy-wait this long before yielding
    int64_t yieldUs;   // then yield the core this long before sleeping
    int64_t timeoutMs; // each wait's, until setTimeout changes it
    size_t ringBytes;  // per ordered pair of ranks, for send/recv
    bool crowded;      // more ranks than cores here: waiters even out the ranks per core
    // What messages call each rank (its rank in the enclosing group when
    // this one serves a host of it); empty: the rank itself.
    std::vector<int> rankNames;
  };

  // The byte ring carrying messages from one rank to another.
  struct ChannelHead {
    alignas(64) std::atomic<uint64_t> written;
    alignas(64) std::atomic<uint64_t> consumed;
    // Messages the receiver read straight from the sender's memory.
    alignas(64) std::atomic<uint64_t> acked;
  };
  struct Channel {
    ChannelHead* head;
    char* data;
    size_t bytes;
  };

  // The creating rank makes the segment (mode 0600, name must be fresh);
  // the others attach to it. Throws if the segment cannot be made or mapped.
  ShmGroup(const std::string& name, bool create, int rank, int worldSize, Options options);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Remove the name from /dev/shm (mappings stay valid). Idempotent.
  void unlink();
  // Make every wait of this process on the group (collectives and posted
  // send/recv, on any thread) fail now; the group is unusable afterwards,
  // and the peers' collectives fail too (see fail()).
  void abort();
  // Whether this rank can read every peer's memory directly (readPeerMemory):
  // same pid namespace, and the kernel lets this process read theirs. Call
  // once every rank has attached.
  bool probeDirect();
  // Large messages of scatter and send/recv go straight from the sender's
  // memory to the receiver's (one copy instead of two through the segment);
  // all_to_all's where the group measured that faster (AllToAllPath). Not
  // broadcast, gather or all_gather: there the segment's two copies run at
  // once on different ranks, or several readers would pin the same pages at
  // once, and direct reads measured no faster or slower. Every
  // rank of the group must set the same value, before the first op: it
  // changes the protocol.
  void setDirect(bool on) {
    direct_ = on;
  }
  bool direct() const {
    return direct_;
  }
  // Whether every peer can map this rank's shared blocks (SharedBlocks):
  // same pid namespace, and the kernel lets this process open theirs through
  // /proc. Call once every rank has attached.
  bool probeShared();
  // allocate() hands out shared blocks, and the all-gathers, reduce-scatters
  // and all-reduces whose input lies in one are read in place by the peers.
  // Every rank of the group must set the same value, before the first op.
  void setShared(bool on);
  bool shared() const {
    return shared_;
  }
  // A 1-D tensor of `numel` elements the peers can read in place (a shared
  // group, CPU, large enough to gain); nullopt otherwise.
  std::optional<at::Tensor> allocate(int64_t numel, const at::TensorOptions& options);
  // Moves `tensor`'s storage into a shared block (SharedBlocks::adopt), so
  // that its all-reduces are read in place; false where the group is not
  // shared or the storage cannot move. Only the storage's owner may ask.
  bool adopt(const at::Tensor& tensor);
  // Bytes this rank holds in shared blocks.
  size_t sharedBytes() const {
    return blocks_->bytes();
  }
  // Bytes of the peers' shared blocks this rank has mapped.
  size_t peerBlockBytes() const {
    return peerBlocks_.bytes();
  }
  // Total bytes mapped.
  size_t mappedBytes() const {
    return mappedBytes_;
  }

  int rank() const {
    return rank_;
  }
  int worldSize() const {
    return worldSize_;
  }
  const Options& options() const {
    return options_;
  }
  // The timeout of the waits that start from now on (dist.set_timeout).
  void setTimeout(int64_t ms) {
    timeoutMs_.store(ms, std::memory_order_relaxed);
  }
  // Overrides it for the op the calling thread runs next (c10d's per-op
  // timeout); -1 goes back to the group's. Ops run one at a time.
  void setOpTimeout(int64_t ms) {
    opTimeoutMs_.store(ms, std::memory_order_relaxed);
  }
  // The group's timeout, whatever op runs now.
  int64_t groupTimeoutMs() const {
    return timeoutMs_.load(std::memory_order_relaxed);
  }
  int64_t timeoutMs() const {
    const int64_t op = opTimeoutMs_.load(std::memory_order_relaxed);
    return op >= 0 ? op : timeoutMs_.load(std::memory_order_relaxed);
  }

  // Point-to-point, progressed by a thread started on first use.
  std::shared_ptr<P2PRequest> send(const at::Tensor& tensor, int dst, int tag);
  std::shared_ptr<P2PRequest> recv(const at::Tensor& tensor, int src, int tag);
  // Moves point-to-point messages on the calling thread for a while, until
  // `request` (posted here) is done (ShmP2P::drive).
  void drive(const P2PRequest& request);

  // For ShmP2P: channels, doorbells (a counter per rank that anyone bumps
  // when that rank's progress thread has something new to look at), liveness.
  Channel channel(int src, int dst) const;
  uint32_t doorbell(int rank) const;
  void ringDoorbell(int rank);
  // Sleeps until `rank`'s doorbell moves past `seen` or `ms` pass. An
  // unheard sleeper is not woken by ringDoorbell (which then makes no system
  // call), only by wakeDoorbell or its timeout.
  void waitDoorbell(int rank, uint32_t seen, int64_t ms, bool heard = true);
  void wakeDoorbell(int rank);
  bool peerGone(int rank) const;
  // Copies `len` bytes at `remote` in `rank`'s memory to `local`
  // (readPeerMemory); false, with errno set, when the kernel refuses.
  bool readPeer(int rank, int64_t remote, void* local, size_t len) const;
  // Why `rank` gave up on the group ("groupcomm: peer rank 1 left the
  // shared-memory group (rank 1 timed out waiting for rank 2)"), or "" while
  // it has not.
  std::string departure(int rank) const;
  // "rank r" as messages say it.
  std::string rankName(int rank) const;

  void barrier();
  void broadcast(at::Tensor& tensor, int root);
  // out (sum(sizes) bytes) receives rank i's `sizes[i]` bytes of `input`.
  void allGather(at::Tensor& out, const at::Tensor& input, const std::vector<int64_t>& sizes);
  // The same into places of their own: rank i's bytes land at dsts[i]
  // (a list of tensors, with no copy through one flat buffer).
  void allGatherInto(const std::vector<char*>& dsts, const at::Tensor& input, const std::vector<int64_t>& sizes);
  // Rank i sends inSizes[j] bytes to rank j and receives outSizes[j] from j.
  void allToAll(
      at::Tensor& out,
      const at::Tensor& input,
      const std::vector<int64_t>& outSizes,
      const std::vector<int64_t>& inSizes);
  // The same between places of their own: srcs[j] goes to rank j, dsts[i]
  // receives rank i's bytes. No source may overlap a destination.
  void allToAllBetween(
      const std::vector<char*>& dsts,
      const std::vector<const char*>& srcs,
      const std::vector<int64_t>& outSizes,
      const std::vector<int64_t>& inSizes);
  // gather: root's outs[i] receives rank i's input (outs empty elsewhere),
  // of sizes[i] bytes (every rank passes the same sizes).
  void gather(std::vector<at::Tensor>& outs, const at::Tensor& input, const std::vector<int64_t>& sizes, int root);
  // scatter: rank i's out receives root's ins[i] (ins empty elsewhere).
  void scatter(at::Tensor& out, const std::vector<at::Tensor>& ins, int root);
  // Reductions take elements, not bytes.
  void allReduce(at::Tensor& tensor, RedKind kind, double factor);
  // Out of place: `out` (input's dtype and size, no overlap with it)
  // receives the reduction of every rank's `input`, which stays as it was.
  void allReduceInto(at::Tensor& out, const at::Tensor& input, RedKind kind, double factor);
  void reduce(at::Tensor& tensor, int root, RedKind kind, double factor);
  // Rank i receives the reduction of slice i (sizes[i] elements) of `input`.
  void reduceScatter(
      at::Tensor& out,
      const at::Tensor& input,
      const std::vector<int64_t>& sizes,
      RedKind kind,
      double factor);
  // The same from slices in places of their own (`srcs[i]`, of out's dtype):
  // none lies in a shared block for the peers to read, none may overlap
  // `out` but this rank's own slice being `out` itself.
  void reduceScatterFrom(
      at::Tensor& out,
      const std::vector<const char*>& srcs,
      const std::vector<int64_t>& sizes,
      RedKind kind,
      double factor);

 private:
  struct Control;
  Control* control(int rank) const;
  char* slot(int rank, int buffer) const;
  int64_t* meta(int rank, int buffer) const;

  // One chunk-step: returns the buffer to write, advancing the round.
  int nextBuffer() {
    return static_cast<int>(round_++ & 1u);
  }
  void sync();
  void waitFor(int peer, uint32_t target);
  // Why a rank gave up on the group, as its peers read it from its control line.
  enum class Failure : uint8_t { kNone = 0, kTimedOut, kPeerExited, kAborted };
  // The failure word: `why`, the rank that saw it (`origin`) and the rank it
  // concerns (`cause`).
  static uint64_t failureCode(Failure why, int origin, int cause);
  // This rank gives up on the group after the failure `code` (its own, or one
  // a peer passed on): the group is unusable here from now on, and every peer
  // waiting on this rank (or later reaching a sync point with it) fails at
  // once instead of at its timeout. Returns CommFailure(what) to throw.
  CommFailure fail(uint64_t code, const std::string& what, bool timedOut);
  void publishFailure(uint64_t code);
  std::string departure(int peer, uint64_t code) const;
  // Throws when `peer` has given up on the group, naming the first failure.
  void throwIfFailed(int peer);
  void evenOutCores();
  // reduce's steps, reading this rank's `count` elements at `src` and
  // writing the result at `data` (the same place in place).
  void reduceFrom(
      char* data,
      const char* src,
      c10::ScalarType dtype,
      size_t count,
      int root,
      RedKind kind,
      double factor);
  // reduceScatter's steps; `whole`: the input as one buffer, which may lie in
  // a shared block (nullptr for separate slices).
  void reduceScatterPieces(
      at::Tensor& out,
      const std::vector<const char*>& srcs,
      const char* whole,
      const std::vector<int64_t>& sizes,
      RedKind kind,
      double factor);
  // Copies `len` bytes at `remote` in `peer`'s memory to `local`; a refusal
  // (the peer is gone, or failed and freed the memory) fails the group.
  void readFrom(int peer, int64_t remote, void* local, size_t len);
  // The failure to throw when the kernel refused (errno `err`) `doing`
  // something with `peer`'s memory: the peer's own failure, its exit, or
  // the refusal; the group fails.
  CommFailure refusedBy(int peer, int err, const char* doing);
  // The sync after a direct op: no rank frees or changes memory its peers
  // read until every peer is done reading.
  void finishDirect();
  // Whether an op whose largest input is `bytes` (the same on every rank)
  // publishes where its inputs lie: below SharedBlocks::kMinBytes no rank
  // reads another's control line for it.
  bool mayReadInPlace(size_t bytes) const;
  // Where this rank's `len` bytes at `data` lie, if in one of its shared
  // blocks and large enough to gain (asked only where mayReadInPlace said
  // so); published in buffer `b`.
  std::optional<BlockPlace> placeOf(const void* data, size_t len) const;
  // `ownSliceLater`: an all-reduce into a block from another tensor, whose
  // own slice is not copied into the block until a peer needs it there.
  void publishPlace(int b, const std::optional<BlockPlace>& place, bool ownSliceLater = false);
  // After the sync: each peer's published bytes as mapped here, in
  // inPlace_ (nullptr: not in a block; all nullptr unless `published`).
  // Returns whether any rank, this one included, published a place; every
  // rank reads the same answer, and those ops end with finishDirect so that
  // no block changes while a peer reads it.
  bool mapPlaces(int b, bool published);
  // After the sync: whether a rank published a place whose own slice it
  // copies in later (publishPlace's ownSliceLater).
  bool anyOwnSliceLater(int b) const;
  // The rest of an all-reduce once mapPlaces found every rank's tensor in a
  // block (the caller's first sync done); this rank's own slice is read
  // from `src`.
  void reduceAllInPlace(char* data, const char* src, c10::ScalarType dtype, RedKind kind, double factor, size_t count);
  void checkUsable() const;
  void throwIfAborted();
  size_t slotBytes() const {
    return options_.slotBytes;
  }

  std::string name_;
  bool owner_;
  int rank_;
  int worldSize_;
  Options options_;
  std::atomic<int64_t> timeoutMs_;
  std::atomic<int64_t> opTimeoutMs_{-1};
  char* base_ = nullptr;
  size_t mappedBytes_ = 0;
  size_t dataOffset_ = 0;
  uint32_t step_ = 0;
  uint32_t round_ = 0;
  uint64_t pidNamespace_ = 0;
  uint64_t probeToken_ = 0; // peers read it to check they can read this process
  bool direct_ = false;
  // Where all_to_all's large messages go: straight from the sender (one copy,
  // with the kernel pinning the sender's pages) or through the segment (two
  // copies). Which is faster depends on the machine: direct reads won by
  // 1.1x-1.2x on an Intel VM, the segment by 1.2x-1.5x on a Zen 4 one. The
  // group's large all_to_alls after the first kWarmup take each path in
  // turn, kTrials of them; each rank keeps its best time per received byte on
  // each and votes for the faster, and from then on the votes decide (a tie:
  // direct). Only the trials are timed: a path taken every call gets warmer
  // than one tried early, which would decide for whichever came first.
  struct AllToAllPath {
    static constexpr uint64_t kWarmup = 2;
    static constexpr uint64_t kTrials = 8;
    uint64_t largeCalls = 0;
    double bestNsPerByte[2] = {0.0, 0.0}; // [segment, direct]; 0: not timed yet
  };
  AllToAllPath allToAllPath_;
  int64_t allToAllVote() const;
  // Whether this large all_to_all (the group's `call`th) reads directly.
  bool allToAllDirect(uint64_t call, int buffer) const;
  bool shared_ = false;
  int probeFd_ = -1; // the block peers map to check they can (probeShared)
  std::shared_ptr<SharedBlocks> blocks_ = std::make_shared<SharedBlocks>();
  PeerBlocks peerBlocks_;
  std::vector<char*> inPlace_; // mapPlaces' answer for the op running
  size_t channelOffset_ = 0;
  bool broken_ = false;
  std::atomic<bool> aborted_{false};
  bool unlinked_ = false;
  std::chrono::steady_clock::time_point nextCoreCheck_{};
  std::vector<int> ranksOnCore_;
  std::mutex p2pMutex_;
  std::unique_ptr<ShmP2P> p2p_;
};

} // namespace groupcomm
