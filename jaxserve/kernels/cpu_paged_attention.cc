// Causal GQA attention of a flat token batch over the paged KV cache, on the CPU.
//
// The XLA FFI handler behind `jaxserve.kernels.cpu_attention` (its docstring has the
// contract and why it exists). A work unit is (request, tile of up to kTile consecutive
// query tokens of the request, KV heads: all of them when the step has kMinTilesAllHeads
// such tiles or more, else one): its tokens' query heads are the rows that attend
// together, so each key and value of the request is read once per tile, in place
// through the block table (with all KV heads, a block is one stretch of memory), and
// nothing is gathered or padded. Keys are taken in chunks of up to 16 of one cache block,
// and the chunks a segment of up to kSegmentChunks (128 keys) at a time, with the online
// softmax of FlashAttention (Dao et al. 2022) across segments, in three passes: every
// row's scores for the segment, the softmax (each row's running max, rescale and sum
// updated once a segment), then the weighted values, a token's rows two at a time (the g
// query heads of a KV head are consecutive: the second reads the keys and values from
// L1) with their outputs in registers for all the segment's keys. A decode step's 64-key
// context is one segment. Work units are shared with XLA's intra-op thread pool
// (cpu_work_sharing.h) when the step has enough work to pay for it, claimed a few
// consecutive ones at a time so that a unit can prefetch the first keys of the next one
// on its thread.
//
// Scores are, for a chunk of 16 keys, one vector accumulator per key and one transposing
// tree that adds them all up (SumEach16); the softmax is vectorised (Exp16, no libm call
// that would spill every vector register); the weighted values are added 16 lanes at a
// time (cpu_attention_chunk.h; cpu_vec16.h: GCC vector extensions, one AVX-512 register
// here). While the scores run, the segment's values are prefetched into L2, and while the
// values run, the next segment's keys (or the next unit's first), a share between each
// two rows: a decode step of 128 requests reads its K and V from memory (8 layers, each
// 16.8 MB at 64 keys, between them the experts' weights), and with software prefetch
// off, to L1 (locality 3), non-temporal, or of every other line it measured 1.3-2x slower.
//
// Until the segments, a row pair's online-softmax update ran once a 16-key chunk (max,
// rescale, exp, the output loaded, rescaled and stored; a chain of dependent steps per
// chunk): `scripts/bench_attention_cpu.py --layers 8` (8 caches in turn, from memory),
// 2 threads, old and new alternating, 5 rounds, medians, AVX-512 EPYC (2 cores, shared,
// load 1.2-1.6): 128 x 64 keys 880 -> 729 us a call, 128 x 96 1368 -> 1045 us (another
// run of 4 rounds: 794 -> 694, 1237 -> 1067); in L3, 32 x 64 88 -> 75.5 us; prefill
// chunks (--query 32) 16 x 32 519 -> 418 us; 1 x 48, 8 x 48, 1 x 32 the same. Reading K
// and V alone (no arithmetic) took ~540 us at 128 x 64, the arithmetic alone (every
// block the same, in cache) ~315 us before. End to end, `scripts/compare_hf.py --models
// qwen3moe --batches 128` 2083 -> 2173 tok/s (1.04x, each of 3 interleaved rounds
// 1.03-1.04x), 64.0% of the f32 matmul ceiling. Before the vectorised chunk, scores
// were one dot product per (row, key) whose lanes were added one after the other, about
// 20 ns a (query head, key) pair: 8 rows x 48 keys 65.4 -> 27.6 us, 128 x 48 540 -> 243 us.

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
using jaxserve::Exp16;
using jaxserve::HorizontalMax16;
using jaxserve::Max16;
using jaxserve::Splat16;
using jaxserve::Store16;
using jaxserve::V16;
using jaxserve::ValueRef;
using jaxserve::RowScores;
using jaxserve::HorizontalSum16;
using jaxserve::I16;
using jaxserve::kNegInf;
using jaxserve::Load16;

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

