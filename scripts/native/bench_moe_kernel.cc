// The CPU MoE kernel (jaxserve/kernels/cpu_moe_rows.cc) alone, outside XLA: ms a call
// and GFLOP/s for the random Qwen3-MoE's layer (hidden 512, 32 experts, I 256, top-4),
// T tokens routed uniformly at random, 8 layers of weights cycled (from memory, as in a
// step), the work shared by this thread and one helper (two cores). Checks the output
// against a double-precision reference. With --panel-major the weights are first
// repacked [E][N/16][K][16] (each 16-column panel contiguous) and the tile path reads
// them so: the same products in the same order (equal output), contiguous streams.
//
//   g++ -O3 -march=native -std=c++17 -I$(python -c 'import jax; print(jax.ffi.include_dir())') \
//       -Ijaxserve/kernels scripts/native/bench_moe_kernel.cc -o /tmp/bench_moe_kernel -pthread
//   /tmp/bench_moe_kernel [T=128] [calls=80] [--panel-major]
#include "../../jaxserve/kernels/cpu_moe_rows.cc"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

namespace {

// RunTileUnit of cpu_moe_rows.cc over panel-major weights (--panel-major).
void RunTileUnitPanelMajor(const Problem& p, int64_t e, int rows, const int32_t* copy) {
  RunTileUnitWith(p, e, rows, copy,
                  [](const jaxserve::RowBlocks& blocks, const float* packed, const float* w,
                     int64_t K, int64_t N, float* const* o) {
                    for (int64_t col = 0; col < N; col += 16)  // panel col/16 at w + col * K
                      for (int b = 0; b < blocks.blocks; ++b) {
                        const int s = blocks.BlockStart(b);
                        jaxserve::TileRows<jaxserve::kTileRows>(
                            blocks.BlockRows(b), packed + s * K, w + col * K - col, 16, K, col,
                            0xffff, o + s);
                      }
                  });
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atoi(argv[1]) : 128, E = 32, H = 512, I = 256, K = 4, L = 8;
  const int calls = argc > 2 ? atoi(argv[2]) : 80;
  const bool panel_major = argc > 3 && std::strcmp(argv[3], "--panel-major") == 0;
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
    if (panel_major) pg[l] = repack(wg[l], H, I), pu[l] = repack(wu[l], H, I), pd[l] = repack(wd[l], I, H);
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
  std::vector<double> times;
  for (int c = 0; c < calls; ++c) {
    const int l = c % L;
    const auto start = std::chrono::steady_clock::now();
    auto state = std::make_shared<Problem>();
    Problem& p = *state;
    p.x = x.data();
    p.w_gate = (panel_major ? pg : wg)[l].data();
    p.w_up = (panel_major ? pu : wu)[l].data();
    p.w_down = (panel_major ? pd : wd)[l].data();
    p.y = y.data();
    p.top_k = K, p.hidden = H, p.inter = I;
    std::fill(y.begin(), y.end(), 0.f);
    PlanUnits(p, ids.data(), T * K, E);
    const int64_t units = p.unit_expert.size();
    auto next = std::make_shared<std::atomic<int64_t>>(0);
    auto work = [state, next, units, panel_major] {
      for (int64_t u; (u = next->fetch_add(1)) < units;) {
        const Problem& q = *state;
        if (panel_major && Tiled(q.unit_rows[u]))
          RunTileUnitPanelMajor(q, q.unit_expert[u], q.unit_rows[u], q.copies.data() + q.unit_start[u]);
        else
          RunUnit(q, u);
      }
    };
    const int before = finished.load();
    job = work;
    ++posted;
    work();
    while (finished.load() == before) std::this_thread::yield();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (c == L) {  // every 7th copy against a double-precision reference
      double err = 0, top = 0;
      for (int64_t cp = 0; cp < T * K; cp += 7) {
        const int e = ids[cp];
        const float* xr = x.data() + (cp / K) * H;
        std::vector<double> hid(I);
        for (int j = 0; j < I; ++j) {
          double g = 0, u = 0;
          for (int k = 0; k < H; ++k) g += xr[k] * wg[l][(e * H + k) * I + j], u += xr[k] * wu[l][(e * H + k) * I + j];
          hid[j] = g / (1 + std::exp(-g)) * u;
        }
        for (int o = 0; o < H; ++o) {
          double s = 0;
          for (int j = 0; j < I; ++j) s += hid[j] * wd[l][(e * I + j) * H + o];
          err = std::max(err, std::abs(s - y[cp * H + o])), top = std::max(top, std::abs(s));
        }
      }
      std::printf("check: max |error| %.3g (max |reference| %.3g)\n", err, top);
    }
  }
  stop = true;
  helper.join();
  std::sort(times.begin() + L, times.end());  // the first round of layers is warm-up
  const double median = times[L + (times.size() - L) / 2];
  std::printf("T=%ld%s: median %.3f ms a call, %.1f GFLOP/s\n", static_cast<long>(T),
              panel_major ? " panel-major" : "", median * 1e3, 2.0 * T * K * 3 * H * I / median / 1e9);
}
