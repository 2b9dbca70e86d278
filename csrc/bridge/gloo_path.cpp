#include "bridge/gloo_path.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <numeric>
#include <thread>

#include "bindings.h"
#include "bridge/queued_op.h"
#include "comm_failure.h"

namespace groupcomm {
namespace {

// The words of GlooCommunicator's ABORTED: a wait the group's abort ended.
constexpr const char* kAborted = "groupcomm: gloo group aborted";

bool dense(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous();
}

// gloo moves the bytes of any dtype: its own dtype limits do not apply.
// A new view every time: the views gloo's threads may drop last have no
// Python wrapper, so dropping them never needs the GIL.
at::Tensor asBytes(const at::Tensor& t) {
  // as_strided, not view: a contiguous tensor's size-1 dims may have any stride
  return t.as_strided({t.numel()}, {1}, t.storage_offset()).view(at::kByte);
}

// to = from, two byte views: one memcpy, never split across torch's
// intra-op threads (ranks at torch's default thread count on a host they
// fill would wait on each other's spinning workers).
void copyBytes(const at::Tensor& to, const at::Tensor& from) {
  if (to.nbytes() == from.nbytes() && to.is_contiguous() && from.is_contiguous()) {
    if (to.data_ptr() != from.data_ptr()) { // the same bytes are already in place
      std::memcpy(to.data_ptr(), from.data_ptr(), from.nbytes());
    }
  } else {
    at::Tensor(to).copy_(from);
  }
}

std::vector<at::Tensor> asBytes(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> bytes;
  bytes.reserve(list.size());
  for (const auto& t : list) {
    bytes.push_back(asBytes(t));
  }
  return bytes;
}

// Whether `list` holds `count` dense tensors of `like`'s dtype and size.
bool alike(const std::vector<at::Tensor>& list, const at::Tensor& like, size_t count) {
  return list.size() == count && std::all_of(list.begin(), list.end(), [&](const at::Tensor& t) {
           return dense(t) && t.scalar_type() == like.scalar_type() && t.numel() == like.numel();
         });
}

bool noneGiven(const std::vector<std::vector<at::Tensor>>& lists) {
  return std::all_of(lists.begin(), lists.end(), [](const auto& list) { return list.empty(); });
}

// gloo says "timed out" (or "timeout") when its timeout passed; the one
// place that reads another library's words (as gloo.py's _ours does).
bool timedOutText(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text.find("timed out") != std::string::npos || text.find("timeout") != std::string::npos;
}

} // namespace

GlooPath::GlooPath(
    c10::intrusive_ptr<c10d::Backend> gloo,
    std::shared_ptr<AbortableWait> waiter,
    std::shared_ptr<Tuner> pieces,
    std::shared_ptr<Tuner> reduceWays,
    std::shared_ptr<OpQueue> queue,
    GlooRoutes routes,
    int64_t timeoutMs,
    int tag,
    std::vector<int64_t> rankNames)
    : gloo_(std::move(gloo)),
      waiter_(std::move(waiter)),
      queue_(std::move(queue)),
      pieces_(std::move(pieces)),
      reduceWays_(std::move(reduceWays)),
      routes_(routes),
      timeoutMs_(timeoutMs),
      tag_(tag),
      rankNames_(std::move(rankNames)),
      rank_(gloo_->getRank()),
      size_(gloo_->getSize()) {
  TORCH_CHECK(static_cast<int>(rankNames_.size()) == size_, "groupcomm: GlooPath needs a name for every rank");
}

c10::intrusive_ptr<c10d::Backend> GlooPath::current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gloo_;
}

c10::intrusive_ptr<c10d::Backend> GlooPath::gloo() const {
  auto gloo = current();
  if (!gloo) {
    throw CommFailure(kAborted, false);
  }
  return gloo;
}

void GlooPath::await(const c10::intrusive_ptr<c10d::Work>& work) {
  if (!waiter_->wait(work)) { // raises gloo's failure, if any
    throw CommFailure(kAborted, false);
  }
}

void GlooPath::release() {
  c10::intrusive_ptr<c10d::Backend> gone;
  std::lock_guard<std::mutex> lock(mutex_);
  gone.swap(gloo_);
}

void GlooPath::abort() {
  std::vector<c10::intrusive_ptr<c10d::Work>> posted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    posted.swap(inFlight_);
  }
  for (auto& work : posted) {
    work->abort(); // gloo wakes the transfer's waiter
  }
}

