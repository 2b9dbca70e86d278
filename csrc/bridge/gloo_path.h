#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "bridge/abortable_wait.h"
#include "bridge/health.h"
#include "bridge/tuner.h"
#include "bridge/work.h"
#include "queue/op_queue.h"

namespace groupcomm {

// Which ops of a group carried by gloo the bridge runs on gloo's sends and
// receives from C++, decided once per group in Python
// (GlooCommunicator._gloo_routes).
struct GlooRoutes {
  bool barrier = false;   // one byte each way between two ranks; among 3+ an all-reduce of a byte
  bool broadcast = false; // one transfer, gloo's own or down a chain (chainMinBytes)
  bool rooted = false;    // gather and scatter with one tensor per rank, all of the input's size
  bool allToAll = false;  // all_to_all_single, even or with split sizes
  bool allGather = false; // all_gather_into_tensor below ringMinBytes
  bool allReduce = false; // one tensor of a dtype and op gloo's all-reduce has
  // an all-reduce that puts at most this many bytes on a rank's link is an
  // all-gather and a reduction here; a larger one is gloo's own
  int64_t gatherReduceMaxBytes = 256 << 10;
  int64_t ringMinBytes = 1 << 20;
  // broadcasts from this many bytes among 3+ ranks go down a chain in two
  // halves, pieces of chainPieceBytes, or chainPieces larger ones (gloo.py's
  // _chain_pieces); between two ranks a broadcast is one send and one receive
  int64_t chainMinBytes = 32 << 10;
  int64_t chainPieceBytes = 512 << 10;
  int64_t chainPieces = 16;
  // a gather's root takes (a scatter's root sends) blocks of this many bytes
  // or more from (to) one peer at a time
  int64_t onePeerAtATimeBytes = 1 << 20;
  // between two ranks, an all_to_all or all-gather whose larger direction
  // carries fewer bytes than pairExchangeMaxBytes is one exchange; from there
  // to pairAllToAllMaxBytes gloo's own all-to-all; past it the exchange again
  int64_t pairExchangeMaxBytes = 64 << 10;
  int64_t pairAllToAllMaxBytes = 1 << 20;
  // an exchange's sends of fewer bytes than this are posted before its
  // receives, larger ones after them
  int64_t sendFirstMaxBytes = 512 << 10;
  // all_to_all_single without split sizes of this many bytes or more is left
  // to Python (a group across hosts may move it per pair of hosts)
  int64_t pythonAllToAllMinBytes = std::numeric_limits<int64_t>::max();
};

// One op on the gloo path: its label for failures, the tensors its Work
// hands back, and how to run it (blocking until it is done).
struct GlooOp {
  const char* label;
  std::vector<at::Tensor> outputs;
  std::function<void(class GlooPath& path, std::chrono::milliseconds timeout)> run;
  int64_t timeoutMs = -1; // c10d's per-op timeout; -1: the group's
};

// The ops of a CPU group whose transport is gloo that the bridge runs
// without Python: gloo's own all-reduce, its small broadcasts among 3+
// ranks and all-reduce of a byte (the barrier among 3+ ranks), and on gloo's
// sends and receives (posted on the caller's thread, with no hand-over to
// gloo's worker threads) small all-reduces as an all-gather, the barrier and
// broadcast between two ranks, large broadcasts down a chain, gather,
// scatter and both all_to_all forms. Every op
// runs in the group's op queue (synchronous ones on the caller's thread once
// the queue is drained), so issue order with the ops Python runs is kept,
// and so is the order of their messages on each pair of ranks. A transfer's
// wait ends at its timeout, when its peer goes away, or at abort(); a
// failure names the peer waited on and reads as the frontend words it.
class GlooPath : public std::enable_shared_from_this<GlooPath> {
 public:
  // `tag`: the collectives' own send/recv tag (far above users' tags);
  // `rankNames`: what failures call the group's ranks.
  // `waiter`: the communicator's, whose abort ends waits on gloo's collectives;
  // `pieces` (how a chain broadcast is cut) and `reduceWays` (whether an
  // all-reduce among 3+ ranks is gloo's ring or directAllReduce): the
  // communicator's, which its Python paths use too.
  GlooPath(
      c10::intrusive_ptr<c10d::Backend> gloo,
      std::shared_ptr<AbortableWait> waiter,
      std::shared_ptr<Tuner> pieces,
      std::shared_ptr<Tuner> reduceWays,
      std::shared_ptr<OpQueue> queue,
      GlooRoutes routes,
      int64_t timeoutMs,
      int tag,
      std::vector<int64_t> rankNames);

