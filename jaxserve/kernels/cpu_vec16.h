// 16 float lanes as one value (GCC/Clang vector extensions): one AVX-512 register where
// the build targets it (cpu_build.py: -march=native), two AVX2 or four SSE registers
// elsewhere, so the kernels stay portable C++ without intrinsics.
//
// Included by cpu_paged_attention.cc; the build hashes this header into its cache key.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#ifdef __has_builtin
#if __has_builtin(__builtin_shufflevector)
#define JAXSERVE_SHUFFLEVECTOR 1  // Clang, GCC 12 and later
#endif
#endif

namespace jaxserve {

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

inline V16 Load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

inline void Store16(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }

inline V16 Splat16(float x) { return V16{} + x; }

inline V16 Max16(V16 a, V16 b) { return a > b ? a : b; }

namespace vec16_detail {

// Lanes of (a, b) picked by constant indices (0-15 a's, 16-31 b's): Clang's and GCC 12's
// __builtin_shufflevector, older GCC's __builtin_shuffle.
template <int32_t... i>
inline V16 Pick(V16 a, V16 b) {
#ifdef JAXSERVE_SHUFFLEVECTOR
  return __builtin_shufflevector(a, b, i...);
#else
  return __builtin_shuffle(a, b, I16{i...});
#endif
}

// The lane Fold takes from (a, b) into lane x, as Pick's index. Lane x of segment s (L
// lanes from s * L) sums, in its first half, a[x] (`first`: in place, so a blend) and
// a[x + L / 2] (the other: a shuffle); in its second half, b[x] and b[x - L / 2].
constexpr int32_t FoldLane(int L, int32_t x, bool first) {
  return x % L < L / 2 ? (first ? x : x + L / 2) : (first ? 16 + x : 16 + x - L / 2);
}

template <int L, int32_t... x>
inline V16 FoldLanes(V16 a, V16 b, std::integer_sequence<int32_t, x...>) {
  return Pick<FoldLane(L, x, true)...>(a, b) + Pick<FoldLane(L, x, false)...>(a, b);
}

// a, b: the partial sums of 2^k values each, in segments of L = 16 / 2^k lanes. Returns
// those of the 2^(k+1) values in segments of L / 2 lanes, a's and b's interleaved: new
// segment 2s is a's segment s, 2s + 1 is b's.
template <int L>
inline V16 Fold(V16 a, V16 b) {
  return FoldLanes<L>(a, b, std::make_integer_sequence<int32_t, 16>());
}

// x with lanes i and i ^ k swapped (k a power of two below 16).
template <int k, int32_t... i>
inline V16 SwapLanes(V16 x, std::integer_sequence<int32_t, i...>) {
  return Pick<(i ^ k)...>(x, x);
}

template <int k>
inline V16 Swap(V16 x) {
  return SwapLanes<k>(x, std::make_integer_sequence<int32_t, 16>());
}

}  // namespace vec16_detail

// The 16 lane sums of x[0..15], as one vector: lane j is x[j][0] + ... + x[j][15] (in a
// tree order). One transposing tree of 15 adds, 15 blends and 15 shuffles, instead of 16
// serial scalar reductions of 16 adds each.
inline V16 SumEach16(const V16 x[16]) {
  using vec16_detail::Fold;
  V16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = Fold<16>(x[i], x[i + 8]);
  for (int i = 0; i < 4; ++i) b[i] = Fold<8>(a[i], a[i + 4]);
  for (int i = 0; i < 2; ++i) c[i] = Fold<4>(b[i], b[i + 2]);
  return Fold<2>(c[0], c[1]);
}

// The sum of x's lanes (a tree order), in every lane.
inline V16 HorizontalSum16(V16 x) {
  using vec16_detail::Swap;
  x += Swap<8>(x);
  x += Swap<4>(x);
  x += Swap<2>(x);
  return x + Swap<1>(x);
}

// The largest of x's lanes.
inline float HorizontalMax16(V16 x) {
  using vec16_detail::Swap;
  x = Max16(x, Swap<8>(x));
  x = Max16(x, Swap<4>(x));
  x = Max16(x, Swap<2>(x));
  return std::max(x[0], x[1]);
}

// e^x lane-wise, -inf -> 0: Cephes' expf (range reduction by ln 2, a degree-5
// polynomial; within 2 ulp of std::exp, which GCC does not vectorise without
// -ffast-math, and that would break the -inf masking). Rounds to the nearest integer by
// adding and subtracting 1.5 * 2^23 (|x| / ln 2 < 2^22 after the clamp).
inline V16 Exp16(V16 x) {
  const V16 lo = Splat16(-87.33654f), hi = Splat16(88.72283f);
  V16 c = x < lo ? lo : x;
  c = c > hi ? hi : c;
  const V16 k = (c * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const V16 r = c - k * 0.693359375f + k * 2.12194440e-4f;
  V16 p = Splat16(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I16 bits = (__builtin_convertvector(k, I16) + 127) << 23;  // 2^k as floats' bits
  V16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x == -std::numeric_limits<float>::infinity() ? V16{} : p * scale;
}

}  // namespace jaxserve
