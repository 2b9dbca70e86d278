#include "shm/group.h"
#include "shm/peer_memory.h"
#include "shm/segment.h"
#include "comm_failure.h"
#include "shm/sync.h"

#include <c10/util/Exception.h>

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <utility>

namespace groupcomm {
namespace {

constexpr uint64_t kMagic = 0x67636f6d6d53484dULL; // "gcommSHM"
constexpr size_t kPage = 4096;
// At or below this many bytes an all-reduce is one round: every rank reduces
// everything. Above it each rank reduces a slice (two rounds, less traffic).
constexpr size_t kDirectReduceBytes = 16 * 1024;
// An all-reduce into another tensor than its input writes a result of this
// size or more with streaming stores: such a result does not stay in the
// caches, and reading its lines before writing them added a third to the
// memory traffic (fp32, 16 MiB, four ranks on two cores: 1.07x-1.29x the
// time of the in-place call in the same processes, streamed 1.01x-1.13x).
// Not for 16-bit elements: with two ranks bf16 came out 5% slower streamed.
constexpr size_t kStreamedResultBytes = 4 << 20;
constexpr int64_t kSleepSliceMs = 10;
constexpr int64_t kLivenessEveryMs = 100;
constexpr auto kCoreCheckEvery = std::chrono::milliseconds(1);
constexpr auto kCoreMoveEvery = std::chrono::milliseconds(20);

using Clock = std::chrono::steady_clock;

struct Header {
  uint64_t magic;
  uint32_t worldSize;
  uint32_t reserved;
  uint64_t slotBytes;
  char pad[40];
};
static_assert(sizeof(Header) == 64);

size_t roundUp(size_t value, size_t to) {
  return (value + to - 1) / to * to;
}

// Rank r's share [lo, hi) of `len` elements split among `world` ranks, in
// multiples of 16 elements; the last ranks' may be short or empty.
std::pair<size_t, size_t> sliceOf(size_t len, int r, int world) {
  const size_t per = roundUp((len + world - 1) / world, 16);
  const size_t lo = std::min(len, r * per);
  return {lo, std::min(len, lo + per)};
}

size_t clampLen(int64_t total, size_t offset, size_t limit) {
  if (total <= static_cast<int64_t>(offset)) {
    return 0;
  }
  return std::min(limit, static_cast<size_t>(total) - offset);
}

void copyBytes(void* dst, const void* src, size_t len) {
  if (len != 0 && dst != src) {
    std::memcpy(dst, src, len);
  }
}

// copyBytes with streaming stores where the CPU has them: dst's lines are
// written without first being read into the cache (x86's read for
// ownership). For a result too large to stay in the caches anyway.
void streamBytes(void* dst, const void* src, size_t len) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const size_t head = std::min(len, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  len -= head;
  for (; len >= 64; len -= 64, d += 64, s += 64) {
    for (int i = 0; i < 4; ++i) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s) + i);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d) + i, v);
    }
  }
  std::memcpy(d, s, len);
  _mm_sfence();
#else
  copyBytes(dst, src, len);
#endif
}

// Where each of `sizes`' consecutive pieces of the buffer at `base` starts.
template <typename Byte>
std::vector<Byte*> piecesOf(Byte* base, const std::vector<int64_t>& sizes) {
  std::vector<Byte*> at(sizes.size());
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    at[i] = base + offset;
    offset += sizes[i];
  }
  return at;
}

std::vector<int64_t> displacements(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> displ(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) {
    displ[i] = displ[i - 1] + sizes[i - 1];
  }
  return displ;
}

} // namespace

struct alignas(64) ShmGroup::Control {
  std::atomic<uint32_t> seq;     // last sync point this rank reached
  std::atomic<uint32_t> waiters; // peers asleep on `seq`
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> doorbell; // bumped when this rank's p2p has news
  std::atomic<uint32_t> doorbellWaiters;
  std::atomic<uint64_t> pidNamespace;
  std::atomic<int32_t> cpu; // where this rank last synced (crowded hosts)
  // Set once when this rank gives up on the group: the group's first
  // failure as this rank knows it, (Failure << 56) | (origin << 32) | cause,
  // where `origin` saw it happen and `cause` is the rank it concerns.
  std::atomic<uint64_t> failure;
  // Where this process keeps probeToken_, and its value (probeDirect).
  std::atomic<uint64_t> probeAddress;
  std::atomic<uint64_t> probeToken;
  std::atomic<int32_t> probeFd; // a block holding probeToken (probeShared)
  int64_t meta[2][4];           // small per-buffer values published with the data
};

