"""What the two paged attention kernels share: the query layout, the work list, the
launch settings, and the pipeline of one CTA (its SMEM ring, the TMA warpgroup that
fills it, and the loop by which the compute warpgroup walks the same units).

`paged_attention.py` is the entry point; `paged_attention_ragged.py` (mixed prefill and
decode) and `paged_attention_decode.py` (one query token per request) are the kernels;
`paged_attention_flash.py` is the inner loop both run over a unit's key stages.

A work unit is (item, KV split, KV head). An item is a tile of consecutive query tokens
of one request (`plan_work_items`); a KV split is a contiguous range of its key stages
(flash-decoding, Dao et al. 2023; the ragged kernel uses one split). CTAs are persistent
(`launch`) and walk the units; in each, warpgroup 1 (`stream_qkv`) streams the unit's
query rows and its key/value blocks through a ring of `num_stages` buffers, and
warpgroup 0 computes (`consume_units`); `run_pipelined` allocates the ring and starts
both. The ring runs across unit boundaries, so the loads of the next unit overlap the
end of the current one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxserve.kernels.tile_table import AttentionConfig
from jaxserve.models.base import AttentionMetadata

ROW_TILING = 8  # TMA into swizzled SMEM moves whole 8-row tiles
MASK_VALUE = -1e30  # finite, so exp2(mask - max) is 0 and never NaN
LOG2E = math.log2(math.e)
# Item fields (rows of the [fields, items] metadata array).
REQ, FIRST_TOK, NUM_TOKS, POS_FIRST, NUM_KEYS, SEQ_LEN, FIRST_STAGE = range(7)
NUM_FIELDS = 7


@dataclass(frozen=True, slots=True)
class QueryLayout:
    """Where the query rows of (token t, KV head h) live in the 2-D [rows, D] view.

    Rows of (t, h) are [t * token_stride + h * head_stride, + rows_per_token). With g
    query heads per KV head: if g is a multiple of 8, q itself ([T * H, D]) is used
    (token_stride H, head_stride g); otherwise q is repacked to [KVH, T, gp, D] with
    gp = g rounded up to 8 (token_stride gp, head_stride T * gp).
    """

    rows_per_token: int
    token_stride: int
    head_stride: int

    def rows(self, token, head) -> pl.Slice:
        """The rows of (token, head) in the [rows, D] query (and output) view."""
        row = token * self.token_stride + head * self.head_stride
        return pl.ds(pl.multiple_of(row, ROW_TILING), self.rows_per_token)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The static settings of one kernel launch (hashable: part of the compiled kernel).

    config: tiling (block_kv keys per stage, ring depth); layout: where the query rows
    live; scale: softmax scale (natural-log units); sliding_window: if set, a query at
    pos sees keys with pos - key < window.
    """

    config: AttentionConfig
    layout: QueryLayout
    scale: float
    sliding_window: int | None


class KernelInputs(NamedTuple):
    """The operands of both kernels, in the order their bodies take the refs.

    meta, counts: `plan_work_items`; block_tables: [R, max_blocks] int32; q_rows:
    [rows, D] in the launch's `QueryLayout`; k_cache, v_cache: [num_blocks, block_size,
    KVH, D] in q's dtype.
    """

    meta: jax.Array
    counts: jax.Array
    block_tables: jax.Array
    q_rows: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array


