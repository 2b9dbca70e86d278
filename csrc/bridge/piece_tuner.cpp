#include "bridge/piece_tuner.h"

#include <algorithm>
#include <bit>

#include <c10/util/Exception.h>

namespace groupcomm {

int PieceTuner::classOf(int64_t bytes) {
  return 63 - std::countl_zero(static_cast<uint64_t>(std::max<int64_t>(bytes, 1)));
}

PieceTuner::Choice PieceTuner::choose(int64_t bytes, int64_t planned) {
  if (planned >= bytes || bytes < fromBytes_) {
    return {std::min(planned, bytes), -1};
  }
  std::lock_guard<std::mutex> lock(mutex_);
  SizeClass& c = classes_[classOf(bytes)];
  if (c.decided >= 0) {
    return {c.decided == 0 ? planned : bytes, -1};
  }
  if (c.calls == kTrials) {
    return {planned, -1}; // a trial failed before the ranks agreed: the group failed with it
  }
  const int trial = c.calls++;
  return {trial % 2 == 0 ? planned : bytes, trial};
}

bool PieceTuner::record(int64_t bytes, int trial, int64_t nanos) {
  std::lock_guard<std::mutex> lock(mutex_);
  SizeClass& c = classes_[classOf(bytes)];
  if (trial >= 2) {
    c.nanosPerKiB[trial % 2] += nanos / std::max<int64_t>(bytes >> 10, 1);
  }
  return trial == kTrials - 1;
}

at::Tensor PieceTuner::totals(int64_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const SizeClass& c = classes_[classOf(bytes)];
  return at::tensor({c.nanosPerKiB[0], c.nanosPerKiB[1]}, at::kLong);
}

void PieceTuner::decide(int64_t bytes, const at::Tensor& summed) {
  TORCH_CHECK(summed.numel() == 2 && summed.scalar_type() == at::kLong, "groupcomm: decide() takes totals()' sum");
  const auto sums = summed.contiguous();
  const int64_t* t = sums.data_ptr<int64_t>();
  std::lock_guard<std::mutex> lock(mutex_);
  classes_[classOf(bytes)].decided = t[1] < t[0] ? 1 : 0;
}

} // namespace groupcomm