std::optional<GlooOp> GlooPath::planned(const char* label, std::vector<at::Tensor> outputs, decltype(GlooOp::run) run)
    const {
  if (!current()) {
    return std::nullopt;
  }
  return GlooOp{label, std::move(outputs), std::move(run)};
}

GlooPath::Posted GlooPath::post(bool isSend, const at::Tensor& bytes, int peer, int tag) {
  auto gloo = this->gloo();
  std::vector<at::Tensor> tensors{bytes};
  if (tag < 0) {
    tag = tag_;
  }
  auto work = isSend ? gloo->send(tensors, peer, tag) : gloo->recv(tensors, peer, tag);
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) {
    work->abort();
    throw CommFailure(kAborted, false);
  }
  inFlight_.push_back(work);
  return {std::move(work), peer};
}

void GlooPath::finish(const Posted& posted, std::chrono::milliseconds timeout) {
  bool done = false;
  std::string why;
  try {
    // none given: no limit but the connection's own (its peer going away)
    done = posted.work->wait(timeout == c10d::kUnsetTimeout ? ::kNoTimeout : timeout);
  } catch (const std::exception& error) {
    why = error.what();
  }
  bool aborted = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inFlight_.erase(std::remove(inFlight_.begin(), inFlight_.end(), posted.work), inFlight_.end());
    aborted = aborted_;
  }
  if (done) {
    return;
  }
  if (aborted || why.empty()) { // gloo's answer to Work::abort()
    throw CommFailure(kAborted, false);
  }
  // as gloo.py's _naming words it
  throw CommFailure(why + " (waiting on peer rank " + std::to_string(rankNames_[posted.peer]) + ")", timedOutText(why));
}

void GlooPath::exchange(const Transfers& recvs, const Transfers& sends, std::chrono::milliseconds timeout) {
  std::vector<Posted> posted;
  posted.reserve(recvs.size() + sends.size());
  const int64_t firstMax = routes_.sendFirstMaxBytes;
  auto postSends = [&](bool small) {
    for (const auto& [bytes, peer] : sends) {
      if (bytes.numel() != 0 && (bytes.numel() < firstMax) == small) {
        posted.push_back(post(true, bytes, peer));
      }
    }
  };
  try {
    postSends(true);
    for (const auto& [bytes, peer] : recvs) {
      if (bytes.numel() != 0) {
        posted.push_back(post(false, bytes, peer));
      }
    }
    postSends(false);
    for (const auto& p : posted) {
      finish(p, timeout);
    }
  } catch (...) {
    abandon(posted);
    throw;
  }
}

void GlooPath::carryTransfers(std::shared_ptr<OpQueue> completions) {
  completions_ = std::move(completions);
}

std::optional<PostedTransfer> GlooPath::transfer(
    bool isSend,
    const std::vector<at::Tensor>& tensors,
    int64_t peer,
    int64_t tag) {
  if (!completions_ || tensors.size() != 1 || !dense(tensors[0]) || tensors[0].numel() == 0 || peer < 0 ||
      peer >= size_ || peer == rank_ || tag < 0 || tag > std::numeric_limits<int>::max()) {
    return std::nullopt;
  }
  const char* label = isSend ? "send" : "recv";
  std::optional<Posted> posted;
  try {
    posted = post(isSend, asBytes(tensors[0]), static_cast<int>(peer), static_cast<int>(tag));
  } catch (const std::exception&) {
    return std::nullopt; // aborted or released: Python words it
  }
  // As GlooCommunicator's transfers: no limit but gloo's own (its context's timeout, the peer going away).
  GlooOp op{label, tensors, [posted = *posted](GlooPath& path, std::chrono::milliseconds) {
              path.finish(posted, c10d::kUnsetTimeout);
            }};
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  OpQueue::Ticket ticket = 0;
  try {
    ticket = postCompleting(
        *completions_, std::move(op), future, [self = shared_from_this()](GlooOp& op) { self->execute(op); });
  } catch (const std::exception&) {
    abandon({*posted}); // the queue closed (shutdown): Python words it
    return std::nullopt;
  }
  // The Work may outlive the group: it must not keep the queue alive.
  auto help = [queue = std::weak_ptr<OpQueue>(completions_), ticket] {
    if (auto alive = queue.lock()) {
      alive->help(ticket);
    }
  };
  return PostedTransfer{std::move(future), std::move(help)};
}

