#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "shm/group.h"

namespace groupcomm {

// The ops the bridge runs without entering Python: synchronous calls on dense
// contiguous CPU tensors that the group's shared-memory engine carries as
// they are (the Python frontend hands the engine over once it is built, see
// C10dFrontend.native_plan). Each method returns false, having done nothing,
// for a call it does not cover; the bridge then forwards that call to Python,
// which also owns every argument error. A failure is raised as the frontend
// raises it: CommTimeoutError / GroupCommError naming op, group and rank.
class NativePath {
 public:
  NativePath(
      std::shared_ptr<ShmGroup> group,
      std::string groupName,
      std::function<void()> onCollective);

  bool allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);
  bool broadcast(std::vector<at::Tensor>& tensors, int64_t root);
  bool reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int64_t root);
  bool allgatherBase(at::Tensor& output, at::Tensor& input);
  bool reduceScatterBase(at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& op);
  bool alltoallBase(
      at::Tensor& output,
      at::Tensor& input,
      const std::vector<int64_t>& outputSplits,
      const std::vector<int64_t>& inputSplits);
  bool barrier();

 private:
  // Runs `op` (counted as a collective first), raising its failure in Python.
  void run(const char* label, const std::function<void()>& op);
  // A reduce op the engine computes on `dtype` with no factor: its kind.
  std::optional<RedKind> kindFor(const c10d::ReduceOp& op, c10::ScalarType dtype) const;

  std::shared_ptr<ShmGroup> group_;
  std::string groupName_;
  std::function<void()> onCollective_;
};

} // namespace groupcomm