  std::optional<GlooOp> barrier();
  std::optional<GlooOp> broadcast(std::vector<at::Tensor>& tensors, int64_t root);
  std::optional<GlooOp> allgatherBase(at::Tensor& output, at::Tensor& input);
  std::optional<GlooOp> allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);
  std::optional<GlooOp> alltoallBase(
      at::Tensor& output,
      at::Tensor& input,
      const std::vector<int64_t>& outputSplits,
      const std::vector<int64_t>& inputSplits);
  // all_to_all of lists (one tensor per peer each way), as
  // GlooCommunicator.all_to_all_into moves the joined lists' bytes.
  std::optional<GlooOp> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs);
  std::optional<GlooOp> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      int64_t root);
  std::optional<GlooOp> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      int64_t root);

  // From now on the group's send/recv travel here (it is the group's
  // send/recv transport), completing in `completions`: the frontend's
  // queue of send/recv completions, in the order posted. Set once, before
  // the bridge plans its first op.
  void carryTransfers(std::shared_ptr<OpQueue> completions);
  // Posts one dense CPU tensor's bytes to (from) `peer` with the user's
  // `tag`, as GlooCommunicator.isend (irecv) does; nullopt where Python
  // answers instead (not carrying transfers, a list or a strided tensor, an
  // empty one, a bad peer, a released path). Posted on the caller's thread;
  // a waiter's help waits for it there when the completion queue has not
  // started on it.
  std::optional<PostedTransfer> transfer(
      bool isSend,
      const std::vector<at::Tensor>& tensors,
      int64_t peer,
      int64_t tag);

  // What failures call the group ("group '<name>' (rank r of n)") and who
  // hears of them: the bridge's, given once before its first op.
  void bind(std::shared_ptr<const std::string> where, std::shared_ptr<GroupHealth> health);
  // Runs `op` on this thread once the group's earlier ops are done; its
  // failure is raised in Python.
  void runNow(GlooOp& op);
  // Queues `op` behind the group's earlier ops; `future` gets its outputs or failure.
  OpQueue::Ticket post(GlooOp op, c10::intrusive_ptr<c10::ivalue::Future> future);
  const std::shared_ptr<OpQueue>& queue() const {
    return queue_;
  }

  // The group's timeout for the ops issued from now on (dist.set_timeout).
  void setTimeout(int64_t ms) {
    timeoutMs_.store(ms, std::memory_order_relaxed);
  }
  // Ends the waits of the transfers in flight now, and fails later ones (the group's abort).
  void abort();
  // No op is planned here from now on and gloo's group is let go, so that
  // its connections close once Python drops it too (a peer waiting on this
  // rank then fails at once).
  void release();

  // Posts the sends of `sends` smaller than sendFirstMaxBytes, a receive of
  // each (bytes, peer) of `recvs`, then the larger sends, and waits for them
  // all. gloo reads a connection only into a posted receive, and a pair's
  // messages leave in order: a large send posted first holds back the
  // notice of this side's receive, and the swap runs one way at a time.
  using Transfers = std::vector<std::pair<at::Tensor, int>>;
  void exchange(const Transfers& recvs, const Transfers& sends, std::chrono::milliseconds timeout);
  // All-to-all of byte blocks, one per rank: this rank's own block copied,
  // every other one exchanged with its rank at once.
  void exchangeBlocks(
      const std::vector<at::Tensor>& outs,
      const std::vector<at::Tensor>& ins,
      std::chrono::milliseconds timeout);
  // The gloo group, for an op's run (a failure once released).
  c10::intrusive_ptr<c10d::Backend> gloo() const;
  // The root's side of a gather (receives) or scatter (`send`): every
  // transfer at once, or `onePeerAtATime`.
  void fromEach(const Transfers& transfers, bool onePeerAtATime, bool send, std::chrono::milliseconds timeout);
  // Waits for gloo's collective `work` (the communicator's abort ends the wait), raising its failure.
  void await(const c10::intrusive_ptr<c10d::Work>& work);
  // All-reduce of `tensor` among 3+ ranks in two exchanges, as gloo.py's
  // _start_direct_all_reduce: every rank sends piece p of its tensor (even
  // pieces, one per rank) to rank p, reduces the pieces it got into its own,
  // and sends that to every rank. Two transfers deep where gloo's ring is
  // 2(n-1); the links carry the same bytes.
  void directAllReduce(const at::Tensor& tensor, c10d::ReduceOp::RedOpType kind, std::chrono::milliseconds timeout);
  // Broadcast of `bytes` down the chain root, root+1, ... in the pieces the
  // group's pieces tuner chooses.
  void chainBroadcast(const at::Tensor& bytes, int root, std::chrono::milliseconds timeout);
  int rank() const {
    return rank_;
  }
  int size() const {
    return size_;
  }

 private:
  struct Posted {
    c10::intrusive_ptr<c10d::Work> work;
    int peer;
  };
  // The gloo group while the path is in use; null once released.
  c10::intrusive_ptr<c10d::Backend> current() const;
  // `run` as an op on the gloo group; nullopt once the path is released.
  std::optional<GlooOp> planned(const char* label, std::vector<at::Tensor> outputs, decltype(GlooOp::run) run) const;
  // Runs op.run; a failure is rethrown as a CommFailure worded as the frontend words it.
  void execute(GlooOp& op);
  // A send (`isSend`) or recv of `bytes` with `tag` (-1: the collectives'), which abort() ends.
  Posted post(bool isSend, const at::Tensor& bytes, int peer, int tag = -1);
  // Waits for a posted transfer; a failure names its peer.
  void finish(const Posted& posted, std::chrono::milliseconds timeout);
  // Aborts those of `posted` still in flight (after one of their op's transfers failed).
  void abandon(const std::vector<Posted>& posted);
  // run(way) with the way `tuner` chose for `bytes`, timed while the size
  // class is on trial; after its last trial every rank keeps the way whose
  // time summed over the ranks is lower.
  void tuned(Tuner& tuner, int64_t bytes, std::chrono::milliseconds timeout, const std::function<void(int way)>& run);
  // One rank's part of a chain broadcast of `bytes` cut in pieces of `piece` bytes.
  void chain(const at::Tensor& bytes, int64_t piece, int root, std::chrono::milliseconds timeout);

  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<AbortableWait> waiter_;
  std::shared_ptr<OpQueue> queue_;
  std::shared_ptr<OpQueue> completions_; // carryTransfers()
  const std::shared_ptr<Tuner> pieces_;
  const std::shared_ptr<Tuner> reduceWays_;
  const GlooRoutes routes_;
  std::atomic<int64_t> timeoutMs_;
  const int tag_;
  const std::vector<int64_t> rankNames_;
  std::shared_ptr<const std::string> where_; // bind()'s
  std::shared_ptr<GroupHealth> health_;
  const int rank_, size_;
  bool aborted_ = false;                                 // under mutex_
  std::vector<c10::intrusive_ptr<c10d::Work>> inFlight_; // posted transfers not yet finished, under mutex_
};

} // namespace groupcomm
