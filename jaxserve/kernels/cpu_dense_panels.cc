// A few rows by a dense weight held panel-major on the CPU: y[M, N] = x[M, K] @ W[K, N],
// float32, with W stored as w[P][K][16] (P = ceil(N / 16) column panels of 16, the last
// zero-padded): w[p][k][j] = W[k][16 p + j].
//
// The XLA FFI handler behind `jaxserve.kernels.cpu_dense` (its docstring has the
// contract and the measurements). Why panel-major: a 16-column panel of a row-major
// [K, N] weight is K runs of 64 bytes, N * 4 bytes apart, which the hardware prefetcher
// follows poorly and which crowd into a few cache sets; stored panel-major, each panel
// is one contiguous K * 64-byte stream (as llama.cpp's and oneDNN's packed weights).
// The weight is repacked once, at load (`cpu_dense.PanelMajor.pack`), not per call as
// XLA's dot (YNNPACK) does.
//
// Each work unit, a range of panels, runs register tiles over them, reading x in place:
// rows in blocks of up to kTileRows, every block reading the panel while it is in L1. A
// block of one or two rows (a GEMV) runs several panels at once (`WideTile`), so that
// enough independent FMA chains hide the FMA latency. Units are shared with XLA's
// intra-op thread pool (cpu_work_sharing.h) unless the product is too small to repay
// waking it.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cpu_tile_matmul.h"
#include "cpu_work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if JAXSERVE_HAVE_TILES

// Multiply-adds below which the call runs on the calling thread alone (about 10 us of
// one core's work; waking a pool thread on an idle vCPU costs about as much).
constexpr int64_t kSerialMacs = int64_t{1} << 20;
// Floats ahead of the tile's current weight row that it prefetches (1 KiB: 16 rows of a
// panel), so the next lines are in flight while the FMAs run.
constexpr int64_t kAheadFloats = 256;

// R rows x C consecutive panels (16 C columns of out from column `col`), x read in place
// (row r at x + r * ldx): y[r][col + j] = sum_k x[r][k] * panel[(c K + k) 16 + j'] for
// the C panels starting at `panel`. Only the first `lanes` columns of the last panel are
// stored (the panels are zero-padded in memory, so their loads stay in bounds). One
// or two rows take several panels a tile, so that enough independent FMA chains hide
// the FMA latency (4-5 cycles; one panel has 1 chain a row on AVX-512, 2 on AVX2); more
// rows take one panel.
//
// Why x in place and not packed transposed ([K][R] a block, as cpu_tile_matmul.h's
// PackRows for the MoE kernel, whose rows are a gather anyway): the pack ran serially
// before the threads started, 53 us of a 128-row [512, 512] product that the tiles run
// in ~290 us on two cores, and the tiles read the R rows' lines as fast as the packed
// block (scripts/bench_dense_panels.py; one thread, 128 x [512, 512]: 570 us either
// way).
#if JAXSERVE_TILES_AVX2
// 2 R C ymm accumulators.
template <int R, int C>
inline void WideTile(const float* x, int64_t ldx, const float* panel, int64_t K, int64_t col,
                     int lanes, float* const* out) {
  __m256 acc[R][C][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 a[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const float* wk = panel + c * 16 * K + 16 * k;
      _mm_prefetch(reinterpret_cast<const char*>(wk + kAheadFloats), _MM_HINT_T0);
      const __m256 b0 = _mm256_loadu_ps(wk), b1 = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r][c][0] = _mm256_fmadd_ps(a[r], b0, acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(a[r], b1, acc[r][c][1]);
      }
    }
  }
  if (lanes == 16) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        _mm256_storeu_ps(out[r] + col + 16 * c, acc[r][c][0]);
        _mm256_storeu_ps(out[r] + col + 16 * c + 8, acc[r][c][1]);
      }
    return;
  }
  const jaxserve::Mask16 mask = jaxserve::LaneMask(lanes);  // the last panel's lanes
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c + 1 < C; ++c) {
      _mm256_storeu_ps(out[r] + col + 16 * c, acc[r][c][0]);
      _mm256_storeu_ps(out[r] + col + 16 * c + 8, acc[r][c][1]);
    }
    float* last = out[r] + col + 16 * (C - 1);
    _mm256_maskstore_ps(last, mask.lo, acc[r][C - 1][0]);
    _mm256_maskstore_ps(last + 8, mask.hi, acc[r][C - 1][1]);
  }
}
constexpr int kWidePanels = 4;  // C of a one-row block (8 accumulators; 2 rows: C = 2)
#else
// R C zmm accumulators. Measured (scripts/bench_dense_panels.py, AVX-512 EPYC VM, 2
// cores, load ~1.5, old and new trees alternating 3x, medians): one row [512, 512] /
// [512, 256] / [512, 4096] / [128, 4096] 1.50 / 1.48 / 1.48 / 1.03x faster than one panel
// a tile (which ran 0.61-0.98x of XLA's dot there, now 0.84-1.10x), two rows 1.35 /
// 1.29 / 1.16 / 1.34x.
template <int R, int C>
inline void WideTile(const float* x, int64_t ldx, const float* panel, int64_t K, int64_t col,
                     int lanes, float* const* out) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 a[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[r] = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const float* wk = panel + c * 16 * K + 16 * k;
      _mm_prefetch(reinterpret_cast<const char*>(wk + kAheadFloats), _MM_HINT_T0);
      const __m512 b = _mm512_loadu_ps(wk);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(a[r], b, acc[r][c]);
    }
  }
  const jaxserve::Mask16 mask = jaxserve::LaneMask(lanes);  // the last panel's lanes
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c + 1 < C; ++c) _mm512_storeu_ps(out[r] + col + 16 * c, acc[r][c]);
    _mm512_mask_storeu_ps(out[r] + col + 16 * (C - 1), mask, acc[r][C - 1]);
  }
}
constexpr int kWidePanels = 8;  // C of a one-row block (8 accumulators; 2 rows: C = 4)
#endif

