// Register-tiled matmul of a few rows by a weight matrix read in place (AVX-512, or
// AVX2 + FMA), in either of two layouts: PanelMatmul reads a row-major [K, N] matrix
// (what follows), PanelsMatmul a panel-major one, [ceil(N / 16)][K][16] (each 16-column
// panel contiguous: what the engine holds on one CPU device, cpu_moe.ExpertPanels).
//
// Included by cpu_moe_rows.cc for experts with many routed rows (`kTileMinRows`); the
// build (kernels/cpu_build.py) hashes this header into the kernel's cache key. Without
// AVX-512 or AVX2 + FMA (`JAXSERVE_HAVE_TILES` 0) nothing here is compiled and the kernel
// streams rows instead.
//
// out[r][0:N] = sum_k a[r][k] * w[k][0:N] for up to kTileRows rows at a time
// (PanelsMatmul on AVX-512: kPanelsTileRows, measurements there), with
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
//
// On an AVX2-only host (a 2-core AMD EPYC Zen 3 VM, 32 KiB L1d and 512 KiB L2 a core,
// load 1.4-2 from other jobs; bench_moe_kernel.cc's AVX2 variants in bench_moe_avx2.h,
// interleaved medians) the 6 x 16 tile measured best among those tried, at 128 / 512
// tokens against itself: plain loads on full panels (the mask on the last only) 0.93x /
// 0.95x (level with the panel copy below: 1.00x / 1.01x), 4 rows x 24 columns 0.64x /
// 0.61x, 3 x 32 0.60x / 0.63x, 12 x 8 0.90x / 0.93x. What gained there is the panel
// copy (kCopyMinBlocks) and the vectorised SwiGlu: the kernel alone, processes of the
// old and new kernel alternating 3x (load 1.7-2.7), 128 tokens 4.61 -> 4.17 ms a call
// (1.11x, 87 -> 97 GFLOP/s), 512 tokens 15.09 -> 12.79 ms (1.18x, 107 -> 126 GFLOP/s),
// 32 tokens (the row path) 2.65 -> 2.59 ms (1.02x, noise). Inside XLA (bench_moe.py
// --cpu-kernel --weight-sets 8, alternating 2x, load ~2): 128 tokens level (4.2-4.3 ms
// both), 512 tokens 1.12x; so a qwen3moe batch-128 run, mostly 128-token decode calls,
// did not gain measurably end to end (compare_hf: 1.01x and 0.99x).

#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

// AVX2 + FMA builds (most laptops, AMD Zen 2/3) get the same tiles on 8-lane registers:
// a row's 16 columns are two ymm accumulators, so a tile has 6 rows (12 accumulators, two
// weight vectors and a broadcast: 15 of the 16 ymm registers). Without them (and
// `cpu_moe.has_tiles()` false) a qwen3moe batch-128 step left its experts to XLA's path,
// at 32% of the matmul ceiling (compare_hf.py on an AVX2-only EPYC VM), against 60%
// with tiles on AVX-512.
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define JAXSERVE_HAVE_TILES 1
#define JAXSERVE_TILES_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXSERVE_HAVE_TILES 1
#define JAXSERVE_TILES_AVX2 1
#else
#define JAXSERVE_HAVE_TILES 0
#define JAXSERVE_TILES_AVX2 0
#endif

