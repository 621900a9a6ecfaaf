// SwiGLU experts over routed token copies on the CPU, each expert's weights read in place.
//
// The XLA FFI handler behind `jaxserve.kernels.cpu_moe` (see its docstring for the
// contract and why it exists: XLA's CPU backend copies an expert's weights out of the
// stacked [E, H, I] arrays before every dot that reads them). Copies are grouped by
// expert (a counting sort), and each expert's rows run in blocks of up to kRows rows:
// a block streams the expert's matrices once, row by row (sequential reads), into
// accumulator rows that stay in L1. (Column tiles with the accumulators in registers,
// reading the weights with a stride, measured 3-4x slower there; 8-row blocks tied
// with 4.) An expert with kTileMinRows rows or more, or with small matrices
// (kSmallExpertFloats), runs register tiles instead (cpu_tile_matmul.h, AVX-512 or AVX2
// builds): its rows in units of up to kUnitRows, each unit streaming the expert's
// matrices once, 16 columns at a time for all its rows (on AVX2 builds, units of fewer
// than 4 row blocks in k-chunks read in address order instead: cpu_moe_chunks.h). Work
// units (expert, row block) are shared with XLA's intra-op thread pool
// (cpu_work_sharing.h), unless the call is under kMinParallelWork.
//
// Two layouts of the weights, one FFI target each: JaxserveMoeRows reads the model's
// row-major w_gate / w_up [E, H, I] and w_down [E, I, H] as above; JaxservePanels
// (`cpu_moe.ExpertPanels`, what the engine holds on one CPU device) reads them
// panel-major, each expert's [K, N] matrix as [ceil(N / 16)][K][16] (each 16-column
// panel one contiguous stream, zero past N): every expert runs the register tiles
// (PanelsMatmul, cpu_tile_matmul.h), whose panel reads are then sequential, at any row
// count (tile builds only: the engine packs only there), in row blocks of up to
// kPanelsTileRows (24 on AVX-512: an expert's rows at 128 tokens in one tile).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_moe_chunks.h"
#include "cpu_tile_matmul.h"
#include "cpu_work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 4;  // rows per block of the row-streaming path
// Rows of an expert from which it runs register tiles (0: never, without AVX-512 or AVX2),
// and the most rows of one such work unit.
constexpr int kTileMinRows = JAXSERVE_HAVE_TILES ? 8 : 0;
constexpr int kUnitRows = 64;
// Multiply-adds of a call below which it runs on the calling thread alone: waking a pool
// thread costs more than it saves (the demo model's decode at batch 8: 16 copies).
constexpr int64_t kMinParallelWork = int64_t{1} << 20;

// Floats of one expert matrix ([H, I]) up to which its experts run register tiles at
// any row count: such a matrix (256 KiB) stays in L2 between steps, where the tiles' reads
// down a 16-column panel cost nothing, and the row path's accumulators in memory lose
// (demo model, 2 rows an expert at batch 8). Larger ones come from memory, where the
// tiles' strided reads lose to the row path's sequential ones below kTileMinRows.
constexpr int64_t kSmallExpertFloats = int64_t{64} << 10;

// Whether an expert with `rows` rows (or a work unit of that many) of hidden x inter
// matrices runs register tiles.
// Panel-major weights (`panels`) always do.
inline bool Tiled(int64_t rows, int64_t hidden, int64_t inter, bool panels = false) {
  return kTileMinRows > 0 && rows > 0 &&
         (panels || rows >= kTileMinRows || hidden * inter <= kSmallExpertFloats);
}

// Floats of one expert's [K, N] matrix: K * N row-major, ceil(N / 16) * 16 * K panel-major.
inline int64_t MatrixFloats(int64_t K, int64_t N, bool panels) {
  return panels ? (N + 15) / 16 * 16 * K : K * N;
}

