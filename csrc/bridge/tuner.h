#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <mutex>

#include <ATen/ATen.h>

namespace groupcomm {

// Which of two ways of running an op is faster on these hosts, for each size
// class (a power of two) from fromBytes: the class's first calls alternate
// between way 0 (the planned one, which ties keep) and way 1, every rank
// times its own, the ranks add their times up (one all-reduce, which the
// caller runs) and all keep the faster from then on. The best way depends on
// the hosts more than on the size: how fast their links are against their
// cores. A group's C++ and Python paths share one tuner per op, so that every
// rank counts the same calls whichever side ran them.
class Tuner {
 public:
  // Messages below `fromBytes`, or of `toBytes` or more, take way 0 untimed.
  explicit Tuner(int64_t fromBytes, int64_t toBytes = std::numeric_limits<int64_t>::max())
      : fromBytes_(fromBytes), toBytes_(toBytes) {}

  // Calls per way that are timed, after kWarmUps untimed each (the first
  // calls of a size meet connections whose windows are still opening).
  static constexpr int kWarmUps = 2;
  static constexpr int kTimedRounds = 3;
  static constexpr int kTrials = 2 * (kWarmUps + kTimedRounds);

  struct Choice {
    int way;   // 0: the planned way, 1: the other
    int trial; // this call's trial in its class; -1 once decided
  };

  // The way for a message of `bytes`.
  Choice choose(int64_t bytes);
  // That trial `trial` of `bytes`' class took `nanos` here (a way's time is
  // its fastest timed call: a call that a peer or the scheduler held up says
  // little about the way). True after the class's last trial: the caller
  // then sums totals() over the ranks and hands the sum to decide(), on
  // every rank at the same call.
  bool record(int64_t bytes, int trial, int64_t nanos);
  // This rank's times for the class's two ways (ns per KiB, int64, way 0 first).
  at::Tensor totals(int64_t bytes) const;
  // Keeps the way whose summed time (totals() over every rank) is lower.
  void decide(int64_t bytes, const at::Tensor& summed);

 private:
  struct SizeClass {
    int calls = 0;
    std::array<int64_t, 2> nanosPerKiB{0, 0};
    int decided = -1;
  };
  static int classOf(int64_t bytes);

  const int64_t fromBytes_;
  const int64_t toBytes_;
  mutable std::mutex mutex_;
  std::array<SizeClass, 64> classes_{};
};

} // namespace groupcomm
