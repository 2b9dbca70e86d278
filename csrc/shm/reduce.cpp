#include "shm/reduce.h"

#include "shm/fold.h"
#include "shm/reduce16.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace groupcomm {
namespace {

// Elements reduced per pass: the accumulator block stays in L1.
constexpr size_t kBlock = 1024;

template <typename T>
struct Traits {
  using Acc = T;
  static Acc load(T v) {
    return v;
  }
  static T store(Acc v) {
    return v;
  }
};

// 16-bit floats are loaded into float32, reduced there and rounded once.
template <typename T>
struct Float32Accumulated {
  using Acc = float;
  static float load(T v) {
    return static_cast<float>(v);
  }
  static T store(float v) {
    return T(v);
  }
};

template <>
struct Traits<c10::Half> : Float32Accumulated<c10::Half> {};

// bfloat16 on the bits (shm/fold.h), so that the compiler vectorises both
// directions (c10's own conversion branches per element).
template <>
struct Traits<c10::BFloat16> {
  using Acc = float;
  static float load(c10::BFloat16 v) {
    return bf16ToFloat(v.x);
  }
  static c10::BFloat16 store(float f) {
    return c10::BFloat16(floatToBf16(f), c10::BFloat16::from_bits());
  }
};

// Block by block: the first two inputs are folded in one pass and the last
// one with the rounding back to T, so that two inputs (world 2) take a single
// pass. Every loop writes only a local array: out and the mirrors may be
// inputs, and the compiler vectorises without checking for overlap.
template <typename T, RedKind K>
void reduceTyped(
    T* out,
    const void* const* inputs,
    int n,
    size_t count,
    double factor,
    void* const* mirrors,
    int mirrorCount) {
  using Tr = Traits<T>;
  using Acc = typename Tr::Acc;
  using F = Fold<Acc, K>;
  Acc acc[kBlock];
  T result[kBlock];
  const Acc scale = static_cast<Acc>(factor);
  auto in = [&](int p, size_t base) { return static_cast<const T*>(inputs[p]) + base; };
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    const T* a = in(0, base);
    if (n == 1) {
      for (size_t i = 0; i < len; ++i) {
        result[i] = Tr::store(F::finish(F::first(Tr::load(a[i]), scale), n));
      }
    } else if (n == 2) {
      const T* b = in(1, base);
      for (size_t i = 0; i < len; ++i) {
        result[i] = Tr::store(F::finish(F::next(F::first(Tr::load(a[i]), scale), Tr::load(b[i]), scale), n));
      }
    } else {
      const T* b = in(1, base);
      for (size_t i = 0; i < len; ++i) {
        acc[i] = F::next(F::first(Tr::load(a[i]), scale), Tr::load(b[i]), scale);
      }
      for (int p = 2; p < n - 1; ++p) {
        const T* x = in(p, base);
        for (size_t i = 0; i < len; ++i) {
          acc[i] = F::next(acc[i], Tr::load(x[i]), scale);
        }
      }
      const T* last = in(n - 1, base);
      for (size_t i = 0; i < len; ++i) {
        result[i] = Tr::store(F::finish(F::next(acc[i], Tr::load(last[i]), scale), n));
      }
    }
    std::memcpy(out + base, result, len * sizeof(T)); // from L1
    for (int m = 0; m < mirrorCount; ++m) {
      std::memcpy(static_cast<T*>(mirrors[m]) + base, result, len * sizeof(T));
    }
  }
}

template <typename T>
void reduceKind(
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount) {
  withKind(kind, [&](auto k) {
    constexpr RedKind K = decltype(k)::value;
    if constexpr (std::is_integral_v<T> ? K != RedKind::PremulSum : !isBitwise(K)) {
      reduceTyped<T, K>(static_cast<T*>(out), inputs, n, count, factor, mirrors, mirrorCount);
    } else {
      TORCH_CHECK(false, "groupcomm: no shared-memory kernel for op ", static_cast<int>(kind));
    }
  });
}

bool isFloating(c10::ScalarType dtype) {
  return dtype == c10::kFloat || dtype == c10::kDouble || dtype == c10::kHalf || dtype == c10::kBFloat16;
}

bool isIntegral(c10::ScalarType dtype) {
  return dtype == c10::kByte || dtype == c10::kChar || dtype == c10::kShort || dtype == c10::kInt ||
      dtype == c10::kLong;
}

} // namespace

bool reduceSupported(c10::ScalarType dtype, RedKind kind) {
  if (isFloating(dtype)) {
    return !isBitwise(kind);
  }
  if (isIntegral(dtype)) {
    return kind != RedKind::PremulSum;
  }
  return false;
}

namespace {

void reduceAny(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount) {
  switch (dtype) {
    case c10::kFloat:
      return reduceKind<float>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kDouble:
      return reduceKind<double>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kHalf:
      return reduceKind<c10::Half>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kBFloat16:
      return reduceKind<c10::BFloat16>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kByte:
      return reduceKind<uint8_t>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kChar:
      return reduceKind<int8_t>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kShort:
      return reduceKind<int16_t>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kInt:
      return reduceKind<int32_t>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case c10::kLong:
      return reduceKind<int64_t>(kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    default:
      break;
  }
  TORCH_CHECK(false, "groupcomm: unsupported dtype ", c10::toString(dtype));
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same kernels, every call inlined and compiled for AVX-512 (16 floats a
// step) or AVX2 (8), the 16-bit widening and narrowing in vector registers,
// for CPUs that have it (checked once at run time). The build turns
// floating-point contraction off: a fused multiply-add would round
// PREMUL_SUM differently from the portable build.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), flatten)) void reduceAvx512(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount) {
  reduceAny(dtype, kind, factor, out, inputs, n, count, mirrors, mirrorCount);
}

__attribute__((target("avx2"), flatten)) void reduceAvx2(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount) {
  reduceAny(dtype, kind, factor, out, inputs, n, count, mirrors, mirrorCount);
}

enum class Isa { Portable, Avx2, Avx512 };

Isa bestIsa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")) {
      return Isa::Avx512;
    }
    return __builtin_cpu_supports("avx2") ? Isa::Avx2 : Isa::Portable;
  }();
  return isa;
}
#endif

} // namespace

void reduceInto(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount) {
  TORCH_CHECK(reduceSupported(dtype, kind), "groupcomm: no shared-memory kernel for ", c10::toString(dtype));
  if ((dtype == c10::kBFloat16 || dtype == c10::kHalf) && reduce16Available()) {
    return reduce16(dtype, kind, factor, out, inputs, n, count, mirrors, mirrorCount);
  }
#if defined(__x86_64__) && defined(__GNUC__)
  switch (bestIsa()) {
    case Isa::Avx512:
      return reduceAvx512(dtype, kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case Isa::Avx2:
      return reduceAvx2(dtype, kind, factor, out, inputs, n, count, mirrors, mirrorCount);
    case Isa::Portable:
      break;
  }
#endif
  reduceAny(dtype, kind, factor, out, inputs, n, count, mirrors, mirrorCount);
}

} // namespace groupcomm