void GlooPath::abandon(const std::vector<Posted>& posted) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& p : posted) {
    auto at = std::find(inFlight_.begin(), inFlight_.end(), p.work);
    if (at != inFlight_.end()) {
      p.work->abort();
      inFlight_.erase(at);
    }
  }
}

void GlooPath::fromEach(const Transfers& transfers, bool onePeerAtATime, bool send, std::chrono::milliseconds timeout) {
  if (!onePeerAtATime) {
    exchange(send ? Transfers{} : transfers, send ? transfers : Transfers{}, timeout);
    return;
  }
  for (const auto& transfer : transfers) {
    exchange(send ? Transfers{} : Transfers{transfer}, send ? Transfers{transfer} : Transfers{}, timeout);
  }
}

void GlooPath::bind(std::shared_ptr<const std::string> where, std::shared_ptr<GroupHealth> health) {
  where_ = std::move(where);
  health_ = std::move(health);
}

void GlooPath::execute(GlooOp& op) {
  runWorded(
      op.label, *where_, *health_,
      [&] {
        if (!current()) {
          throw CommFailure(kAborted, false);
        }
        const int64_t ms = op.timeoutMs >= 0 ? op.timeoutMs : timeoutMs_.load(std::memory_order_relaxed);
        op.run(*this, ms >= 0 ? std::chrono::milliseconds(ms) : c10d::kUnsetTimeout);
      },
      timedOutText);
}

void GlooPath::runNow(GlooOp& op) {
  runExclusive(*queue_, [&] { execute(op); });
}

OpQueue::Ticket GlooPath::post(GlooOp op, c10::intrusive_ptr<c10::ivalue::Future> future) {
  return postCompleting(
      *queue_, std::move(op), std::move(future), [self = shared_from_this()](GlooOp& op) { self->execute(op); });
}

std::optional<GlooOp> GlooPath::barrier() {
  if (!routes_.barrier) {
    return std::nullopt;
  }
  // as GlooCommunicator.barrier: between two ranks one byte each way, among
  // more an all-reduce of one byte
  return planned("barrier", {}, [](GlooPath& path, std::chrono::milliseconds timeout) {
    if (path.size() == 2) {
      const int peer = 1 - path.rank();
      path.exchange({{at::empty({1}, at::kByte), peer}}, {{at::zeros({1}, at::kByte), peer}}, timeout);
      return;
    }
    std::vector<at::Tensor> byte{at::zeros({1}, at::kByte)};
    c10d::AllreduceOptions opts;
    opts.timeout = timeout;
    path.await(path.gloo()->allreduce(byte, opts));
  });
}

std::optional<GlooOp> GlooPath::broadcast(std::vector<at::Tensor>& tensors, int64_t root) {
  if (!routes_.broadcast || tensors.size() != 1 || !dense(tensors[0]) || root < 0 || root >= size_) {
    return std::nullopt;
  }
  at::Tensor bytes = asBytes(tensors[0]);
  const int src = static_cast<int>(root);
  const bool chain = size_ >= 3 && bytes.numel() >= routes_.chainMinBytes;
  const bool pair = size_ == 2;
  return planned("broadcast", tensors, [bytes, src, chain, pair](GlooPath& path, std::chrono::milliseconds timeout) {
    if (bytes.numel() == 0) {
      return;
    }
    if (chain) {
      path.chainBroadcast(bytes, src, timeout);
      return;
    }
    if (pair) { // one send, one receive, as GlooCommunicator.broadcast_
      const int peer = 1 - path.rank();
      const bool root = path.rank() == src;
      path.exchange(
          root ? Transfers{} : Transfers{{bytes, peer}}, root ? Transfers{{bytes, peer}} : Transfers{}, timeout);
      return;
    }
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    opts.rootTensor = 0;
    opts.timeout = timeout;
    std::vector<at::Tensor> list{bytes};
    path.await(path.gloo()->broadcast(list, opts));
  });
}

// The pieces gloo.py's _chain_piece_bytes plans, or the whole tensor, as
// the tuner chose for its size; as GlooCommunicator._chain_broadcast, so that
// a rank whose call Python runs pairs with the others.
void GlooPath::chainBroadcast(const at::Tensor& bytes, int root, std::chrono::milliseconds timeout) {
  const int64_t n = bytes.numel();
  const int64_t planned = std::max(
      (n + routes_.chainPieces - 1) / routes_.chainPieces, std::min((n + 1) / 2, routes_.chainPieceBytes));
  tuned(*pieces_, n, timeout, [&](int way) { chain(bytes, way == 0 ? planned : n, root, timeout); });
}

