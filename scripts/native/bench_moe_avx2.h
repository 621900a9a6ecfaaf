// AVX2 + FMA variants of the tile product for bench_moe_kernel.cc (included by it where
// cpu_tile_matmul.h picked the AVX2 tiles; the AVX-512 variants are in the .cc).
//
//   tile:V,R,pf,hint,kc,seq,lead,mask  register tiles of V ymm vectors (8 columns each)
//       x R rows over the [K, N] weights (V * R accumulators; seq unused); kc 1: the
//       first row block of a panel copies the panel as it reads it into a contiguous
//       [K][8 V] buffer, which the panel's other row blocks read instead (sequentially);
//       pf < 0 prefetches -pf 64-byte lines ahead in the weight row (the kernel: -2),
//       pf > 0 pf rows ahead in the panel, 0 none; hint 0-3 T0, T1, T2, NTA; lead > 0
//       also prefetches lead rows ahead in the first -pf lines of the row (the kernel:
//       8); mask 1 reads every weight vector by maskload (the kernel's way), 0 by plain
//       loads, with a mask only on the last, partial vector of a row.
//       tile:2,6,-2,0,0,0,8,1 is the kernel's PanelMatmul.
//   chunk:V,R,pf,hint,kc,seq,copy  6 x 16 tiles (V ignored, R 4-6) over k-chunks of kc
//       rows (contiguous, 0: all K), all panels and row blocks of a chunk before the next,
//       accumulating into out; seq 1: block 0 prefetches the next chunk (after the last,
//       the next matrix of the unit) one line a row, in address order; copy 1: block 0
//       copies each panel's chunk for the other blocks. chunk:2,6,0,0,64,1,1 is the
//       kernel's ChunkMatmul (cpu_moe_chunks.h), which it runs below 4 row blocks.
//   (pm, the kernel on panel-major weights, is bench_moe_kernel.cc's: the kernel's own
//       PanelsMatmul, as pm:2,6,8,0 was here: 6 x 16 tiles, block 0 prefetching 8 rows
//       ahead in the contiguous panel.)

#pragma once

namespace {

// out[r][col + 8 j + i] = sum_k at[k * R + r] * w[k * ldw + col + 8 j + i] for the V
// vectors j of a tile, the last one's lanes outside `last` neither read nor written
// when kPartial; kMaskAll reads and writes every vector through a mask.
// kCopy: also stores what it reads of w to copy[k * 8 V + 8 j] (masked lanes as 0).
template <int V, int R, int Hint, bool kMaskAll, bool kPartial, bool kCopy = false>
inline void YTile(const float* at, const float* w, int64_t ldw, int64_t K, int64_t col,
                  __m256i last, float* const* out, int64_t pf, int64_t pf2,
                  float* copy = nullptr) {
  constexpr auto hint = Hint == 0   ? _MM_HINT_T0
                       : Hint == 1 ? _MM_HINT_T1
                       : Hint == 2 ? _MM_HINT_T2
                                   : _MM_HINT_NTA;
  const __m256i ones = _mm256_set1_epi32(-1);
  auto masked = [&](int j) { return kMaskAll || (kPartial && j == V - 1); };
  auto mask_of = [&](int j) { return kPartial && j == V - 1 ? last : ones; };
  __m256 acc[R * V];
#pragma GCC unroll 32
  for (int a = 0; a < R * V; ++a) acc[a] = _mm256_setzero_ps();
  const float* wk = w + col;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + pf), hint);
      if (V > 2) _mm_prefetch(reinterpret_cast<const char*>(wk + pf + 8 * V - 1), hint);
    }
    if (pf2) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + pf2), hint);
      if (V > 2) _mm_prefetch(reinterpret_cast<const char*>(wk + pf2 + 8 * V - 1), hint);
    }
    __m256 b[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j)
      b[j] = masked(j) ? _mm256_maskload_ps(wk + 8 * j, mask_of(j)) : _mm256_loadu_ps(wk + 8 * j);
    if constexpr (kCopy) {
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) _mm256_store_ps(copy + k * 8 * V + 8 * j, b[j]);
    }
    const float* ak = at + k * R;
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(ak + r);
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r * V + j] = _mm256_fmadd_ps(a, b[j], acc[r * V + j]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) {
      float* o = out[r] + col + 8 * j;
      if (masked(j)) _mm256_maskstore_ps(o, mask_of(j), acc[r * V + j]);
      else _mm256_storeu_ps(o, acc[r * V + j]);
    }
}

