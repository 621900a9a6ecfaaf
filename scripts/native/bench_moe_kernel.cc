// The CPU MoE kernel (jaxserve/kernels/cpu_moe_rows.cc) alone, outside XLA: ms a call
// and GFLOP/s for the random Qwen3-MoE's layer (hidden 512, 32 experts, I 256, top-4),
// T tokens routed uniformly at random, 8 layers of weights cycled (from memory, as in a
// step), the work shared by this thread and one helper (two cores). Checks each
// variant's output against a double-precision reference (a line only if it fails).
//
// Variants of the tile product (experts with kTileMinRows rows or more; the others take
// the kernel's row path; an AVX2 build has its own, listed in bench_moe_avx2.h), run
// interleaved: 12 rounds of `calls` calls of each, medians
// (the first two calls of a round dropped), speed-up against the first one named, and
// the median gap between the two threads' ends (idle time of one):
//   base    the kernel as built on the model's row-major weights (cpu_tile_matmul.h's
//           PanelMatmul; on AVX2, cpu_moe_chunks.h's ChunkMatmul below 4 row blocks)
//   pm      the kernel as built on the weights panel-major [E][N/16][K][16] (each
//           16-column panel contiguous: its JaxserveMoePanels target, what the engine
//           holds on one CPU device; every expert on PanelsMatmul tiles, also below
//           kTileMinRows rows) (--panel-major: pm)
//   pmr:1,R,pf,hint,0,seq,0,0,order  the kernel's PanelsMatmul on panel-major weights
//           with R rows a tile at most (8, 12, 16, 20, 24, 28), pf lines ahead, hint
//           0-3, seq 1: the prefetch goes on into the next matrix (the kernel, AVX-512:
//           pmr:1,24,128,1,0,1; before: pmr:1,8,8,0)
//   order (the 9th field, any variant): units as planned (0), most rows first (1), or
//           most rows first for this thread and fewest first for the helper (2)
//   tile:P,R,pf,hint,kc,seq,lead  register tiles of P panels x R rows over the [K, N]
//           weights; pf > 0 prefetches pf rows ahead in the panel, pf < 0 -pf panels
//           ahead in the row, 0 none; hint 0-3 T0, T1, T2, NTA; lead > 0 also prefetches
//           lead rows ahead in the first -pf panels. tile:1,8 (pf 8, T0) is the kernel
//           before the panels-ahead prefetch.
//   pack:P,R,pf,hint,kc  copies kc rows (0: all K) of an expert's matrix panel-major into
//           a per-thread buffer (one sequential read), then tiles over the copy
//   chunk:P,R,pf,hint,kc,seq  k-chunks of kc rows (contiguous in memory), all panels of
//           one chunk before the next, accumulating into out; seq 1 prefetches the next
//           chunk in address order
// BENCH_HUGEPAGES=1 puts the weights on transparent huge pages (fewer TLB misses on
// the row-strided reads; the older prefetch gains most from them). E.g. T=128 on two
// shared Zen 4 cores (load ~1.8), ms and x tile:1,8, 4 KB pages / huge pages: base 2.97
// (1.36x) / 2.60 (1.20x), pm (then a tile variant on panel-major weights) 2.97 (1.36x) /
// 2.74 (1.14x), tile:1,8,-3,0 1.29x / 1.15x, tile:2,8,-4,0 1.21x / 0.93x, tile:4,6 1.00x /
// 0.84x, pack:1,8 0.87x / 0.69x, chunk:4,6,0,0,64,1 0.95x / 0.76x.
//
//   g++ -O3 -march=native -std=c++17 -I$(python -c 'import jax; print(jax.ffi.include_dir())') \
//       -Ijaxserve/kernels scripts/native/bench_moe_kernel.cc -o /tmp/bench_moe_kernel -pthread
//   /tmp/bench_moe_kernel [T=128] [calls=16] [variant ...]   (default: base)
// To A/B a change outside the tile product (e.g. SwiGlu), build this file in two trees
// and alternate the two binaries' processes (base or pm only). E.g. the 24-row panel tiles
// (cpu_tile_matmul.h's kPanelsTileRows) against b0fead8's kernel, pm, processes
// alternating 3x, Zen 4 2 cores, load 1.0-1.4, medians of the three: T=32 1.59 -> 1.55 ms
// (noise), T=128 2.66 -> 2.09 ms (151 -> 193 GFLOP/s, 1.28x), T=512 8.48 -> 7.67 ms
// (190 -> 210 GFLOP/s, 1.11x).
#include "../../jaxserve/kernels/cpu_moe_rows.cc"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sys/mman.h>
#include <string>
#include <thread>

