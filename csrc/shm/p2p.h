#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace groupcomm {

class ShmGroup;

// One posted send or receive. Completed by the progress thread.
class P2PRequest {
 public:
  P2PRequest(bool isSend, int peer, int tag, at::Tensor tensor);

  // Block (no GIL) until done; throws on failure or after timeoutMs.
  void wait(int64_t timeoutMs);
  bool completed() const {
    return state_.load() != kPending;
  }
  // The sender's rank once a receive is done (useful for any-source).
  int source() const {
    return source_;
  }
  // A future the progress thread completes with `outputs` when the transfer
  // is done, so a waiter needs no thread of its own. A failure, or no
  // completion within timeoutMs, sets a CommFailure whose message starts
  // with `context`.
  c10::intrusive_ptr<c10::ivalue::Future> future(
      std::vector<at::Tensor> outputs,
      std::string context,
      int64_t timeoutMs);

 private:
  friend class ShmP2P;
  static constexpr int kPending = 0;
  static constexpr int kDone = 1;
  static constexpr int kFailed = 2;
  void finish(int source);
  void fail(const std::string& why, bool timedOut = false);
  std::exception_ptr failure() const; // the caller holds mutex_
  bool expired(std::chrono::steady_clock::time_point now) const;

  bool isSend_;
  int peer_; // -1: any source
  int tag_;
  at::Tensor tensor_; // keeps the memory alive until completion
  char* data_;
  size_t size_;
  size_t done_ = 0; // bytes moved, header included for sends
  // A send the receiver reads from this memory: done when the channel's
  // acked count reaches this (0: not posted yet, or not direct).
  uint64_t ackTarget_ = 0;
  int source_ = -1;
  std::atomic<int> state_{kPending};
  std::string error_;
  bool timedOut_ = false;
  // Set by future(): completed along with the request.
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
  std::string context_;
  int64_t timeoutMs_ = 0;
  std::atomic<int64_t> deadlineNs_{0}; // steady clock; 0: none
  std::mutex mutex_;
  std::condition_variable cv_;
};

// Point-to-point messages between ranks of one host: a byte ring per ordered
// pair in the group's segment, and a progress thread per rank that moves
// posted sends into rings and ring contents into posted receives (or holds
// them as unexpected until a matching receive is posted). Messages between
// two ranks arrive in order; a receive takes the first message from its
// source (any, for -1) with its tag.
class ShmP2P {
 public:
  explicit ShmP2P(ShmGroup& group);
  ~ShmP2P();
  ShmP2P(const ShmP2P&) = delete;
  ShmP2P& operator=(const ShmP2P&) = delete;

  std::shared_ptr<P2PRequest> send(at::Tensor tensor, int dst, int tag);
  std::shared_ptr<P2PRequest> recv(at::Tensor tensor, int src, int tag);
  // Fail every posted request (and any posted later) with `why`.
  void failAll(const std::string& why);
  // Moves messages on the calling thread (whenever the progress thread is
  // not at it) until `request` is done or the group's spin and yield time
  // (Options) has passed; then the progress thread finishes it. A waiter
  // that polls sees a small message microseconds after it lands, where
  // waking the progress thread and being woken by it costs two wake-ups.
  void drive(const P2PRequest& request);

 private:
  struct Unexpected {
    int source;
    int tag;
    std::vector<char> payload;
  };
  // tag (4 bytes), direct (4), size (8), the sender's address when direct (8)
  static constexpr size_t kHeaderBytes = 24;
  struct Inbound {
    char header[kHeaderBytes];
    size_t headerGot = 0;
    int tag = 0;
    size_t size = 0;
    size_t got = 0;
    // The message stays in the sender's memory, at `address`: the receiver
    // copies it from there and acknowledges (ChannelHead::acked).
    bool direct = false;
    int64_t address = 0;
    std::shared_ptr<P2PRequest> target;
    std::vector<char> spill; // an unexpected message being read
    // Its receive failed on a size mismatch: the message is read past (a
    // receive consumes what it matched, as in MPI).
    bool discard = false;
    // A large message nobody asked for yet waits in the ring instead of
    // being copied aside (see admit()).
    bool parked = false;
    std::chrono::steady_clock::time_point parkedSince;
    // The sender died in the middle of a message: the rest of the ring
    // cannot be parsed.
    bool broken = false;
  };

  void loop();
  // One pass over every channel; the caller holds progressMutex_.
  bool progress();
  bool pushSend(int dst);
  bool pullFrom(int src);
  // Why `peer` answers no more (it exited, or gave up on the group), or ""
  // while it is there. `err`: what reading its memory failed with, ESRCH
  // meaning that memory is gone with its process (not yet a zombie, maybe).
  std::string lost(int peer, int err = 0) const;
  // Copies a direct message from the sender's memory into its receive (or
  // aside); a failed copy fails the receive.
  void readDirect(int src, Inbound& in);
  // The caller holds mutex_.
  std::shared_ptr<P2PRequest> takeMatchingRecv(int src, int tag);
  bool admit(int src, Inbound& in);
  // Fail the receive that a message from `src` is being read into, if any,
  // and read nothing more from `src`. The caller holds progressMutex_.
  void failInbound(int src, const std::string& why, bool timedOut = false);
  // Fail the requests whose future() deadline has passed: queued ones, and a
  // receive in the middle of its message (that channel is read no further).
  // A send already partly written is left to finish or fail with its peer.
  void expire();
  // Fail and drop the queued requests `which` picks, each with `why(request)`.
  // The caller holds mutex_.
  template <typename Which, typename Why>
  void failQueued(Which which, Why why, bool timedOut);
  bool recvWaitingOn(int src);
  // Whether any send or receive is posted and not done.
  bool pending();
  void ring(int rank);
  // Requests the progress thread is done with wait in retired_ until a
  // posting thread drops them: the last reference to a tensor that Python
  // has seen takes the GIL to free it, which the progress thread must never
  // wait for (a thread holding the GIL may be joining it).
  void retire(std::shared_ptr<P2PRequest>&& request);
  void dropRetired();

  ShmGroup& group_;
  // Whoever holds it moves bytes: the progress thread, or a posting thread
  // that finds it free (a small message then needs no thread hop at all).
  std::mutex progressMutex_;
  // Threads in drive() now.
  std::atomic<int> drivers_{0};
  std::mutex mutex_; // guards the queues below
  std::vector<std::deque<std::shared_ptr<P2PRequest>>> sends_;
  std::list<std::shared_ptr<P2PRequest>> recvs_;
  std::list<Unexpected> unexpected_;
  std::vector<std::shared_ptr<P2PRequest>> retired_;
  std::vector<Inbound> inbound_;
  std::vector<uint64_t> directSent_; // direct messages posted to each rank
  std::atomic<bool> stop_{false};
  std::string failure_; // set by failAll, guarded by mutex_
  std::thread thread_;
};

} // namespace groupcomm