// Chunks of up to 16 keys whose scores a unit holds at once (a segment): the softmax's
// max, rescaling and exps run once a segment, not once a chunk.
constexpr int kSegmentChunks = 8;

// A thread's scratch, kept between units and calls (no allocation per unit once grown).
struct Scratch {
  std::vector<int32_t> pos;  // per token of the unit
  // Per row: the output so far (head_dim floats), the running max, the running sum of
  // the weights as 16 lanes (added up once, at the end), the rescale of the segment, and
  // the segment's scores, then weights (16 a chunk).
  std::vector<float> acc, row_max, row_sum, rescale, w;
  std::vector<char> visible;   // per token and chunk of the segment: a key seen
};

// The keys unit u reads, [first, last] (last -1: none); pos[i] (unless null) its token
// i's position, -1 for a padded token (PAD_SLOT: it attends to nothing, as in the
// reference).
void UnitKeys(const Problem& p, const Unit& u, int32_t* pos, int64_t& first, int64_t& last) {
  const int64_t context = std::min<int64_t>(p.seq_lens[u.request], p.table_width * p.block_size);
  first = std::numeric_limits<int64_t>::max();
  last = -1;
  for (int64_t i = 0; i < u.num_tokens; ++i) {
    const int64_t t = u.first_token + i;
    const int32_t at = p.slots[t] == kPadSlot ? -1 : p.positions[t];
    if (pos != nullptr) pos[i] = at;
    if (at < 0) continue;
    last = std::max<int64_t>(last, std::min<int64_t>(at, context - 1));
    first = std::min<int64_t>(first, p.window > 0 ? std::max<int64_t>(0, at - p.window + 1) : 0);
  }
}

// A unit's keys in order, in chunks of up to 16 of one cache block each: from the start
// of first's block to last.
class ChunkCursor {
 public:
  ChunkCursor(const Problem& p, const Unit& u, int64_t first, int64_t last)
      : p_(p), u_(u), last_(last), b_(first / p.block_size) {}
  // The next chunk's first key, its keys and where they start (elements into k or v, at
  // the unit's first KV head); false past the last.
  bool Next(int64_t& key0, int& m, int64_t& offset) {
    const int64_t bs = p_.block_size;
    if (last_ < 0 || b_ > last_ / bs) return false;
    key0 = b_ * bs + j0_;
    m = static_cast<int>(std::min<int64_t>(16, std::min(bs, last_ + 1 - b_ * bs) - j0_));
    // Out-of-range ids clamp, as a JAX gather does (the engine never writes one).
    const int64_t block =
        std::clamp<int64_t>(p_.tables[u_.request * p_.table_width + b_], 0, p_.num_blocks - 1);
    offset = ((block * bs + j0_) * p_.kv_heads + u_.kv_head) * p_.head_dim;
    j0_ += 16;
    if (j0_ >= std::min(bs, last_ + 1 - b_ * bs)) j0_ = 0, ++b_;
    return true;
  }

 private:
  const Problem& p_;
  const Unit& u_;
  int64_t last_, b_, j0_ = 0;
};

// Up to kSegmentChunks next chunks of a cursor; n of them.
struct Segment {
  int64_t key0[kSegmentChunks], offset[kSegmentChunks];
  int keys[kSegmentChunks];
  int n = 0;
  void Fill(ChunkCursor& chunks) {
    for (n = 0; n < kSegmentChunks && chunks.Next(key0[n], keys[n], offset[n]);) ++n;
  }
};

// Prefetches the cache lines of up to kSegmentChunks chunks (keys of `span` floats each,
// `stride` apart) into L2, a share at each call of Some(): a burst of hundreds of
// prefetches stalls on the full miss queue.
class Prefetch {
 public:
  void Add(const float* base, int keys, int64_t stride, int64_t span) {
    if (count_ == kSegmentChunks || keys <= 0) return;
    regions_[count_++] = {base, keys, stride, (span + 15) / 16};
    total_ += keys * ((span + 15) / 16);
  }
  void Plan(int64_t steps) {
    steps = std::max<int64_t>(steps, 1);
    share_ = (total_ + steps - 1) / steps;
  }
  void Some() { Issue(std::min(total_, done_ + share_)); }
  void Rest() { Issue(total_); }

