#include "bridge/native.h"

#include <cstring>
#include <numeric>

#include "bindings.h"
#include "bridge/queued_op.h"
#include "bridge/shapes.h"
#include "comm_failure.h"

namespace groupcomm {
namespace {

// What the engine moves as it is: CPU, strided, contiguous.
bool dense(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous();
}

std::vector<int64_t> bytesOf(const std::vector<at::Tensor>& list) {
  std::vector<int64_t> bytes;
  for (const auto& t : list) {
    bytes.push_back(static_cast<int64_t>(t.nbytes()));
  }
  return bytes;
}

// Whether a rank other than the root passed no tensors (gather's outputs, scatter's inputs).
bool noneGiven(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& list : lists) {
    if (!list.empty()) {
      return false;
    }
  }
  return true;
}

// The dense tensors of `list`, their bytes one after another in a new byte tensor.
at::Tensor joined(const std::vector<at::Tensor>& list) {
  int64_t total = 0;
  for (const auto& t : list) {
    total += static_cast<int64_t>(t.nbytes());
  }
  at::Tensor flat = at::empty({total}, at::kByte);
  auto* cursor = static_cast<char*>(flat.data_ptr());
  for (const auto& t : list) {
    if (t.nbytes() != 0) {
      std::memcpy(cursor, t.data_ptr(), t.nbytes());
      cursor += t.nbytes();
    }
  }
  return flat;
}

std::vector<int64_t> numelsOf(const std::vector<at::Tensor>& list) {
  std::vector<int64_t> numels;
  for (const auto& t : list) {
    numels.push_back(t.numel());
  }
  return numels;
}

// Where the tensors of `list` start: `char` for outputs, `const char` for inputs.
template <typename Byte>
std::vector<Byte*> placesOf(const std::vector<at::Tensor>& list) {
  std::vector<Byte*> places;
  for (const auto& t : list) {
    places.push_back(static_cast<Byte*>(t.data_ptr()));
  }
  return places;
}

// Whether writing `out` (rank `i`'s piece of the outputs) could change bytes
// of `in` (the input for rank `j`) that a rank still reads: they share a
// byte, and are not this rank's own piece written onto itself, which the
// engine skips.
bool clobbers(const at::Tensor& out, int i, const at::Tensor& in, int j, int rank) {
  const auto* o = static_cast<const char*>(out.data_ptr());
  const auto* n = static_cast<const char*>(in.data_ptr());
  const size_t ob = out.nbytes(), nb = in.nbytes();
  if (ob == 0 || nb == 0 || o >= n + nb || n >= o + ob) {
    return false;
  }
  return !(i == rank && j == rank && o == n && ob == nb);
}

// The inverse: consecutive runs of `flat`'s bytes into the dense tensors of `list`.
void split(const at::Tensor& flat, std::vector<at::Tensor>& list) {
  const auto* cursor = static_cast<const char*>(flat.data_ptr());
  for (auto& t : list) {
    if (t.nbytes() != 0) {
      std::memcpy(t.data_ptr(), cursor, t.nbytes());
      cursor += t.nbytes();
    }
  }
}

} // namespace

NativePath::NativePath(
    std::shared_ptr<ShmGroup> group,
    std::shared_ptr<OpQueue> queue,
    std::shared_ptr<const std::string> where,
    std::shared_ptr<GroupHealth> health,
    bool p2p)
    : group_(std::move(group)),
      queue_(std::move(queue)),
      where_(std::move(where)),
      health_(std::move(health)),
      p2p_(p2p) {}

std::optional<RedKind> NativePath::kindFor(const c10d::ReduceOp& op, c10::ScalarType dtype) const {
  const auto kind = static_cast<RedKind>(op.op_);
  if (kind == RedKind::PremulSum || !reduceSupported(dtype, kind)) {
    return std::nullopt;
  }
  return kind;
}

