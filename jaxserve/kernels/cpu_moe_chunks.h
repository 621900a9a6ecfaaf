// The MoE kernel's tile product for experts of a few row blocks, on AVX2 builds: k-chunks
// read in address order (cpu_moe_rows.cc, AVX2 + FMA without AVX-512).
//
// PanelMatmul (cpu_tile_matmul.h) walks a [K, N] weight one 16-column panel at a time,
// so its first row block reads memory a row stride (N * 4 bytes) apart, and the panel's
// other blocks read it again from L2. On the AVX2 EPYC VM this work was measured on
// (Zen 3, two cores, 32 MiB L3), two threads stream ~30 GB/s from memory in address
// order but ~22 GB/s in panel order (one thread 19 vs 14), and a decode call (128 tokens,
// ~16 rows an expert: 3 row blocks, too few for PanelMatmul's panel copy) is bound by
// that stream. Here the weight is read in chunks of kChunkRows rows (contiguous:
// kChunkRows * N floats); all panels and row blocks of a chunk run before the next, the
// accumulators reloaded from `out` between chunks, and at each weight row it reads, the
// first row block prefetches one line of the next chunk in address order (after the
// last chunk, of the matrix the unit reads next), so memory is read sequentially about
// one chunk ahead. Each panel's chunk is copied contiguously by the first row block for
// the others (as PanelMatmul's copy), so they read it from L1.
//
// Measured (scripts/native/bench_moe_kernel.cc, the random Qwen3-MoE's layer, 8 layers
// of weights from memory, load 1.0-1.4): variants interleaved in one process, against
// PanelMatmul, 128 tokens: chunks of 64 rows with the copy 1.09x (32 rows 1.08x, 128
// 1.03x; without the copy 1.03-1.06x, without the prefetch 0.87x), 64 tokens (8 rows an
// expert, 2 blocks) 1.02x; 512 tokens (11 blocks, where PanelMatmul copies its panels)
// 1.02x (0.90-0.92x without the copy), so PanelMatmul keeps those. Old and new kernels'
// processes alternating 3x: 128 tokens 4.03 -> 3.80 ms a call (medians, 1.06x).
// The weights stored panel-major ([E][N/16][K][16], each panel contiguous) measured
// 1.15-1.21x at 128 tokens and 1.14-1.16x at 512 there: the engine holds them so on one
// CPU device (cpu_moe.ExpertPanels, read by cpu_tile_matmul.h's PanelsMatmul), so these
// chunks serve only the row-major target (the local experts of a CPU mesh).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_tile_matmul.h"

namespace jaxserve {

#if JAXSERVE_TILES_AVX2

constexpr int64_t kChunkRows = 64;  // weight rows of a chunk (64 KiB at N = 256)

// out[r][col:col+16] (+= with kAcc) sum_{k < kn} at[k * R + r] * w[k * ldw + j], j < 16.
// next: prefetch next + 16 k at row k (nullptr: none); kCopy: store the panel's rows to
// copy[16 k + j] as they are read (copy 32-byte aligned).
template <int R, bool kAcc, bool kCopy>
inline void ChunkTile(const float* at, const float* w, int64_t ldw, int64_t kn, int64_t col,
                      float* const* out, const float* next, float* copy) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    lo[r] = kAcc ? _mm256_loadu_ps(out[r] + col) : _mm256_setzero_ps();
    hi[r] = kAcc ? _mm256_loadu_ps(out[r] + col + 8) : _mm256_setzero_ps();
  }
  const float* wk = w;
  for (int64_t k = 0; k < kn; ++k, wk += ldw) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + 16 * k), _MM_HINT_T0);
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

// ChunkTile<rows> for a runtime rows in [1, R].
template <int R, bool kAcc, bool kCopy>
inline void ChunkTileRows(int rows, const float* at, const float* w, int64_t ldw, int64_t kn,
                          int64_t col, float* const* out, const float* next, float* copy) {
  WithRows<R>(rows, [&](auto r) {
    ChunkTile<decltype(r)::value, kAcc, kCopy>(at, w, ldw, kn, col, out, next, copy);
  });
}

template <bool kAcc, bool kCopy>
inline void ChunkTileAny(int rows, const float* at, const float* w, int64_t ldw, int64_t kn,
                         int64_t col, float* const* out, const float* next, float* copy) {
  ChunkTileRows<kTileRows, kAcc, kCopy>(rows, at, w, ldw, kn, col, out, next, copy);
}

// Whether ChunkMatmul takes a product of `blocks` row blocks with N columns: fewer blocks
// than PanelMatmul's copy needs (kCopyMinBlocks), whole panels.
inline bool UsesChunks(const RowBlocks& blocks, int64_t N) {
  return blocks.blocks < kCopyMinBlocks && N % 16 == 0;
}

// out[r][0:N] = sum_k a[r][k] * w[k][0:N] for every row r of `blocks`, from the PackRows
// layout of a; w is [K, N] row-major, N a multiple of 16. after: the weight the caller
// reads next (its first chunk is prefetched during this one's last; nullptr: none).
inline void ChunkMatmul(const RowBlocks& blocks, const float* packed, const float* w,
                        int64_t K, int64_t N, float* const* out, const float* after) {
  std::vector<float> copy_store;
  float* copy = nullptr;
  if (blocks.blocks > 1) {
    copy_store.resize(16 * kChunkRows + 8);
    copy = copy_store.data();
    copy += (8 - reinterpret_cast<uintptr_t>(copy) / 4 % 8) % 8;  // 32-byte aligned
  }
  const int first_rows = blocks.BlockRows(0);
  for (int64_t k0 = 0; k0 < K; k0 += kChunkRows) {
    const int64_t kn = std::min(kChunkRows, K - k0);
    // Block 0 reads kn rows a panel, N / 16 panels: kn * N / 16 lines, as many as the
    // next chunk of this matrix has (the next matrix's first chunk: about as many).
    const float* next = k0 + kn < K ? w + (k0 + kn) * N : after;
    for (int64_t col = 0, panel = 0; col < N; col += 16, ++panel) {
      const float* wc = w + k0 * N + col;
      const float* pf = next ? next + panel * kn * 16 : nullptr;
      const float* first_at = packed + k0 * first_rows;
      if (copy) {
        if (k0) ChunkTileAny<true, true>(first_rows, first_at, wc, N, kn, col, out, pf, copy);
        else ChunkTileAny<false, true>(first_rows, first_at, wc, N, kn, col, out, pf, copy);
      } else {
        if (k0) ChunkTileAny<true, false>(first_rows, first_at, wc, N, kn, col, out, pf, nullptr);
        else ChunkTileAny<false, false>(first_rows, first_at, wc, N, kn, col, out, pf, nullptr);
      }
      for (int b = 1; b < blocks.blocks; ++b) {
        const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
        const float* at = packed + int64_t{s} * K + k0 * n;
        if (k0) ChunkTileAny<true, false>(n, at, copy, 16, kn, col, out + s, nullptr, nullptr);
        else ChunkTileAny<false, false>(n, at, copy, 16, kn, col, out + s, nullptr, nullptr);
      }
    }
  }
}

#endif  // JAXSERVE_TILES_AVX2

}  // namespace jaxserve
