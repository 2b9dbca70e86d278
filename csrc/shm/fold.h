#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "shm/reduce.h"

// What one element of a reduction is, shared by the kernels in reduce.cpp
// (every dtype) and reduce16.cpp (16-bit floats in intrinsics).

namespace groupcomm {

// Integer arithmetic wraps like two's complement hardware (no UB).
template <typename T>
T wrapAdd(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T>
T wrapMul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    using W = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, U>;
    return static_cast<T>(static_cast<W>(a) * static_cast<W>(b));
  } else {
    return a * b;
  }
}

// One step of reduction K in the accumulator type: `first` takes the first
// input, `next` folds in each further one, `finish` ends it (Avg divides).
template <typename Acc, RedKind K>
struct Fold {
  static Acc first(Acc x, Acc scale) {
    if constexpr (K == RedKind::PremulSum) {
      return x * scale;
    } else {
      return x;
    }
  }
  static Acc next(Acc acc, Acc x, Acc scale) {
    if constexpr (K == RedKind::Sum || K == RedKind::Avg) {
      return wrapAdd(acc, x);
    } else if constexpr (K == RedKind::PremulSum) {
      return acc + scale * x;
    } else if constexpr (K == RedKind::Product) {
      return wrapMul(acc, x);
    } else if constexpr (K == RedKind::Min) {
      return x < acc ? x : acc;
    } else if constexpr (K == RedKind::Max) {
      return x > acc ? x : acc;
    } else if constexpr (std::is_integral_v<Acc> && K == RedKind::BitAnd) {
      return acc & x;
    } else if constexpr (std::is_integral_v<Acc> && K == RedKind::BitOr) {
      return acc | x;
    } else if constexpr (std::is_integral_v<Acc> && K == RedKind::BitXor) {
      return acc ^ x;
    } else {
      return acc;
    }
  }
  static Acc finish(Acc v, int n) {
    if constexpr (K == RedKind::Avg) {
      return static_cast<Acc>(v / static_cast<Acc>(n));
    } else {
      return v;
    }
  }
};

// bfloat16 is the top half of a float32: widening is a shift, narrowing
// rounds to nearest even and makes NaN the quiet NaN 0x7FC0.
inline float bf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t floatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// The ops defined on integers only.
constexpr bool isBitwise(RedKind kind) {
  return kind == RedKind::BitAnd || kind == RedKind::BitOr || kind == RedKind::BitXor;
}

// Calls f(std::integral_constant<RedKind, kind>{}): the kernels take the op
// as a template argument.
template <typename F>
void withKind(RedKind kind, F&& f) {
  switch (kind) {
    case RedKind::Sum:
      return f(std::integral_constant<RedKind, RedKind::Sum>{});
    case RedKind::Avg:
      return f(std::integral_constant<RedKind, RedKind::Avg>{});
    case RedKind::Product:
      return f(std::integral_constant<RedKind, RedKind::Product>{});
    case RedKind::Min:
      return f(std::integral_constant<RedKind, RedKind::Min>{});
    case RedKind::Max:
      return f(std::integral_constant<RedKind, RedKind::Max>{});
    case RedKind::BitAnd:
      return f(std::integral_constant<RedKind, RedKind::BitAnd>{});
    case RedKind::BitOr:
      return f(std::integral_constant<RedKind, RedKind::BitOr>{});
    case RedKind::BitXor:
      return f(std::integral_constant<RedKind, RedKind::BitXor>{});
    case RedKind::PremulSum:
      return f(std::integral_constant<RedKind, RedKind::PremulSum>{});
  }
  TORCH_CHECK(false, "groupcomm: unknown reduce op ", static_cast<int>(kind));
}

} // namespace groupcomm
