#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

namespace groupcomm {

// c10d::ReduceOp::RedOpType values, as the Python side hands them over.
enum class RedKind : int {
  Sum = 0,
  Avg = 1,
  Product = 2,
  Min = 3,
  Max = 4,
  BitAnd = 5,
  BitOr = 6,
  BitXor = 7,
  PremulSum = 8,
};

// out[i] = reduce(inputs[0][i], ..., inputs[n - 1][i]) for i < count.
// `out` may be one of the inputs; each of the `mirrorCount` `mirrors`
// receives another copy of the result, block by block while it is still in
// L1 (a mirror may be one of the inputs too, at the same position; it must
// not overlap `out` or another input). float16/bfloat16 accumulate in float32;
// integer Avg is the wrapped sum divided by n, truncated; PremulSum
// multiplies every input by `factor` before summing.
void reduceInto(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors = nullptr,
    int mirrorCount = 0);

// Whether reduceInto implements this pair (the caller checked meaning).
bool reduceSupported(c10::ScalarType dtype, RedKind kind);

} // namespace groupcomm
