// One chunk of up to 16 keys for one or two rows of the CPU attention kernel
// (cpu_paged_attention.cc): the scores, the online-softmax update of FlashAttention
// (Dao et al. 2022) and the weighted values.
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

// Where R rows of one token attend (R = 1 or 2: two rows' dependent chains, the
// reduction tree, max, exp and rescaling, interleave).
struct RowsRef {
  const float* q[2];
  const float* k[2];  // the chunk's key j of row r at k[r] + j * stride
  const float* v[2];
  float* acc[2];      // head_dim floats: the row's output so far
  float* row_max[2];  // the running max of its scores
  float* row_sum[2];  // 16 floats: the running sum of its weights, by lanes
};

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

// The rows' online-softmax step over a chunk of m <= 16 keys, seen where `seen` (lanes
// past m are not).
//
// Scores: ChunkScores. Then the running max, sum and output are rescaled and the
// weighted values added, the output 16 lanes at a time in registers.
template <int R>
inline void AttendChunk(const RowsRef& x, int64_t stride, int m, int64_t d, float scale,
                        I16 seen) {
  const int64_t whole = d / 16 * 16;
  V16 s[R];
  for (int r = 0; r < R; ++r) {
    s[r] = ChunkScores(x.q[r], x.k[r], stride, m, whole);
    if (whole < d) {  // head_dim not a multiple of 16: the rest one key at a time
      alignas(64) float rest[16];
      for (int j = 0; j < 16; ++j) {
        const float* kj = x.k[r] + std::min(j, m - 1) * stride;
        float sum = 0.f;
        for (int64_t c = whole; c < d; ++c) sum += x.q[r][c] * kj[c];
        rest[j] = sum;
      }
      s[r] += Load16(rest);
    }
    s[r] = seen ? s[r] * scale : Splat16(kNegInf);
  }
  alignas(64) float w[R][16];
  float rescale[R];
  bool any = false;
  for (int r = 0; r < R; ++r) {
    const float chunk_max = HorizontalMax16(s[r]);
    // No key of this chunk for this row: weights 0, nothing rescaled.
    const float new_max = std::max(*x.row_max[r], chunk_max);
    if (new_max == kNegInf) {
      rescale[r] = 1.f;
      Store16(w[r], V16{});
      continue;
    }
    any = true;
    // exp(-inf) = 0 at the start. Exp16, not std::exp: a call would spill every vector
    // register.
    rescale[r] = Exp16(Splat16(*x.row_max[r] - new_max))[0];
    *x.row_max[r] = new_max;
    const V16 weights = Exp16(s[r] - new_max);  // masked keys weigh 0
    Store16(w[r], weights);
    Store16(x.row_sum[r], Load16(x.row_sum[r]) * rescale[r] + weights);
  }
  if (!any) return;
  // acc = acc * rescale + sum_j w[j] v[j], a vector register at a time, over two partial
  // sums a row (even and odd keys) so that the multiply-adds are not one dependent chain.
#if JAXSERVE_ATTENTION_AVX2
  // 8 lanes: 16-lane V16s are two ymm each, and with R = 2 the compiler kept them on the
  // stack (see ChunkScores).
  for (int64_t c = 0; c < whole; c += 8) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_mul_ps(_mm256_loadu_ps(x.acc[r] + c), _mm256_set1_ps(rescale[r]));
      a1[r] = _mm256_setzero_ps();
    }
    int j = 0;
    for (; j + 2 <= m; j += 2)
      for (int r = 0; r < R; ++r) {
        const float* vj = x.v[r] + j * stride + c;
        a0[r] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][j]), _mm256_loadu_ps(vj), a0[r]);
        a1[r] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][j + 1]), _mm256_loadu_ps(vj + stride), a1[r]);
      }
    if (j < m)
      for (int r = 0; r < R; ++r)
        a0[r] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][j]),
                                _mm256_loadu_ps(x.v[r] + j * stride + c), a0[r]);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(x.acc[r] + c, _mm256_add_ps(a0[r], a1[r]));
  }
#else
  for (int64_t c = 0; c < whole; c += 16) {
    V16 a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      a0[r] = Load16(x.acc[r] + c) * rescale[r];
      a1[r] = V16{};
    }
    int j = 0;
    for (; j + 2 <= m; j += 2)
      for (int r = 0; r < R; ++r) {
        a0[r] += w[r][j] * Load16(x.v[r] + j * stride + c);
        a1[r] += w[r][j + 1] * Load16(x.v[r] + (j + 1) * stride + c);
      }
    if (j < m)
      for (int r = 0; r < R; ++r) a0[r] += w[r][j] * Load16(x.v[r] + j * stride + c);
    for (int r = 0; r < R; ++r) Store16(x.acc[r] + c, a0[r] + a1[r]);
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t c = whole; c < d; ++c) {
      float a = x.acc[r][c] * rescale[r];
      for (int j = 0; j < m; ++j) a += w[r][j] * x.v[r][j * stride + c];
      x.acc[r][c] = a;
    }
}

}  // namespace jaxserve