void NativePath::execute(NativeOp& op) const {
  runWorded(
      op.label, *where_, *health_,
      [&] {
        if (op.timeoutMs < 0) {
          op.run(*group_, op);
          return;
        }
        struct OpTimeout {
          ShmGroup& group;
          OpTimeout(ShmGroup& g, int64_t ms) : group(g) {
            group.setOpTimeout(ms);
          }
          ~OpTimeout() {
            group.setOpTimeout(-1);
          }
        } scope(*group_, op.timeoutMs);
        op.run(*group_, op);
      },
      [](const std::string&) { return false; });
}

void NativePath::runNow(NativeOp& op) {
  runExclusive(*queue_, [&] { execute(op); });
}

OpQueue::Ticket NativePath::post(NativeOp op, c10::intrusive_ptr<c10::ivalue::Future> future) {
  return postCompleting(
      *queue_, std::move(op), std::move(future), [self = shared_from_this()](NativeOp& op) { self->execute(op); });
}

std::optional<NativeOp> NativePath::allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  if (tensors.size() != 1 || !dense(tensors[0])) {
    return std::nullopt;
  }
  auto kind = kindFor(op, tensors[0].scalar_type());
  if (!kind) {
    return std::nullopt;
  }
  NativeOp planned{
      "allreduce", [](ShmGroup& group, NativeOp& op) { group.allReduce(op.outputs[0], op.kind, 1.0); }, tensors};
  planned.kind = *kind;
  return planned;
}

std::optional<NativeOp> NativePath::broadcast(std::vector<at::Tensor>& tensors, int64_t root) {
  if (tensors.size() != 1 || !dense(tensors[0]) || root < 0 || root >= group_->worldSize()) {
    return std::nullopt;
  }
  NativeOp planned{
      "broadcast", [](ShmGroup& group, NativeOp& op) { group.broadcast(op.outputs[0], op.root); }, tensors};
  planned.root = static_cast<int>(root);
  return planned;
}

std::optional<NativeOp> NativePath::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int64_t root) {
  if (tensors.size() != 1 || !dense(tensors[0]) || root < 0 || root >= group_->worldSize()) {
    return std::nullopt;
  }
  auto kind = kindFor(op, tensors[0].scalar_type());
  if (!kind) {
    return std::nullopt;
  }
  NativeOp planned{
      "reduce", [](ShmGroup& group, NativeOp& op) { group.reduce(op.outputs[0], op.root, op.kind, 1.0); }, tensors};
  planned.root = static_cast<int>(root);
  planned.kind = *kind;
  return planned;
}

bool NativePath::fits(const at::Tensor& part, const at::Tensor& whole) const {
  return dense(part) && dense(whole) && onePartPerRank(part, whole, group_->worldSize());
}

bool NativePath::allFit(const std::vector<at::Tensor>& parts, const std::vector<at::Tensor>& wholes) const {
  return everyPairFits(parts, wholes, [this](const at::Tensor& p, const at::Tensor& w) { return fits(p, w); });
}

std::optional<NativeOp> NativePath::allgatherBase(at::Tensor& output, at::Tensor& input) {
  if (!fits(input, output)) {
    return std::nullopt;
  }
  return NativeOp{
      "_allgather_base",
      [](ShmGroup& group, NativeOp& op) {
        group.allGather(op.outputs[0], op.input, std::vector<int64_t>(group.worldSize(), op.input.nbytes()));
      },
      {output},
      input};
}

std::optional<NativeOp> NativePath::reduceScatterBase(at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& op) {
  if (!fits(output, input)) {
    return std::nullopt;
  }
  auto kind = kindFor(op, output.scalar_type());
  if (!kind) {
    return std::nullopt;
  }
  NativeOp planned{
      "_reduce_scatter_base",
      [](ShmGroup& group, NativeOp& op) {
        at::Tensor& out = op.outputs[0];
        group.reduceScatter(out, op.input, std::vector<int64_t>(group.worldSize(), out.numel()), op.kind, 1.0);
      },
      {output},
      input};
  planned.kind = *kind;
  return planned;
}

