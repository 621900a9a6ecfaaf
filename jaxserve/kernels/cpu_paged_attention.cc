// Causal GQA attention of a flat token batch over the paged KV cache, on the CPU.
//
// The XLA FFI handler behind `jaxserve.kernels.cpu_attention` (its docstring has the
// contract and why it exists). A work unit is (request, tile of up to kTile consecutive
// query tokens of the request, KV heads: all of them when the step has kMinTilesAllHeads
// such tiles or more, else one): its tokens' query heads are the rows that attend
// together, so each key and value of the request is read once per tile, in place
// through the block table (with all KV heads, a block is one stretch of memory), and
// nothing is gathered or padded. Keys are taken a cache block at a time with the online
// softmax of FlashAttention (Dao et al. 2022): scores of the block for every row, then
// each row's running max, sum and output are rescaled and updated. Work units are shared
// with XLA's intra-op thread pool (cpu_work_sharing.h) when the step has enough work to
// pay for it, claimed a few consecutive ones at a time so that a unit can prefetch the
// first block of the next one on its thread. Decode at 128 rows x 48 keys, 8 layers of
// cache cycled (from memory), 2 threads: 1.23 -> 0.95-1.0 ms a call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 8;  // query tokens per work unit (prefill chunks)
constexpr int32_t kPadSlot = -1;  // models.base.PAD_SLOT
// Multiply-adds below which the step runs on the calling thread alone: waking the
// pool's threads costs more than it saves (a decode step of a few short requests).
constexpr int64_t kMinParallelWork = int64_t{1} << 18;
// (request, token tile) pairs from which a unit takes all KV heads (PlanUnits).
constexpr int64_t kMinTilesAllHeads = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float Dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 16; ++l) s += lanes[l];
  return s;
}

// e^x for x[0:n] in place, -inf -> 0, in a loop the compiler vectorises: Cephes' expf
// (range reduction by ln 2, a degree-5 polynomial; within 2 ulp of std::exp, whose call
// per element GCC does not vectorise without -ffast-math, which would break the -inf
// masking). With the prefetch of the next block (RunUnit), decode attention from memory
// runs about 1.45x faster (`scripts/bench_attention_cpu.py`, 3 interleaved runs of each
// kernel, medians: 128 rows x 200 keys 6.8 -> 4.7 ms a call, 32 x 1000 8.7 -> 5.8 ms; 128
// x 48, from L3, unchanged); neither change helped alone.
inline void ExpInPlace(float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = x[j];
    const float c = std::min(std::max(v, -87.33654f), 88.72283f);
    const float k = std::nearbyint(c * 1.44269504088896341f);
    const float r = c - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t e = (static_cast<int32_t>(k) + 127) << 23;  // 2^k as a float's bits
    float scale;
    std::memcpy(&scale, &e, sizeof scale);
    x[j] = v == kNegInf ? 0.f : p * scale;
  }
}

struct Unit {
  // Query tokens [first_token, first_token + num_tokens) of `request`, KV heads
  // [kv_head, kv_head + num_kv_heads).
  int32_t request, kv_head, num_kv_heads, first_token, num_tokens;
};

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* positions;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* slots;
  float* out;
  int64_t heads, head_dim, kv_heads, group, block_size, num_blocks, table_width;
  float scale;
  int32_t window;  // 0: none
  std::vector<Unit> units;
};

// A thread's scratch, kept between units and calls (no allocation per unit once grown).
struct Scratch {
  std::vector<const float*> qrow;
  std::vector<float*> orow;
  std::vector<int32_t> pos;
  std::vector<float> acc, row_max, row_sum, score;
};

// Where unit u's first block of keys starts (elements into k or v), as RunUnit's
// block_offset: the block of its first token's first key (0 without a window).
int64_t FirstBlockOffset(const Problem& p, const Unit& u) {
  int64_t b = 0;
  if (p.window > 0) {
    const int64_t first = std::max<int64_t>(0, p.positions[u.first_token] - p.window + 1);
    b = std::min<int64_t>(first / p.block_size, p.table_width - 1);
  }
  const int64_t block =
      std::clamp<int64_t>(p.tables[u.request * p.table_width + b], 0, p.num_blocks - 1);
  return (block * p.block_size * p.kv_heads + u.kv_head) * p.head_dim;
}