 private:
  struct Region {
    const float* base;
    int64_t keys, stride, lines;
  };
  void Issue(int64_t end) {
    for (; done_ < end; ++done_) {
      const Region& r = regions_[region_];
      __builtin_prefetch(r.base + key_ * r.stride + line_ * 16, 0, 2);  // to L2
      if (++line_ == r.lines) {
        line_ = 0;
        if (++key_ == r.keys) key_ = 0, ++region_;
      }
    }
  }
  Region regions_[kSegmentChunks];
  int count_ = 0, region_ = 0;
  int64_t total_ = 0, share_ = 0, done_ = 0, key_ = 0, line_ = 0;
};

// The unit's rows attend over their keys: row i is token first_token + i / (heads of the
// unit) and query head kv_head * g + i % (heads of the unit), so that the rows of one KV
// head are consecutive and read each key and value from cache after the first (rows go
// two at a time).
//
// A segment of up to kSegmentChunks chunks at a time, in three passes: the scores of
// every row (K read), the softmax (the running max, rescale and sum updated once a
// segment), the weighted values (V read; each row's output in registers for all the
// segment's keys). While the scores run, this segment's values are prefetched; while the
// values run, the next segment's keys (or the next unit's first ones).
void RunUnit(const Problem& p, const Unit& u, const Unit* next) {
  thread_local Scratch scratch;
  Scratch& sc = scratch;
  const int64_t d = p.head_dim, g = p.group;
  const int64_t unit_heads = u.num_kv_heads * g;
  const int64_t rows = u.num_tokens * unit_heads;
  constexpr int64_t kW = 16 * kSegmentChunks;  // scores of a row in a segment
  sc.pos.resize(u.num_tokens);
  int32_t* pos = sc.pos.data();
  int64_t first_key, last_key;
  UnitKeys(p, u, pos, first_key, last_key);
  sc.acc.assign(rows * d, 0.f);
  sc.row_max.assign(rows, kNegInf);
  sc.row_sum.assign(rows * 16, 0.f);
  sc.rescale.resize(rows);
  sc.w.resize(rows * kW);
  sc.visible.resize(u.num_tokens * kSegmentChunks);
  float* acc = sc.acc.data();
  float* row_max = sc.row_max.data();
  float* row_sum = sc.row_sum.data();
  float* w = sc.w.data();
  char* visible = sc.visible.data();
  const int64_t key_stride = p.kv_heads * d;
  const int64_t span = u.num_kv_heads * d;  // floats of one key for the unit's KV heads
  const int64_t pairs = u.num_tokens * ((unit_heads + 1) / 2);
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  ChunkCursor chunks(p, u, first_key, last_key);
  Segment seg, following;
  seg.Fill(chunks);
  while (seg.n > 0) {
    following.Fill(chunks);
    // Scores, this segment's values prefetched meanwhile.
    Prefetch values;
    for (int i = 0; i < seg.n; ++i) values.Add(p.v + seg.offset[i], seg.keys[i], key_stride, span);
    values.Plan(seg.n * pairs);
    for (int i = 0; i < seg.n; ++i) {
      const int64_t key0 = seg.key0[i];
      const int m = seg.keys[i];
      const I16 key = static_cast<int32_t>(key0) + lane;
      const float* kb = p.k + seg.offset[i];
      for (int64_t t = 0; t < u.num_tokens; ++t) {
        // No key of this chunk for this token (causal, window): skipped in all passes.
        const bool seen_any =
            pos[t] >= key0 && !(p.window > 0 && pos[t] - (key0 + m - 1) >= p.window);
        visible[t * kSegmentChunks + i] = seen_any;
        if (!seen_any) continue;
        I16 seen = (lane < m) & (key <= pos[t]);
        if (p.window > 0) seen &= pos[t] - key < p.window;
        for (int64_t row = t * unit_heads; row < (t + 1) * unit_heads; ++row) {
          const int64_t h = row % unit_heads;  // the row's head in the unit
          const float* q = p.q + ((u.first_token + t) * p.heads + u.kv_head * g + h) * d;
          Store16(w + row * kW + 16 * i,
                  RowScores(q, kb + h / g * d, key_stride, m, d, p.scale, seen));
          if (h % 2 == 1 || h + 1 == unit_heads) values.Some();
        }
      }
    }
    values.Rest();
    // Softmax: the rows' running max, rescale and sums; scores become weights.
    for (int64_t row = 0; row < rows; ++row) {
      const char* vis = visible + row / unit_heads * kSegmentChunks;
      float* wr = w + row * kW;
      V16 most = Splat16(kNegInf);
      for (int i = 0; i < seg.n; ++i)
        if (vis[i]) most = Max16(most, Load16(wr + 16 * i));
      const float new_max = std::max(row_max[row], HorizontalMax16(most));
      if (new_max == kNegInf) {  // no key seen yet: weights 0, nothing rescaled
        sc.rescale[row] = 1.f;
        for (int i = 0; i < seg.n; ++i) Store16(wr + 16 * i, V16{});
        continue;
      }
      // exp(-inf) = 0 at the start. Exp16, not std::exp: GCC does not vectorise it.
      const float rescale = Exp16(Splat16(row_max[row] - new_max))[0];
      sc.rescale[row] = rescale;
      row_max[row] = new_max;
      V16 sum = Load16(row_sum + row * 16) * rescale;
      for (int i = 0; i < seg.n; ++i) {
        if (!vis[i]) continue;
        const V16 weights = Exp16(Load16(wr + 16 * i) - new_max);  // masked keys weigh 0
        Store16(wr + 16 * i, weights);
        sum += weights;
      }
      Store16(row_sum + row * 16, sum);
    }
    // Weighted values, the next keys prefetched meanwhile.
    Prefetch keys;
    if (following.n > 0) {
      for (int i = 0; i < following.n; ++i)
        keys.Add(p.k + following.offset[i], following.keys[i], key_stride, span);
    } else if (next != nullptr) {
      int64_t first, last;
      UnitKeys(p, *next, nullptr, first, last);
      ChunkCursor next_chunks(p, *next, first, last);
      Segment next_seg;
      next_seg.Fill(next_chunks);
      for (int i = 0; i < next_seg.n; ++i)
        keys.Add(p.k + next_seg.offset[i], next_seg.keys[i], key_stride, next->num_kv_heads * d);
    }
    keys.Plan(pairs);
    for (int64_t t = 0; t < u.num_tokens; ++t) {
      ValueRef x;
      x.v = p.v;
      x.offset = seg.offset;
      x.keys = seg.keys;
      x.visible = visible + t * kSegmentChunks;
      x.n = seg.n;
      x.stride = key_stride;
      bool any = false;
      for (int i = 0; i < seg.n; ++i) any |= x.visible[i];
      for (int64_t h = 0; h < unit_heads; h += 2) {
        const int R = std::min<int64_t>(2, unit_heads - h);
        for (int r = 0; r < R; ++r) {
          const int64_t row = t * unit_heads + h + r;
          x.head_offset[r] = (h + r) / g * d;
          x.w[r] = w + row * kW;
          x.acc[r] = acc + row * d;
          x.rescale[r] = sc.rescale[row];
        }
        if (any) {
          if (R == 2) {
            jaxserve::AddValues<2>(x, d);
          } else {
            jaxserve::AddValues<1>(x, d);
          }
        }
        keys.Some();
      }
    }
    keys.Rest();
    seg = following;
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
      const int64_t context = std::min<int64_t>(p.seq_lens[r], p.table_width * p.block_size);
      work += n * p.heads * p.head_dim * context;
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
