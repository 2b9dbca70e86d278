#include "shm/p2p.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include <sched.h>

#include "comm_failure.h"
#include "shm/group.h"
#include "shm/sync.h"

namespace groupcomm {
namespace {

constexpr int64_t kIdleSleepMs = 5;
constexpr int64_t kLivenessEveryMs = 100;
constexpr size_t kEagerBytes = 64 << 10;
constexpr std::chrono::milliseconds kPark{20};

void ringWrite(char* ring, size_t ringBytes, uint64_t pos, const char* src, size_t len) {
  const size_t off = pos % ringBytes;
  const size_t first = std::min(len, ringBytes - off);
  std::memcpy(ring + off, src, first);
  std::memcpy(ring, src + first, len - first);
}

void ringRead(const char* ring, size_t ringBytes, uint64_t pos, char* dst, size_t len) {
  const size_t off = pos % ringBytes;
  const size_t first = std::min(len, ringBytes - off);
  std::memcpy(dst, ring + off, first);
  std::memcpy(dst + first, ring, len - first);
}

std::string sizeMismatch(size_t wanted, size_t got, int src) {
  return "groupcomm: recv of " + std::to_string(wanted) + " bytes matched a message of " + std::to_string(got) +
      " bytes from rank " + std::to_string(src);
}

} // namespace

P2PRequest::P2PRequest(bool isSend, int peer, int tag, at::Tensor tensor)
    : isSend_(isSend),
      peer_(peer),
      tag_(tag),
      tensor_(std::move(tensor)),
      data_(static_cast<char*>(tensor_.data_ptr())),
      size_(tensor_.nbytes()) {}

void P2PRequest::finish(int source) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_.load() != kPending) {
      return; // failed meanwhile (abort)
    }
    source_ = source;
    state_.store(kDone);
    future = future_; // kept: the request may hold its last reference
  }
  cv_.notify_all();
  if (future) {
    future->markCompleted(c10::IValue(std::move(outputs_)));
  }
}

void P2PRequest::fail(const std::string& why, bool timedOut) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_.load() != kPending) {
      return;
    }
    error_ = why;
    timedOut_ = timedOut;
    state_.store(kFailed);
    if (future_) {
      future = future_;
      failure = this->failure();
    }
  }
  cv_.notify_all();
  if (future) {
    future->setError(failure);
  }
}

std::exception_ptr P2PRequest::failure() const {
  return std::make_exception_ptr(
      CommFailure(context_ + (timedOut_ ? " timed out: " : " failed: ") + error_, timedOut_));
}

bool P2PRequest::expired(std::chrono::steady_clock::time_point now) const {
  const int64_t deadline = deadlineNs_.load(std::memory_order_acquire);
  return deadline != 0 && now.time_since_epoch().count() >= deadline;
}

c10::intrusive_ptr<c10::ivalue::Future> P2PRequest::future(
    std::vector<at::Tensor> outputs,
    std::string context,
    int64_t timeoutMs) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    context_ = std::move(context);
    if (state_.load() == kPending) {
      future_ = future;
      outputs_ = std::move(outputs);
      timeoutMs_ = timeoutMs;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
      deadlineNs_.store(deadline.time_since_epoch().count());
      return future;
    }
    if (state_.load() == kFailed) {
      failure = this->failure();
    }
  }
  if (failure) {
    future->setError(failure);
  } else {
    future->markCompleted(c10::IValue(std::move(outputs)));
  }
  return future;
}

void P2PRequest::wait(int64_t timeoutMs) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool finished = cv_.wait_for(
      lock, std::chrono::milliseconds(timeoutMs), [&] { return state_.load() != kPending; });
  if (!finished) {
    throw CommFailure(
        std::string("groupcomm: shared-memory ") + (isSend_ ? "send" : "recv") + " timed out after " +
            std::to_string(timeoutMs) + " ms",
        true);
  }
  if (state_.load() == kFailed) {
    throw CommFailure(error_, timedOut_);
  }
  tensor_ = at::Tensor(); // release the buffer as soon as we are done
}

