// Chunks of up to 16 keys for the rows of the CPU attention kernel
// (cpu_paged_attention.cc): a row's scores for a chunk (RowScores), and the weighted
// values of a segment of chunks for one or two rows (AddValues).
//
// Included by cpu_paged_attention.cc; the build hashes this header into its cache key.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_vec16.h"

// AVX2 + FMA without AVX-512: the parts where 16-lane vectors outgrow the 16 ymm
// registers use 8-lane intrinsics instead (ChunkScores).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JAXSERVE_ATTENTION_AVX2 1
#include <immintrin.h>
#else
#define JAXSERVE_ATTENTION_AVX2 0
#endif

namespace jaxserve {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if JAXSERVE_ATTENTION_AVX2
// The 8 lane sums of x[0..7], as one vector: lane j is x[j][0] + ... + x[j][7] (three
// rounds of pairwise adds, then the two 128-bit halves).
inline __m256 SumEach8(const __m256 x[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  // u0 = [x0..x3 lanes 0-3 sums, x0..x3 lanes 4-7 sums], u1 the same for x4..x7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k_j for keys j = first .. first + 7 (past m - 1: key m - 1 again), over the first
// `whole` lanes (a multiple of 16).
inline __m256 Scores8(const float* q, const float* k, int64_t stride, int first, int m,
                      int64_t whole) {
  const float* kj[8];
  __m256 part[8];
  for (int j = 0; j < 8; ++j) {
    kj[j] = k + std::min(first + j, m - 1) * stride;
    part[j] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) part[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj[j] + c), part[j]);
  }
  return SumEach8(part);
}
#endif

// A row's scores q . k_j for the chunk's 16 keys (past m - 1: key m - 1 again, so that no
// key past the context is read), over its first `whole` lanes (a multiple of 16).
//
// With AVX-512: a 16-lane accumulator per key (16 of the 32 zmm registers), one
// transposing tree (SumEach16). With AVX2 the same 16 accumulators are 32 ymm, twice the
// register file: the compiler kept them on the stack (a load and a store around every
// multiply-add), which made the kernel ~4x slower per key than on AVX-512
// (scripts/bench_attention_cpu.py); there, two passes of 8 keys, an 8-lane accumulator each.
inline V16 ChunkScores(const float* q, const float* k, int64_t stride, int m, int64_t whole) {
#if JAXSERVE_ATTENTION_AVX2
  alignas(64) float out[16];
  _mm256_store_ps(out, Scores8(q, k, stride, 0, m, whole));
  _mm256_store_ps(out + 8, Scores8(q, k, stride, 8, m, whole));
  return Load16(out);
#else
  V16 part[16];
  for (int j = 0; j < 16; ++j) part[j] = V16{};
  for (int64_t c = 0; c < whole; c += 16) {
    const V16 qc = Load16(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) part[j] += qc * Load16(k + std::min(j, m - 1) * stride + c);
  }
  return SumEach16(part);
#endif
}

// A row's scaled scores for a chunk of m <= 16 keys (key j at k + j * stride), -inf
// where not `seen` (lanes past m are not).
inline V16 RowScores(const float* q, const float* k, int64_t stride, int m, int64_t d,
                     float scale, I16 seen) {
  const int64_t whole = d / 16 * 16;
  V16 s = ChunkScores(q, k, stride, m, whole);
  if (whole < d) {  // head_dim not a multiple of 16: the rest one key at a time
    alignas(64) float rest[16];
    for (int j = 0; j < 16; ++j) {
      const float* kj = k + std::min(j, m - 1) * stride;
      float sum = 0.f;
      for (int64_t c = whole; c < d; ++c) sum += q[c] * kj[c];
      rest[j] = sum;
    }
    s += Load16(rest);
  }
  return seen ? s * scale : Splat16(kNegInf);
}

// Lanes of a row's output held in registers while the weighted values of a segment are
// added: 4 vectors (head_dim 64 in one pass), 2 with AVX2, where a V16 is two of the 16
// ymm registers and 2 rows x 4 would not fit.
constexpr int kValueVectors = JAXSERVE_ATTENTION_AVX2 ? 2 : 4;

// What ValuePass reads for R rows of one token over a segment of n chunks.
struct ValueRef {
  const float* v;         // the value cache
  const int64_t* offset;  // chunk i's first key at v + offset[i] (the unit's first KV head)
  const int* keys;        // chunk i's keys
  const char* visible;    // whether chunk i has a key for the token (else skipped)
  int n;
  int64_t stride;           // floats from a key to the next
  int64_t head_offset[2];   // row r's KV head, floats past offset[i]
  const float* w[2];        // row r's weights, 16 a chunk (chunk i's at w[r] + 16 i)
  float* acc[2];            // row r's output so far
  float rescale[2];         // what acc[r] is multiplied by first
};

// acc[r] = acc[r] * rescale[r] + sum over the segment's keys j of w[r][j] v_j, on lanes
// [c0, c0 + 16 NV): the R x NV output vectors stay in registers for all the keys (R x NV
// independent chains of multiply-adds), each value vector read once for the R rows when
// they share a KV head.
template <int R, int NV>
inline void ValuePass(const ValueRef& x, int64_t c0) {
  V16 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = Load16(x.acc[r] + c0 + 16 * c) * x.rescale[r];
  for (int i = 0; i < x.n; ++i) {
    if (!x.visible[i]) continue;
    const float* vb[R];
    const float* wr[R];
    for (int r = 0; r < R; ++r) {
      vb[r] = x.v + x.offset[i] + x.head_offset[r] + c0;
      wr[r] = x.w[r] + 16 * i;
    }
    const int m = x.keys[i];
    for (int j = 0; j < m; ++j)
      for (int r = 0; r < R; ++r) {
        const float wj = wr[r][j];
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) a[r][c] += wj * Load16(vb[r] + j * x.stride + 16 * c);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) Store16(x.acc[r] + c0 + 16 * c, a[r][c]);
}

// ValuePass over all head_dim d lanes: kValueVectors vectors a pass, then one, then the
// lanes past the last whole vector one at a time.
template <int R>
inline void AddValues(const ValueRef& x, int64_t d) {
  const int64_t whole = d / 16 * 16;
  int64_t c0 = 0;
  for (; c0 + 16 * kValueVectors <= whole; c0 += 16 * kValueVectors)
    ValuePass<R, kValueVectors>(x, c0);
  for (; c0 < whole; c0 += 16) ValuePass<R, 1>(x, c0);
  for (int r = 0; r < R; ++r)
    for (int64_t c = whole; c < d; ++c) {
      float a = x.acc[r][c] * x.rescale[r];
      for (int i = 0; i < x.n; ++i) {
        if (!x.visible[i]) continue;
        const float* vb = x.v + x.offset[i] + x.head_offset[r] + c;
        for (int j = 0; j < x.keys[i]; ++j) a += x.w[r][16 * i + j] * vb[j * x.stride];
      }
      x.acc[r][c] = a;
    }
}

}  // namespace jaxserve
