#include "bridge/native.h"

#include "bindings.h"
#include "comm_failure.h"

namespace groupcomm {
namespace {

// What the engine moves as it is: CPU, strided, contiguous.
bool dense(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous();
}

} // namespace

NativePath::NativePath(
    std::shared_ptr<ShmGroup> group,
    std::string groupName,
    std::function<void()> onCollective)
    : group_(std::move(group)),
      groupName_(std::move(groupName)),
      onCollective_(std::move(onCollective)) {}

std::optional<RedKind> NativePath::kindFor(
    const c10d::ReduceOp& op,
    c10::ScalarType dtype) const {
  const auto kind = static_cast<RedKind>(op.op_);
  if (kind == RedKind::PremulSum || !reduceSupported(dtype, kind)) {
    return std::nullopt;
  }
  return kind;
}

void NativePath::run(const char* label, const std::function<void()>& op) {
  onCollective_();
  std::string why;
  bool timedOut = false;
  try {
    op();
    return;
  } catch (const CommFailure& failure) {
    why = failure.what();
    timedOut = failure.timedOut();
  } catch (const std::exception& error) {
    why = error.what();
  }
  // As the frontend words it (Submission._where / _reraise).
  const std::string where = std::string("groupcomm: ") + label + " on group '" +
      groupName_ + "' (rank " + std::to_string(group_->rank()) + " of " +
      std::to_string(group_->worldSize()) + ")";
  const std::string message = timedOut
      ? where + " hit its timeout before completing (" + why + ")"
      : where + " failed: " + why;
  throwInPython(CommFailure(message, timedOut), label);
}

bool NativePath::allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  if (tensors.size() != 1 || !dense(tensors[0])) {
    return false;
  }
  auto kind = kindFor(op, tensors[0].scalar_type());
  if (!kind) {
    return false;
  }
  run("allreduce", [&] { group_->allReduce(tensors[0], *kind, 1.0); });
  return true;
}

bool NativePath::broadcast(std::vector<at::Tensor>& tensors, int64_t root) {
  if (tensors.size() != 1 || !dense(tensors[0]) || root < 0 || root >= group_->worldSize()) {
    return false;
  }
  run("broadcast", [&] { group_->broadcast(tensors[0], static_cast<int>(root)); });
  return true;
}

bool NativePath::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int64_t root) {
  if (tensors.size() != 1 || !dense(tensors[0]) || root < 0 || root >= group_->worldSize()) {
    return false;
  }
  auto kind = kindFor(op, tensors[0].scalar_type());
  if (!kind) {
    return false;
  }
  run("reduce", [&] { group_->reduce(tensors[0], static_cast<int>(root), *kind, 1.0); });
  return true;
}

bool NativePath::allgatherBase(at::Tensor& output, at::Tensor& input) {
  const int world = group_->worldSize();
  if (!dense(output) || !dense(input) || output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * world) {
    return false;
  }
  run("_allgather_base", [&] {
    group_->allGather(output, input, std::vector<int64_t>(world, input.nbytes()));
  });
  return true;
}

bool NativePath::reduceScatterBase(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceOp& op) {
  const int world = group_->worldSize();
  if (!dense(output) || !dense(input) || output.scalar_type() != input.scalar_type() ||
      input.numel() != output.numel() * world) {
    return false;
  }
  auto kind = kindFor(op, output.scalar_type());
  if (!kind) {
    return false;
  }
  run("_reduce_scatter_base", [&] {
    group_->reduceScatter(output, input, std::vector<int64_t>(world, output.numel()), *kind, 1.0);
  });
  return true;
}

bool NativePath::alltoallBase(
    at::Tensor& output,
    at::Tensor& input,
    const std::vector<int64_t>& outputSplits,
    const std::vector<int64_t>& inputSplits) {
  const int world = group_->worldSize();
  if (!outputSplits.empty() || !inputSplits.empty() || !dense(output) || !dense(input) ||
      output.scalar_type() != input.scalar_type() || output.numel() != input.numel() ||
      input.dim() == 0 || output.dim() == 0 || input.size(0) % world != 0 ||
      output.size(0) % world != 0) {
    return false;
  }
  run("alltoall_base", [&] {
    std::vector<int64_t> sizes(world, static_cast<int64_t>(input.nbytes()) / world);
    group_->allToAll(output, input, sizes, sizes);
  });
  return true;
}

bool NativePath::barrier() {
  run("barrier", [&] { group_->barrier(); });
  return true;
}

} // namespace groupcomm