ShmGroup::ShmGroup(const std::string& name, bool create, int rank, int worldSize, Options options)
    : name_(name),
      owner_(create),
      rank_(rank),
      worldSize_(worldSize),
      options_(options),
      timeoutMs_(options.timeoutMs) {
  TORCH_CHECK(
      worldSize_ >= 1 && rank_ >= 0 && rank_ < worldSize_, "groupcomm: bad shared-memory rank ", rank_, " of ",
      worldSize_);
  options_.slotBytes = roundUp(std::max<size_t>(options_.slotBytes, kPage), kPage);
  options_.ringBytes = roundUp(std::max<size_t>(options_.ringBytes, kPage), kPage);
  dataOffset_ = roundUp(sizeof(Header) + worldSize_ * sizeof(Control), kPage);
  channelOffset_ = dataOffset_ + 2 * worldSize_ * options_.slotBytes;
  mappedBytes_ = channelOffset_ +
      static_cast<size_t>(worldSize_) * worldSize_ * (sizeof(ChannelHead) + options_.ringBytes);

  base_ = mapSegment(name_, mappedBytes_, create);
  auto* header = reinterpret_cast<Header*>(base_);
  if (create) {
    header->worldSize = static_cast<uint32_t>(worldSize_);
    header->slotBytes = options_.slotBytes;
    header->magic = kMagic;
  } else if (
      header->magic != kMagic || header->worldSize != static_cast<uint32_t>(worldSize_) ||
      header->slotBytes != options_.slotBytes) {
    munmap(base_, mappedBytes_);
    base_ = nullptr;
    throw std::runtime_error("groupcomm: shared memory " + name_ + " belongs to another group layout");
  }
  pidNamespace_ = currentPidNamespace();
  Control* me = control(rank_);
  me->pidNamespace.store(pidNamespace_);
  me->pid.store(static_cast<int32_t>(getpid()));
  me->cpu.store(sched_getcpu());
  std::random_device random;
  probeToken_ = (static_cast<uint64_t>(random()) << 32) | random();
  me->probeToken.store(probeToken_);
  me->probeAddress.store(reinterpret_cast<uintptr_t>(&probeToken_));
  probeFd_ = makeProbeBlock(probeToken_);
  me->probeFd.store(probeFd_);
}

bool ShmGroup::probeDirect() {
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) {
      continue;
    }
    const Control* c = control(peer);
    uint64_t seen = 0;
    if (c->pidNamespace.load() != pidNamespace_ ||
        !readPeerMemory(c->pid.load(), reinterpret_cast<const void*>(c->probeAddress.load()), &seen, sizeof(seen)) ||
        seen != c->probeToken.load()) {
      return false;
    }
  }
  return true;
}

bool ShmGroup::probeShared() {
  for (int peer = 0; peer < worldSize_; ++peer) {
    const Control* c = control(peer);
    if (peer != rank_ &&
        (c->pidNamespace.load() != pidNamespace_ || c->probeFd.load() < 0 ||
         !readProbeBlock(c->pid.load(), c->probeFd.load(), c->probeToken.load()))) {
      return false;
    }
  }
  return probeFd_ >= 0;
}

void ShmGroup::setShared(bool on) {
  shared_ = on;
  if (probeFd_ >= 0) {
    close(probeFd_); // every peer has probed by now
    probeFd_ = -1;
  }
}

std::optional<at::Tensor> ShmGroup::allocate(int64_t numel, const at::TensorOptions& options) {
  if (!shared_ || !options.device().is_cpu()) {
    return std::nullopt;
  }
  return blocks_->allocate(numel, options);
}

bool ShmGroup::adopt(const at::Tensor& tensor) {
  return shared_ && blocks_->adopt(tensor);
}

std::optional<BlockPlace> ShmGroup::placeOf(const void* data, size_t len) const {
  if (len < SharedBlocks::kMinBytes) {
    return std::nullopt;
  }
  return blocks_->find(data, len);
}

bool ShmGroup::mayReadInPlace(size_t bytes) const {
  return shared_ && bytes >= SharedBlocks::kMinBytes;
}

void ShmGroup::publishPlace(int b, const std::optional<BlockPlace>& place, bool ownSliceLater) {
  int64_t* out = meta(rank_, b);
  out[0] = place ? (static_cast<int64_t>(place->fd) << 32) | place->serial : -1;
  if (place) {
    out[1] = place->blockBytes;
    out[2] = place->offset;
    out[3] = ownSliceLater ? 1 : 0;
  }
}

bool ShmGroup::mapPlaces(int b, bool published) {
  auto& where = inPlace_;
  where.assign(worldSize_, nullptr);
  if (!published) {
    return false;
  }
  bool any = false;
  for (int r = 0; r < worldSize_; ++r) {
    const int64_t* m = meta(r, b);
    if (m[0] < 0) {
      continue;
    }
    any = true;
    if (r == rank_) {
      continue;
    }
    const BlockPlace place{static_cast<int32_t>(m[0] >> 32), static_cast<uint32_t>(m[0]), m[1], m[2]};
    where[r] = peerBlocks_.map(control(r)->pid.load(), place);
    if (where[r] == nullptr) {
      throw refusedBy(r, errno, "mapping a buffer of");
    }
  }
  return any;
}

bool ShmGroup::anyOwnSliceLater(int b) const {
  for (int r = 0; r < worldSize_; ++r) {
    const int64_t* m = meta(r, b);
    if (m[0] >= 0 && m[3] == 1) {
      return true;
    }
  }
  return false;
}

bool ShmGroup::readPeer(int rank, int64_t remote, void* local, size_t len) const {
  return readPeerMemory(control(rank)->pid.load(), reinterpret_cast<const void*>(remote), local, len);
}

void ShmGroup::readFrom(int peer, int64_t remote, void* local, size_t len) {
  if (readPeer(peer, remote, local, len)) {
    return;
  }
  throw refusedBy(peer, errno, "reading the memory of");
}

CommFailure ShmGroup::refusedBy(int peer, int err, const char* doing) {
  throwIfFailed(peer);
  // ESRCH: the peer's memory is gone with its process, which may not be a zombie yet
  if (err == ESRCH || peerGone(peer)) {
    return fail(failureCode(Failure::kPeerExited, rank_, peer), "groupcomm: peer " + rankName(peer) + " exited", false);
  }
  return fail(
      failureCode(Failure::kAborted, rank_, peer),
      std::string("groupcomm: ") + doing + " " + rankName(peer) + " failed: " + std::strerror(err), false);
}

void ShmGroup::finishDirect() {
  nextBuffer();
  sync();
}