// out[r][0:n] = sum_k a[r][k] * w[k][0:n] for r < R; w is [K, n] row-major.
template <int R>
void MatmulRows(const float* const* a, const float* w, int64_t K, int64_t n,
                float* const* out) {
  for (int r = 0; r < R; ++r) std::fill(out[r], out[r] + n, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * n;
    for (int r = 0; r < R; ++r) {
      const float s = a[r][k];
      float* o = out[r];
      for (int64_t j = 0; j < n; ++j) o[j] += s * wk[j];
    }
  }
}

// MatmulRows<rows> for a runtime rows in [1, R].
template <int R>
void MatmulBlock(int rows, const float* const* a, const float* w, int64_t K, int64_t n,
                 float* const* out) {
  if (rows >= R) return MatmulRows<R>(a, w, K, n, out);
  if constexpr (R > 1) MatmulBlock<R - 1>(rows, a, w, K, n, out);
}

struct Problem {
  const float* x;
  const float* w_gate;
  const float* w_up;
  const float* w_down;
  float* y;
  int64_t top_k, hidden, inter;
  bool panels = false;  // weights panel-major (JaxserveMoePanels), else row-major
  std::vector<int32_t> copies;  // copy indices (t * k + j) sorted by expert
  std::vector<int32_t> unit_expert, unit_start, unit_rows;  // one work unit per block
};

#if JAXSERVE_HAVE_TILES
// `floats` floats of this thread's scratch (grown as needed, never shrunk; contents
// undefined), valid until its next call on this thread.
inline float* UnitScratch(int64_t floats) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t size = 0;
  if (floats > size) buffer.reset(new float[floats]), size = floats;
  return buffer.get();
}

// Rows of one expert on register tiles: gate/up [rows, I], SwiGLU, down [rows, H] into y.
// matmul(blocks, packed rows, expert weight [K, N], K, N, out rows, the weight read after
// it or nullptr) is the tile product and block_rows the most rows of a row block
// (MoeMatmul and kTileRows here; scripts/native/bench_moe_kernel.cc passes variants:
// other tiles, another layout).
template <class Matmul>
void RunTileUnitWith(const Problem& p, int64_t e, int rows, const int32_t* copy, Matmul matmul,
                     int block_rows = jaxserve::kTileRows) {
  const int64_t h = p.hidden, i = p.inter;
  const jaxserve::RowBlocks blocks(rows, block_rows);
  // This thread's scratch, not zeroed (each float is written before it is read): the
  // vectors' zeroing of 64 KiB a unit was ~1% of a 128-token call.
  float* const packed = UnitScratch(rows * (std::max(h, i) + 2 * i));
  float* const gate = packed + rows * std::max(h, i);
  float* const up = gate + rows * i;
  std::vector<const float*> a(rows);
  std::vector<float*> g(rows), u(rows), out(rows);
  for (int r = 0; r < rows; ++r) {
    a[r] = p.x + (copy[r] / p.top_k) * h;
    g[r] = gate + r * i;
    u[r] = up + r * i;
    out[r] = p.y + int64_t{copy[r]} * h;
  }
  jaxserve::PackRows(blocks, a.data(), h, packed);
  const int64_t gate_floats = MatrixFloats(h, i, p.panels);
  const float* w_up = p.w_up + e * gate_floats;
  const float* w_down = p.w_down + e * MatrixFloats(i, h, p.panels);
  matmul(blocks, packed, p.w_gate + e * gate_floats, h, i, g.data(), w_up);
  matmul(blocks, packed, w_up, h, i, u.data(), w_down);
  jaxserve::SwiGlu(gate, up, rows * i);
  jaxserve::PackRows(blocks, const_cast<const float* const*>(g.data()), i, packed);
  matmul(blocks, packed, w_down, i, h, out.data(), nullptr);
}

