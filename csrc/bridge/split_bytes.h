#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

namespace groupcomm {

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