void GlooPath::tuned(
    Tuner& tuner,
    int64_t bytes,
    std::chrono::milliseconds timeout,
    const std::function<void(int way)>& run) {
  const auto choice = tuner.choose(bytes);
  const auto start = std::chrono::steady_clock::now();
  run(choice.way);
  const auto took = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
  if (choice.trial >= 0 && tuner.record(bytes, choice.trial, took.count())) {
    std::vector<at::Tensor> totals{tuner.totals(bytes)};
    c10d::AllreduceOptions opts;
    opts.timeout = timeout;
    await(gloo()->allreduce(totals, opts));
    tuner.decide(bytes, totals[0]);
  }
}

// Down the chain root, root+1, ...: a rank posts a receive of every piece
// into place, and sends each on to the next rank once it arrived, so that no
// link carries the tensor twice and the pieces overlap along the chain.
void GlooPath::chain(const at::Tensor& bytes, int64_t piece, int root, std::chrono::milliseconds timeout) {
  const int position = (rank_ - root + size_) % size_;
  const int prev = (rank_ - 1 + size_) % size_, next = (rank_ + 1) % size_;
  const auto parts = bytes.split(piece);
  std::vector<Posted> arriving, leaving;
  try {
    if (position != 0) {
      for (const auto& part : parts) {
        arriving.push_back(post(false, part, prev));
      }
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      if (!arriving.empty()) {
        finish(arriving[i], timeout);
      }
      if (position < size_ - 1) {
        leaving.push_back(post(true, parts[i], next));
      }
    }
    for (const auto& p : leaving) {
      finish(p, timeout);
    }
  } catch (...) {
    abandon(arriving);
    abandon(leaving);
    throw;
  }
}

// Below ringMinBytes: every block to every peer at once (larger ones go
// around the ring in Python); between two ranks from pairExchangeMaxBytes a
// block, gloo's own all-to-all with this rank's block left out (as
// GlooCommunicator._pair_all_gather).
std::optional<GlooOp> GlooPath::allgatherBase(at::Tensor& output, at::Tensor& input) {
  if (!routes_.allGather || !dense(output) || !dense(input) || output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * size_ || static_cast<int64_t>(output.nbytes()) >= routes_.ringMinBytes) {
    return std::nullopt;
  }
  at::Tensor out = asBytes(output), in = asBytes(input);
  const bool glooPair = size_ == 2 && in.numel() >= routes_.pairExchangeMaxBytes;
  return planned(
      "_allgather_base", {output}, [out, in, glooPair](GlooPath& path, std::chrono::milliseconds timeout) mutable {
        const int me = path.rank(), n = path.size();
        if (in.numel() == 0) {
          return;
        }
        auto blocks = out.chunk(n);
        if (glooPair) {
          copyBytes(blocks[me], in);
          std::vector<int64_t> outSplits(2, 0);
          outSplits[1 - me] = in.numel();
          auto inSplits = outSplits; // gloo may move from each
          c10d::AllToAllOptions opts;
          opts.timeout = timeout;
          path.await(path.gloo()->alltoall_base(blocks[1 - me], in, outSplits, inSplits, opts));
          return;
        }
        path.exchangeBlocks(blocks, std::vector<at::Tensor>(n, in), timeout);
      });
}

namespace {

// Whether gloo's all-reduce has `kind` on `dtype` among `ranks`, as
// gloo.py's gloo_plan: float16 and bfloat16 only between two ranks (its
// ring rounds at every step; Python accumulates them in float32 instead).
bool glooReduces(c10::ScalarType dtype, c10d::ReduceOp::RedOpType kind, int ranks) {
  using K = c10d::ReduceOp::RedOpType;
  const bool arithmetic = kind == K::SUM || kind == K::PRODUCT || kind == K::MIN || kind == K::MAX;
  const bool bitwise = kind == K::BAND || kind == K::BOR || kind == K::BXOR;
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
      return arithmetic;
    case at::kHalf:
    case at::kBFloat16:
      return arithmetic && ranks == 2;
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return arithmetic || bitwise;
    default:
      return false;
  }
}