ShmGroup::~ShmGroup() {
  p2p_.reset(); // stops the progress thread before the memory goes
  if (probeFd_ >= 0) {
    close(probeFd_);
  }
  if (owner_) {
    unlink();
  }
  if (base_ != nullptr) {
    munmap(base_, mappedBytes_);
  }
}

void ShmGroup::unlink() {
  if (!unlinked_) {
    unlinked_ = true;
    unlinkSegment(name_);
  }
}

ShmGroup::Control* ShmGroup::control(int rank) const {
  return reinterpret_cast<Control*>(base_ + sizeof(Header)) + rank;
}

char* ShmGroup::slot(int rank, int buffer) const {
  return base_ + dataOffset_ + (2 * rank + buffer) * options_.slotBytes;
}

int64_t* ShmGroup::meta(int rank, int buffer) const {
  return control(rank)->meta[buffer];
}

ShmGroup::Channel ShmGroup::channel(int src, int dst) const {
  char* at = base_ + channelOffset_ +
      static_cast<size_t>(src * worldSize_ + dst) * (sizeof(ChannelHead) + options_.ringBytes);
  return Channel{reinterpret_cast<ChannelHead*>(at), at + sizeof(ChannelHead), options_.ringBytes};
}

uint32_t ShmGroup::doorbell(int rank) const {
  return control(rank)->doorbell.load(std::memory_order_seq_cst);
}

void ShmGroup::ringDoorbell(int rank) {
  Control* c = control(rank);
  c->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (c->doorbellWaiters.load(std::memory_order_seq_cst) != 0) {
    futexWakeAll(&c->doorbell);
  }
}

void ShmGroup::waitDoorbell(int rank, uint32_t seen, int64_t ms, bool heard) {
  Control* c = control(rank);
  if (!heard) {
    futexWait(&c->doorbell, seen, ms);
    return;
  }
  c->doorbellWaiters.fetch_add(1, std::memory_order_seq_cst);
  if (c->doorbell.load(std::memory_order_seq_cst) == seen) {
    futexWait(&c->doorbell, seen, ms);
  }
  c->doorbellWaiters.fetch_sub(1, std::memory_order_seq_cst);
}

void ShmGroup::wakeDoorbell(int rank) {
  Control* c = control(rank);
  c->doorbell.fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(&c->doorbell);
}

bool ShmGroup::peerGone(int rank) const {
  const Control* c = control(rank);
  const int32_t pid = c->pid.load();
  return pid > 0 && c->pidNamespace.load() == pidNamespace_ && processGone(pid);
}

std::shared_ptr<P2PRequest> ShmGroup::send(const at::Tensor& tensor, int dst, int tag) {
  std::lock_guard<std::mutex> lock(p2pMutex_);
  if (!p2p_) {
    p2p_ = std::make_unique<ShmP2P>(*this);
  }
  return p2p_->send(tensor, dst, tag);
}

std::shared_ptr<P2PRequest> ShmGroup::recv(const at::Tensor& tensor, int src, int tag) {
  std::lock_guard<std::mutex> lock(p2pMutex_);
  if (!p2p_) {
    p2p_ = std::make_unique<ShmP2P>(*this);
  }
  return p2p_->recv(tensor, src, tag);
}

void ShmGroup::drive(const P2PRequest& request) {
  ShmP2P* p2p = nullptr;
  {
    std::lock_guard<std::mutex> lock(p2pMutex_);
    p2p = p2p_.get();
  }
  if (p2p != nullptr) { // it lives as long as the group
    p2p->drive(request);
  }
}

std::string ShmGroup::rankName(int rank) const {
  const auto& names = options_.rankNames;
  return "rank " + std::to_string(rank >= 0 && static_cast<size_t>(rank) < names.size() ? names[rank] : rank);
}

CommFailure ShmGroup::fail(uint64_t code, const std::string& what, bool timedOut) {
  broken_ = true;
  publishFailure(code);
  return CommFailure(what, timedOut);
}

uint64_t ShmGroup::failureCode(Failure why, int origin, int cause) {
  return (static_cast<uint64_t>(why) << 56) | (static_cast<uint64_t>(origin & 0xffffff) << 32) |
      static_cast<uint32_t>(cause);
}

void ShmGroup::publishFailure(uint64_t code) {
  Control* me = control(rank_);
  uint64_t none = 0;
  if (me->failure.compare_exchange_strong(none, code, std::memory_order_seq_cst)) {
    // peers asleep on this rank's counter look at its failure when they wake
    futexWakeAll(&me->seq);
  }
}

std::string ShmGroup::departure(int peer) const {
  const uint64_t code = control(peer)->failure.load(std::memory_order_acquire);
  return code == 0 ? std::string() : departure(peer, code);
}

std::string ShmGroup::departure(int peer, uint64_t code) const {
  auto known = [&](int64_t r) { return r >= 0 && r < worldSize_ ? static_cast<int>(r) : peer; };
  const auto why = static_cast<Failure>(code >> 56);
  const int origin = known(static_cast<int64_t>((code >> 32) & 0xffffff));
  const int cause = known(static_cast<int32_t>(code & 0xffffffffu));
  std::string reason;
  switch (why) {
    case Failure::kTimedOut:
      reason = rankName(origin) + " timed out waiting for " + rankName(cause);
      break;
    case Failure::kPeerExited:
      reason = "peer " + rankName(cause) + " (pid " + std::to_string(control(cause)->pid.load()) + ") exited";
      break;
    default:
      reason = rankName(origin) + " gave up on the group";
      break;
  }
  return "groupcomm: peer " + rankName(peer) + " left the shared-memory group (" + reason + ")";
}

