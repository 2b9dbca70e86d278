#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

namespace groupcomm {

// What the C++ paths (the CPU engine's and NCCL's) accept of a call's shapes;
// whatever they decline goes to the Python frontend, which words the error.

// `whole` holds one `part` per rank of a `world`-rank group, same dtype.
inline bool onePartPerRank(const at::Tensor& part, const at::Tensor& whole, int64_t world) {
  return part.scalar_type() == whole.scalar_type() && whole.numel() == part.numel() * world;
}

// A coalesced call's pairs: as many parts as wholes, at least one, each pair
// accepted by `fits`.
template <typename Fits>
bool everyPairFits(const std::vector<at::Tensor>& parts, const std::vector<at::Tensor>& wholes, Fits fits) {
  if (parts.empty() || parts.size() != wholes.size()) {
    return false;
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!fits(parts[i], wholes[i])) {
      return false;
    }
  }
  return true;
}

// An all-to-all's bytes per peer of `t` in a group of `world` ranks: its rows
// split by `splits` (evenly when empty); none where they do not fit, as the
// frontend would refuse them (it words the error).
inline std::optional<std::vector<int64_t>> splitBytes(
    const at::Tensor& t,
    const std::vector<int64_t>& splits,
    int64_t world) {
  if (t.dim() == 0) {
    return std::nullopt;
  }
  const int64_t rows = t.size(0);
  const int64_t rowBytes = rows == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / rows;
  if (splits.empty()) {
    if (rows % world != 0) {
      return std::nullopt;
    }
    return std::vector<int64_t>(world, rows / world * rowBytes);
  }
  if (static_cast<int64_t>(splits.size()) != world) {
    return std::nullopt;
  }
  std::vector<int64_t> bytes;
  int64_t total = 0;
  for (const int64_t rowsTo : splits) {
    if (rowsTo < 0) {
      return std::nullopt;
    }
    total += rowsTo;
    bytes.push_back(rowsTo * rowBytes);
  }
  if (total != rows) {
    return std::nullopt;
  }
  return bytes;
}

} // namespace groupcomm