// A work unit is a range of panels by a range of row blocks (a row chunk).
//
// Panels a unit at least for one or two rows: a unit must hold a one-row block's wide
// tile. More rows: one panel at least, and about 8 units a thread, so that a pool thread
// that wakes late (on a VM, tens of microseconds) still finds half of the work left: with
// 4 units a thread of at least 8 panels, a 128-row [512, 512] product (4 units) ran as
// slowly as on one thread.
constexpr int64_t kMinWideUnitPanels = kWidePanels;
constexpr int64_t kUnitsPerThread = 8;
// x bytes of a row chunk at most: the rows every panel of a unit is read against stay in
// L2 (1 MiB on Zen 4, 512 KiB on Zen 3). A 512-row [512, 256] product with all rows in
// one chunk (1 MiB of x read again for every panel) ran at 128 GFLOP/s, 128 rows at 184.
constexpr int64_t kChunkBytes = 256 << 10;

struct Problem {
  jaxserve::RowBlocks blocks;
  const float* x;           // [M][K]
  std::vector<float*> out;  // row r of y
  const float* w;           // [P][K][16]
  int64_t K, N, panels;
  int64_t panels_per_unit = 1, blocks_per_chunk = 1, chunks = 1;
};

// WideTile<R, 1> for a runtime R in [1, kTileRows].
template <int R = jaxserve::kTileRows>
inline void PanelTile(int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                      int64_t col, int lanes, float* const* out) {
  jaxserve::WithRows<R>(
      rows, [&](auto r) { WideTile<decltype(r)::value, 1>(x, ldx, panel, K, col, lanes, out); });
}

