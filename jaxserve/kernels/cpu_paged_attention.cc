// Causal GQA attention of a flat token batch over the paged KV cache, on the CPU.
//
// The XLA FFI handler behind `jaxserve.kernels.cpu_attention` (its docstring has the
// contract and why it exists). A work unit is (request, tile of up to kTile consecutive
// query tokens of the request, KV heads: all of them when the step has kMinTilesAllHeads
// such tiles or more, else one): its tokens' query heads are the rows that attend
// together, so each key and value of the request is read once per tile, in place
// through the block table (with all KV heads, a block is one stretch of memory), and
// nothing is gathered or padded. Keys are taken a cache block at a time, in chunks of up
// to 16, with the online softmax of FlashAttention (Dao et al. 2022): a chunk's scores
// for a row, then the row's running max, sum and output are rescaled and updated
// (AttendChunk). A token's rows go two at a time (the g query heads of a KV head are
// consecutive), so that two rows' dependent chains interleave and the second reads the
// keys and values from L1 (one thread, 8 rows x 48 keys: 1.08x at head_dim 64, 1.18x at
// 32, over one at a time; four at a time measured the same as two). Work units are shared with XLA's intra-op thread pool
// (cpu_work_sharing.h) when the step has enough work to pay for it, claimed a few
// consecutive ones at a time so that a unit can prefetch the first block of the next one
// on its thread.
//
// Scores were one dot product per (row, key) whose 16 lanes were added up one after the
// other (float order, no -ffast-math): about 20 ns a (query head, key) pair. Now a chunk
// of 16 keys has one vector accumulator per key and one transposing tree adds them all
// up (SumEach16), the softmax is vectorised over the chunk (Exp16, no libm call that
// would spill every vector register), and the weighted values are added 16 lanes at a
// time in registers (cpu_attention_chunk.h; cpu_vec16.h: GCC vector extensions, one
// AVX-512 register here). The next block is prefetched into L2 (L1 holds the block being
// read), a share between each two rows (BlockPrefetch): from memory, 1.3x over all at
// once into L1. `scripts/bench_attention_cpu.py`, old and new kernel alternating, 3 runs
// each, medians, 2 threads, load 1.1-1.5: Qwen3-MoE shapes (8 heads, 4 KV heads,
// head_dim 64) 8 rows x 48 keys 65.4 -> 27.6 us a call, 128 x 48 540 -> 243 us, 128 x 200
// (from memory) 3.64 -> 1.55 ms, 32 x 1000 4.92 -> 2.23 ms; the demo model's (4, 2, 32)
// 8 x 48 27.9 -> 10.6 us, 8 x 200 112 -> 37 us, 128 x 48 337 -> 99 us.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_attention_chunk.h"
#include "cpu_vec16.h"
#include "cpu_work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::AttendChunk;
using jaxserve::HorizontalSum16;
using jaxserve::I16;
using jaxserve::kNegInf;
using jaxserve::Load16;
using jaxserve::RowsRef;

namespace {

constexpr int64_t kTile = 8;  // query tokens per work unit (prefill chunks)
constexpr int32_t kPadSlot = -1;  // models.base.PAD_SLOT
// Multiply-adds below which the step runs on the calling thread alone: waking the
// pool's threads costs more than it saves (a decode step of a few short requests).
constexpr int64_t kMinParallelWork = int64_t{1} << 18;
// (request, token tile) pairs from which a unit takes all KV heads (PlanUnits).
constexpr int64_t kMinTilesAllHeads = 16;

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
  std::vector<int32_t> pos;  // per token of the unit
  // Per row: the output so far (head_dim floats), the running max, and the running sum
  // of the weights as 16 lanes (added up once, at the end).
  std::vector<float> acc, row_max, row_sum;
};

// Prefetches a block's keys and values (cache lines of `span` floats at key j * stride
// for j < keys, from k and v; none if k is null) into L2, over `steps` calls of Some().
class BlockPrefetch {
 public:
  BlockPrefetch(const float* k, const float* v, int64_t stride, int64_t span, int64_t keys,
                int64_t steps)
      : k_(k), v_(v), stride_(stride), per_key_((span + 15) / 16),
        total_(k == nullptr ? 0 : keys * per_key_),
        share_((total_ + std::max<int64_t>(steps, 1) - 1) / std::max<int64_t>(steps, 1)) {}
  void Some() { Issue(std::min(total_, done_ + share_)); }
  void Rest() { Issue(total_); }