std::optional<NativeOp> NativePath::alltoallBase(
    at::Tensor& output,
    at::Tensor& input,
    const std::vector<int64_t>& outputSplits,
    const std::vector<int64_t>& inputSplits) {
  if (!dense(output) || !dense(input) || output.scalar_type() != input.scalar_type() ||
      (outputSplits.empty() && inputSplits.empty() && output.numel() != input.numel())) {
    return std::nullopt;
  }
  auto received = splitBytes(output, outputSplits, group_->worldSize());
  auto sent = splitBytes(input, inputSplits, group_->worldSize());
  if (!received || !sent) {
    return std::nullopt;
  }
  NativeOp planned{
      "alltoall_base",
      [](ShmGroup& group, NativeOp& op) { group.allToAll(op.outputs[0], op.input, op.outBytes, op.inBytes); },
      {output},
      input};
  planned.outBytes = std::move(*received);
  planned.inBytes = std::move(*sent);
  return planned;
}

bool NativePath::alike(const std::vector<at::Tensor>& list, const at::Tensor& like, size_t count, bool sameNumel) {
  if (list.size() != count) {
    return false;
  }
  for (const auto& t : list) {
    if (!dense(t) || t.scalar_type() != like.scalar_type() || (sameNumel && t.numel() != like.numel())) {
      return false;
    }
  }
  return true;
}

std::optional<NativeOp> NativePath::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    int64_t root) {
  const int world = group_->worldSize();
  if (inputs.size() != 1 || !dense(inputs[0]) || root < 0 || root >= world) {
    return std::nullopt;
  }
  NativeOp planned{
      "gather",
      [](ShmGroup& group, NativeOp& op) {
        group.gather(op.outputs, op.input, std::vector<int64_t>(group.worldSize(), op.input.nbytes()), op.root);
      },
      {},
      inputs[0]};
  if (root == group_->rank()) {
    if (outputs.size() != 1 || !alike(outputs[0], inputs[0], world, true)) {
      return std::nullopt;
    }
    planned.outputs = outputs[0];
  } else if (!noneGiven(outputs)) {
    return std::nullopt; // the frontend words the error
  }
  planned.root = static_cast<int>(root);
  return planned;
}

std::optional<NativeOp> NativePath::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    int64_t root) {
  const int world = group_->worldSize();
  if (outputs.size() != 1 || !dense(outputs[0]) || root < 0 || root >= world) {
    return std::nullopt;
  }
  NativeOp planned{
      "scatter", [](ShmGroup& group, NativeOp& op) { group.scatter(op.outputs[0], op.inputs, op.root); }, outputs};
  if (root == group_->rank()) {
    if (inputs.size() != 1 || !alike(inputs[0], outputs[0], world, true)) {
      return std::nullopt;
    }
    planned.inputs = inputs[0];
  } else if (!noneGiven(inputs)) {
    return std::nullopt;
  }
  planned.root = static_cast<int>(root);
  return planned;
}

std::optional<NativeOp> NativePath::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs) {
  const int world = group_->worldSize();
  if (inputs.size() != 1 || outputs.size() != 1 || !dense(inputs[0]) || !alike(outputs[0], inputs[0], world, false) ||
      outputs[0][group_->rank()].numel() != inputs[0].numel()) {
    return std::nullopt;
  }
  NativeOp planned{
      "allgather",
      [](ShmGroup& group, NativeOp& op) {
        group.allGatherInto(placesOf<char>(op.outputs), op.input, bytesOf(op.outputs));
      },
      outputs[0], inputs[0]};
  for (int i = 0; i < world; ++i) {
    if (clobbers(outputs[0][i], i, inputs[0], group_->rank(), group_->rank())) {
      // An output overlaps the input: gather into a buffer of its own first.
      planned.run = [](ShmGroup& group, NativeOp& op) {
        const auto sizes = bytesOf(op.outputs);
        at::Tensor all = at::empty({std::accumulate(sizes.begin(), sizes.end(), int64_t{0})}, at::kByte);
        group.allGather(all, op.input, sizes);
        split(all, op.outputs);
      };
      break;
    }
  }
  return planned;
}