void ShmGroup::throwIfFailed(int peer) {
  const uint64_t code = control(peer)->failure.load(std::memory_order_acquire);
  if (code != 0) {
    // the first failure is passed on: whoever waits on this rank learns it too
    throw fail(code, departure(peer, code), false);
  }
}

void ShmGroup::abort() {
  aborted_.store(true, std::memory_order_seq_cst);
  publishFailure(failureCode(Failure::kAborted, rank_, rank_));
  std::lock_guard<std::mutex> lock(p2pMutex_);
  if (p2p_) {
    p2p_->failAll("groupcomm: shared-memory group aborted");
  }
}

void ShmGroup::throwIfAborted() {
  if (aborted_.load(std::memory_order_relaxed)) {
    throw fail(failureCode(Failure::kAborted, rank_, rank_), "groupcomm: shared-memory group aborted", false);
  }
}

void ShmGroup::checkUsable() const {
  if (aborted_.load(std::memory_order_relaxed)) {
    throw CommFailure("groupcomm: shared-memory group aborted", false);
  }
  if (broken_) {
    throw CommFailure("groupcomm: shared-memory group unusable after an earlier failure", false);
  }
}

void ShmGroup::sync() {
  ++step_;
  Control* me = control(rank_);
  if (options_.crowded) {
    me->cpu.store(sched_getcpu(), std::memory_order_relaxed);
  }
  me->seq.store(step_, std::memory_order_seq_cst);
  if (me->waiters.load(std::memory_order_seq_cst) != 0) {
    futexWakeAll(&me->seq);
  }
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer != rank_) {
      waitFor(peer, step_);
    }
  }
}

void ShmGroup::waitFor(int peer, uint32_t target) {
  Control* c = control(peer);
  auto reached = [&](uint32_t seen) { return static_cast<int32_t>(seen - target) >= 0; };
  if (reached(c->seq.load(std::memory_order_acquire))) {
    return;
  }
  const auto start = Clock::now();
  const auto spinEnd = start + std::chrono::microseconds(options_.spinUs);
  if (options_.spinUs > 0 && spinUntil([&] { return reached(c->seq.load(std::memory_order_acquire)); }, spinEnd)) {
    return;
  }
  if (options_.crowded) {
    evenOutCores();
  }
  const auto yieldEnd = spinEnd + std::chrono::microseconds(options_.yieldUs);
  while (Clock::now() < yieldEnd) {
    sched_yield();
    if (reached(c->seq.load(std::memory_order_acquire))) {
      return;
    }
    throwIfAborted();
    throwIfFailed(peer);
  }
  const int64_t timeoutMs = this->timeoutMs();
  const auto deadline = start + std::chrono::milliseconds(timeoutMs);
  auto nextLivenessCheck = Clock::now();
  while (true) {
    uint32_t seen = c->seq.load(std::memory_order_seq_cst);
    if (reached(seen)) {
      return;
    }
    c->waiters.fetch_add(1, std::memory_order_seq_cst);
    futexWait(&c->seq, seen, kSleepSliceMs);
    c->waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(c->seq.load(std::memory_order_acquire))) {
      return;
    }
    throwIfAborted();
    throwIfFailed(peer);
    const auto now = Clock::now();
    if (now >= deadline) {
      throw fail(
          failureCode(Failure::kTimedOut, rank_, peer),
          "groupcomm: shared-memory wait timed out after " + std::to_string(timeoutMs) + " ms waiting for " +
              rankName(peer),
          true);
    }
    if (now >= nextLivenessCheck) {
      nextLivenessCheck = now + std::chrono::milliseconds(kLivenessEveryMs);
      for (int other = 0; other < worldSize_; ++other) {
        if (other != rank_) {
          throwIfFailed(other); // this op cannot complete without it either
        }
      }
      if (peerGone(peer)) {
        const int32_t pid = c->pid.load();
        throw fail(
            failureCode(Failure::kPeerExited, rank_, peer),
            "groupcomm: peer " + rankName(peer) + " (pid " + std::to_string(pid) + ") exited", false);
      }
    }
  }
}

// With more ranks than cores the kernel can leave, say, three ranks on one
// core and one on the other for a hundred milliseconds (it does not move a
// task that ran moments ago), and every collective then waits for three
// ranks' turns on the crowded core. A waiting rank whose core holds at least
// two more of the group's ranks than another core it may run on moves itself
// there: it pins itself to that core for an instant, then restores its
// affinity mask. Only the highest rank on the crowded core moves, and a
// process moves at most once per kCoreMoveEvery, so that groups with other
// members cannot undo each other quickly.
void ShmGroup::evenOutCores() {
  const auto now = Clock::now();
  if (now < nextCoreCheck_) {
    return;
  }
  nextCoreCheck_ = now + kCoreCheckEvery;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const int here = sched_getcpu();
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < 2 || here < 0 ||
      here >= CPU_SETSIZE || !CPU_ISSET(here, &allowed)) {
    return;
  }
  control(rank_)->cpu.store(here, std::memory_order_relaxed);
  ranksOnCore_.assign(CPU_SETSIZE, 0);
  for (int r = 0; r < worldSize_; ++r) {
    const int core = control(r)->cpu.load(std::memory_order_relaxed);
    if (core >= 0 && core < CPU_SETSIZE && CPU_ISSET(core, &allowed)) {
      ++ranksOnCore_[core];
      if (core == here && r > rank_) {
        return; // a higher rank shares this core: it is the one to move
      }
    }
  }
  int target = -1;
  for (int core = 0; core < CPU_SETSIZE; ++core) {
    if (CPU_ISSET(core, &allowed) && (target < 0 || ranksOnCore_[core] < ranksOnCore_[target])) {
      target = core;
    }
  }
  if (ranksOnCore_[here] - ranksOnCore_[target] < 2) {
    return;
  }
  static std::atomic<int64_t> lastMove{0};
  const int64_t nowNs = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
  int64_t last = lastMove.load();
  if (nowNs - last < std::chrono::nanoseconds(kCoreMoveEvery).count() ||
      !lastMove.compare_exchange_strong(last, nowNs)) {
    return;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(target, &one);
  if (sched_setaffinity(0, sizeof(one), &one) == 0) {
    sched_setaffinity(0, sizeof(allowed), &allowed);
    control(rank_)->cpu.store(target, std::memory_order_relaxed);
  }
}