template <int V, int R, int Hint, bool kMaskAll, bool kPartial, bool kCopy = false>
inline void YTileRows(int rows, const float* at, const float* w, int64_t ldw, int64_t K,
                      int64_t col, __m256i last, float* const* out, int64_t pf, int64_t pf2,
                      float* copy = nullptr) {
  if (rows >= R)
    return YTile<V, R, Hint, kMaskAll, kPartial, kCopy>(at, w, ldw, K, col, last, out, pf, pf2,
                                                        copy);
  if constexpr (R > 1)
    YTileRows<V, R - 1, Hint, kMaskAll, kPartial, kCopy>(rows, at, w, ldw, K, col, last, out,
                                                         pf, pf2, copy);
}

thread_local std::vector<float, std::allocator<float>> copy_buffer;

// The last, narrower tile of a row (lanes < 8 V columns): ceil(lanes / 8) vectors.
template <int V, int R, int Hint, bool kMaskAll>
inline void YTileTail(int vectors, bool partial, int rows, const float* at, const float* w,
                      int64_t ldw, int64_t K, int64_t col, __m256i last, float* const* out,
                      int64_t pf, int64_t pf2) {
  if (vectors >= V) {
    if (partial)
      return YTileRows<V, R, Hint, kMaskAll, true>(rows, at, w, ldw, K, col, last, out, pf, pf2);
    return YTileRows<V, R, Hint, kMaskAll, false>(rows, at, w, ldw, K, col, last, out, pf, pf2);
  }
  if constexpr (V > 1)
    YTileTail<V - 1, R, Hint, kMaskAll>(vectors, partial, rows, at, w, ldw, K, col, last, out,
                                        pf, pf2);
}

template <int V, int R, int Hint, bool kMaskAll>
void YMatmul(const jaxserve::RowBlocks& blocks, const float* packed, const float* w, int64_t K,
             int64_t N, float* const* out) {
  const int64_t width = 8 * V;
  const int64_t pf = variant.pf < 0 ? -variant.pf * 16 : variant.pf * N;
  for (int64_t col = 0; col < N; col += width) {
    const int64_t lanes = std::min(width, N - col);
    const int tail = static_cast<int>(lanes % 8);
    alignas(32) int32_t m[8];
    for (int i = 0; i < 8; ++i) m[i] = i < tail ? -1 : 0;
    const __m256i last = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
    const int64_t lead = variant.pf < 0 && col < -variant.pf * 16 ? variant.lead * N : 0;
    if (variant.kc == 1 && lanes == width && blocks.blocks > 1) {  // copy, then read the copy
      if (copy_buffer.size() < static_cast<size_t>(K * width + 8))
        copy_buffer.resize(K * width + 8);
      float* buf = copy_buffer.data();
      buf += (8 - reinterpret_cast<uintptr_t>(buf) / 4 % 8) % 8;  // 32-byte aligned
      YTileRows<V, R, Hint, kMaskAll, false, true>(blocks.BlockRows(0), packed, w, N, K, col,
                                                   last, out, pf, lead, buf);
      for (int b = 1; b < blocks.blocks; ++b) {
        const int s = blocks.BlockStart(b);
        float* const* o = out + s;
        YTileRows<V, R, Hint, false, false>(blocks.BlockRows(b), packed + int64_t{s} * K,
                                            buf - col, width, K, col, last, o, 0, 0);
      }
      continue;
    }
    for (int b = 0; b < blocks.blocks; ++b) {
      const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
      const float* at = packed + int64_t{s} * K;
      const int64_t pf2 = b == 0 ? lead : 0;
      if (lanes == width)
        YTileRows<V, R, Hint, kMaskAll, false>(n, at, w, N, K, col, last, out + s, pf, pf2);
      else
        YTileTail<V, R, Hint, kMaskAll>(static_cast<int>((lanes + 7) / 8), tail != 0, n, at, w,
                                        N, K, col, last, out + s, pf, pf2);
    }
  }
}