namespace {

struct Variant {
  std::string kind = "base";  // base | pm | tile | chunk | pack
  int P = 1, R = 8, pf = 8, hint = 0, kc = 0, seq = 0, lead = 0, mask = 1, order = 0;
};
Variant variant;

}  // namespace

#if JAXSERVE_TILES_AVX2
#include "bench_moe_avx2.h"
#else
namespace {

// A register tile of P 16-column panels x R rows (P * R zmm accumulators), so one weight
// row k gives P * 64 contiguous bytes: out[r][col + 16 j + i] (+)= sum_k at[k * R + r] *
// w[k * ldw + j * lds + i], lanes of the last panel outside `last` neither read nor
// written; panel j at w + j * lds (lds 16 over [K, N] weights, 16 * K panel-major).
// `Hint` the software prefetch's (0 T0, 1 T1, 2 T2, 3 NTA), pf and pf2 its offsets in
// floats (0: none). kAcc: add to out instead of storing.
template <int P, int R, int Hint, bool kAcc>
inline void WideTile(const float* at, const float* w, int64_t ldw, int64_t lds, int64_t K,
                     int64_t col, __mmask16 last, float* const* out, int64_t pf, int64_t pf2 = 0) {
  constexpr auto hint = Hint == 0   ? _MM_HINT_T0
                       : Hint == 1 ? _MM_HINT_T1
                       : Hint == 2 ? _MM_HINT_T2
                                   : _MM_HINT_NTA;
  __m512 acc[R * P];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j)
      acc[r * P + j] = kAcc ? _mm512_maskz_loadu_ps(j == P - 1 ? last : 0xffff,
                                                    out[r] + col + 16 * j)
                            : _mm512_setzero_ps();
  const float* wk = w;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    if (pf) {
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wk + j * lds + pf), hint);
    }
    if (pf2) {
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wk + j * lds + pf2), hint);
    }
    __m512 b[P];
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j)
      b[j] = _mm512_maskz_loadu_ps(j == P - 1 ? last : 0xffff, wk + j * lds);
    const float* ak = at + k * R;
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(ak[r]);
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[r * P + j] = _mm512_fmadd_ps(a, b[j], acc[r * P + j]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j)
      _mm512_mask_storeu_ps(out[r] + col + 16 * j, j == P - 1 ? last : 0xffff, acc[r * P + j]);
}

template <int P, int R, int Hint, bool kAcc>
inline void WideTileRows(int rows, const float* at, const float* w, int64_t ldw, int64_t lds,
                         int64_t K, int64_t col, __mmask16 last, float* const* out, int64_t pf,
                         int64_t pf2 = 0) {
  if (rows >= R) return WideTile<P, R, Hint, kAcc>(at, w, ldw, lds, K, col, last, out, pf, pf2);
  if constexpr (R > 1)
    WideTileRows<P, R - 1, Hint, kAcc>(rows, at, w, ldw, lds, K, col, last, out, pf, pf2);
}

