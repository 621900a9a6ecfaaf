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

// The rows' online-softmax step over a chunk of m <= 16 keys, seen where `seen` (lanes
// past m are not).
//
// Scores: a vector accumulator per key over head_dim in 16-lane pieces, then one
// transposing tree (SumEach16) for all 16 keys; keys past m repeat key m - 1, so that no
// key past the context is read. Then the running max, sum and output are rescaled and the
// weighted values added, the output 16 lanes at a time in registers.
template <int R>
inline void AttendChunk(const RowsRef& x, int64_t stride, int m, int64_t d, float scale,
                        I16 seen) {
  const int64_t whole = d / 16 * 16;
  V16 s[R];
  for (int r = 0; r < R; ++r) {
    V16 part[16];
    for (int j = 0; j < 16; ++j) part[j] = V16{};
    for (int64_t c = 0; c < whole; c += 16) {
      const V16 qc = Load16(x.q[r] + c);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        part[j] += qc * Load16(x.k[r] + std::min(j, m - 1) * stride + c);
    }
    s[r] = SumEach16(part);
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
  // acc = acc * rescale + sum_j w[j] v[j], 16 lanes at a time, over two partial sums a
  // row (even and odd keys) so that the multiply-adds are not one dependent chain.
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
  for (int r = 0; r < R; ++r)
    for (int64_t c = whole; c < d; ++c) {
      float a = x.acc[r][c] * rescale[r];
      for (int j = 0; j < m; ++j) a += w[r][j] * x.v[r][j * stride + c];
      x.acc[r][c] = a;
    }
}

}  // namespace jaxserve