namespace jaxserve {

// Rows of a register tile (accumulators: one zmm, or two ymm, per row).
constexpr int kTileRows = JAXSERVE_TILES_AVX2 ? 6 : 8;

// f(std::integral_constant<int, rows>{}) for a runtime rows in [1, R] (R when larger): a
// register tile needs its row count at compile time, so every tile's runtime-rows entry
// point is this chain of R compares over its instantiations, e.g.
//   WithRows<kTileRows>(rows, [&](auto r) { Tile<decltype(r)::value>(...); });
template <int R, class F>
inline decltype(auto) WithRows(int rows, F&& f) {
  if constexpr (R > 1) {
    if (rows < R) return WithRows<R - 1>(rows, std::forward<F>(f));
  }
  return f(std::integral_constant<int, R>{});
}

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
// kCopy: also stores the panel's lanes as read (masked ones 0) to copy[16 k + j], a
// contiguous [K][16] copy of the panel for the row blocks after this one. ahead 0: no
// prefetch (a tile reading such a copy).
template <int R, bool kCopy = false>
inline void Tile(const float* at, const float* w, int64_t ldw, int64_t K, int64_t col,
                 Mask16 mask, float* const* out, int64_t ahead, int64_t lead,
                 float* copy = nullptr) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* wk = w + col;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(wk + ahead), _MM_HINT_T0);
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(wk + lead), _MM_HINT_T0);
    const __m256 b0 = _mm256_maskload_ps(wk, mask.lo);
    const __m256 b1 = _mm256_maskload_ps(wk + 8, mask.hi);
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
template <int R, bool kCopy = false>
inline void TileRows(int rows, const float* at, const float* w, int64_t ldw, int64_t K,
                     int64_t col, Mask16 mask, float* const* out, int64_t ahead,
                     int64_t lead, float* copy = nullptr) {
  WithRows<R>(rows, [&](auto r) {
    if constexpr (kCopy)
      Tile<decltype(r)::value, true>(at, w, ldw, K, col, mask, out, ahead, lead, copy);
    else
      Tile<decltype(r)::value>(at, w, ldw, K, col, mask, out, ahead, lead);
  });
}

#endif  // JAXSERVE_HAVE_TILES

// gate[c] = silu(gate[c]) * up[c] = gate[c] / (1 + e^-gate[c]) * up[c] for c < n (SwiGLU).
// With AVX2 + FMA (every AVX-512 CPU has them too) 8 lanes at a time, e^x by Cephes' expf
// (range reduction by ln 2, a degree-5 polynomial; within 2 ulp of std::exp, which GCC
// does not vectorise without -ffast-math): the scalar loop cost 3.7 ns an element on the
// AVX2 EPYC VM (a qwen3moe prefill call of 512 tokens: 2048 x 256 of them, ~8% of the
// kernel), this one 0.55; the kernel alone (old and new processes alternating 3x, load
// ~1.5) went 4.34 -> 4.16 ms at 128 tokens (1.04x), 14.81 -> 14.04 at 512 (1.05x).
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^k as a float's bits; k in [-126, 128] after the clamp (128: +inf, so e^x = inf
  // there and silu(x) = x / inf = -0 for x <= -88.7, where it is below 2^-120 anyway).
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif

inline void SwiGlu(float* gate, const float* up, int64_t n) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; c + 8 <= n; c += 8) {
    const __m256 g = _mm256_loadu_ps(gate + c);
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(gate + c, _mm256_mul_ps(silu, _mm256_loadu_ps(up + c)));
  }
#endif
  for (; c < n; ++c) gate[c] = gate[c] / (1.f + std::exp(-gate[c])) * up[c];
}

// Row blocks of a group of `rows` rows: as few blocks of at most kTileRows rows as
// possible, their sizes within one of each other. Block b starts at BlockStart(b).
struct RowBlocks {
  int rows, blocks;
  explicit RowBlocks(int n, int max_rows = kTileRows)
      : rows(n), blocks((n + max_rows - 1) / max_rows) {}
  int BlockStart(int b) const { return static_cast<int>(int64_t{rows} * b / blocks); }
  int BlockRows(int b) const { return BlockStart(b + 1) - BlockStart(b); }
};

#if defined(__AVX512F__)
// Transposes the 16 x 16 floats in v (v[i] lane j -> v[j] lane i).
inline void Transpose16(__m512 v[16]) {
  __m512 t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);  // rows i, i+1 interleaved (lanes 0,1 4,5 ..)
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // 4 rows' 4-lane groups
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes of rows 0-7 and 8-15
    t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xdd);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// Packs rows a[0..rows)[0:K] transposed per row block: block b's R_b rows from s_b go