// One k-range [k0, k0 + kn) of out += packed x w for all row blocks. panel_major: w is
// [N/16][kn][16] (ldw 16), else w points at row k0 of a [K, N] matrix.
template <int P, int R, int Hint>
void WideRange(const jaxserve::RowBlocks& blocks, const float* packed, int64_t K, int64_t k0,
               int64_t kn, const float* w, int64_t ldw, bool panel_major, int64_t N,
               float* const* o, const float* seq_next, int64_t seq_lines) {
  // pf > 0: rows ahead in the same panel; pf < 0: -pf panels ahead in the same row.
  const int64_t pf =
      variant.pf >= 0 ? variant.pf * ldw : -variant.pf * (panel_major ? 16 * kn : 16);
  const int64_t lds = panel_major ? 16 * kn : 16;
  const int64_t groups = (N + 16 * P - 1) / (16 * P);
  for (int64_t col = 0, g = 0; col < N; col += 16 * P, ++g) {
    if (seq_next)  // this group's share of the next range's lines, in address order
      for (int64_t l = g * seq_lines / groups; l < (g + 1) * seq_lines / groups; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(seq_next + 16 * l), _MM_HINT_T0);
    const float* wc = panel_major ? w + col * kn : w + col;
    for (int b = 0; b < blocks.blocks; ++b) {
      const int s = blocks.BlockStart(b), n = blocks.BlockRows(b);
      const float* at = packed + s * K + k0 * n;
      if (N - col >= 16 * P) {
        // lead: rows-ahead prefetch for the panels that the panels-ahead one did not cover.
        const int64_t pf2 =
            variant.pf < 0 && b == 0 && col < -variant.pf * 16 ? variant.lead * ldw : 0;
        if (k0)
          WideTileRows<P, R, Hint, true>(n, at, wc, ldw, lds, kn, col, 0xffff, o + s, pf, pf2);
        else
          WideTileRows<P, R, Hint, false>(n, at, wc, ldw, lds, kn, col, 0xffff, o + s, pf, pf2);
      } else {
        for (int64_t c = col; c < N; c += 16) {
          const int64_t lanes = N - c < 16 ? N - c : 16;
          const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1);
          const float* wcc = panel_major ? w + c * kn : w + c;
          if (k0) WideTileRows<1, R, Hint, true>(n, at, wcc, ldw, lds, kn, c, m, o + s, pf);
          else WideTileRows<1, R, Hint, false>(n, at, wcc, ldw, lds, kn, c, m, o + s, pf);
        }
      }
    }
  }
}

thread_local std::vector<float> pack_buffer;

template <int P, int R, int Hint>
void WideMatmul(const jaxserve::RowBlocks& blocks, const float* packed, const float* w,
                int64_t K, int64_t N, float* const* o) {
  if (variant.kind == "pack" && blocks.blocks >= 2) {  // copy kc rows panel-major, then tiles
    const int64_t kc = variant.kc ? variant.kc : K;
    pack_buffer.resize(kc * N);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kn = std::min(kc, K - k0);
      float* buf = pack_buffer.data();
      for (int64_t k = 0; k < kn; ++k)
        for (int64_t c = 0; c < N; c += 16)
          _mm512_storeu_ps(buf + c * kn + k * 16, _mm512_loadu_ps(w + (k0 + k) * N + c));
      WideRange<P, R, Hint>(blocks, packed, K, k0, kn, buf, 16, true, N, o, nullptr, 0);
    }
    return;
  }
  const int64_t kc = variant.kind == "chunk" && variant.kc ? variant.kc : K;
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kn = std::min(kc, K - k0);
    const int64_t next = std::min(kc, K - k0 - kn);
    WideRange<P, R, Hint>(blocks, packed, K, k0, kn, w + k0 * N, N, false, N, o,
                          variant.seq && next > 0 ? w + (k0 + kn) * N : nullptr, next * N / 16);
  }
}

using MatmulFn = void (*)(const jaxserve::RowBlocks&, const float*, const float*, int64_t,
                          int64_t, float* const*);

template <int P, int R>
MatmulFn PickHint(int hint) {
  switch (hint) {
    case 1: return WideMatmul<P, R, 1>;
    case 2: return WideMatmul<P, R, 2>;
    case 3: return WideMatmul<P, R, 3>;
    default: return WideMatmul<P, R, 0>;
  }
}

// pmr: the kernel's PanelsMatmul over panel-major weights with R rows a tile at most,
// pf lines ahead, hint, and (seq 1) the prefetch going on into the next matrix.
using PanelsFn = void (*)(const jaxserve::RowBlocks&, const float*, const float*, int64_t,
                          int64_t, float* const*, const float*, int64_t);