ShmP2P::ShmP2P(ShmGroup& group)
    : group_(group), sends_(group.worldSize()), inbound_(group.worldSize()), directSent_(group.worldSize(), 0) {
  thread_ = std::thread([this] { loop(); });
}

ShmP2P::~ShmP2P() {
  stop_.store(true);
  group_.wakeDoorbell(group_.rank());
  thread_.join();
  for (int src = 0; src < group_.worldSize(); ++src) {
    failInbound(src, "groupcomm: group destroyed with a recv pending");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& queue : sends_) {
    for (auto& request : queue) {
      request->fail("groupcomm: group destroyed with a send pending");
    }
  }
  for (auto& request : recvs_) {
    request->fail("groupcomm: group destroyed with a recv pending");
  }
}

void ShmP2P::retire(std::shared_ptr<P2PRequest>&& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  retired_.push_back(std::move(request));
}

void ShmP2P::dropRetired() {
  std::vector<std::shared_ptr<P2PRequest>> retired;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    retired.swap(retired_);
  }
}

void ShmP2P::ring(int rank) {
  group_.ringDoorbell(rank);
}

std::shared_ptr<P2PRequest> ShmP2P::send(at::Tensor tensor, int dst, int tag) {
  auto request = std::make_shared<P2PRequest>(true, dst, tag, std::move(tensor));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) {
      request->fail(failure_);
      return request;
    }
    sends_[dst].push_back(request);
  }
  std::unique_lock<std::mutex> mover(progressMutex_, std::try_to_lock);
  if (mover.owns_lock()) {
    pushSend(dst);
  }
  ring(group_.rank());
  dropRetired();
  return request;
}

std::shared_ptr<P2PRequest> ShmP2P::recv(at::Tensor tensor, int src, int tag) {
  auto request = std::make_shared<P2PRequest>(false, src, tag, std::move(tensor));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) {
      request->fail(failure_);
      return request;
    }
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      if ((src < 0 || it->source == src) && it->tag == tag) {
        if (it->payload.size() != request->size_) {
          request->fail(sizeMismatch(request->size_, it->payload.size(), it->source));
        } else {
          std::memcpy(request->data_, it->payload.data(), request->size_);
          request->finish(it->source);
        }
        unexpected_.erase(it);
        return request;
      }
    }
    recvs_.push_back(request);
  }
  std::unique_lock<std::mutex> mover(progressMutex_, std::try_to_lock);
  if (mover.owns_lock()) {
    progress();
  }
  ring(group_.rank());
  dropRetired();
  return request;
}

void ShmP2P::drive(const P2PRequest& request) {
  const ShmGroup::Options& options = group_.options();
  const auto spinEnd = std::chrono::steady_clock::now() + std::chrono::microseconds(options.spinUs);
  const auto end = spinEnd + std::chrono::microseconds(options.yieldUs);
  drivers_.fetch_add(1);
  while (!request.completed()) {
    {
      std::unique_lock<std::mutex> mover(progressMutex_, std::try_to_lock);
      if (mover.owns_lock()) {
        progress();
      }
    }
    if (request.completed()) {
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) {
      break;
    }
    if (now < spinEnd) {
      cpuRelax();
    } else {
      sched_yield();
    }
  }
  if (drivers_.fetch_sub(1) == 1 && pending()) {
    group_.wakeDoorbell(group_.rank()); // the progress thread takes over
  }
  dropRetired();
}

bool ShmP2P::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!recvs_.empty()) {
    return true;
  }
  for (const auto& queue : sends_) {
    if (!queue.empty()) {
      return true;
    }
  }
  return false;
}

std::shared_ptr<P2PRequest> ShmP2P::takeMatchingRecv(int src, int tag) {
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    if (((*it)->peer_ < 0 || (*it)->peer_ == src) && (*it)->tag_ == tag) {
      auto request = *it;
      recvs_.erase(it);
      return request;
    }
  }
  return nullptr;
}

bool ShmP2P::recvWaitingOn(int src) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& request : recvs_) {
    if (request->peer_ < 0 || request->peer_ == src) {
      return true;
    }
  }
  return false;
}

