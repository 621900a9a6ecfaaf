// Causal GQA attention of a flat token batch over the paged KV cache, on the CPU.
//
// The XLA FFI handler behind `jaxserve.kernels.cpu_attention` (its docstring has the
// contract and why it exists). A work unit is (request, KV head, tile of up to kTile
// consecutive query tokens of the request): its tokens' g query heads each are the rows
// that attend together, so each key and value of the request is read once per tile,
// in place through the block table, and nothing is gathered or padded. Keys are taken a
// cache block at a time with the online softmax of FlashAttention (Dao et al. 2022):
// scores of the block for every row, then each row's running max, sum and output are
// rescaled and updated. Work units are shared with XLA's intra-op thread pool
// (cpu_work_sharing.h) when the step has enough work to pay for it.

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
  int32_t request, kv_head, first_token, num_tokens;
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

// The unit's rows (token i / g, head kv_head * g + i % g) attend over their keys.
void RunUnit(const Problem& p, const Unit& u) {
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size;
  const int64_t rows = u.num_tokens * g;
  std::vector<const float*> qrow(rows);
  std::vector<float*> orow(rows);
  std::vector<int32_t> pos(rows);
  const int64_t seq_len = p.seq_lens[u.request];
  const int64_t context = std::min<int64_t>(seq_len, p.table_width * bs);  // keys [0, context)
  int64_t first_key = std::numeric_limits<int64_t>::max(), last_key = -1;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = u.first_token + i / g, head = u.kv_head * g + i % g;
    qrow[i] = p.q + (t * p.heads + head) * d;
    orow[i] = p.out + (t * p.heads + head) * d;
    // A padded token (PAD_SLOT) attends to nothing, as in the reference.
    pos[i] = p.slots[t] == kPadSlot ? -1 : p.positions[t];
    if (pos[i] < 0) continue;
    last_key = std::max<int64_t>(last_key, std::min<int64_t>(pos[i], context - 1));
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos[i] - p.window + 1) : 0;
    first_key = std::min(first_key, lo);
  }
  std::vector<float> acc(rows * d, 0.f), row_max(rows, kNegInf), row_sum(rows, 0.f);
  std::vector<float> score(rows * bs);
  // Where block b of the request's table starts, for this unit's KV head (elements into
  // k or v). Out-of-range ids clamp, as a JAX gather does (the engine never writes one).
  auto block_offset = [&](int64_t b) {
    const int64_t block =
        std::clamp<int64_t>(p.tables[u.request * p.table_width + b], 0, p.num_blocks - 1);
    return (block * bs * p.kv_heads + u.kv_head) * d;
  };
  for (int64_t b = first_key / bs; last_key >= 0 && b <= last_key / bs; ++b) {
    const int64_t key0 = b * bs, n = std::min(bs, last_key + 1 - key0);
    const float* kb = p.k + block_offset(b);
    const float* vb = p.v + block_offset(b);
    const int64_t key_stride = p.kv_heads * d;
    if (b < last_key / bs) {  // the next block's keys and values, while this one computes
      const float* kn = p.k + block_offset(b + 1);
      const float* vn = p.v + block_offset(b + 1);
      for (int64_t j = 0; j < bs; ++j)
        for (int64_t c = 0; c < d; c += 16) {
          __builtin_prefetch(kn + j * key_stride + c);
          __builtin_prefetch(vn + j * key_stride + c);
        }
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* s = score.data() + i * bs;
      float block_max = kNegInf;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = key0 + j;
        const bool seen = key <= pos[i] && (p.window <= 0 || pos[i] - key < p.window);
        s[j] = seen ? Dot(qrow[i], kb + j * key_stride, d) * p.scale : kNegInf;
        block_max = std::max(block_max, s[j]);
      }
      if (block_max == kNegInf) continue;  // no key of this block for this row
      const float new_max = std::max(row_max[i], block_max);
      const float rescale = std::exp(row_max[i] - new_max);  // exp(-inf) = 0 at the start
      row_max[i] = new_max;
      float* a = acc.data() + i * d;
      float sum = row_sum[i] * rescale;
      for (int64_t c = 0; c < d; ++c) a[c] *= rescale;
      for (int64_t j = 0; j < n; ++j) s[j] -= new_max;  // -inf stays -inf
      ExpInPlace(s, n);  // masked keys weigh 0
      for (int64_t j = 0; j < n; ++j) {
        const float w = s[j];
        if (w == 0.f) continue;
        sum += w;
        const float* vj = vb + j * key_stride;
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
  const int32_t* qsl = query_start_loc.typed_data();
  int64_t work = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t begin = std::clamp<int64_t>(qsl[r], 0, num_tokens);
    const int64_t end = std::clamp<int64_t>(qsl[r + 1], begin, num_tokens);
    if (p.seq_lens[r] <= 0) continue;  // a padded row: its tokens attend to nothing
    for (int64_t t = begin; t < end; t += kTile) {
      const int32_t n = static_cast<int32_t>(std::min(kTile, end - t));
      for (int64_t h = 0; h < p.kv_heads; ++h)
        p.units.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h),
                           static_cast<int32_t>(t), n});
      work += n * p.heads * p.head_dim * std::min<int64_t>(p.seq_lens[r], p.table_width * p.block_size);
    }
  }
  const int64_t units = static_cast<int64_t>(p.units.size());
  if (work < kMinParallelWork || units < 2) {
    for (const Unit& u : p.units) RunUnit(p, u);
    return ffi::Error::Success();
  }
  jaxserve::ShareUnits(pool, units, [state](int64_t u) { RunUnit(*state, state->units[u]); });
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
