// Register-tiled matmul of a few rows by a weight matrix read in place (AVX-512, or
// AVX2 + FMA).
//
// Included by cpu_moe_rows.cc for experts with many routed rows (`kTileMinRows`); the
// build (kernels/cpu_build.py) hashes this header into the kernel's cache key. Without
// AVX-512 or AVX2 + FMA (`JAXSERVE_HAVE_TILES` 0) nothing here is compiled and the kernel
// streams rows instead.
//
// out[r][0:N] = sum_k a[r][k] * w[k][0:N] for up to kTileRows rows at a time, with
// the activations packed transposed ([K][R], `PackRows`) so that one broadcast feeds a
// row's FMA. A register tile is R rows x 16 columns (R zmm accumulators); the column
// panel w[0:K][col:col+16] is streamed once for all row blocks of the call (panel
// order: columns outer, row blocks inner, so the panel stays in L1/L2 between blocks)
// (the BLIS micro-kernel idea: Van Zee and van de Geijn, "BLIS", ACM TOMS 2015).
//
// The panel's lines are a row stride (N * 4 bytes) apart, which the hardware prefetcher
// follows poorly, so the tile prefetches in software: at row k of panel p it fetches row
// k of panel p + kPrefetchPanels (the same weight row, 128 bytes on), so each row is
// read from memory in runs two panels ahead of its use and the panel to come is in L1
// when the tile reaches it; the first kPrefetchPanels panels, which no earlier panel
// fetched, also prefetch kPrefetchRows rows ahead. Measured (scripts/native/
// bench_moe_kernel.cc: Zen 4, two cores, hidden 512, 32 experts, I 256, top-4, 8 layers
// of weights from memory, interleaved medians), ms a call and speed-up over the earlier
// prefetch of the same panel 8 rows ahead, weights on 4 KB pages / on huge pages:
// 32 tokens 2.29 (1.12x) / 1.95 (1.04x), 64 3.34 (1.19x) / 2.42 (1.14x), 128 2.97
// (1.36x, 136 GFLOP/s) / 2.60 (1.20x, 155 GFLOP/s), 256 5.08 (1.20x) / 4.68 (1.09x);
// level with storing the weights panel-major ([E][N/16][K][16], contiguous panels: 1.36x
// / 1.14x at 128), which this layout does without. Wider tiles (2-4 panels x 6-8 rows),
// packing an expert's weights panel-major per call, and k-chunks with a sequential
// prefetch all measured slower (the benchmark keeps them as variants). Inside XLA
// (scripts/bench_moe.py --cpu-kernel --weight-sets 8) the kernel went 3.57 -> 3.09 ms
// at 128 tokens (1.16x).

#pragma once

#include <cstdint>

// AVX2 + FMA builds (most laptops, AMD Zen 2/3) get the same tiles on 8-lane registers:
// a row's 16 columns are two ymm accumulators, so a tile has 6 rows (12 accumulators, two
// weight vectors and a broadcast: 15 of the 16 ymm registers). Without them (and
// `cpu_moe.has_tiles()` false) a qwen3moe batch-128 step left its experts to XLA's path,
// at 32% of the matmul ceiling (compare_hf.py on an AVX2-only EPYC VM), against 60%
// with tiles on AVX-512.
#if defined(__AVX512F__)
#define JAXSERVE_HAVE_TILES 1
#define JAXSERVE_TILES_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXSERVE_HAVE_TILES 1
#define JAXSERVE_TILES_AVX2 1
#include <immintrin.h>
#else
#define JAXSERVE_HAVE_TILES 0
#define JAXSERVE_TILES_AVX2 0
#endif

namespace jaxserve {

// Rows of a register tile (accumulators: one zmm, or two ymm, per row).
constexpr int kTileRows = JAXSERVE_TILES_AVX2 ? 6 : 8;

#if JAXSERVE_HAVE_TILES

#if JAXSERVE_TILES_AVX2
// Lanes of a 16-column panel read and written: all-ones int32 lanes, columns 0-7, 8-15.
struct Mask16 {
  __m256i lo, hi;
};
inline Mask16 LaneMask(int64_t lanes) {
  alignas(32) int32_t m[16];
  for (int j = 0; j < 16; ++j) m[j] = j < lanes ? -1 : 0;
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(m)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(m + 8))};
}
#else
using Mask16 = __mmask16;
inline Mask16 LaneMask(int64_t lanes) { return static_cast<__mmask16>((1u << lanes) - 1); }
#endif

constexpr int kPrefetchPanels = 2;  // how far ahead (in 16-column panels) a row is fetched
constexpr int kPrefetchRows = 8;    // and (in weight rows) for the first kPrefetchPanels panels