// Decide where a message without a posted receive goes. A small one is read
// aside at once. A large one stays in the ring (its sender stalls once the
// ring is full) until its receive is posted, which saves allocating and
// copying it twice in the common case of a receive posted just late; it is
// read aside after all when a receive from this source wants a message
// behind it, or when it has waited kPark, so no program that works with
// eager buffering can stall on it.
bool ShmP2P::admit(int src, Inbound& in) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in.target = takeMatchingRecv(src, in.tag);
  }
  if (in.target && in.target->size_ != in.size) {
    in.target->fail(sizeMismatch(in.target->size_, in.size, src));
    retire(std::move(in.target));
    in.discard = true;
  }
  if (in.target || in.discard) {
    in.parked = false;
    return true;
  }
  if (in.size > kEagerBytes && !recvWaitingOn(src) && std::chrono::steady_clock::now() - in.parkedSince < kPark) {
    return false;
  }
  in.spill.resize(in.size);
  in.parked = false;
  return true;
}

bool ShmP2P::pushSend(int dst) {
  std::shared_ptr<P2PRequest> request;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (sends_[dst].empty()) {
      return false;
    }
    request = sends_[dst].front();
  }
  ShmGroup::Channel channel = group_.channel(group_.rank(), dst);
  const uint64_t written = channel.head->written.load(std::memory_order_relaxed);
  const uint64_t consumed = channel.head->consumed.load(std::memory_order_acquire);
  size_t room = channel.bytes - static_cast<size_t>(written - consumed);
  const bool direct = group_.direct() && request->size_ >= ShmGroup::kDirectMinBytes;
  const size_t total = kHeaderBytes + (direct ? 0 : request->size_);
  uint64_t pos = written;
  while (room > 0 && request->done_ < total) {
    if (request->done_ < kHeaderBytes) {
      char header[kHeaderBytes] = {};
      const int32_t tag = request->tag_;
      const int32_t isDirect = direct ? 1 : 0;
      const uint64_t size = request->size_;
      const auto address = reinterpret_cast<intptr_t>(request->data_);
      std::memcpy(header, &tag, sizeof(tag));
      std::memcpy(header + 4, &isDirect, sizeof(isDirect));
      std::memcpy(header + 8, &size, sizeof(size));
      std::memcpy(header + 16, &address, sizeof(address));
      const size_t n = std::min(room, kHeaderBytes - request->done_);
      ringWrite(channel.data, channel.bytes, pos, header + request->done_, n);
      request->done_ += n;
      pos += n;
      room -= n;
    } else {
      const size_t offset = request->done_ - kHeaderBytes;
      const size_t n = std::min(room, request->size_ - offset);
      ringWrite(channel.data, channel.bytes, pos, request->data_ + offset, n);
      request->done_ += n;
      pos += n;
      room -= n;
    }
  }
  if (pos != written) {
    channel.head->written.store(pos, std::memory_order_release);
    ring(dst);
    if (direct && request->done_ == total) {
      request->ackTarget_ = ++directSent_[dst];
    }
  }
  const bool acked = !direct ||
      (request->ackTarget_ != 0 && channel.head->acked.load(std::memory_order_acquire) >= request->ackTarget_);
  if (request->done_ == total && acked) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& queue = sends_[dst];
      if (!queue.empty() && queue.front() == request) { // not failed meanwhile
        retired_.push_back(std::move(queue.front()));
        queue.pop_front();
      }
    }
    request->finish(group_.rank());
    return true;
  }
  return pos != written;
}

std::string ShmP2P::lost(int peer, int err) const {
  auto exited = [&] { return "groupcomm: peer " + group_.rankName(peer) + " exited"; };
  if (group_.peerGone(peer)) {
    return exited();
  }
  std::string departed = group_.departure(peer);
  return departed.empty() && err == ESRCH ? exited() : departed;
}

