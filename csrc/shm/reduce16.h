#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "shm/reduce.h"

namespace groupcomm {

// bfloat16 and float16 reductions written with AVX2 (and F16C) intrinsics:
// 16 elements a step, widened to float32, folded in registers and rounded
// once, at the speed of a float32 reduction. The compiler's own
// vectorisation of these conversions ran 2x (bfloat16) and 40x (float16)
// slower. Same contract and results as reduceInto; the caller checked
// reduceSupported.

// Whether this CPU runs reduce16 (checked once).
bool reduce16Available();

void reduce16(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount);

} // namespace groupcomm
