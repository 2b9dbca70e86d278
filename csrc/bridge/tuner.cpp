#include "bridge/tuner.h"

#include <algorithm>
#include <bit>

#include <c10/util/Exception.h>

namespace groupcomm {

int Tuner::classOf(int64_t bytes) {
  return 63 - std::countl_zero(static_cast<uint64_t>(std::max<int64_t>(bytes, 1)));
}

Tuner::Choice Tuner::choose(int64_t bytes) {
  if (bytes < fromBytes_ || bytes >= toBytes_) {
    return {0, -1};
  }
  std::lock_guard<std::mutex> lock(mutex_);
  SizeClass& c = classes_[classOf(bytes)];
  if (c.decided >= 0) {
    return {c.decided, -1};
  }
  if (c.calls == kTrials) {
    return {0, -1}; // a trial failed before the ranks agreed: the group failed with it
  }
  const int trial = c.calls++;
  return {trial % 2, trial};
}

bool Tuner::record(int64_t bytes, int trial, int64_t nanos) {
  std::lock_guard<std::mutex> lock(mutex_);
  SizeClass& c = classes_[classOf(bytes)];
  if (trial >= 2 * kWarmUps) {
    const int64_t perKiB = std::max<int64_t>(nanos / std::max<int64_t>(bytes >> 10, 1), 1);
    int64_t& fastest = c.nanosPerKiB[trial % 2];
    fastest = fastest == 0 ? perKiB : std::min(fastest, perKiB);
  }
  return trial == kTrials - 1;
}

at::Tensor Tuner::totals(int64_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const SizeClass& c = classes_[classOf(bytes)];
  return at::tensor({c.nanosPerKiB[0], c.nanosPerKiB[1]}, at::kLong);
}

void Tuner::decide(int64_t bytes, const at::Tensor& summed) {
  TORCH_CHECK(summed.numel() == 2 && summed.scalar_type() == at::kLong, "groupcomm: decide() takes totals()' sum");
  const auto sums = summed.contiguous();
  const int64_t* t = sums.data_ptr<int64_t>();
  std::lock_guard<std::mutex> lock(mutex_);
  classes_[classOf(bytes)].decided = t[1] < t[0] ? 1 : 0;
}

} // namespace groupcomm