void ShmP2P::readDirect(int src, Inbound& in) {
  // A sender that gave up on the group has failed its sends and may have
  // freed their memory already: what is there now is not the message.
  std::string why = group_.departure(src);
  if (why.empty()) {
    char* to = in.target ? in.target->data_ : in.spill.data();
    if (group_.readPeer(src, in.address, to, in.size)) {
      return;
    }
    const int err = errno;
    why = lost(src, err);
    if (why.empty()) {
      why = "groupcomm: reading a message from " + group_.rankName(src) + " failed: " + std::strerror(err);
    }
  }
  if (in.target) {
    in.target->fail(why);
  } else {
    in.discard = true; // nobody asked for it yet; its sender is gone
  }
}

bool ShmP2P::pullFrom(int src) {
  ShmGroup::Channel channel = group_.channel(src, group_.rank());
  const uint64_t consumed = channel.head->consumed.load(std::memory_order_relaxed);
  const uint64_t written = channel.head->written.load(std::memory_order_acquire);
  size_t avail = static_cast<size_t>(written - consumed);
  Inbound& in = inbound_[src];
  if (in.broken) {
    return false;
  }
  uint64_t pos = consumed;
  bool progressed = false;
  while (true) {
    if (in.headerGot < kHeaderBytes) {
      const size_t n = std::min(avail, kHeaderBytes - in.headerGot);
      ringRead(channel.data, channel.bytes, pos, in.header + in.headerGot, n);
      in.headerGot += n;
      pos += n;
      avail -= n;
      if (in.headerGot < kHeaderBytes) {
        break;
      }
      int32_t tag = 0;
      int32_t isDirect = 0;
      uint64_t size = 0;
      std::memcpy(&tag, in.header, sizeof(tag));
      std::memcpy(&isDirect, in.header + 4, sizeof(isDirect));
      std::memcpy(&size, in.header + 8, sizeof(size));
      std::memcpy(&in.address, in.header + 16, sizeof(in.address));
      in.tag = tag;
      in.direct = isDirect != 0;
      in.size = size;
      in.got = 0;
      in.parked = true;
      in.parkedSince = std::chrono::steady_clock::now();
    }
    if (in.parked && !admit(src, in)) {
      break;
    }
    if (in.direct) {
      if (!in.discard) {
        readDirect(src, in);
      }
      in.got = in.size; // a discarded one is acknowledged all the same
    }
    const size_t n = in.direct ? 0 : std::min(avail, in.size - in.got);
    if (!in.discard) {
      char* dst = in.target ? in.target->data_ : in.spill.data();
      ringRead(channel.data, channel.bytes, pos, dst + in.got, n);
    }
    in.got += n;
    pos += n;
    avail -= n;
    if (in.got < in.size) {
      break;
    }
    const bool spilled = !in.target && !in.discard;
    if (spilled) {
      // A receive may have been posted while this message was spilling. The
      // lookup and the stash share one critical section: a receive posted
      // between them would miss the message in both lists and never end.
      std::lock_guard<std::mutex> lock(mutex_);
      in.target = takeMatchingRecv(src, in.tag);
      if (!in.target) {
        unexpected_.push_back(Unexpected{src, in.tag, std::move(in.spill)});
      }
    }
    if (in.target && spilled) {
      if (in.target->size_ == in.size) {
        std::memcpy(in.target->data_, in.spill.data(), in.size);
      } else {
        in.target->fail(sizeMismatch(in.target->size_, in.size, src));
      }
    }
    if (in.target) {
      in.target->finish(src); // no-op when it already failed
      retire(std::move(in.target));
    }
    if (in.direct) {
      channel.head->acked.fetch_add(1, std::memory_order_acq_rel);
      ring(src);
    }
    in.spill = {};
    in.discard = false;
    in.direct = false;
    in.headerGot = 0;
    progressed = true;
    if (avail == 0) {
      break;
    }
  }
  if (pos != consumed) {
    channel.head->consumed.store(pos, std::memory_order_release);
    ring(src);
    progressed = true;
  }
  return progressed;
}

bool ShmP2P::progress() {
  bool progressed = false;
  for (int peer = 0; peer < group_.worldSize(); ++peer) {
    if (peer != group_.rank()) {
      progressed |= pushSend(peer);
      progressed |= pullFrom(peer);
    }
  }
  return progressed;
}