template <int R>
PanelsFn PickPanelsHint(int hint) {
  switch (hint) {
    case 1: return jaxserve::PanelsMatmul<R, 1>;
    case 2: return jaxserve::PanelsMatmul<R, 2>;
    case 3: return jaxserve::PanelsMatmul<R, 3>;
    default: return jaxserve::PanelsMatmul<R, 0>;
  }
}

PanelsFn PickPanels(const Variant& v) {
#define JS_CASE(r) if (v.R == r) return PickPanelsHint<r>(v.hint);
  JS_CASE(8) JS_CASE(12) JS_CASE(16) JS_CASE(20) JS_CASE(24) JS_CASE(28)
#undef JS_CASE
  std::fprintf(stderr, "no panels tile of %d rows\n", v.R);
  std::exit(2);
}

MatmulFn PickMatmul(const Variant& v) {
  const int P = v.P, R = v.R, hint = v.hint;
#define JS_CASE(p, r) if (P == p && R == r) return PickHint<p, r>(hint);
  JS_CASE(1, 8) JS_CASE(1, 12) JS_CASE(1, 16) JS_CASE(2, 6) JS_CASE(2, 8) JS_CASE(2, 12)
  JS_CASE(2, 14) JS_CASE(3, 8) JS_CASE(4, 4) JS_CASE(4, 6) JS_CASE(4, 7) JS_CASE(8, 3)
#undef JS_CASE
  std::fprintf(stderr, "no tile %dx%d\n", P, R);
  std::exit(2);
}

}  // namespace
#endif  // JAXSERVE_TILES_AVX2

