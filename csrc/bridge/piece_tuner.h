#pragma once

#include <array>
#include <cstdint>
#include <mutex>

#include <ATen/ATen.h>

namespace groupcomm {

// How a chain broadcast cuts a message: in the pieces the size rule plans,
// or whole. A piece lets the ranks along the chain overlap, and costs every
// one of them a wake-up; which wins depends on the hosts, not the size (4
// hosts of 1 rank on 2 vCPUs, 1 MiB: at 1 Gbit/s two halves are 1.1x faster
// than one piece, at 10 Gbit/s one piece is 1.1x-1.2x faster than two). So
// the first calls of each size class (a power of two) from fromBytes
// alternate between the two, every rank times its own, the ranks add their
// times up (one all-reduce, which the caller runs) and all keep the faster
// from then on.
// Shared by a group's C++ and Python chains, so that every rank counts the
// same calls whichever side ran them.
class PieceTuner {
 public:
  // Messages below `fromBytes` keep the planned pieces untimed.
  explicit PieceTuner(int64_t fromBytes) : fromBytes_(fromBytes) {}

  // Calls per candidate that are timed, after one untimed each.
  static constexpr int kTimedRounds = 3;
  static constexpr int kTrials = 2 * (kTimedRounds + 1);

  struct Choice {
    int64_t piece;
    int trial; // this call's trial in its class; -1 once decided
  };

  // The piece size for a chain of `bytes` whose rule plans `planned`.
  Choice choose(int64_t bytes, int64_t planned);
  // That trial `trial` of `bytes`' class took `nanos` here. True after the
  // class's last trial: the caller then sums totals() over the ranks and
  // hands the sum to decide(), on every rank at the same call.
  bool record(int64_t bytes, int trial, int64_t nanos);
  // This rank's times for the class's two candidates (int64, planned first).
  at::Tensor totals(int64_t bytes) const;
  // Keeps the candidate whose summed time (totals() over every rank) is lower.
  void decide(int64_t bytes, const at::Tensor& summed);

 private:
  struct SizeClass {
    int calls = 0;
    std::array<int64_t, 2> nanosPerKiB{0, 0};
    int decided = -1; // 0: the planned pieces, 1: whole
  };
  static int classOf(int64_t bytes);

  const int64_t fromBytes_;
  mutable std::mutex mutex_;
  std::array<SizeClass, 64> classes_{};
};

} // namespace groupcomm