void ShmGroup::barrier() {
  checkUsable();
  nextBuffer();
  sync();
}

void ShmGroup::broadcast(at::Tensor& tensor, int root) {
  checkUsable();
  auto* data = static_cast<char*>(tensor.data_ptr());
  const size_t total = tensor.nbytes();
  for (size_t off = 0; off < total; off += slotBytes()) {
    const size_t len = std::min(slotBytes(), total - off);
    const int b = nextBuffer();
    if (rank_ == root) {
      copyBytes(slot(root, b), data + off, len);
    }
    sync();
    if (rank_ != root) {
      copyBytes(data + off, slot(root, b), len);
    }
  }
}

void ShmGroup::allGather(at::Tensor& out, const at::Tensor& input, const std::vector<int64_t>& sizes) {
  allGatherInto(piecesOf(static_cast<char*>(out.data_ptr()), sizes), input, sizes);
}

void ShmGroup::allGatherInto(
    const std::vector<char*>& dsts,
    const at::Tensor& input,
    const std::vector<int64_t>& sizes) {
  checkUsable();
  TORCH_CHECK(
      static_cast<int>(sizes.size()) == worldSize_ && static_cast<int>(dsts.size()) == worldSize_,
      "groupcomm: all_gather needs one size and one destination per rank");
  const auto* src = static_cast<const char*>(input.data_ptr());
  const int64_t widest = *std::max_element(sizes.begin(), sizes.end());
  // A rank whose input lies in a shared block leaves it there for its peers.
  const bool inPlaceOp = mayReadInPlace(static_cast<size_t>(widest));
  const auto mine = inPlaceOp ? placeOf(src, sizes[rank_]) : std::nullopt;
  bool anyInPlace = false;
  for (size_t off = 0; off < static_cast<size_t>(widest); off += slotBytes()) {
    const int b = nextBuffer();
    if (off == 0 && inPlaceOp) {
      publishPlace(b, mine);
    }
    if (!mine) {
      copyBytes(slot(rank_, b), src + off, clampLen(sizes[rank_], off, slotBytes()));
    }
    sync();
    if (off == 0) {
      anyInPlace = mapPlaces(b, inPlaceOp);
    }
    for (int r = 0; r < worldSize_; ++r) {
      const size_t len = clampLen(sizes[r], off, slotBytes());
      const char* from = r == rank_ ? src + off : inPlace_[r] != nullptr ? inPlace_[r] + off : slot(r, b);
      copyBytes(dsts[r] + off, from, len);
    }
  }
  if (anyInPlace) {
    finishDirect();
  }
}

void ShmGroup::allToAll(
    at::Tensor& out,
    const at::Tensor& input,
    const std::vector<int64_t>& outSizes,
    const std::vector<int64_t>& inSizes) {
  allToAllBetween(
      piecesOf(static_cast<char*>(out.data_ptr()), outSizes),
      piecesOf(static_cast<const char*>(input.data_ptr()), inSizes), outSizes, inSizes);
}