std::optional<NativeOp> NativePath::reduceScatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceOp& op) {
  const int world = group_->worldSize();
  if (outputs.size() != 1 || inputs.size() != 1 || !dense(outputs[0]) || !alike(inputs[0], outputs[0], world, false) ||
      inputs[0][group_->rank()].numel() != outputs[0].numel()) {
    return std::nullopt;
  }
  auto kind = kindFor(op, outputs[0].scalar_type());
  if (!kind) {
    return std::nullopt;
  }
  NativeOp planned{
      "reduce_scatter",
      [](ShmGroup& group, NativeOp& op) {
        group.reduceScatterFrom(op.outputs[0], placesOf<const char>(op.inputs), numelsOf(op.inputs), op.kind, 1.0);
      },
      outputs};
  for (int j = 0; j < world; ++j) {
    if (clobbers(outputs[0], group_->rank(), inputs[0][j], j, group_->rank())) {
      // The output overlaps an input: reduce from a copy of the inputs.
      planned.run = [](ShmGroup& group, NativeOp& op) {
        const at::Tensor all = joined(op.inputs).view(op.outputs[0].scalar_type());
        group.reduceScatter(op.outputs[0], all, numelsOf(op.inputs), op.kind, 1.0);
      };
      break;
    }
  }
  planned.inputs = inputs[0];
  planned.kind = *kind;
  return planned;
}

std::optional<NativeOp> NativePath::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs) {
  const size_t world = static_cast<size_t>(group_->worldSize());
  if (inputs.empty() || !alike(inputs, inputs[0], world, false) || !alike(outputs, inputs[0], world, false)) {
    return std::nullopt;
  }
  const int rank = group_->rank();
  bool overlap = false;
  for (size_t i = 0; i < world && !overlap; ++i) {
    for (size_t j = 0; j < world && !overlap; ++j) {
      overlap = clobbers(outputs[i], static_cast<int>(i), inputs[j], static_cast<int>(j), rank);
    }
  }
  NativeOp planned{
      "alltoall",
      [](ShmGroup& group, NativeOp& op) {
        group.allToAllBetween(
            placesOf<char>(op.outputs), placesOf<const char>(op.inputs), bytesOf(op.outputs), bytesOf(op.inputs));
      },
      outputs};
  if (overlap) {
    // Outputs overlap inputs: copy the inputs aside and receive into a buffer of its own.
    planned.run = [](ShmGroup& group, NativeOp& op) {
      const auto outBytes = bytesOf(op.outputs);
      at::Tensor received = at::empty({std::accumulate(outBytes.begin(), outBytes.end(), int64_t{0})}, at::kByte);
      const at::Tensor sent = joined(op.inputs);
      group.allToAll(received, sent, outBytes, bytesOf(op.inputs));
      split(received, op.outputs);
    };
  }
  planned.inputs = inputs;
  return planned;
}

std::optional<NativeOp> NativePath::barrier() {
  return NativeOp{"barrier", [](ShmGroup& group, NativeOp&) { group.barrier(); }, {}};
}