// A 16-column tile of R rows over rows [0, kn) of a weight panel at w (row stride ldw):
// out[r][col:col+16] (+= when kAcc) sum_k at[k * R + r] * w[k * ldw + j]. pf: prefetch
// w + pf at each row (0: none); seq: prefetch seq + 16 k at each row k (one line each,
// a sequential stream; nullptr: none).
template <int R, bool kAcc, int Hint, bool kCopy = false>
inline void ZTile(const float* at, const float* w, int64_t ldw, int64_t kn, int64_t col,
                  float* const* out, int64_t pf, const float* seq, float* copy = nullptr) {
  constexpr auto hint = Hint == 0   ? _MM_HINT_T0
                       : Hint == 1 ? _MM_HINT_T1
                       : Hint == 2 ? _MM_HINT_T2
                                   : _MM_HINT_NTA;
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    lo[r] = kAcc ? _mm256_loadu_ps(out[r] + col) : _mm256_setzero_ps();
    hi[r] = kAcc ? _mm256_loadu_ps(out[r] + col + 8) : _mm256_setzero_ps();
  }
  const float* wk = w;
  for (int64_t k = 0; k < kn; ++k, wk += ldw) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(wk + pf), hint);
    if (seq) _mm_prefetch(reinterpret_cast<const char*>(seq + 16 * k), hint);
    const __m256 b0 = _mm256_loadu_ps(wk);
    const __m256 b1 = _mm256_loadu_ps(wk + 8);
    if constexpr (kCopy) {
      _mm256_store_ps(copy + 16 * k, b0);
      _mm256_store_ps(copy + 16 * k + 8, b1);
    }
    const float* ak = at + k * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(ak + r);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out[r] + col, lo[r]);
    _mm256_storeu_ps(out[r] + col + 8, hi[r]);
  }
}

template <int R, bool kAcc, int Hint, bool kCopy = false>
inline void ZTileRows(int rows, const float* at, const float* w, int64_t ldw, int64_t kn,
                      int64_t col, float* const* out, int64_t pf, const float* seq,
                      float* copy = nullptr) {
  if (rows >= R) return ZTile<R, kAcc, Hint, kCopy>(at, w, ldw, kn, col, out, pf, seq, copy);
  if constexpr (R > 1)
    ZTileRows<R - 1, kAcc, Hint, kCopy>(rows, at, w, ldw, kn, col, out, pf, seq, copy);
}

// The matrices a tile unit reads after the current one (set by RunTileUnitVariant), so
// that the chunk variant's sequential prefetch runs on into the next matrix.
thread_local const float* tl_matrix[3];