void ShmGroup::allToAllBetween(
    const std::vector<char*>& dsts,
    const std::vector<const char*>& srcs,
    const std::vector<int64_t>& outSizes,
    const std::vector<int64_t>& inSizes) {
  checkUsable();
  const auto started = Clock::now();
  TORCH_CHECK(
      static_cast<int>(outSizes.size()) == worldSize_ && static_cast<int>(inSizes.size()) == worldSize_ &&
          static_cast<int>(dsts.size()) == worldSize_ && static_cast<int>(srcs.size()) == worldSize_,
      "groupcomm: all_to_all needs one size, source and destination per rank");
  // Where each peer finds its piece of this rank's input (direct reads).
  std::vector<int64_t> sourceAt(worldSize_);
  for (int j = 0; j < worldSize_; ++j) {
    sourceAt[j] = reinterpret_cast<intptr_t>(srcs[j]);
  }
  const size_t region = slotBytes() / worldSize_ / 64 * 64;
  int64_t localMax = 0;
  for (int r = 0; r < worldSize_; ++r) {
    localMax = std::max({localMax, outSizes[r], inSizes[r]});
  }
  // Each rank knows only its own row and column of the size matrix, so the
  // number of steps travels with the first step's data.
  int64_t globalMax = localMax;
  bool large = false;
  bool direct = false;
  uint64_t call = 0;
  for (size_t off = 0, step = 0; step == 0 || off < static_cast<size_t>(globalMax); off += region, ++step) {
    const int b = nextBuffer();
    char* mine = slot(rank_, b);
    for (int j = 0; j < worldSize_; ++j) {
      if (j != rank_) {
        copyBytes(mine + j * region, srcs[j] + off, clampLen(inSizes[j], off, region));
      }
    }
    if (step == 0) {
      meta(rank_, b)[0] = localMax;
      meta(rank_, b)[1] = reinterpret_cast<intptr_t>(sourceAt.data());
      meta(rank_, b)[2] = allToAllVote();
    }
    sync();
    if (step == 0) {
      for (int r = 0; r < worldSize_; ++r) {
        globalMax = std::max(globalMax, meta(r, b)[0]);
      }
      large = direct_ && static_cast<size_t>(globalMax) >= kDirectMinBytes;
      if (large) {
        call = allToAllPath_.largeCalls++;
        direct = allToAllDirect(call, b);
      }
    }
    for (int i = 0; i < worldSize_; ++i) {
      const char* from = i == rank_ ? srcs[rank_] + off : slot(i, b) + rank_ * region;
      copyBytes(dsts[i] + off, from, clampLen(outSizes[i], off, region));
    }
    if (step == 0 && direct) {
      // The first region came through the segment, the rest comes straight
      // from each peer's input, where the peer's table says its piece lies.
      for (int k = 1; k < worldSize_; ++k) {
        const int i = (rank_ + k) % worldSize_;
        const size_t rest = clampLen(outSizes[i], region, SIZE_MAX);
        if (rest != 0) {
          int64_t at = 0;
          readFrom(i, meta(i, b)[1] + rank_ * static_cast<int64_t>(sizeof(int64_t)), &at, sizeof(at));
          readFrom(i, at + static_cast<int64_t>(region), dsts[i] + region, rest);
        }
      }
      copyBytes(dsts[rank_] + region, srcs[rank_] + region, clampLen(outSizes[rank_], region, SIZE_MAX));
      finishDirect();
      break;
    }
  }
  if (!large || call < AllToAllPath::kWarmup || call >= AllToAllPath::kWarmup + AllToAllPath::kTrials) {
    return; // only the trials are timed
  }
  const int64_t received = std::accumulate(outSizes.begin(), outSizes.end(), int64_t{0});
  if (received > 0) {
    const double ns = std::chrono::duration<double, std::nano>(Clock::now() - started).count() / received;
    double& best = allToAllPath_.bestNsPerByte[direct ? 1 : 0];
    if (best == 0.0 || ns < best) {
      best = ns;
    }
  }
}

int64_t ShmGroup::allToAllVote() const {
  const double* best = allToAllPath_.bestNsPerByte;
  if (best[0] == 0.0 || best[1] == 0.0) {
    return -1; // no opinion yet
  }
  return best[1] <= best[0] ? 1 : 0;
}

bool ShmGroup::allToAllDirect(uint64_t call, int buffer) const {
  if (call < AllToAllPath::kWarmup + AllToAllPath::kTrials) {
    return call % 2 == 0;
  }
  int forDirect = 0;
  int forSegment = 0;
  for (int r = 0; r < worldSize_; ++r) {
    forDirect += meta(r, buffer)[2] == 1;
    forSegment += meta(r, buffer)[2] == 0;
  }
  return forDirect >= forSegment;
}

void ShmGroup::gather(
    std::vector<at::Tensor>& outs,
    const at::Tensor& input,
    const std::vector<int64_t>& sizes,
    int root) {
  checkUsable();
  TORCH_CHECK(
      static_cast<int>(sizes.size()) == worldSize_ && sizes[rank_] == static_cast<int64_t>(input.nbytes()),
      "groupcomm: gather needs one size per rank, this rank's its input's");
  TORCH_CHECK(
      rank_ != root || static_cast<int>(outs.size()) == worldSize_,
      "groupcomm: gather needs one output per rank on the root");
  const auto* src = static_cast<const char*>(input.data_ptr());
  const int64_t widest = *std::max_element(sizes.begin(), sizes.end());
  for (size_t off = 0; off < static_cast<size_t>(widest); off += slotBytes()) {
    const int b = nextBuffer();
    if (rank_ != root) {
      copyBytes(slot(rank_, b), src + off, clampLen(sizes[rank_], off, slotBytes()));
    }
    sync();
    if (rank_ == root) {
      for (int r = 0; r < worldSize_; ++r) {
        copyBytes(
            static_cast<char*>(outs[r].data_ptr()) + off, r == root ? src + off : slot(r, b),
            clampLen(sizes[r], off, slotBytes()));
      }
    }
  }
}

void ShmGroup::scatter(at::Tensor& out, const std::vector<at::Tensor>& ins, int root) {
  checkUsable();
  TORCH_CHECK(
      rank_ != root || static_cast<int>(ins.size()) == worldSize_,
      "groupcomm: scatter needs one input per rank on the root");
  auto* dst = static_cast<char*>(out.data_ptr());
  const size_t total = out.nbytes();
  if (direct_ && total >= kDirectMinBytes && worldSize_ * sizeof(int64_t) <= slotBytes()) {
    const int b = nextBuffer();
    auto* table = reinterpret_cast<int64_t*>(slot(root, b));
    if (rank_ == root) {
      for (int j = 0; j < worldSize_; ++j) {
        table[j] = reinterpret_cast<intptr_t>(ins[j].data_ptr());
      }
    }
    sync();
    if (rank_ == root) {
      copyBytes(dst, ins[root].data_ptr(), total);
    } else {
      readFrom(root, table[rank_], dst, total);
    }
    finishDirect();
    return;
  }
  const size_t region = slotBytes() / worldSize_ / 64 * 64;
  for (size_t off = 0; off < total; off += region) {
    const size_t len = std::min(region, total - off);
    const int b = nextBuffer();
    if (rank_ == root) {
      for (int j = 0; j < worldSize_; ++j) {
        if (j != root) {
          copyBytes(slot(root, b) + j * region, static_cast<const char*>(ins[j].data_ptr()) + off, len);
        }
      }
    }
    sync();
    const char* from = rank_ == root ? static_cast<const char*>(ins[root].data_ptr()) + off
                                     : slot(root, b) + rank_ * region;
    copyBytes(dst + off, from, len);
  }
}

