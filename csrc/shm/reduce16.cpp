#include "shm/reduce16.h"

#include "shm/fold.h"

#include <c10/util/Exception.h>

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GROUPCOMM_REDUCE16 1
#endif

namespace groupcomm {

#ifdef GROUPCOMM_REDUCE16
namespace {

#define TARGET __attribute__((target("avx2,f16c"), always_inline)) inline

// Sixteen 16-bit values as two vectors of eight float32. bfloat16 is the top
// half of a float32: interleaving with zeros widens it, lanes out of order
// (0-3 and 8-11, then 4-7 and 12-15), and packing undoes that order.
struct Bf16 {
  TARGET static void widen(__m256i v, __m256& lo, __m256& hi) {
    const __m256i zero = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
  // Round to nearest even on the bits; NaN becomes the quiet NaN 0x7FC0.
  TARGET static __m256i round(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  }
  TARGET static __m256i narrow(__m256 lo, __m256 hi) {
    return _mm256_packus_epi32(round(lo), round(hi));
  }
  TARGET static float widen1(uint16_t v) {
    return bf16ToFloat(v);
  }
  TARGET static uint16_t narrow1(float f) {
    return floatToBf16(f);
  }
};

// float16 through F16C, rounding to nearest even as c10::Half does.
struct Fp16 {
  TARGET static void widen(__m256i v, __m256& lo, __m256& hi) {
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
  }
  TARGET static __m256i narrow(__m256 lo, __m256 hi) {
    return _mm256_set_m128i(
        _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
  }
  TARGET static float widen1(uint16_t v) {
    return _cvtsh_ss(v);
  }
  TARGET static uint16_t narrow1(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
};

// Fold<float, K> (shm/fold.h) on eight lanes, op for op (no fused
// multiply-add): the remainder that fills no vector takes Fold itself.
template <RedKind K>
TARGET __m256 first(__m256 x, __m256 scale) {
  return K == RedKind::PremulSum ? _mm256_mul_ps(x, scale) : x;
}

template <RedKind K>
TARGET __m256 next(__m256 acc, __m256 x, __m256 scale) {
  if constexpr (K == RedKind::Sum || K == RedKind::Avg) {
    return _mm256_add_ps(acc, x);
  } else if constexpr (K == RedKind::PremulSum) {
    return _mm256_add_ps(acc, _mm256_mul_ps(scale, x));
  } else if constexpr (K == RedKind::Product) {
    return _mm256_mul_ps(acc, x);
  } else if constexpr (K == RedKind::Min) {
    return _mm256_min_ps(x, acc); // x < acc ? x : acc
  } else {
    return _mm256_max_ps(x, acc); // x > acc ? x : acc
  }
}

template <RedKind K>
TARGET __m256 finish(__m256 v, __m256 n) {
  return K == RedKind::Avg ? _mm256_div_ps(v, n) : v;
}

template <typename Codec, RedKind K>
__attribute__((target("avx2,f16c"))) void reduceWith(
    uint16_t* out,
    const void* const* inputs,
    int n,
    size_t count,
    float scale,
    void* const* mirrors,
    int mirrorCount) {
  auto in = [&](int p) { return static_cast<const uint16_t*>(inputs[p]); };
  const __m256 scales = _mm256_set1_ps(scale);
  const __m256 ns = _mm256_set1_ps(static_cast<float>(n));
  size_t i = 0;
  // Every input's sixteen values are read before any output or mirror is
  // written: either may be an input at the same position.
  for (; i + 16 <= count; i += 16) {
    __m256 lo, hi, xlo, xhi;
    Codec::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in(0) + i)), lo, hi);
    lo = first<K>(lo, scales);
    hi = first<K>(hi, scales);
    for (int p = 1; p < n; ++p) {
      Codec::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in(p) + i)), xlo, xhi);
      lo = next<K>(lo, xlo, scales);
      hi = next<K>(hi, xhi, scales);
    }
    const __m256i result = Codec::narrow(finish<K>(lo, ns), finish<K>(hi, ns));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), result);
    for (int m = 0; m < mirrorCount; ++m) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(mirrors[m]) + i), result);
    }
  }
  using F = Fold<float, K>;
  for (; i < count; ++i) {
    float acc = F::first(Codec::widen1(in(0)[i]), scale);
    for (int p = 1; p < n; ++p) {
      acc = F::next(acc, Codec::widen1(in(p)[i]), scale);
    }
    const uint16_t result = Codec::narrow1(F::finish(acc, n));
    out[i] = result;
    for (int m = 0; m < mirrorCount; ++m) {
      static_cast<uint16_t*>(mirrors[m])[i] = result;
    }
  }
}

#undef TARGET

template <typename Codec>
void reduceCodec(
    RedKind kind,
    uint16_t* out,
    const void* const* inputs,
    int n,
    size_t count,
    float scale,
    void* const* mirrors,
    int mirrorCount) {
  withKind(kind, [&](auto k) {
    constexpr RedKind K = decltype(k)::value;
    if constexpr (!isBitwise(K)) {
      reduceWith<Codec, K>(out, inputs, n, count, scale, mirrors, mirrorCount);
    } else {
      TORCH_CHECK(false, "groupcomm: no 16-bit float kernel for op ", static_cast<int>(kind));
    }
  });
}

} // namespace

bool reduce16Available() {
  static const bool available = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return available;
}

void reduce16(
    c10::ScalarType dtype,
    RedKind kind,
    double factor,
    void* out,
    const void* const* inputs,
    int n,
    size_t count,
    void* const* mirrors,
    int mirrorCount) {
  auto* o = static_cast<uint16_t*>(out);
  const auto scale = static_cast<float>(factor);
  if (dtype == c10::kBFloat16) {
    return reduceCodec<Bf16>(kind, o, inputs, n, count, scale, mirrors, mirrorCount);
  }
  TORCH_CHECK(dtype == c10::kHalf, "groupcomm: no 16-bit float kernel for ", c10::toString(dtype));
  reduceCodec<Fp16>(kind, o, inputs, n, count, scale, mirrors, mirrorCount);
}

#else

bool reduce16Available() {
  return false;
}

void reduce16(c10::ScalarType dtype, RedKind, double, void*, const void* const*, int, size_t, void* const*, int) {
  TORCH_CHECK(false, "groupcomm: no 16-bit float kernel on this CPU for ", c10::toString(dtype));
}

#endif

} // namespace groupcomm