def plan_work_items(
    metadata: AttentionMetadata,
    positions: jax.Array,
    num_tokens: int,
    tokens_per_tile: int,
    sliding_window: int | None,
    block_kv: int,
) -> tuple[jax.Array, jax.Array]:
    """Tiles of query tokens, one request each, and what each tile needs (tiny XLA ops).

    Tile j of request r covers its tokens [qs + j * tpt, min(qs + (j + 1) * tpt, qe)),
    tpt = tokens_per_tile. Tokens of one request in a step have consecutive positions
    (the engine's contract), so the tile's query positions are positions[first] + 0, 1..

    Returns:
      meta: [7, max_items] int32, fields (req, first_tok, num_toks, pos_first, num_keys,
        seq_len, first_stage): the item's tokens are [first_tok, first_tok + num_toks),
        it needs keys [first_stage * block_kv, num_keys) of a context of seq_len keys.
        Entries past num_items have num_toks = 0.
      counts: [2] int32, (num_items, covered = tokens in some request).
    """
    qsl = jnp.clip(metadata.query_start_loc.astype(jnp.int32), 0, num_tokens)
    num_reqs = qsl.shape[0] - 1
    starts, ends = qsl[:-1], qsl[1:]
    q_lens = jnp.maximum(ends - starts, 0)
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_ends = jnp.cumsum(tiles)
    max_items = pl.cdiv(num_tokens, tokens_per_tile) + num_reqs
    i = jnp.arange(max_items, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(tile_ends, i, side="right"), num_reqs - 1)
    req = req.astype(jnp.int32)
    first_tok = starts[req] + (i - (tile_ends[req] - tiles[req])) * tokens_per_tile
    num_toks = jnp.clip(ends[req] - first_tok, 0, tokens_per_tile)
    num_toks = jnp.where(i < tile_ends[-1], num_toks, 0)
    first_tok = jnp.clip(first_tok, 0, num_tokens - 1)
    last_tok = jnp.clip(first_tok + num_toks - 1, 0, num_tokens - 1)
    pos_first = positions[first_tok].astype(jnp.int32)
    seq_len = metadata.seq_lens.astype(jnp.int32)[req]
    num_keys = jnp.minimum(positions[last_tok].astype(jnp.int32) + 1, seq_len)
    num_keys = jnp.maximum(num_keys, 1)
    if sliding_window is None:
        first_stage = jnp.zeros_like(num_keys)
    else:
        first_stage = jnp.maximum(pos_first - sliding_window + 1, 0) // block_kv
    meta = jnp.stack([req, first_tok, num_toks, pos_first, num_keys, seq_len, first_stage])
    counts = jnp.stack([tile_ends[-1], qsl[-1]])
    return meta.astype(jnp.int32), counts.astype(jnp.int32)


def swizzled(minor: int, dtype) -> tuple:
    """SMEM transforms for a [rows, minor] wgmma operand: 8-row tiles, widest swizzle."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return (
        plgpu.TilingTransform((ROW_TILING, swizzle // itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


@dataclass(frozen=True)
class WorkUnits:
    """The units of one kernel launch: unit `lin` = ((item * splits) + split) * KVH + head.

    meta_gmem: the [7, max_items] item metadata; num_items: traced count of items.
    """

    meta_gmem: jax.Array
    num_items: jax.Array
    num_kv_heads: int
    num_splits: int
    block_kv: int

    @property
    def grid(self) -> tuple[jax.Array]:
        return (self.num_items * self.num_splits * self.num_kv_heads,)

    def unpack(self, lin):
        """(fields, split, head) of unit `lin`."""
        head = lax.rem(lin, self.num_kv_heads)
        rest = lax.div(lin, self.num_kv_heads)
        split = lax.rem(rest, self.num_splits)
        item = lax.div(rest, self.num_splits)
        return [self.meta_gmem[f, item] for f in range(NUM_FIELDS)], split, head

    def stages(self, fields, split):
        """[first, last) key stages of this split: an even share of the item's stages."""
        first = fields[FIRST_STAGE]
        last = lax.div(fields[NUM_KEYS] + self.block_kv - 1, self.block_kv)
        if self.num_splits == 1:
            return first, last
        share = lax.div(last - first + self.num_splits - 1, self.num_splits)
        begin = jnp.minimum(first + split * share, last)
        return begin, jnp.minimum(begin + share, last)