// `stacked` ([ranks, n], one row per rank) reduced over its rows into `out`,
// with the ATen calls of reduction.py's reduce_stacked for these kinds, so
// that a rank the bridge leaves to Python ends with the same bits.
void reduceRows(const at::Tensor& stacked, c10d::ReduceOp::RedOpType kind, at::Tensor& out) {
  using K = c10d::ReduceOp::RedOpType;
  switch (kind) {
    case K::BAND:
    case K::BOR:
    case K::BXOR: {
      at::Tensor acc = stacked[0];
      for (int64_t r = 1; r < stacked.size(0); ++r) {
        acc = kind == K::BAND ? at::bitwise_and(acc, stacked[r])
            : kind == K::BOR  ? at::bitwise_or(acc, stacked[r])
                              : at::bitwise_xor(acc, stacked[r]);
      }
      out.copy_(acc);
      return;
    }
    case K::MIN:
      out.copy_(stacked.amin(0));
      return;
    case K::MAX:
      out.copy_(stacked.amax(0));
      return;
    default: {
      const auto type = stacked.scalar_type();
      const at::Tensor acc = type == at::kHalf || type == at::kBFloat16 ? stacked.to(at::kFloat) : stacked;
      out.copy_(kind == K::PRODUCT ? acc.prod(0) : acc.sum(0));
    }
  }
}

} // namespace

// As GlooCommunicator.start_all_reduce for the dtypes and ops gloo's
// all-reduce has: one that puts at most gatherReduceMaxBytes on a rank's link
// is every rank's tensor to every rank (start_all_gather's transfers) and
// the reduction here; a larger one is gloo's own between two ranks, and
// among 3+ gloo's ring or directAllReduce, as the group's tuner chose.
std::optional<GlooOp> GlooPath::allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  if (!routes_.allReduce || tensors.size() != 1 || !dense(tensors[0])) {
    return std::nullopt;
  }
  at::Tensor tensor = tensors[0];
  const auto kind = op.op_;
  const bool gather = static_cast<int64_t>(tensor.nbytes()) * (size_ - 1) <= routes_.gatherReduceMaxBytes;
  // a gathered one reduces here, where float16 and bfloat16 accumulate in float32
  if (!glooReduces(tensor.scalar_type(), kind, gather ? 2 : size_)) {
    return std::nullopt;
  }
  return planned(
      "allreduce", tensors, [tensor, kind, gather](GlooPath& path, std::chrono::milliseconds timeout) mutable {
        if (tensor.numel() == 0) {
          return;
        }
        if (gather) {
          const int n = path.size();
          at::Tensor gathered = at::empty({n, tensor.numel()}, tensor.options());
          path.exchangeBlocks(asBytes(gathered.unbind(0)), std::vector<at::Tensor>(n, asBytes(tensor)), timeout);
          at::Tensor flat = tensor.view({-1});
          reduceRows(gathered, kind, flat);
          return;
        }
        auto ring = [&] {
          c10d::AllreduceOptions opts;
          opts.reduceOp = c10d::ReduceOp(kind);
          opts.timeout = timeout;
          std::vector<at::Tensor> list{tensor};
          path.await(path.gloo()->allreduce(list, opts));
        };
        if (path.size() == 2) {
          ring();
          return;
        }
        path.tuned(*path.reduceWays_, static_cast<int64_t>(tensor.nbytes()), timeout, [&](int way) {
          if (way == 0) {
            ring();
          } else {
            path.directAllReduce(tensor, kind, timeout);
          }
        });
      });
}

void GlooPath::directAllReduce(
    const at::Tensor& tensor,
    c10d::ReduceOp::RedOpType kind,
    std::chrono::milliseconds timeout) {
  const int64_t numel = tensor.numel();
  at::Tensor flat = tensor.view({-1});
  std::vector<at::Tensor> pieces; // base.py's even_pieces
  for (int64_t p = 0, start = 0; p < size_; ++p) {
    const int64_t length = numel / size_ + (p < numel % size_ ? 1 : 0);
    pieces.push_back(flat.narrow(0, start, length));
    start += length;
  }
  at::Tensor mine = pieces[rank_];
  at::Tensor received = at::empty({size_, mine.numel()}, tensor.options());
  exchangeBlocks(asBytes(received.unbind(0)), asBytes(pieces), timeout);
  reduceRows(received, kind, mine);
  exchangeBlocks(asBytes(pieces), std::vector<at::Tensor>(size_, asBytes(mine)), timeout);
}