 private:
  void Issue(int64_t end) {
    for (; done_ < end; ++done_) {
      __builtin_prefetch(k_ + key_ + line_, 0, 2);  // to L2: L1 holds the block being read
      __builtin_prefetch(v_ + key_ + line_, 0, 2);
      line_ += 16;
      if (line_ == per_key_ * 16) line_ = 0, key_ += stride_;
    }
  }
  const float* k_;
  const float* v_;
  int64_t stride_, per_key_, total_, share_, done_ = 0, key_ = 0, line_ = 0;
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
// memory when those are all the KV heads) are read once for them all, from cache for
// every row after the first.
void RunUnit(const Problem& p, const Unit& u, const Unit* next) {
  thread_local Scratch scratch;
  Scratch& sc = scratch;
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size;
  const int64_t unit_heads = u.num_kv_heads * g;
  const int64_t rows = u.num_tokens * unit_heads;
  sc.pos.resize(u.num_tokens);
  int32_t* pos = sc.pos.data();
  const int64_t seq_len = p.seq_lens[u.request];
  const int64_t context = std::min<int64_t>(seq_len, p.table_width * bs);  // keys [0, context)
  int64_t first_key = std::numeric_limits<int64_t>::max(), last_key = -1;
  for (int64_t i = 0; i < u.num_tokens; ++i) {
    const int64_t t = u.first_token + i;
    // A padded token (PAD_SLOT) attends to nothing, as in the reference.
    pos[i] = p.slots[t] == kPadSlot ? -1 : p.positions[t];
    if (pos[i] < 0) continue;
    last_key = std::max<int64_t>(last_key, std::min<int64_t>(pos[i], context - 1));
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos[i] - p.window + 1) : 0;
    first_key = std::min(first_key, lo);
  }
  sc.acc.assign(rows * d, 0.f);
  sc.row_max.assign(rows, kNegInf);
  sc.row_sum.assign(rows * 16, 0.f);
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
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t b = first_key / bs; last_key >= 0 && b <= last_key / bs; ++b) {
    const int64_t n = std::min(bs, last_key + 1 - b * bs);
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
    // Issued a share at a time between row pairs, not all at once: a burst of hundreds
    // of prefetches stalls on the full miss queue.
    BlockPrefetch prefetch(next_offset >= 0 ? p.k + next_offset : nullptr,
                           p.v + std::max<int64_t>(next_offset, 0), key_stride, next_span, bs,
                           (n + 15) / 16 * u.num_tokens * ((unit_heads + 1) / 2));
    // Chunks of up to 16 keys of the block; the rows of one token share its mask.
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - j0));
      const int64_t key0 = b * bs + j0;
      const I16 key = static_cast<int32_t>(key0) + lane;
      for (int64_t t = 0; t < u.num_tokens; ++t) {
        if (pos[t] < key0) continue;  // no key of this chunk for this token (causal)
        if (p.window > 0 && pos[t] - (key0 + m - 1) >= p.window) continue;
        I16 seen = (lane < m) & (key <= pos[t]);
        if (p.window > 0) seen &= pos[t] - key < p.window;
        // The token's rows two at a time (the rows of one KV head are consecutive).
        RowsRef x;
        for (int64_t i = t * unit_heads; i < (t + 1) * unit_heads; i += 2) {
          const int R = std::min<int64_t>(2, (t + 1) * unit_heads - i);
          for (int r = 0; r < R; ++r) {
            const int64_t h = (i + r) % unit_heads;  // the row's head in the unit
            const int64_t off = h / g * d + j0 * key_stride;  // its KV head, the chunk
            x.q[r] = p.q + ((u.first_token + t) * p.heads + u.kv_head * g + h) * d;
            x.k[r] = kb + off;
            x.v[r] = vb + off;
            x.acc[r] = acc + (i + r) * d;
            x.row_max[r] = row_max + i + r;
            x.row_sum[r] = row_sum + (i + r) * 16;
          }
          if (R == 2) {
            AttendChunk<2>(x, key_stride, m, d, p.scale, seen);
          } else {
            AttendChunk<1>(x, key_stride, m, d, p.scale, seen);
          }
          prefetch.Some();
        }
      }
    }
    prefetch.Rest();
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float sum = HorizontalSum16(Load16(row_sum + i * 16))[0];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t t = u.first_token + i / unit_heads, head = u.kv_head * g + i % unit_heads;
    float* o = p.out + (t * p.heads + head) * d;
    for (int64_t c = 0; c < d; ++c) o[c] = acc[i * d + c] * inv;
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
// threads still even out at the end. The call passes pool.num_threads() + 1 threads, one
// more than ShareUnitChunks runs on a 2-CPU machine (MaxHelpers), i.e. smaller chunks:
// MaxHelpers(pool) + 1 measured the same within noise (scripts/bench_attention_cpu.py,
// AVX2 EPYC VM, 6 interleaved rounds, load ~1.9: 128 x 200 medians 2128 vs 2019 us).
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