// to packed[s_b * K + k * R_b + r]. packed holds rows * K floats. With AVX-512, 16 rows
// x 16 columns at a time through registers (Transpose16): the scalar loop's strided
// stores were ~5% of the MoE kernel's time at 128 tokens (perf, bench_moe_kernel.cc).
inline void PackRows(const RowBlocks& blocks, const float* const* a, int64_t K, float* packed) {
  for (int b = 0; b < blocks.blocks; ++b) {
    const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
    float* p = packed + int64_t{s} * K;
    int64_t k0 = 0;
#if defined(__AVX512F__)
    for (; k0 + 16 <= K; k0 += 16) {
      for (int r0 = 0; r0 < n; r0 += 16) {
        const int m = n - r0 < 16 ? n - r0 : 16;
        __m512 v[16];
        for (int r = 0; r < 16; ++r)
          v[r] = r < m ? _mm512_loadu_ps(a[s + r0 + r] + k0) : _mm512_setzero_ps();
        Transpose16(v);
        const __mmask16 lanes = static_cast<__mmask16>((1u << m) - 1);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(p + (k0 + j) * n + r0, lanes, v[j]);
      }
    }
#endif
    for (int r = 0; r < n; ++r) {
      const float* src = a[s + r];
      for (int64_t k = k0; k < K; ++k) p[k * n + r] = src[k];
    }
  }
}

#if JAXSERVE_HAVE_TILES

#if JAXSERVE_TILES_AVX2
// Row blocks of a call from which the first block of each panel copies the panel
// (contiguous, [K][16]) for the others to read instead of the weights. A panel's rows are
// N * 4 bytes apart (1 or 2 KiB for qwen3moe's experts), so they fall in a few cache
// sets: at most 32 (16) of them stay in the 32 KiB 8-way L1 of a Zen 3 and a 512 KiB
// 8-way L2 holds the panel only just, so every row block read the panel from L2 or L3
// again. Measured (scripts/native/bench_moe_kernel.cc tile:2,6,-2,0,1 against base,
// AVX2 EPYC VM, two cores, load ~1.6, interleaved medians): 512 tokens (64 rows an
// expert, 11 blocks) 14.48 -> 12.27 ms a call (1.18x, 111 -> 131 GFLOP/s); 128 tokens
// (16 rows, 3 blocks) 0.97x, so 3 blocks keep reading the weights (4-10 blocks: not
// measured apart). The AVX-512 tiles read a panel as before (not measured there).
constexpr int kCopyMinBlocks = 4;
#endif

// out[r][0:N] = sum_k a[r][k] * w[k][0:N] for every row r of `blocks`, from the
// PackRows layout of a; w is [K, N] row-major, read once per 16-column panel.
inline void PanelMatmul(const RowBlocks& blocks, const float* packed, const float* w,
                        int64_t K, int64_t N, float* const* out) {
#if JAXSERVE_TILES_AVX2
  std::vector<float> copy_store;
  float* copy = nullptr;
  if (blocks.blocks >= kCopyMinBlocks) {
    copy_store.resize(16 * K + 8);
    copy = copy_store.data();
    copy += (8 - reinterpret_cast<uintptr_t>(copy) / 4 % 8) % 8;  // 32-byte aligned
  }
#endif
  for (int64_t col = 0; col < N; col += 16) {
    const int64_t lanes = N - col < 16 ? N - col : 16;
    const Mask16 mask = LaneMask(lanes);
    const int64_t lead = col < 16 * kPrefetchPanels ? kPrefetchRows * N : 0;
#if JAXSERVE_TILES_AVX2
    if (copy) {  // the first block copies the panel, the others read the copy
      TileRows<kTileRows, true>(blocks.BlockRows(0), packed, w, N, K, col, mask, out,
                                16 * kPrefetchPanels, lead, copy);
      for (int b = 1; b < blocks.blocks; ++b) {
        const int s = blocks.BlockStart(b);
        TileRows<kTileRows>(blocks.BlockRows(b), packed + int64_t{s} * K, copy - col, 16, K,
                            col, mask, out + s, 0, 0);
      }
      continue;
    }
#endif
    for (int b = 0; b < blocks.blocks; ++b) {
      const int s = blocks.BlockStart(b);
      TileRows<kTileRows>(blocks.BlockRows(b), packed + int64_t{s} * K, w, N, K, col, mask,
                          out + s, 16 * kPrefetchPanels, b == 0 ? lead : 0);
    }
  }
}