// One register tile: out[r][col:col+16] = sum_k at[k * R + r] * w[k * ldw + col + j],
// lanes j outside `mask` neither read nor written. At row k it prefetches
// w[k * ldw + col] + `ahead` and, unless 0, + `lead` (offsets in floats; a prefetch past
// the array is harmless: it never faults).
#if JAXSERVE_TILES_AVX2
template <int R>
inline void Tile(const float* at, const float* w, int64_t ldw, int64_t K, int64_t col,
                 Mask16 mask, float* const* out, int64_t ahead, int64_t lead) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* wk = w + col;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    _mm_prefetch(reinterpret_cast<const char*>(wk + ahead), _MM_HINT_T0);
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(wk + lead), _MM_HINT_T0);
    const __m256 b0 = _mm256_maskload_ps(wk, mask.lo);
    const __m256 b1 = _mm256_maskload_ps(wk + 8, mask.hi);
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
    _mm256_maskstore_ps(out[r] + col, mask.lo, lo[r]);
    _mm256_maskstore_ps(out[r] + col + 8, mask.hi, hi[r]);
  }
}
#else
template <int R>
inline void Tile(const float* at, const float* w, int64_t ldw, int64_t K, int64_t col,
                 Mask16 mask, float* const* out, int64_t ahead, int64_t lead) {
  __m512 acc[R];
#pragma GCC unroll 16  // accumulators in registers (a loop left rolled keeps them in memory)
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const float* wk = w + col;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    _mm_prefetch(reinterpret_cast<const char*>(wk + ahead), _MM_HINT_T0);
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(wk + lead), _MM_HINT_T0);
    const __m512 b = _mm512_maskz_loadu_ps(mask, wk);
    const float* ak = at + k * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(ak[r]), b, acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out[r] + col, mask, acc[r]);
}
#endif  // JAXSERVE_TILES_AVX2

// Tile<rows> for a runtime rows in [1, R].
template <int R>
inline void TileRows(int rows, const float* at, const float* w, int64_t ldw, int64_t K,
                     int64_t col, Mask16 mask, float* const* out, int64_t ahead,
                     int64_t lead) {
  if (rows >= R) return Tile<R>(at, w, ldw, K, col, mask, out, ahead, lead);
  if constexpr (R > 1) TileRows<R - 1>(rows, at, w, ldw, K, col, mask, out, ahead, lead);
}

#endif  // JAXSERVE_HAVE_TILES

// Row blocks of a group of `rows` rows: as few blocks of at most kTileRows rows as
// possible, their sizes within one of each other. Block b starts at BlockStart(b).
struct RowBlocks {
  int rows, blocks;
  explicit RowBlocks(int n, int max_rows = kTileRows)
      : rows(n), blocks((n + max_rows - 1) / max_rows) {}
  int BlockStart(int b) const { return static_cast<int>(int64_t{rows} * b / blocks); }
  int BlockRows(int b) const { return BlockStart(b + 1) - BlockStart(b); }
};

// Packs rows a[0..rows)[0:K] transposed per row block: block b's R_b rows from s_b go
// to packed[s_b * K + k * R_b + r]. packed holds rows * K floats.
inline void PackRows(const RowBlocks& blocks, const float* const* a, int64_t K, float* packed) {
  for (int b = 0; b < blocks.blocks; ++b) {
    const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
    float* p = packed + int64_t{s} * K;
    for (int r = 0; r < n; ++r) {
      const float* src = a[s + r];
      for (int64_t k = 0; k < K; ++k) p[k * n + r] = src[k];
    }
  }
}

#if JAXSERVE_HAVE_TILES

// out[r][0:N] = sum_k a[r][k] * w[k][0:N] for every row r of `blocks`, from the
// PackRows layout of a; w is [K, N] row-major, read once per 16-column panel.
inline void PanelMatmul(const RowBlocks& blocks, const float* packed, const float* w,
                        int64_t K, int64_t N, float* const* out) {
  for (int64_t col = 0; col < N; col += 16) {
    const int64_t lanes = N - col < 16 ? N - col : 16;
    const Mask16 mask = LaneMask(lanes);
    const int64_t lead = col < 16 * kPrefetchPanels ? kPrefetchRows * N : 0;
    for (int b = 0; b < blocks.blocks; ++b) {
      const int s = blocks.BlockStart(b);
      TileRows<kTileRows>(blocks.BlockRows(b), packed + int64_t{s} * K, w, N, K, col, mask,
                          out + s, 16 * kPrefetchPanels, b == 0 ? lead : 0);
    }
  }
}

#endif  // JAXSERVE_HAVE_TILES

}  // namespace jaxserve