// Between two ranks, from pairExchangeMaxBytes up to pairAllToAllMaxBytes
// the larger way, gloo's own all-to-all; otherwise every block to every peer
// at once.
std::optional<GlooOp> GlooPath::alltoallBase(
    at::Tensor& output,
    at::Tensor& input,
    const std::vector<int64_t>& outputSplits,
    const std::vector<int64_t>& inputSplits) {
  if (!routes_.allToAll || !dense(output) || !dense(input) || output.scalar_type() != input.scalar_type()) {
    return std::nullopt;
  }
  if (outputSplits.empty() && inputSplits.empty() &&
      static_cast<int64_t>(input.nbytes()) >= routes_.pythonAllToAllMinBytes) {
    return std::nullopt;
  }
  // Each peer's block, in bytes: even, or rows of dim 0 by the split sizes.
  auto blocks = [&](const at::Tensor& t, const std::vector<int64_t>& splits) -> std::optional<std::vector<int64_t>> {
    if (splits.empty()) {
      if (t.numel() % size_ != 0) {
        return std::nullopt;
      }
      return std::vector<int64_t>(size_, static_cast<int64_t>(t.nbytes()) / size_);
    }
    if (t.dim() == 0 || static_cast<int>(splits.size()) != size_) {
      return std::nullopt;
    }
    int64_t rows = 0;
    for (auto s : splits) {
      if (s < 0) {
        return std::nullopt;
      }
      rows += s;
    }
    if (rows != t.size(0)) {
      return std::nullopt;
    }
    const int64_t rowBytes = rows == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / rows;
    std::vector<int64_t> bytes;
    for (auto s : splits) {
      bytes.push_back(s * rowBytes);
    }
    return bytes;
  };
  auto outBytes = blocks(output, outputSplits), inBytes = blocks(input, inputSplits);
  if (!outBytes || !inBytes || (*outBytes)[rank_] != (*inBytes)[rank_]) {
    return std::nullopt; // the frontend words the error
  }
  const int64_t widest = size_ == 2 ? std::max((*outBytes)[1 - rank_], (*inBytes)[1 - rank_]) : 0;
  if (size_ == 2 && widest >= routes_.pairExchangeMaxBytes && widest < routes_.pairAllToAllMaxBytes) {
    at::Tensor out = asBytes(output), in = asBytes(input);
    return planned(
        "alltoall_base", {output},
        [out, in, outSplit = *outBytes, inSplit = *inBytes](GlooPath& path, std::chrono::milliseconds timeout) mutable {
          c10d::AllToAllOptions opts;
          opts.timeout = timeout;
          path.await(path.gloo()->alltoall_base(out, in, outSplit, inSplit, opts));
        });
  }
  std::vector<at::Tensor> outs = asBytes(output).split_with_sizes(*outBytes);
  std::vector<at::Tensor> ins = asBytes(input).split_with_sizes(*inBytes);
  return planned("alltoall_base", {output}, [outs, ins](GlooPath& path, std::chrono::milliseconds timeout) {
    path.exchangeBlocks(outs, ins, timeout);
  });
}

void GlooPath::exchangeBlocks(
    const std::vector<at::Tensor>& outs,
    const std::vector<at::Tensor>& ins,
    std::chrono::milliseconds timeout) {
  copyBytes(outs[rank_], ins[rank_]);
  Transfers recvs, sends;
  for (int k = 1; k < size_; ++k) {
    const int peer = (rank_ + k) % size_;
    recvs.emplace_back(outs[peer], peer);
    sends.emplace_back(ins[peer], peer);
  }
  exchange(recvs, sends, timeout);
}