// The tile product of a unit: on AVX2 builds, k-chunks read in address order where the
// unit has few row blocks (cpu_moe_chunks.h), else panels (cpu_tile_matmul.h).
inline void MoeMatmul(const jaxserve::RowBlocks& blocks, const float* packed, const float* w,
                      int64_t k, int64_t n, float* const* o, const float* after) {
#if JAXSERVE_TILES_AVX2
  if (jaxserve::UsesChunks(blocks, n))
    return jaxserve::ChunkMatmul(blocks, packed, w, k, n, o, after);
#endif
  (void)after;
  jaxserve::PanelMatmul(blocks, packed, w, k, n, o);
}

// The tile product of panel-major weights (cpu_tile_matmul.h's PanelsMatmul).
inline void PanelsMoeMatmul(const jaxserve::RowBlocks& blocks, const float* packed,
                            const float* w, int64_t k, int64_t n, float* const* o,
                            const float* after) {
  jaxserve::PanelsMatmul(blocks, packed, w, k, n, o, after);
}

void RunTileUnit(const Problem& p, int64_t e, int rows, const int32_t* copy) {
  if (p.panels)
    return RunTileUnitWith(p, e, rows, copy, PanelsMoeMatmul, jaxserve::kPanelsTileRows);
  RunTileUnitWith(p, e, rows, copy, MoeMatmul);
}
#endif

// One block of rows of one expert: gate/up [rows, I], SwiGLU, down [rows, H] into y.
void RunUnit(const Problem& p, int64_t u) {
  const int64_t e = p.unit_expert[u], h = p.hidden, i = p.inter;
  const int rows = p.unit_rows[u];
  const int32_t* copy = p.copies.data() + p.unit_start[u];
#if JAXSERVE_HAVE_TILES
  if (Tiled(rows, h, i, p.panels)) return RunTileUnit(p, e, rows, copy);
#endif
  const float* a[kRows];
  float* out[kRows];
  std::vector<float> gate(kRows * i), up(kRows * i);
  float* g[kRows];
  float* up_rows[kRows];
  for (int r = 0; r < rows; ++r) {
    a[r] = p.x + (copy[r] / p.top_k) * h;
    g[r] = gate.data() + r * i;
    up_rows[r] = up.data() + r * i;
    out[r] = p.y + int64_t{copy[r]} * h;
  }
  MatmulBlock<kRows>(rows, a, p.w_gate + e * h * i, h, i, g);
  MatmulBlock<kRows>(rows, a, p.w_up + e * h * i, h, i, up_rows);
  jaxserve::SwiGlu(gate.data(), up.data(), rows * i);
  MatmulBlock<kRows>(rows, const_cast<const float* const*>(g), p.w_down + e * i * h, i, h, out);
}

// Groups the n copies of `id` (expert of each; outside [0, E) marks an empty copy) by
// expert (a counting sort) and cuts each expert's copies into work units. Zeroes the
// output rows (p.y, p.hidden) of the empty copies; the units write all the others.
void PlanUnits(Problem& p, const int32_t* id, int64_t n, int64_t num_experts) {
  std::vector<int32_t> count(num_experts + 1, 0);
  for (int64_t c = 0; c < n; ++c) {
    const int32_t e = id[c];
    if (e >= 0 && e < num_experts) ++count[e + 1];
    else std::fill(p.y + c * p.hidden, p.y + (c + 1) * p.hidden, 0.f);
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];
  p.copies.resize(count[num_experts]);
  std::vector<int32_t> next(count.begin(), count.end() - 1);
  for (int64_t c = 0; c < n; ++c) {
    const int32_t e = id[c];
    if (e >= 0 && e < num_experts) p.copies[next[e]++] = static_cast<int32_t>(c);
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    const int32_t rows = count[e + 1] - count[e];
    int32_t step = kRows;
    if (Tiled(rows, p.hidden, p.inter, p.panels)) {  // as few units as kUnitRows allows
      const int32_t units = (rows + kUnitRows - 1) / kUnitRows;
      step = (rows + units - 1) / units;
    }
    for (int32_t s = count[e]; s < count[e + 1]; s += step) {
      p.unit_expert.push_back(static_cast<int32_t>(e));
      p.unit_start.push_back(s);
      p.unit_rows.push_back(std::min(step, count[e + 1] - s));
    }
  }
}