def stream_qkv(
    units: WorkUnits,
    config: AttentionConfig,
    layout: QueryLayout,
    tokens_per_tile: int,
    block_tables_gmem,
    q_gmem,
    k_gmem,
    v_gmem,
    ring: Ring,
) -> None:
    """The TMA warpgroup: per unit, the query rows into a 2-slot buffer, then the unit's
    key/value stages into the `num_stages` ring.

    A stage is block_kv keys: block_kv / block_size boxes of one KV block each (or one
    box inside a larger block), at ids read from the block table. Boxes past the keys
    the item needs read the null block 0 (kept allocated by the cache contract), so
    they cost an L2 hit, not HBM traffic.
    """
    q_smem, k_smem, v_smem = ring.q_smem, ring.k_smem, ring.v_smem
    q_ready, q_free, k_ready, v_ready, kv_free = ring.barriers
    _, block_size, _, _ = k_gmem.shape
    max_blocks = block_tables_gmem.shape[1]
    block_kv, num_stages = config.block_kv, config.num_stages
    box_rows = min(block_kv, block_size)
    boxes = block_kv // box_rows

    def load_stage(stage, step, req, head, num_keys):
        slot = lax.rem(step, num_stages)

        @pl.when(step >= num_stages)
        def _():
            plgpu.barrier_wait(kv_free.at[slot])

        for j in range(boxes):
            key = stage * block_kv + j * box_rows
            block_idx = jnp.minimum(lax.div(key, block_size), max_blocks - 1)
            block = jnp.where(key < num_keys, block_tables_gmem[req, block_idx], 0)
            offset = pl.multiple_of(lax.rem(key, block_size), ROW_TILING)
            src = (block, pl.ds(offset, box_rows), head)
            dst = (slot, pl.ds(j * box_rows, box_rows))
            plgpu.copy_gmem_to_smem(k_gmem.at[src], k_smem.at[dst], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[src], v_smem.at[dst], v_ready.at[slot])
        return step + 1

    @plgpu.nd_loop(units.grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
    def _units(loop_info, carry):
        step, count = carry
        fields, split, head = units.unpack(loop_info.index[0])
        q_slot = lax.rem(count, 2)

        @pl.when(count >= 2)
        def _():
            plgpu.barrier_wait(q_free.at[q_slot])

        # A fixed number of boxes per tile (the barrier counts arrivals): rows of tokens
        # past the item repeat its last token and are never stored.
        last_tok = fields[FIRST_TOK] + fields[NUM_TOKS] - 1
        for i in range(tokens_per_tile):
            token = jnp.minimum(fields[FIRST_TOK] + i, last_tok)
            plgpu.copy_gmem_to_smem(
                q_gmem.at[layout.rows(token, head)],
                q_smem.at[q_slot, pl.ds(i * layout.rows_per_token, layout.rows_per_token)],
                q_ready.at[q_slot],
            )
        first, last = units.stages(fields, split)
        body = functools.partial(load_stage, req=fields[REQ], head=head, num_keys=fields[NUM_KEYS])
        return lax.fori_loop(first, last, body, step), count + 1

    # Observe the releases not waited for yet, so that every barrier ends quiescent.
    step, count = _units

    @pl.loop(jnp.maximum(step - num_stages, 0), step)
    def _drain_kv(s):
        plgpu.barrier_wait(kv_free.at[lax.rem(s, num_stages)])

    @pl.loop(jnp.maximum(count - 2, 0), count)
    def _drain_q(i):
        plgpu.barrier_wait(q_free.at[lax.rem(i, 2)])


def ring_barriers(config: AttentionConfig, block_size: int, tokens_per_tile: int) -> tuple:
    """(q_ready, q_free, k_ready, v_ready, kv_free) barriers of `stream_qkv`."""
    boxes = config.block_kv // min(config.block_kv, block_size)
    return (
        plgpu.Barrier(num_arrivals=tokens_per_tile, num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=boxes, num_barriers=config.num_stages),
        plgpu.Barrier(num_arrivals=boxes, num_barriers=config.num_stages),
        plgpu.Barrier(num_barriers=config.num_stages),
    )


@dataclass(frozen=True)
class Ring:
    """The SMEM buffers and barriers one CTA's warpgroups share (see `stream_qkv`)."""

    q_smem: jax.Array  # [2, tile rows, D]
    k_smem: jax.Array  # [num_stages, block_kv, D]
    v_smem: jax.Array
    p_smem: jax.Array  # [tile rows, block_kv]
    q_ready: jax.Array
    q_free: jax.Array
    k_ready: jax.Array
    v_ready: jax.Array
    kv_free: jax.Array

    @property
    def barriers(self) -> tuple:
        return (self.q_ready, self.q_free, self.k_ready, self.v_ready, self.kv_free)


def consume_units(units: WorkUnits, ring: Ring, body: Callable[..., jax.Array]) -> None:
    """The compute warpgroup's side of `stream_qkv`: walk this CTA's units in the same
    order, waiting for each unit's query rows before calling

        body(step, q_slot, fields, split, head) -> next ring step

    `body` consumes the unit's key stages from ring step `step` and must arrive on
    `ring.q_free[q_slot]` once it no longer reads the query slot (which may be after it
    used the slot to stage the output).
    """

    @plgpu.nd_loop(units.grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
    def _units(loop_info, carry):
        step, count = carry
        fields, split, head = units.unpack(loop_info.index[0])
        q_slot = lax.rem(count, 2)
        plgpu.barrier_wait(ring.q_ready.at[q_slot])
        return body(step, q_slot, fields, split, head), count + 1


def run_pipelined(
    units: WorkUnits,
    spec: AttentionSpec,
    tokens_per_tile: int,
    tile_rows: int,
    block_tables_gmem,
    q_gmem,
    k_gmem,
    v_gmem,
    compute: Callable[..., None],
    *extra_scratch,
) -> None:
    """Allocate one CTA's ring and run its two warpgroups: warpgroup 1 streams Q, K and
    V (`stream_qkv`), warpgroup 0 runs `compute(ring, *extra_refs)`.

    The ring holds 2 query slots of [tile_rows, D], `num_stages` K and V slots of
    [block_kv, D], and a [tile_rows, block_kv] buffer for P, all in q's dtype and
    swizzled for wgmma. `extra_scratch` (SMEM types) are allocated beside it and handed
    to `compute` in order.
    """
    config = spec.config
    head_dim, dtype = q_gmem.shape[1], q_gmem.dtype
    block_size, block_kv = k_gmem.shape[1], config.block_kv

    def scoped(q_smem, k_smem, v_smem, p_smem, *rest):
        extra_refs, barriers = rest[: len(extra_scratch)], rest[len(extra_scratch) :]
        ring = Ring(q_smem, k_smem, v_smem, p_smem, *barriers)
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _stream():
            stream_qkv(
                units, config, spec.layout, tokens_per_tile, block_tables_gmem, q_gmem, k_gmem,
                v_gmem, ring,
            )  # fmt: skip

        pl.when(wg == 0)(lambda: compute(ring, *extra_refs))

    kv_ring = plgpu.SMEM(
        (config.num_stages, block_kv, head_dim), dtype, transforms=swizzled(head_dim, dtype)
    )
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, tile_rows, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        kv_ring,
        kv_ring,
        plgpu.SMEM((tile_rows, block_kv), dtype, transforms=swizzled(block_kv, dtype)),
        *extra_scratch,
        *ring_barriers(config, block_size, tokens_per_tile),
        collective_axes="wg",
    )


def launch(body: Callable[..., None], out_type, num_sms: int, inputs: KernelInputs):
    """Run `body(*input_refs, *out_refs)` as a persistent kernel: `num_sms` CTAs (grid
    axis "sm") of two warpgroups (axis "wg"), with Mosaic GPU's approximate math (fast
    exp2 and division, enough for a float32 softmax compared at bf16 tolerance).

    Returns the outputs of `out_type` (a ShapeDtypeStruct or a tuple of them)."""
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    return kernel(*inputs)