// The unit's rows attend over their keys: row i is token first_token + i / (heads of the
// unit) and query head kv_head * g + i % (heads of the unit), so that the rows of one KV
// head are consecutive and each block's keys (for all the unit's KV heads, one stretch of
// memory when those are all the KV heads) are read once for them all.
void RunUnit(const Problem& p, const Unit& u, const Unit* next) {
  thread_local Scratch scratch;
  Scratch& sc = scratch;
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size;
  const int64_t unit_heads = u.num_kv_heads * g;
  const int64_t rows = u.num_tokens * unit_heads;
  sc.qrow.resize(rows);
  sc.orow.resize(rows);
  sc.pos.resize(rows);
  const float** qrow = sc.qrow.data();
  float** orow = sc.orow.data();
  int32_t* pos = sc.pos.data();
  const int64_t seq_len = p.seq_lens[u.request];
  const int64_t context = std::min<int64_t>(seq_len, p.table_width * bs);  // keys [0, context)
  int64_t first_key = std::numeric_limits<int64_t>::max(), last_key = -1;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = u.first_token + i / unit_heads;
    const int64_t head = u.kv_head * g + i % unit_heads;
    qrow[i] = p.q + (t * p.heads + head) * d;
    orow[i] = p.out + (t * p.heads + head) * d;
    // A padded token (PAD_SLOT) attends to nothing, as in the reference.
    pos[i] = p.slots[t] == kPadSlot ? -1 : p.positions[t];
    if (pos[i] < 0) continue;
    last_key = std::max<int64_t>(last_key, std::min<int64_t>(pos[i], context - 1));
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos[i] - p.window + 1) : 0;
    first_key = std::min(first_key, lo);
  }
  sc.acc.assign(rows * d, 0.f);
  sc.row_max.assign(rows, kNegInf);
  sc.row_sum.assign(rows, 0.f);
  sc.score.resize(rows * bs);
  float* acc = sc.acc.data();
  float* row_max = sc.row_max.data();
  float* row_sum = sc.row_sum.data();
  const int64_t key_stride = p.kv_heads * d;
  // Where block b of the request's table starts, at this unit's first KV head (elements
  // into k or v). Out-of-range ids clamp, as a JAX gather does (the engine never writes one).
  auto block_offset = [&](int64_t b) {
    const int64_t block =
        std::clamp<int64_t>(p.tables[u.request * p.table_width + b], 0, p.num_blocks - 1);
    return (block * bs * p.kv_heads + u.kv_head) * d;
  };
  const int64_t span = u.num_kv_heads * d;  // floats of one key for the unit's KV heads
  for (int64_t b = first_key / bs; last_key >= 0 && b <= last_key / bs; ++b) {
    const int64_t key0 = b * bs, n = std::min(bs, last_key + 1 - key0);
    const float* kb = p.k + block_offset(b);
    const float* vb = p.v + block_offset(b);
    // The next block's keys and values (or the next unit's first), while this one computes.
    int64_t next_offset = -1, next_span = span;
    if (b < last_key / bs) {
      next_offset = block_offset(b + 1);
    } else if (next != nullptr) {
      next_offset = FirstBlockOffset(p, *next);
      next_span = next->num_kv_heads * d;
    }
    if (next_offset >= 0) {
      const float* kn = p.k + next_offset;
      const float* vn = p.v + next_offset;
      for (int64_t j = 0; j < bs; ++j)
        for (int64_t c = 0; c < next_span; c += 16) {
          __builtin_prefetch(kn + j * key_stride + c);
          __builtin_prefetch(vn + j * key_stride + c);
        }
    }
    for (int64_t i = 0; i < rows; ++i) {
      if (pos[i] < key0) continue;  // no key of this block for this row (causal)
      const int64_t head_off = (i % unit_heads) / g * d;  // the row's KV head in the unit
      const float* kh = kb + head_off;
      const float* vh = vb + head_off;
      float* s = sc.score.data() + i * bs;
      float block_max = kNegInf;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = key0 + j;
        const bool seen = key <= pos[i] && (p.window <= 0 || pos[i] - key < p.window);
        s[j] = seen ? Dot(qrow[i], kh + j * key_stride, d) * p.scale : kNegInf;
        block_max = std::max(block_max, s[j]);
      }
      if (block_max == kNegInf) continue;  // no key of this block for this row
      const float new_max = std::max(row_max[i], block_max);
      const float rescale = std::exp(row_max[i] - new_max);  // exp(-inf) = 0 at the start
      row_max[i] = new_max;
      float* a = acc + i * d;
      float sum = row_sum[i] * rescale;
      for (int64_t c = 0; c < d; ++c) a[c] *= rescale;
      for (int64_t j = 0; j < n; ++j) s[j] -= new_max;  // -inf stays -inf
      ExpInPlace(s, n);  // masked keys weigh 0
      for (int64_t j = 0; j < n; ++j) {
        const float w = s[j];
        if (w == 0.f) continue;
        sum += w;
        const float* vj = vh + j * key_stride;
        for (int64_t c = 0; c < d; ++c) a[c] += w * vj[c];
      }
      row_sum[i] = sum;
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;
    for (int64_t c = 0; c < d; ++c) orow[i][c] = acc[i * d + c] * inv;
  }
}