// Whether the weights' shapes fit x [T, H] and ids [T, k]; sets p's hidden, inter and
// panels. Row-major: w_gate, w_up [E, H, I], w_down [E, I, H]; panel-major: w_gate,
// w_up [E, ceil(I / 16), H, 16], w_down [E, ceil(H / 16), I, 16].
bool TakeShapes(Problem& p, bool panels, ffi::Span<const int64_t> xd,
                ffi::Span<const int64_t> idd, ffi::Span<const int64_t> gd,
                ffi::Span<const int64_t> ud, ffi::Span<const int64_t> dd) {
  if (xd.size() != 2 || idd.size() != 2 || idd[0] != xd[0]) return false;
  const int64_t h = xd[1];
  const bool same_up = std::equal(gd.begin(), gd.end(), ud.begin(), ud.end());
  if (!panels) {
    if (gd.size() != 3 || dd.size() != 3 || !same_up || gd[1] != h) return false;
    p.inter = gd[2];
    return dd[0] == gd[0] && dd[1] == p.inter && dd[2] == h;
  }
  if (gd.size() != 4 || dd.size() != 4 || !same_up || !kTileMinRows) return false;
  p.inter = dd[2];
  p.panels = true;
  return gd[1] == (p.inter + 15) / 16 && gd[2] == h && gd[3] == 16 && dd[0] == gd[0] &&
         dd[1] == (h + 15) / 16 && dd[3] == 16;
}

template <bool kPanels>
ffi::Error MoeRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w_gate,
                       ffi::Buffer<ffi::F32> w_up, ffi::Buffer<ffi::F32> w_down,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto state = std::make_shared<Problem>();
  Problem& p = *state;
  if (!TakeShapes(p, kPanels, x.dimensions(), ids.dimensions(), w_gate.dimensions(),
                  w_up.dimensions(), w_down.dimensions())) {
    return ffi::Error::InvalidArgument(
        kPanels ? "moe_panels: expected x [T, H], ids [T, k], w_gate / w_up [E, I/16, H, 16], "
                  "w_down [E, H/16, I, 16] (on a build with register tiles)"
                : "moe_rows: expected x [T, H], ids [T, k], w_gate / w_up [E, H, I], "
                  "w_down [E, I, H]");
  }
  auto idd = ids.dimensions();
  const int64_t num_experts = w_gate.dimensions()[0];
  p.x = x.typed_data();
  p.w_gate = w_gate.typed_data();
  p.w_up = w_up.typed_data();
  p.w_down = w_down.typed_data();
  p.y = y->typed_data();
  p.top_k = idd[1];
  p.hidden = x.dimensions()[1];
  const int64_t n = idd[0] * idd[1];
  PlanUnits(p, ids.typed_data(), n, num_experts);
  const int64_t units = static_cast<int64_t>(p.unit_expert.size());
  if (static_cast<int64_t>(p.copies.size()) * 3 * p.hidden * p.inter < kMinParallelWork) {
    for (int64_t u = 0; u < units; ++u) RunUnit(p, u);
    return ffi::Error::Success();
  }
  jaxserve::ShareUnits(pool, units, [state](int64_t u) { RunUnit(*state, u); });
  return ffi::Error::Success();
}

}  // namespace

// Both targets: x [T, H], ids [T, k], w_gate, w_up, w_down (row-major or panel-major,
// TakeShapes) -> y [T, k, H].
#define JAXSERVE_MOE_BINDING                 \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Ret<ffi::Buffer<ffi::F32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeRows, MoeRowsImpl<false>, JAXSERVE_MOE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoePanels, MoeRowsImpl<true>, JAXSERVE_MOE_BINDING);
#undef JAXSERVE_MOE_BINDING