namespace {

MatmulFn chosen;
#if !JAXSERVE_TILES_AVX2
PanelsFn chosen_panels;
#endif

void RunTileUnitVariant(const Problem& p, int64_t e, int rows, const int32_t* copy) {
#if JAXSERVE_TILES_AVX2
  const int64_t hi = p.hidden * p.inter;
  tl_matrix[0] = p.w_gate + e * hi, tl_matrix[1] = p.w_up + e * hi;
  tl_matrix[2] = p.w_down + e * hi;
#endif
#if !JAXSERVE_TILES_AVX2
  if (variant.kind == "pmr")
    return RunTileUnitWith(
        p, e, rows, copy,
        [](const jaxserve::RowBlocks& blocks, const float* packed, const float* w, int64_t k,
           int64_t n, float* const* o, const float* after) {
          chosen_panels(blocks, packed, w, k, n, o, variant.seq ? after : nullptr, variant.pf);
        },
        variant.R);
#endif
  RunTileUnitWith(
      p, e, rows, copy,
      [](const jaxserve::RowBlocks& blocks, const float* packed, const float* w, int64_t k,
         int64_t n, float* const* o, const float*) { chosen(blocks, packed, w, k, n, o); },
      variant.R);
}

// "kind[:P,R,pf,hint,kc,seq]" (missing fields keep their defaults).
Variant ParseVariant(const char* spec) {
  Variant v;
  std::string s(spec);
  const size_t colon = s.find(':');
  v.kind = s.substr(0, colon);
  if (colon != std::string::npos) {
    int* fields[] = {&v.P, &v.R, &v.pf, &v.hint, &v.kc, &v.seq, &v.lead, &v.mask, &v.order};
    size_t at = colon + 1;
    for (int f = 0; f < 9 && at <= s.size(); ++f) {
      const size_t comma = s.find(',', at);
      const size_t len = comma == std::string::npos ? std::string::npos : comma - at;
      const std::string part = s.substr(at, len);
      if (!part.empty()) *fields[f] = std::atoi(part.c_str());
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atoi(argv[1]) : 128, E = 32, H = 512, I = 256, K = 4, L = 8;
  const int calls = argc > 2 ? atoi(argv[2]) : 16, rounds = 12;
  std::vector<std::string> specs;
  for (int a = 3; a < argc; ++a)
    specs.push_back(std::strcmp(argv[a], "--panel-major") == 0 ? "pm" : argv[a]);
  if (specs.empty()) specs.push_back("base");
  bool any_panel_major = false;
  for (const auto& spec : specs) {
    const Variant v = ParseVariant(spec.c_str());
    any_panel_major |= v.kind == "pm" || v.kind == "pmr";
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::vector<std::vector<float>> wg(L), wu(L), wd(L), pg(L), pu(L), pd(L);
  auto repack = [](const std::vector<float>& w, int64_t K, int64_t N) {
    std::vector<float> o(w.size());
    for (int64_t e = 0; e < E; ++e)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < N; ++n)
          o[e * K * N + (n / 16) * K * 16 + k * 16 + n % 16] = w[e * K * N + k * N + n];
    return o;
  };
  for (int l = 0; l < L; ++l) {
    for (auto* w : {&wg[l], &wu[l], &wd[l]}) {
      w->resize(E * H * I);
      for (auto& v : *w) v = normal(rng);
    }
    if (any_panel_major)
      pg[l] = repack(wg[l], H, I), pu[l] = repack(wu[l], H, I), pd[l] = repack(wd[l], I, H);
  }
  // The weights each call reads: the vectors', or with BENCH_HUGEPAGES=1 copies on
  // transparent huge pages (madvise; as XLA's allocator may place them).
  std::vector<const float*> rg(L), ru(L), rd(L), mg(L), mu(L), md(L);
  for (int l = 0; l < L; ++l) {
    const std::pair<std::vector<float>*, const float**> all[] = {
        {&wg[l], &rg[l]}, {&wu[l], &ru[l]}, {&wd[l], &rd[l]},
        {&pg[l], &mg[l]}, {&pu[l], &mu[l]}, {&pd[l], &md[l]}};
    for (auto [w, ptr] : all) {
      *ptr = w->data();
      if (w->empty() || !std::getenv("BENCH_HUGEPAGES")) continue;
      const size_t huge = size_t{2} << 20, bytes = (w->size() * 4 + huge - 1) / huge * huge;
      void* mem = std::aligned_alloc(huge, bytes);
      madvise(mem, bytes, MADV_HUGEPAGE);
      std::memcpy(mem, w->data(), w->size() * 4);
      *ptr = static_cast<const float*>(mem);  // freed at exit
    }
  }
  std::vector<float> x(T * H), y(T * K * H);
  for (auto& v : x) v = normal(rng) * 20;
  std::vector<int32_t> ids(T * K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> e(E);
    for (int j = 0; j < E; ++j) e[j] = j;
    std::shuffle(e.begin(), e.end(), rng);
    for (int j = 0; j < K; ++j) ids[t * K + j] = e[j];
  }
  std::atomic<int> posted{0}, finished{0};
  std::atomic<bool> stop{false};
  std::function<void()> job;
  std::thread helper([&] {
    for (int seen = 0; !stop;)
      if (posted.load() != seen) seen = posted.load(), job(), ++finished;
  });
  // Variants interleaved: each round runs `calls` calls of every variant in turn.
  std::vector<std::vector<double>> times(specs.size()), tails(specs.size());
  std::chrono::steady_clock::time_point helper_done;
  for (int round = 0; round < rounds; ++round)
    for (size_t vi = 0; vi < specs.size(); ++vi) {
      variant = ParseVariant(specs[vi].c_str());
      const bool panel_major = variant.kind == "pm" || variant.kind == "pmr";
#if JAXSERVE_TILES_AVX2
      chosen = variant.kind == "pm" ? nullptr : PickMatmul(variant);
#else
      chosen = variant.kind == "pm" || variant.kind == "pmr" ? nullptr : PickMatmul(variant);
      if (variant.kind == "pmr") chosen_panels = PickPanels(variant);
#endif
      for (int c = 0; c < calls; ++c) {
        const int l = (round * calls + c) % L;
        const auto start = std::chrono::steady_clock::now();
        auto state = std::make_shared<Problem>();
        Problem& p = *state;
        p.x = x.data();
        p.w_gate = (panel_major ? mg : rg)[l];
        p.w_up = (panel_major ? mu : ru)[l];
        p.w_down = (panel_major ? md : rd)[l];
        p.y = y.data();
        p.top_k = K, p.hidden = H, p.inter = I;
        p.panels = panel_major;
        PlanUnits(p, ids.data(), T * K, E);
        const int64_t units = p.unit_expert.size();
        // Unit order (variant.order): 0 as planned (expert order), 1 most rows first,
        // 2 most rows first for this thread, fewest first for the helper (two ends).
        auto order = std::make_shared<std::vector<int64_t>>(units);
        for (int64_t u = 0; u < units; ++u) (*order)[u] = u;
        if (variant.order)
          std::stable_sort(order->begin(), order->end(), [&p](int64_t a, int64_t b) {
            return p.unit_rows[a] > p.unit_rows[b];
          });
        auto ends = std::make_shared<std::atomic<uint64_t>>(uint64_t(units));  // front << 32 | back
        const bool two_ends = variant.order == 2;
        // base and pm: the kernel's own RunUnit (either layout); the others: their tile
        // product where the kernel runs tiles.
        const bool as_built = variant.kind == "base" || variant.kind == "pm";
        auto work = [state, ends, order, as_built, two_ends](bool front) {
          for (;;) {
            uint64_t e = ends->load(), claimed;
            int64_t at;
            do {
              const uint64_t f = e >> 32, b = e & 0xffffffffu;
              if (f >= b) return;
              at = front || !two_ends ? f : b - 1;
              claimed = front || !two_ends ? ((f + 1) << 32 | b) : (f << 32 | (b - 1));
            } while (!ends->compare_exchange_weak(e, claimed));
            const int64_t u = (*order)[at];
            const Problem& q = *state;
            if (!as_built && Tiled(q.unit_rows[u], q.hidden, q.inter, q.panels))
              RunTileUnitVariant(q, q.unit_expert[u], q.unit_rows[u],
                                 q.copies.data() + q.unit_start[u]);
            else
              RunUnit(q, u);
          }
        };
        const int before = finished.load();
        job = [work, &helper_done] { work(false), helper_done = std::chrono::steady_clock::now(); };
        ++posted;
        work(true);
        const auto main_done = std::chrono::steady_clock::now();
        while (finished.load() == before) std::this_thread::yield();
        if (c >= 2)
          tails[vi].push_back(
              std::abs(std::chrono::duration<double>(main_done - helper_done).count()));
        const double t =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (c >= 2) times[vi].push_back(t);  // each round's first two calls: warm-up
        if (round == 0 && c == calls - 1) {  // every 7th copy against a double-precision reference
          double err = 0, top = 0;
          for (int64_t cp = 0; cp < T * K; cp += 7) {
            const int e = ids[cp];
            const float* xr = x.data() + (cp / K) * H;
            std::vector<double> hid(I);
            for (int j = 0; j < I; ++j) {
              double g = 0, u = 0;
              for (int k = 0; k < H; ++k) {
                g += xr[k] * wg[l][(e * H + k) * I + j];
                u += xr[k] * wu[l][(e * H + k) * I + j];
              }
              hid[j] = g / (1 + std::exp(-g)) * u;
            }
            for (int o = 0; o < H; ++o) {
              double s = 0;
              for (int j = 0; j < I; ++j) s += hid[j] * wd[l][(e * I + j) * H + o];
              err = std::max(err, std::abs(s - y[cp * H + o])), top = std::max(top, std::abs(s));
            }
          }
          if (err > 1e-4 * top)
            std::printf("CHECK FAILED %s: max |error| %.3g (max |reference| %.3g)\n",
                        specs[vi].c_str(), err, top);
        }
      }
    }
  stop = true;
  helper.join();
  const double flop = 2.0 * T * K * 3 * H * I;
  double base_median = 0;
  for (size_t vi = 0; vi < specs.size(); ++vi) {
    auto& t = times[vi];
    std::sort(t.begin(), t.end());
    const double median = t[t.size() / 2];
    if (vi == 0) base_median = median;
    std::sort(tails[vi].begin(), tails[vi].end());
    std::printf("T=%-4ld %-22s median %.3f ms a call, %6.1f GFLOP/s, %.3fx the first"
                " (threads' ends %.3f ms apart)\n",
                static_cast<long>(T), specs[vi].c_str(), median * 1e3, flop / median / 1e9,
                base_median / median, tails[vi][tails[vi].size() / 2] * 1e3);
  }
}