// Cuts the step's tokens into work units (p.units); returns the multiply-adds of
// their QK^T (what decides whether to share them with the pool).
int64_t PlanUnits(Problem& p, const int32_t* qsl, int64_t num_tokens, int64_t num_rows) {
  // All KV heads in one unit where the step has enough (request, token tile) pairs to
  // share: a block's keys for all heads are one stretch of memory, read once; with fewer,
  // one unit per KV head, so that both threads have work.
  int64_t tiles = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t begin = std::clamp<int64_t>(qsl[r], 0, num_tokens);
    const int64_t end = std::clamp<int64_t>(qsl[r + 1], begin, num_tokens);
    if (p.seq_lens[r] > 0) tiles += (end - begin + kTile - 1) / kTile;
  }
  const int64_t heads_per_unit = tiles >= kMinTilesAllHeads ? p.kv_heads : 1;
  int64_t work = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t begin = std::clamp<int64_t>(qsl[r], 0, num_tokens);
    const int64_t end = std::clamp<int64_t>(qsl[r + 1], begin, num_tokens);
    if (p.seq_lens[r] <= 0) continue;  // a padded row: its tokens attend to nothing
    for (int64_t t = begin; t < end; t += kTile) {
      const int32_t n = static_cast<int32_t>(std::min(kTile, end - t));
      for (int64_t h = 0; h < p.kv_heads; h += heads_per_unit)
        p.units.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h),
                           static_cast<int32_t>(heads_per_unit), static_cast<int32_t>(t), n});
      work += n * p.heads * p.head_dim * std::min<int64_t>(p.seq_lens[r], p.table_width * p.block_size);
    }
  }
  return work;
}

// Units a thread claims at a time: about 8 claims per thread, so that most units know
// the unit that follows them on their thread (RunUnit prefetches its first block) and the
// threads still even out at the end.
int64_t ChunkOf(int64_t units, int64_t threads) {
  return std::max<int64_t>(1, units / (threads * 8));
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                              ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> slot_mapping, float scale,
                              int32_t sliding_window, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || kd[3] != qd[2] ||
      qd[1] % kd[2] != 0 || seq_lens.dimensions()[0] != td[0] ||
      query_start_loc.dimensions()[0] != td[0] + 1 || positions.dimensions()[0] != qd[0] ||
      slot_mapping.dimensions()[0] != qd[0]) {
    return ffi::Error::InvalidArgument(
        "paged_attention: expected q [T, H, D], caches [N, bs, KVH, D], block_tables [R, W], "
        "seq_lens [R], query_start_loc [R + 1], positions and slot_mapping [T]");
  }
  auto state = std::make_shared<Problem>();
  Problem& p = *state;
  const int64_t num_tokens = qd[0], num_rows = td[0];
  p.q = q.typed_data();
  p.k = k_cache.typed_data();
  p.v = v_cache.typed_data();
  p.positions = positions.typed_data();
  p.tables = block_tables.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.slots = slot_mapping.typed_data();
  p.out = out->typed_data();
  p.heads = qd[1];
  p.head_dim = qd[2];
  p.kv_heads = kd[2];
  p.group = p.heads / p.kv_heads;
  p.block_size = kd[1];
  p.num_blocks = kd[0];
  p.table_width = td[1];
  p.scale = scale;
  p.window = sliding_window;
  // Tokens in no request (past query_start_loc[R]) stay 0.
  std::fill(p.out, p.out + num_tokens * p.heads * p.head_dim, 0.f);
  const int64_t work = PlanUnits(p, query_start_loc.typed_data(), num_tokens, num_rows);
  const int64_t units = static_cast<int64_t>(p.units.size());
  if (work < kMinParallelWork || units < 2) {
    for (size_t u = 0; u < p.units.size(); ++u)
      RunUnit(p, p.units[u], u + 1 < p.units.size() ? &p.units[u + 1] : nullptr);
    return ffi::Error::Success();
  }
  jaxserve::ShareUnitChunks(pool, units, ChunkOf(units, pool.num_threads() + 1),
                            [state](int64_t u, int64_t next) {
                              const std::vector<Unit>& all = state->units;
                              RunUnit(*state, all[u], next >= 0 ? &all[next] : nullptr);
                            });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache [N, bs, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache [N, bs, KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [R, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, H, D]