std::optional<NativeOp> NativePath::allreduceCoalesced(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  if (tensors.empty()) {
    return std::nullopt;
  }
  for (const auto& t : tensors) {
    // one dtype, as the frontend requires (it words the error)
    if (!dense(t) || t.scalar_type() != tensors[0].scalar_type()) {
      return std::nullopt;
    }
  }
  auto kind = kindFor(op, tensors[0].scalar_type());
  if (!kind) {
    return std::nullopt;
  }
  NativeOp planned{
      "allreduce_coalesced",
      [](ShmGroup& group, NativeOp& op) {
        // Small tensors go as one (an engine op costs microseconds, copying them less),
        // larger ones one by one (no copies).
        constexpr size_t kJoinedBelowBytes = 16 << 10; // on average per tensor
        size_t bytes = 0;
        for (const at::Tensor& t : op.outputs) {
          bytes += t.nbytes();
        }
        if (op.outputs.size() > 1 && bytes < kJoinedBelowBytes * op.outputs.size()) {
          // plain copies, no dispatch per tensor
          at::Tensor all = joined(op.outputs).view(op.outputs[0].scalar_type());
          group.allReduce(all, op.kind, 1.0);
          split(all, op.outputs);
          return;
        }
        for (at::Tensor& t : op.outputs) {
          group.allReduce(t, op.kind, 1.0);
        }
      },
      tensors};
  planned.kind = *kind;
  return planned;
}

std::optional<NativeOp> NativePath::allgatherCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs) {
  if (!allFit(inputs, outputs)) {
    return std::nullopt;
  }
  NativeOp planned{
      "allgather_into_tensor_coalesced",
      [](ShmGroup& group, NativeOp& op) {
        for (size_t i = 0; i < op.outputs.size(); ++i) {
          group.allGather(op.outputs[i], op.inputs[i], std::vector<int64_t>(group.worldSize(), op.inputs[i].nbytes()));
        }
      },
      outputs};
  planned.inputs = inputs;
  return planned;
}

std::optional<NativeOp> NativePath::reduceScatterCoalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceOp& op) {
  if (!allFit(outputs, inputs)) {
    return std::nullopt;
  }
  std::optional<RedKind> kind;
  for (const auto& t : outputs) {
    kind = kindFor(op, t.scalar_type());
    if (!kind) {
      return std::nullopt;
    }
  }
  NativeOp planned{
      "reduce_scatter_tensor_coalesced",
      [](ShmGroup& group, NativeOp& op) {
        for (size_t i = 0; i < op.outputs.size(); ++i) {
          at::Tensor& out = op.outputs[i];
          group.reduceScatter(out, op.inputs[i], std::vector<int64_t>(group.worldSize(), out.numel()), op.kind, 1.0);
        }
      },
      outputs};
  planned.inputs = inputs;
  planned.kind = *kind;
  return planned;
}

std::optional<PostedTransfer> NativePath::transfer(
    bool isSend,
    const std::vector<at::Tensor>& tensors,
    int64_t peer,
    int64_t tag) {
  if (!p2p_ || tensors.size() != 1 || !dense(tensors[0]) || peer < 0 || peer >= group_->worldSize() ||
      peer == group_->rank()) {
    return std::nullopt;
  }
  const char* label = isSend ? "send" : "recv";
  auto request = isSend ? group_->send(tensors[0], static_cast<int>(peer), static_cast<int>(tag))
                        : group_->recv(tensors[0], static_cast<int>(peer), static_cast<int>(tag));
  // As the frontend words it (Submission._where).
  auto future = request->future(
      tensors, std::string("groupcomm: ") + label + " on " + *where_, group_->groupTimeoutMs());
  if (future->completed() && future->hasError()) {
    try {
      std::rethrow_exception(future->exception_ptr());
    } catch (const CommFailure& failure) {
      health_->failed(failure.timedOut());
      throwInPython(CommFailure(failure.what(), failure.timedOut(), label));
    }
  }
  // The Work may outlive the group: it must not keep the engine alive.
  auto help = [group = std::weak_ptr<ShmGroup>(group_), request = std::move(request)] {
    if (auto engine = group.lock()) {
      engine->drive(*request);
    }
  };
  return PostedTransfer{std::move(future), std::move(help)};
}

} // namespace groupcomm