void ShmGroup::allReduce(at::Tensor& tensor, RedKind kind, double factor) {
  reduce(tensor, -1, kind, factor);
}

void ShmGroup::allReduceInto(at::Tensor& out, const at::Tensor& input, RedKind kind, double factor) {
  TORCH_CHECK(
      out.scalar_type() == input.scalar_type() && out.numel() == input.numel(),
      "groupcomm: all_reduce into a tensor needs one dtype and one size, got ", out.scalar_type(), "[", out.numel(),
      "] and ", input.scalar_type(), "[", input.numel(), "]");
  reduceFrom(
      static_cast<char*>(out.data_ptr()), static_cast<const char*>(input.data_ptr()), input.scalar_type(),
      static_cast<size_t>(input.numel()), -1, kind, factor);
}

void ShmGroup::reduce(at::Tensor& tensor, int root, RedKind kind, double factor) {
  auto* data = static_cast<char*>(tensor.data_ptr());
  reduceFrom(data, data, tensor.scalar_type(), static_cast<size_t>(tensor.numel()), root, kind, factor);
}

// root == -1: every rank receives the result (all-reduce). `src` is read,
// `data` written: the same place for an in-place op. Out of place, this
// rank publishes only the block `data` lies in, if any (its peers must not
// write into its input), so the ranks' protocol is the same whichever form
// each of them calls.
void ShmGroup::reduceFrom(
    char* data,
    const char* src,
    c10::ScalarType dtype,
    size_t count,
    int root,
    RedKind kind,
    double factor) {
  checkUsable();
  const size_t elem = c10::elementSize(dtype);
  const bool everyone = root < 0;
  if (worldSize_ == 1) {
    // Alone, the input is the result; only PREMUL_SUM changes it.
    copyBytes(data, src, count * elem);
    if (kind == RedKind::PremulSum) {
      const void* self = data;
      reduceInto(dtype, kind, factor, data, &self, 1, count);
    }
    return;
  }
  const size_t perStep = slotBytes() / elem;
  std::vector<const void*> inputs(worldSize_);
  const bool direct = count * elem <= kDirectReduceBytes || count < static_cast<size_t>(worldSize_) * 16;
  // A rank whose tensor lies in a shared block leaves it there: its peers
  // read its parts and, once reduced, its slice where they lie. Where every
  // rank's does, reduceAllInPlace does the rest after the first sync.
  const bool inPlaceOp = everyone && !direct && mayReadInPlace(count * elem);
  const bool streamed = everyone && src != data && elem >= 4 && count * elem >= kStreamedResultBytes;
  auto collect = streamed ? streamBytes : copyBytes;
  const auto place = inPlaceOp ? placeOf(data, count * elem) : std::nullopt;
  // Out of place into a block: the peers read this rank's input there, so
  // it is copied in, but for the slice this rank reduces itself (from src).
  // Should a peer's tensor lie outside a block, that slice is copied in
  // after the first sync, and every rank syncs once more.
  const bool ownSliceLater = place && src != data;
  const auto [ownLo, ownHi] = sliceOf(count, rank_, worldSize_);
  if (ownSliceLater) {
    copyBytes(data, src, ownLo * elem);
    copyBytes(data + ownHi * elem, src + ownHi * elem, (count - ownHi) * elem);
  }
  bool anyInPlace = false;
  for (size_t first = 0, len = 0; first < count; first += len) {
    len = std::min(perStep, count - first);
    char* chunk = data + first * elem;
    const char* from = src + first * elem;
    const int b = nextBuffer();
    if (direct) {
      copyBytes(slot(rank_, b), from, len * elem);
      sync();
      if (everyone || rank_ == root) {
        for (int r = 0; r < worldSize_; ++r) {
          inputs[r] = slot(r, b);
        }
        reduceInto(dtype, kind, factor, chunk, inputs.data(), worldSize_, len);
      }
      continue;
    }
    // Each rank reduces its own slice: its peers' parts of it from their
    // slots, its own straight from the tensor (it never goes through the
    // slot first). The result lands where it is read next: in the tensor of
    // a rank that receives the result (and, for an all-reduce, in its slot
    // for the peers), in the slot of a rank that does not. Then everyone (or
    // the root) collects the others' reduced slices. An all-reduce writes its
    // slice to the slot block by block as it is reduced, from L1.
    const auto [lo, hi] = sliceOf(len, rank_, worldSize_);
    char* mine = slot(rank_, b);
    if (first == 0 && inPlaceOp) {
      publishPlace(b, place, ownSliceLater);
    }
    if (!place) {
      copyBytes(mine, from, lo * elem);
      copyBytes(mine + hi * elem, from + hi * elem, (len - hi) * elem);
    }
    sync();
    if (first == 0) {
      anyInPlace = mapPlaces(b, inPlaceOp);
      if (place && std::count(inPlace_.begin(), inPlace_.end(), nullptr) == 1) {
        return reduceAllInPlace(data, src, dtype, kind, factor, count);
      }
      if (anyInPlace && anyOwnSliceLater(b)) {
        if (ownSliceLater) {
          copyBytes(data + ownLo * elem, src + ownLo * elem, (ownHi - ownLo) * elem);
        }
        sync();
      }
    }
    auto partOf = [&](int r) -> const char* {
      return inPlace_[r] == nullptr ? slot(r, b) : inPlace_[r] + first * elem;
    };
    if (hi > lo) {
      for (int r = 0; r < worldSize_; ++r) {
        inputs[r] = (r == rank_ ? from : partOf(r)) + lo * elem;
      }
      void* mirror = mine + lo * elem;
      if (streamed) {
        // reduced into the slot (where the peers read it), then streamed out
        reduceInto(dtype, kind, factor, mirror, inputs.data(), worldSize_, hi - lo);
        streamBytes(chunk + lo * elem, mirror, (hi - lo) * elem);
      } else {
        char* out = (everyone || rank_ == root ? chunk : mine) + lo * elem;
        reduceInto(dtype, kind, factor, out, inputs.data(), worldSize_, hi - lo, &mirror, everyone && !place ? 1 : 0);
      }
    }
    sync();
    if (everyone || rank_ == root) {
      for (int r = 0; r < worldSize_; ++r) {
        if (r != rank_) {
          const auto [rlo, rhi] = sliceOf(len, r, worldSize_);
          collect(chunk + rlo * elem, partOf(r) + rlo * elem, (rhi - rlo) * elem);
        }
      }
    }
  }
  if (anyInPlace) {
    finishDirect();
  }
}