// Panels [p0, p1) of row blocks [b0, b1): y[rows, 16 p0 : min(N, 16 p1)]. Panels outer,
// row blocks inner: a panel (K * 64 bytes) stays in L1/L2 for all the blocks that read it.
void RunPanels(const Problem& q, int64_t p0, int64_t p1, int b0, int b1) {
  const int64_t K = q.K, N = q.N;
  int64_t p = p0;
  // One block of one or two rows (M <= 2; RowBlocks never makes a block that small from
  // more rows): several panels a tile. Whole panels only; a partial last one runs below.
  const int rows = q.blocks.BlockRows(0);
  const int64_t full_end = std::min(p1, N / 16);
  if (q.blocks.blocks == 1 && rows == 1) {
    for (; p + kWidePanels <= full_end; p += kWidePanels)
      WideTile<1, kWidePanels>(q.x, K, q.w + p * 16 * K, K, 16 * p, 16, q.out.data());
  } else if (q.blocks.blocks == 1 && rows == 2) {
    constexpr int kPanels = kWidePanels / 2;
    for (; p + kPanels <= full_end; p += kPanels)
      WideTile<2, kPanels>(q.x, K, q.w + p * 16 * K, K, 16 * p, 16, q.out.data());
  }
  for (; p < p1; ++p) {
    const int64_t col = 16 * p;
    const int lanes = static_cast<int>(std::min<int64_t>(16, N - col));
    for (int b = b0; b < b1; ++b) {
      const int s = q.blocks.BlockStart(b);
      PanelTile(q.blocks.BlockRows(b), q.x + int64_t{s} * K, K, q.w + p * 16 * K, K, col,
                lanes, q.out.data() + s);
    }
  }
}

// Unit u: panel range u / chunks, row chunk u % chunks (consecutive units of a thread
// read the same panels, which stay in L1/L2, against the row chunks in turn).
void RunUnit(const Problem& q, int64_t u) {
  const int64_t p0 = u / q.chunks * q.panels_per_unit;
  const int64_t b0 = u % q.chunks * q.blocks_per_chunk;
  RunPanels(q, p0, std::min(q.panels, p0 + q.panels_per_unit), static_cast<int>(b0),
            static_cast<int>(std::min<int64_t>(q.blocks.blocks, b0 + q.blocks_per_chunk)));
}

ffi::Error DensePanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] || wd[2] != 16 ||
      yd[0] != xd[0] || wd[0] != (yd[1] + 15) / 16) {
    return ffi::Error::InvalidArgument(
        "dense_panels: expected x [M, K], w [ceil(N / 16), K, 16], y [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.f);
    return ffi::Error::Success();
  }
  auto state = std::make_shared<Problem>(Problem{jaxserve::RowBlocks(static_cast<int>(M)),
                                                  x.typed_data(), {}, w.typed_data(), K, N,
                                                  wd[0]});
  Problem& p = *state;
  p.out.resize(M);
  for (int64_t r = 0; r < M; ++r) p.out[r] = yp + r * N;
  const int64_t helpers = jaxserve::MaxHelpers(pool);
  if (M * K * N < kSerialMacs || helpers <= 0) {
    RunPanels(p, 0, p.panels, 0, p.blocks.blocks);
    return ffi::Error::Success();
  }
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunkBytes / (4 * K));
  p.blocks_per_chunk = std::max<int64_t>(1, rows_per_chunk / jaxserve::kTileRows);
  p.chunks = (p.blocks.blocks + p.blocks_per_chunk - 1) / p.blocks_per_chunk;
  const int64_t want_units = kUnitsPerThread * (helpers + 1);
  const int64_t panel_units = std::max<int64_t>(1, want_units / p.chunks);
  p.panels_per_unit = std::max<int64_t>(M <= 2 ? kMinWideUnitPanels : 1,
                                        (p.panels + panel_units - 1) / panel_units);
  const int64_t units = (p.panels + p.panels_per_unit - 1) / p.panels_per_unit * p.chunks;
  if (units == 1) {
    RunUnit(p, 0);
  } else {
    jaxserve::ShareUnitChunks(pool, units, 1,
                              [state](int64_t u, int64_t) { RunUnit(*state, u); });
  }
  return ffi::Error::Success();
}

#else  // without tiles the Python side never calls the kernel (`cpu_dense.applies`)

ffi::Error DensePanelsImpl(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                           ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "dense_panels: built without AVX2 + FMA or AVX-512");
}

#endif  // JAXSERVE_HAVE_TILES

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDensePanels, DensePanelsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w [ceil(N/16), K, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