// chunk: k-chunks of kc rows (contiguous kc x N floats), all panels and row blocks of one
// chunk before the next, accumulating into out; block 0 prefetches the next chunk (or the
// next matrix's first chunk) one line per row it reads, in address order (seq 1), and
// pf > 0 prefetches pf rows ahead in the panel (pf < 0: -pf lines ahead in the row).
template <int R, int Hint>
void ZMatmul(const jaxserve::RowBlocks& blocks, const float* packed, const float* w, int64_t K,
             int64_t N, float* const* out) {
  if (N % 16) {
    std::fprintf(stderr, "N %% 16\n");
    std::exit(2);
  }
  const int64_t kc = variant.kc ? std::min<int64_t>(variant.kc, K) : K;
  const int64_t pf = variant.pf > 0 ? variant.pf * N : variant.pf < 0 ? -variant.pf * 16 : 0;
  const float* after = nullptr;
  for (int m = 0; m < 2; ++m)
    if (w == tl_matrix[m]) after = tl_matrix[m + 1];
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kn = std::min(kc, K - k0);
    // The next chunk (of this matrix, or the next matrix's first), kn * N / 16 lines of
    // it: one for each row that block 0 reads.
    const float* next = k0 + kn < K ? w + (k0 + kn) * N : after;
    for (int64_t col = 0, p = 0; col < N; col += 16, ++p) {
      const float* seq = variant.seq && next ? next + p * kn * 16 : nullptr;
      const float* wc = w + k0 * N + col;
      if (variant.lead && blocks.blocks > 1) {  // block 0 copies the chunk's panel
        if (copy_buffer.size() < static_cast<size_t>(16 * kc + 8)) copy_buffer.resize(16 * kc + 8);
        float* buf = copy_buffer.data();
        buf += (8 - reinterpret_cast<uintptr_t>(buf) / 4 % 8) % 8;
        const int n0 = blocks.BlockRows(0);
        const float* at0 = packed + k0 * n0;
        if (k0) ZTileRows<R, true, Hint, true>(n0, at0, wc, N, kn, col, out, pf, seq, buf);
        else ZTileRows<R, false, Hint, true>(n0, at0, wc, N, kn, col, out, pf, seq, buf);
        for (int b = 1; b < blocks.blocks; ++b) {
          const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
          const float* at = packed + int64_t{s} * K + k0 * n;
          if (k0) ZTileRows<R, true, Hint>(n, at, buf, 16, kn, col, out + s, 0, nullptr);
          else ZTileRows<R, false, Hint>(n, at, buf, 16, kn, col, out + s, 0, nullptr);
        }
        continue;
      }
      for (int b = 0; b < blocks.blocks; ++b) {
        const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
        const float* at = packed + int64_t{s} * K + k0 * n;
        if (k0)
          ZTileRows<R, true, Hint>(n, at, wc, N, kn, col, out + s, b == 0 ? pf : 0,
                                   b == 0 ? seq : nullptr);
        else
          ZTileRows<R, false, Hint>(n, at, wc, N, kn, col, out + s, b == 0 ? pf : 0,
                                    b == 0 ? seq : nullptr);
      }
    }
  }
}

using MatmulFn = void (*)(const jaxserve::RowBlocks&, const float*, const float*, int64_t,
                          int64_t, float* const*);

template <int V, int R>
MatmulFn PickHint(int hint, bool mask_all) {
  switch (hint * 2 + mask_all) {
    case 1: return YMatmul<V, R, 0, true>;
    case 2: return YMatmul<V, R, 1, false>;
    case 3: return YMatmul<V, R, 1, true>;
    case 4: return YMatmul<V, R, 2, false>;
    case 5: return YMatmul<V, R, 2, true>;
    case 6: return YMatmul<V, R, 3, false>;
    case 7: return YMatmul<V, R, 3, true>;
    default: return YMatmul<V, R, 0, false>;
  }
}

MatmulFn PickMatmul(const Variant& v) {
  if (v.kind == "chunk") {
    if (v.R == 6) return v.hint == 1 ? ZMatmul<6, 1> : v.hint == 3 ? ZMatmul<6, 3> : ZMatmul<6, 0>;
    if (v.R == 5) return v.hint == 1 ? ZMatmul<5, 1> : ZMatmul<5, 0>;
    if (v.R == 4) return v.hint == 1 ? ZMatmul<4, 1> : ZMatmul<4, 0>;
    std::fprintf(stderr, "chunk: R 4-6\n");
    std::exit(2);
  }
  if (v.kind != "tile" && v.kind != "base") {
    std::fprintf(stderr, "variant %s: only base and tile on AVX2\n", v.kind.c_str());
    std::exit(2);
  }
#define JS_CASE(p, r) if (v.P == p && v.R == r) return PickHint<p, r>(v.hint, v.mask);
  JS_CASE(1, 8) JS_CASE(1, 12) JS_CASE(2, 4) JS_CASE(2, 5) JS_CASE(2, 6) JS_CASE(3, 4)
  JS_CASE(4, 3) JS_CASE(3, 3) JS_CASE(4, 2)
#undef JS_CASE
  std::fprintf(stderr, "no tile %dx%d\n", v.P, v.R);
  std::exit(2);
}

}  // namespace