// Register tiles over panel-major weights (PanelsMatmul): rows a tile (at most), weight
// rows (64-byte lines of a panel) the first row block prefetches ahead, and the hint
// (0-3: T0, T1, T2, NTA).
//
// AVX-512: 24 rows (24 zmm accumulators, the weight vector: 25 of the 32 registers), 128
// lines (8 KiB) ahead into L2. At decode sizes the kernel was neither compute- nor
// bandwidth-bound (qwen3moe, 128 tokens: 16 rows an expert on average, 2.6-2.7 ms a
// layer, 150 GFLOP/s and 18 GB/s): with 8-row tiles the first block of a panel read it
// from memory at 8 FMAs a line, twice the rate two cores' share of the bandwidth gives,
// and the second block read it from L1/L2 with the memory idle; and the prefetch 8 lines
// ahead (T0) was too short to keep enough lines in flight (none at all measured the same:
// the hardware prefetcher does little for this stream). One tile for all of an
// expert's 16-24 rows reads each line once at 16-24 FMAs, evenly spread over the
// expert's time. Measured on the 2-core Zen 4 (scripts/native/bench_moe_kernel.cc, the
// random Qwen3-MoE's layer, 8 layers of weights cycled, interleaved medians, speed-up over
// 8 rows / 8 lines T0 at 128 tokens): 8 rows / 64-128 lines T1 1.06-1.15x, 16 rows / 64
// T1 1.27x, 24 rows / 8 T0 1.08x, / 32 T0 1.18x, / 64-256 T1 or T2 1.24-1.30x, / 128 T0
// 1.19x, / 512 T1 1.29x; 28 rows level with 24; carrying the prefetch on into the next
// matrix (`after`) and other unit orders (most rows first: threads' ends 0.05 -> 0.02 ms
// apart; two ends) within noise. At 32 tokens (4 rows an expert, bandwidth-bound) and 8
// every prefetch tried measured within 3% of every other.
#if JAXSERVE_TILES_AVX2
constexpr int kPanelsTileRows = kTileRows;
constexpr int kPanelPrefetchRows = 8;  // bench_moe_avx2.h's pm:2,6,8,0, as measured there
constexpr int kPanelPrefetchHint = 0;
#else
constexpr int kPanelsTileRows = 24;
constexpr int kPanelPrefetchRows = 128;
constexpr int kPanelPrefetchHint = 1;
#endif