void ShmGroup::reduceAllInPlace(
    char* data,
    const char* src,
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    size_t count) {
  // Every rank's tensor lies in a shared block, mapped here: each reduces
  // its slice of the whole tensor from all of them and writes the result
  // into every one, so nothing is gathered afterwards and no slot is used.
  const size_t elem = c10::elementSize(dtype);
  const auto [lo, hi] = sliceOf(count, rank_, worldSize_);
  if (hi > lo) {
    std::vector<const void*> inputs(worldSize_);
    std::vector<void*> peers;
    for (int r = 0; r < worldSize_; ++r) {
      char* at = (r == rank_ ? data : inPlace_[r]) + lo * elem;
      inputs[r] = r == rank_ ? src + lo * elem : at;
      if (r != rank_) {
        peers.push_back(at);
      }
    }
    reduceInto(
        dtype, kind, factor, data + lo * elem, inputs.data(), worldSize_, hi - lo, peers.data(),
        static_cast<int>(peers.size()));
  }
  sync(); // every slice written everywhere: no rank touches another's tensor after this
}

void ShmGroup::reduceScatter(
    at::Tensor& out,
    const at::Tensor& input,
    const std::vector<int64_t>& sizes,
    RedKind kind,
    double factor) {
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "groupcomm: reduce_scatter needs one dtype");
  const auto* whole = static_cast<const char*>(input.data_ptr());
  std::vector<int64_t> bytes(sizes);
  for (auto& n : bytes) {
    n *= static_cast<int64_t>(input.element_size());
  }
  reduceScatterPieces(out, piecesOf(whole, bytes), whole, sizes, kind, factor);
}

void ShmGroup::reduceScatterFrom(
    at::Tensor& out,
    const std::vector<const char*>& srcs,
    const std::vector<int64_t>& sizes,
    RedKind kind,
    double factor) {
  reduceScatterPieces(out, srcs, nullptr, sizes, kind, factor);
}

void ShmGroup::reduceScatterPieces(
    at::Tensor& out,
    const std::vector<const char*>& srcs,
    const char* whole,
    const std::vector<int64_t>& sizes,
    RedKind kind,
    double factor) {
  checkUsable();
  TORCH_CHECK(
      static_cast<int>(sizes.size()) == worldSize_ && static_cast<int>(srcs.size()) == worldSize_,
      "groupcomm: reduce_scatter needs one size and one slice per rank");
  const c10::ScalarType dtype = out.scalar_type();
  const size_t elem = out.element_size();
  auto* dst = static_cast<char*>(out.data_ptr());
  const auto displ = displacements(sizes);
  const size_t window = slotBytes() / worldSize_ / elem / 16 * 16;
  TORCH_CHECK(window > 0, "groupcomm: shared-memory slot too small for ", worldSize_, " ranks");
  const int64_t widest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<const void*> inputs(worldSize_);
  // A rank whose input lies in a shared block leaves it there for its peers;
  // the peers' inputs are read at the same displacements as this rank's.
  const size_t inputBytes = (displ.back() + sizes.back()) * elem;
  const bool inPlaceOp = mayReadInPlace(inputBytes);
  const auto place = inPlaceOp && whole != nullptr ? placeOf(whole, inputBytes) : std::nullopt;
  bool anyInPlace = false;
  for (size_t first = 0; first < static_cast<size_t>(widest); first += window) {
    const int b = nextBuffer();
    char* mine = slot(rank_, b);
    if (first == 0 && inPlaceOp) {
      publishPlace(b, place);
    }
    for (int j = 0; j < worldSize_ && !place; ++j) {
      if (j == rank_) {
        continue; // reduced straight from the input below
      }
      copyBytes(mine + j * window * elem, srcs[j] + first * elem, clampLen(sizes[j], first, window) * elem);
    }
    sync();
    if (first == 0) {
      anyInPlace = mapPlaces(b, inPlaceOp);
    }
    const size_t len = clampLen(sizes[rank_], first, window);
    if (len > 0) {
      const size_t at = (displ[rank_] + first) * elem;
      for (int r = 0; r < worldSize_; ++r) {
        inputs[r] = r == rank_       ? srcs[rank_] + first * elem
            : inPlace_[r] != nullptr ? inPlace_[r] + at
                                     : slot(r, b) + rank_ * window * elem;
      }
      reduceInto(dtype, kind, factor, dst + first * elem, inputs.data(), worldSize_, len);
    }
  }
  if (anyInPlace) {
    finishDirect();
  }
}

} // namespace groupcomm