void ShmP2P::failInbound(int src, const std::string& why, bool timedOut) {
  Inbound& in = inbound_[src];
  if (in.target) {
    in.target->fail(why, timedOut);
    retire(std::move(in.target));
    in.broken = true;
  }
}

void ShmP2P::expire() {
  const auto now = std::chrono::steady_clock::now();
  auto why = [](const std::shared_ptr<P2PRequest>& request) {
    return std::string("groupcomm: shared-memory ") + (request->isSend_ ? "send to" : "recv from") + " rank " +
        std::to_string(request->peer_) + " did not complete within " + std::to_string(request->timeoutMs_) + " ms";
  };
  std::lock_guard<std::mutex> mover(progressMutex_); // keeps done_ still
  for (int src = 0; src < group_.worldSize(); ++src) {
    const auto& target = inbound_[src].target;
    if (target && target->expired(now)) {
      failInbound(src, why(target), true);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  failQueued(
      [&](const P2PRequest& r) { return (!r.isSend_ || r.done_ == 0) && r.expired(now); },
      [&](const std::shared_ptr<P2PRequest>& r) { return why(r); }, true);
}

template <typename Which, typename Why>
void ShmP2P::failQueued(Which which, Why why, bool timedOut) {
  auto sweep = [&](auto& queue) {
    for (auto it = queue.begin(); it != queue.end();) {
      if (which(**it)) {
        (*it)->fail(why(*it), timedOut);
        retired_.push_back(std::move(*it));
        it = queue.erase(it);
      } else {
        ++it;
      }
    }
  };
  for (auto& queue : sends_) {
    sweep(queue);
  }
  sweep(recvs_);
}

void ShmP2P::failAll(const std::string& why) {
  {
    std::lock_guard<std::mutex> mover(progressMutex_);
    for (int src = 0; src < group_.worldSize(); ++src) {
      failInbound(src, why);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  failure_ = why;
  failQueued([](const P2PRequest&) { return true; }, [&](const std::shared_ptr<P2PRequest>&) { return why; }, false);
}

void ShmP2P::loop() {
  const int me = group_.rank();
  const int world = group_.worldSize();
  auto nextLivenessCheck = std::chrono::steady_clock::now();
  auto idleSince = std::chrono::steady_clock::now();
  const ShmGroup::Options& options = group_.options();
  while (!stop_.load()) {
    const uint32_t bell = group_.doorbell(me);
    bool progressed;
    {
      std::lock_guard<std::mutex> mover(progressMutex_);
      progressed = progress();
    }
    if (progressed) {
      idleSince = std::chrono::steady_clock::now();
      continue;
    }
    const bool pending = this->pending();
    // With work outstanding, poll (yielding the core) for a short while
    // before sleeping: a reply usually comes within microseconds. Not while
    // a waiter polls itself (drive): the two would only take turns.
    if (pending && drivers_.load() == 0 &&
        std::chrono::steady_clock::now() - idleSince < std::chrono::microseconds(options.yieldUs)) {
      sched_yield();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= nextLivenessCheck) {
      nextLivenessCheck = now + std::chrono::milliseconds(kLivenessEveryMs);
      expire();
      for (int peer = 0; peer < world; ++peer) {
        if (peer == me) {
          continue;
        }
        // a peer that exited, or gave up on the group, answers no more
        const std::string why = lost(peer);
        if (why.empty()) {
          continue;
        }
        {
          // What it wrote before it left is delivered first: this pass may
          // have looked at its ring just before the last message landed.
          std::lock_guard<std::mutex> mover(progressMutex_);
          pullFrom(peer);
          failInbound(peer, why);
        }
        std::lock_guard<std::mutex> lock(mutex_);
        failQueued(
            [&](const P2PRequest& r) { return r.peer_ == peer; },
            [&](const std::shared_ptr<P2PRequest>&) { return why; }, false);
      }
    }
    // While a waiter polls, peers need not wake this thread: it sleeps
    // unheard until the waiter leaves.
    group_.waitDoorbell(me, bell, kIdleSleepMs, drivers_.load() == 0);
  }
}

} // namespace groupcomm