#if !JAXSERVE_TILES_AVX2
// One register tile over a contiguous panel [K][16] (AVX-512: R zmm accumulators):
// out[r][col + j] = sum_k at[k * R + r] * panel[16 k + j], lanes j outside `mask` not
// written. At each row it prefetches the line at pf (unless null) and moves pf on by one
// line; at pf_end pf goes on at pf_next (the next matrix the caller reads; null: no more
// prefetches). Returns pf.
template <int R, int Hint>
inline const float* PanelsTile(const float* at, const float* panel, int64_t K, int64_t col,
                               Mask16 mask, float* const* out, const float* pf,
                               const float* pf_end, const float* pf_next) {
  constexpr auto hint = Hint == 0   ? _MM_HINT_T0
                        : Hint == 1 ? _MM_HINT_T1
                        : Hint == 2 ? _MM_HINT_T2
                                    : _MM_HINT_NTA;
  __m512 acc[R];
#pragma GCC unroll 32  // accumulators in registers (a loop left rolled keeps them in memory)
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const float* wk = panel;
  for (int64_t k = 0; k < K; ++k, wk += 16) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf), hint);
      pf += 16;
      if (pf == pf_end) pf = pf_next;
    }
    const __m512 b = _mm512_loadu_ps(wk);  // zero past N: a whole line, no mask
    const float* ak = at + k * R;
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(ak[r]), b, acc[r]);
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out[r] + col, mask, acc[r]);
  return pf;
}

// PanelsTile<rows> for a runtime rows in [1, R].
template <int R, int Hint>
inline const float* PanelsTileRows(int rows, const float* at, const float* panel, int64_t K,
                                   int64_t col, Mask16 mask, float* const* out, const float* pf,
                                   const float* pf_end, const float* pf_next) {
  return WithRows<R>(rows, [&](auto r) {
    return PanelsTile<decltype(r)::value, Hint>(at, panel, K, col, mask, out, pf, pf_end,
                                                pf_next);
  });
}
#endif

// out[r][0:N] = sum_k a[r][k] * W[k][0:N] for every row r of `blocks` (at most R rows a
// block: RowBlocks(rows, R)), from the PackRows layout of a; w holds W panel-major,
// [ceil(N / 16)][K][16] (panel p's row k at w[(p * K + k) * 16], zero past N), so each
// panel is one contiguous stream: the first row block reads it from memory, prefetching
// `ahead` lines ahead (Hint), and the others from L1/L2. On AVX-512 the prefetch goes on
// past the matrix's end into `after` (the weight the caller reads next, null: none), so
// that its first lines are in flight when it starts. No panel copy or k-chunks: those
// work around the [K, N] layout.
template <int R = kPanelsTileRows, int Hint = kPanelPrefetchHint>
inline void PanelsMatmul(const RowBlocks& blocks, const float* packed, const float* w,
                         int64_t K, int64_t N, float* const* out, const float* after = nullptr,
                         int64_t ahead = kPanelPrefetchRows) {
#if JAXSERVE_TILES_AVX2
  (void)after;
  static_assert(R <= kTileRows, "AVX2 tiles: at most kTileRows rows");
  for (int64_t col = 0; col < N; col += 16) {
    const Mask16 mask = LaneMask(N - col < 16 ? N - col : 16);
    const float* panel = w + col * K;  // panel col / 16
    for (int b = 0; b < blocks.blocks; ++b) {
      const int s = blocks.BlockStart(b);
      // Tile reads w + col + k * ldw: the panel's row k.
      TileRows<R>(blocks.BlockRows(b), packed + int64_t{s} * K, panel - col, 16, K, col, mask,
                  out + s, b == 0 ? 16 * ahead : 0, 0);
    }
  }
#else
  const float* end = w + (N + 15) / 16 * 16 * K;
  const float* pf = w + 16 * ahead;
  if (pf >= end) pf = after ? after + (pf - end) : nullptr;
  for (int64_t col = 0; col < N; col += 16) {
    const Mask16 mask = LaneMask(N - col < 16 ? N - col : 16);
    const float* panel = w + col * K;  // panel col / 16
    for (int b = 0; b < blocks.blocks; ++b) {
      const int s = blocks.BlockStart(b);
      const float* got = PanelsTileRows<R, Hint>(blocks.BlockRows(b), packed + int64_t{s} * K,
                                                 panel, K, col, mask, out + s,
                                                 b == 0 ? pf : nullptr, end, after);
      if (b == 0) pf = got;
    }
  }
#endif
}

#endif  // JAXSERVE_HAVE_TILES

}  // namespace jaxserve