std::optional<GlooOp> GlooPath::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs) {
  const auto world = static_cast<size_t>(size_);
  if (!routes_.allToAll || inputs.size() != world || outputs.size() != world ||
      outputs[rank_].numel() != inputs[rank_].numel()) {
    return std::nullopt;
  }
  for (size_t i = 0; i < world; ++i) {
    for (const auto* t : {&outputs[i], &inputs[i]}) {
      if (!dense(*t) || t->scalar_type() != inputs[0].scalar_type()) {
        return std::nullopt; // the frontend words the error
      }
    }
    for (const auto& in : inputs) { // an output sharing an input's storage: Python copies the inputs first
      if (outputs[i].numel() != 0 && in.numel() != 0 && outputs[i].storage().is_alias_of(in.storage())) {
        return std::nullopt;
      }
    }
  }
  const int peer = 1 - rank_;
  const int64_t widest = size_ == 2 ? static_cast<int64_t>(std::max(outputs[peer].nbytes(), inputs[peer].nbytes())) : 0;
  if (size_ == 2 && widest >= routes_.pairExchangeMaxBytes && widest < routes_.pairAllToAllMaxBytes) {
    // gloo's own all-to-all on the joined lists, as alltoallBase with split sizes
    return planned(
        "alltoall", outputs,
        [outs = asBytes(outputs), ins = asBytes(inputs)](GlooPath& path, std::chrono::milliseconds timeout) {
          std::vector<int64_t> outSplits, inSplits;
          for (size_t i = 0; i < outs.size(); ++i) {
            outSplits.push_back(outs[i].numel());
            inSplits.push_back(ins[i].numel());
          }
          at::Tensor received = at::empty({std::accumulate(outSplits.begin(), outSplits.end(), int64_t{0})}, at::kByte);
          at::Tensor sent = at::cat(ins);
          c10d::AllToAllOptions opts;
          opts.timeout = timeout;
          auto pieces = received.split_with_sizes(outSplits); // before gloo may move from outSplits
          path.await(path.gloo()->alltoall_base(received, sent, outSplits, inSplits, opts));
          for (size_t i = 0; i < outs.size(); ++i) {
            copyBytes(outs[i], pieces[i]);
          }
        });
  }
  return planned(
      "alltoall", outputs,
      [outs = asBytes(outputs), ins = asBytes(inputs)](GlooPath& path, std::chrono::milliseconds timeout) {
        path.exchangeBlocks(outs, ins, timeout);
      });
}

std::optional<GlooOp> GlooPath::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    int64_t root) {
  if (!routes_.rooted || inputs.size() != 1 || !dense(inputs[0]) || root < 0 || root >= size_) {
    return std::nullopt;
  }
  std::vector<at::Tensor> results, into;
  if (root == rank_) {
    if (outputs.size() != 1 || !alike(outputs[0], inputs[0], size_)) {
      return std::nullopt;
    }
    results = outputs[0];
    into = asBytes(outputs[0]);
  } else if (!noneGiven(outputs)) {
    return std::nullopt; // the frontend words the error
  }
  at::Tensor in = asBytes(inputs[0]);
  const int dst = static_cast<int>(root);
  const bool onePeerAtATime = static_cast<int64_t>(in.numel()) >= routes_.onePeerAtATimeBytes;
  return planned("gather", results, [into, in, dst, onePeerAtATime](GlooPath& path, std::chrono::milliseconds timeout) {
    if (path.rank() != dst) {
      path.exchange({}, {{in, dst}}, timeout);
      return;
    }
    copyBytes(into[dst], in);
    Transfers recvs;
    for (int peer = 0; peer < path.size(); ++peer) {
      if (peer != dst) {
        recvs.emplace_back(into[peer], peer);
      }
    }
    path.fromEach(recvs, onePeerAtATime, false, timeout);
  });
}

std::optional<GlooOp> GlooPath::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    int64_t root) {
  if (!routes_.rooted || outputs.size() != 1 || !dense(outputs[0]) || root < 0 || root >= size_) {
    return std::nullopt;
  }
  std::vector<at::Tensor> from;
  if (root == rank_) {
    if (inputs.size() != 1 || !alike(inputs[0], outputs[0], size_)) {
      return std::nullopt;
    }
    from = asBytes(inputs[0]);
  } else if (!noneGiven(inputs)) {
    return std::nullopt;
  }
  at::Tensor out = asBytes(outputs[0]);
  const int src = static_cast<int>(root);
  const bool onePeerAtATime = static_cast<int64_t>(out.numel()) >= routes_.onePeerAtATimeBytes;
  return planned(
      "scatter", outputs, [from, out, src, onePeerAtATime](GlooPath& path, std::chrono::milliseconds timeout) {
        if (path.rank() != src) {
          path.exchange({{out, src}}, {}, timeout);
          return;
        }
        copyBytes(out, from[src]);
        Transfers sends;
        for (int peer = 0; peer < path.size(); ++peer) {
          if (peer != src) {
            sends.emplace_back(from[peer], peer);
          }
        }
        path.fromEach(sends, onePeerAtATime, true, timeout);
      });
}

} // namespace groupcomm
