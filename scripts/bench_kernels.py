"""Benchmark jaxserve's Pallas kernels on one GPU against XLA, JAX's example Mosaic GPU
kernel, tokamax, and the machine's floor; print one table and write it as JSON.

    python scripts/bench_kernels.py --out bench_kernels.json      # one GPU, < 5 minutes
    python scripts/bench_kernels.py --sweep --out sweep.json      # tile-table candidates
    JAX_PLATFORMS=cpu python scripts/bench_kernels.py --dry-run   # smoke test on the CPU

What it measures, in one run:
- ceilings: device copy bandwidth (a 2 GiB elementwise copy, bytes read + written) and
  bf16 matmul rate (8192^3, float32 accumulation);
- MoE grouped matmul on Qwen3-30B-A3B expert shapes (128 experts, top-8, hidden 2048,
  moe_intermediate 768) at T = 16 .. 4096 tokens, tokens routed uniformly at random:
  the gate+up projection as one [128, 2048, 1536] matmul for jaxserve's kernel,
  `lax.ragged_dot`, JAX's `ragged_dot_mgpu` example and tokamax's `ragged_dot`
  (mosaic); then jaxserve's fused gate+up+SiLU kernel, the down projection, and the
  whole expert FFN;
- paged decode attention at batch 64 and 256 (and 8, where keys are split over SMs)
  with contexts of 1k and 8k tokens (32 query heads, 4 KV heads, head dim 128, block
  size 16): jaxserve's kernel as the model calls it, the same with the decode-only
  promise (max_query_len=1), and the XLA reference.
Rows run in that order of need: ceilings; gate+up against the alternatives at every T;
decode attention at batch 64 and 256; jaxserve's other grouped-matmul rows; batch 8.
Each row has its floor, max(bytes / copy bandwidth, FLOPs / matmul rate), and the ratio.

Time: 70 measurements, each one compilation (~1-3 s) and ~0.4 s of timed calls (0.2 s
by wall clock, then as many iterations under CUPTI), ~3-4 minutes on an H200. No row
starts after --budget-s (default 270 s; later rows say "skipped"), and the JSON is
rewritten after every row, so a run stopped from outside keeps what it measured.
Times are device time from CUPTI (sum of the kernels of one call, median of iterations);
the JSON also has wall-clock time per call and the per-kernel split. Every measurement is
isolated: a failure is recorded in its row and the run goes on.

tokamax is not on the GPU image: install its wheel and the dependencies the image lacks
with `pip install --no-deps --target DIR` (never with its dependencies: they would shadow
the image's jax) and pass `--extra-path DIR`; scripts/README.md lists the wheels and
scripts/gpu_check.sh does this. Without it that column says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Problem sizes of one run (full size on a GPU, tiny for --dry-run)."""

    experts: int = 128
    top_k: int = 8
    hidden: int = 2048
    inter: int = 768
    tokens: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    batches: tuple[int, ...] = (64, 256)
    split_batches: tuple[int, ...] = (8,)  # the split-KV regime, timed last
    contexts: tuple[int, ...] = (1024, 8192)
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    copy_bytes: int = 2 << 30
    matmul_dim: int = 8192


DRY_RUN = Shapes(
    experts=8,
    top_k=2,
    hidden=128,
    inter=128,
    tokens=(4, 40),
    batches=(3,),
    split_batches=(1,),
    contexts=(64, 136),
    heads=16,
    kv_heads=2,
    head_dim=64,
    block_size=8,
    copy_bytes=1 << 22,
    matmul_dim=256,
)


@dataclasses.dataclass
class Row:
    section: str
    case: str
    impl: str
    time_us: float | None = None
    wall_us: float | None = None
    floor_us: float | None = None
    kernels: list | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.time_us is None or not self.floor_us:
            return None
        return self.time_us / self.floor_us


class Bench:
    """Times jitted calls; CUPTI device time on a GPU, wall clock elsewhere."""

    def __init__(
        self,
        *,
        use_cupti: bool,
        budget_s: float,
        min_time_s: float,
        on_row: Callable[[], None] = lambda: None,
    ):
        self.use_cupti = use_cupti
        self.cupti_error: str | None = None
        self.deadline = time.monotonic() + budget_s
        self.min_time_s = min_time_s
        self.rows: list[Row] = []
        self.on_row = on_row  # called after every row (the JSON is rewritten)

    def add(self, row: Row) -> Row:
        """Record a row measured (or skipped) elsewhere."""
        self.rows.append(row)
        print(format_row(row), flush=True)
        self.on_row()
        return row

    def time(self, fn: Callable, *args) -> tuple[float | None, float, list | None]:
        """(device_us or None, wall_us, [(kernel, us), ...] of one call)."""
        import jax  # noqa: PLC0415

        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*args))  # compile + first run
        iters = 1
        if self.min_time_s > 0:
            start = time.perf_counter()
            jax.block_until_ready(jitted(*args))
            once = time.perf_counter() - start
            iters = int(min(max(self.min_time_s / max(once, 1e-6), 3), 100))
        # Back-to-back asynchronous calls: per-call wall time approaches device time
        # once a call outlasts its dispatch.
        start = time.perf_counter()
        outs = [jitted(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        wall_us = (time.perf_counter() - start) / iters * 1e6
        del outs
        if not self.use_cupti:
            return None, wall_us, None
        try:
            from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415

            _, per_iter = profiler.measure(jitted, aggregate=False, iterations=iters)(*args)
        except Exception as e:  # noqa: BLE001 -- CUPTI missing: keep going on wall clock
            self.use_cupti = False
            self.cupti_error = f"{type(e).__name__}: {e}"
            print(f"CUPTI unavailable ({self.cupti_error}); timing by wall clock", flush=True)
            return None, wall_us, None
        if not per_iter:
            return None, wall_us, None
        totals = [sum(ms for _, ms in kernels) * 1e3 for kernels in per_iter]
        kernels = [(name, ms * 1e3) for name, ms in per_iter[len(per_iter) // 2]]
        return statistics.median(totals), wall_us, kernels

    def run(self, section: str, case: str, impl: str, floor_us: float | None, make: Callable):
        """Time `make()` -> (fn, args) into a row; record errors instead of raising."""
        row = Row(section, case, impl, floor_us=floor_us)
        self.rows.append(row)
        if time.monotonic() > self.deadline:
            row.note = "skipped: time budget spent"
            return row
        try:
            fn, args = make()
            device_us, row.wall_us, row.kernels = self.time(fn, *args)
            row.time_us = device_us if device_us is not None else row.wall_us
        except Exception as e:  # noqa: BLE001 -- one failure must not lose the rest
            row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            traceback.print_exc(limit=3, file=sys.stderr)
        print(format_row(row), flush=True)
        self.on_row()
        return row


def job(fn: Callable, *args) -> Callable:
    """A measurement: `fn` applied to `args` (bound now, not at call time)."""
    return lambda: (fn, args)


# --- ceilings -------------------------------------------------------------------------


def measure_ceilings(bench: Bench, shapes: Shapes) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    n = shapes.copy_bytes // 4
    copy = bench.run(
        "ceiling",
        f"copy {shapes.copy_bytes >> 20} MiB",
        "xla",
        None,
        lambda: (lambda x: x * 2.0, (jnp.ones((n,), jnp.float32),)),
    )
    d = shapes.matmul_dim
    key = jax.random.key(0)

    def make_matmul():
        a = jax.random.normal(key, (d, d), jnp.bfloat16)
        fn = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)  # noqa: E731
        return fn, (a, a)

    matmul = bench.run("ceiling", f"matmul {d}^3 bf16", "xla", None, make_matmul)
    bandwidth = 2 * shapes.copy_bytes / (copy.time_us * 1e-6) if copy.time_us else None
    rate = 2 * d**3 / (matmul.time_us * 1e-6) if matmul.time_us else None
    copy.note = f"{bandwidth / 1e12:.2f} TB/s" if bandwidth else copy.note
    matmul.note = f"{rate / 1e12:.0f} TFLOP/s" if rate else matmul.note
    return {"copy_bytes_per_s": bandwidth, "matmul_flops_per_s": rate}


def floor_us(ceilings: dict, bytes_moved: float, flops: float) -> float | None:
    bw, rate = ceilings.get("copy_bytes_per_s"), ceilings.get("matmul_flops_per_s")
    if not bw or not rate:
        return None
    return max(bytes_moved / bw, flops / rate) * 1e6


# --- grouped matmul -------------------------------------------------------------------


def route(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """Rows per expert when each token picks top_k distinct experts uniformly at random."""
    choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(choice.ravel(), minlength=experts).astype(np.int32)


def gmm_bytes(m: int, k: int, n: int, group_sizes: np.ndarray, weights: int = 1) -> float:
    """HBM bytes of x @ w[g]: x, the weights of experts with rows, the output (bf16)."""
    active = int(np.count_nonzero(group_sizes))
    return 2.0 * (m * k + weights * active * k * n + m * n)


def tokamax_ragged_dot():
    """tokamax's ragged_dot as f(x, w, group_sizes), or None with the reason."""
    try:
        import tokamax  # noqa: PLC0415
    except ImportError as e:
        return None, f"tokamax not importable ({e}); see --extra-path"

    def call(x, w, group_sizes):
        return tokamax.ragged_dot(x, w, group_sizes=group_sizes, implementation="mosaic")

    return call, f"tokamax {getattr(tokamax, '__version__', '?')}"


def bench_grouped_matmul(
    bench: Bench, shapes: Shapes, ceilings: dict, interpret: bool
) -> list[Callable[[], None]]:
    """Time the gate+up grouped matmul at every T against lax.ragged_dot, ragged_dot_mgpu
    and tokamax now; return the jaxserve-only rows (fused gate+up+SiLU, down projection,
    whole FFN) as calls to run after the attention rows, which the issue asks for first."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    e, h, i = shapes.experts, shapes.hidden, shapes.inter
    keys = jax.random.split(jax.random.key(1), 4)
    w_gate_up = jax.random.normal(keys[0], (e, h, 2 * i), jnp.bfloat16) * 0.02
    w_gate, w_up = w_gate_up[:, :, :i], w_gate_up[:, :, i:]
    w_down = jax.random.normal(keys[1], (e, i, h), jnp.bfloat16) * 0.02
    tokamax_call, tokamax_note = tokamax_ragged_dot()
    rng = np.random.default_rng(0)
    later = []
    for tokens in shapes.tokens:
        m = tokens * shapes.top_k
        sizes_np = route(rng, tokens, e, shapes.top_k)
        sizes = jnp.asarray(sizes_np)
        x = jax.random.normal(keys[2], (m, h), jnp.bfloat16)
        case = f"T={tokens} M={m}"
        gu_floor = floor_us(ceilings, gmm_bytes(m, h, 2 * i, sizes_np), 2.0 * m * h * 2 * i)
        section = f"gmm gate_up [{e},{h},{2 * i}]"
        _versus_ragged_dot(bench, section, case, gu_floor, x, w_gate_up, sizes)
        # (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
        for cfg in ((64, 128, 64, 4, 1), (128, 128, 64, 4, 1)):
            bench.run(
                section,
                case,
                f"ragged_dot_mgpu {cfg}",
                gu_floor,
                functools.partial(_mgpu_example, x, w_gate_up, sizes, cfg),
            )
        if tokamax_call is None:
            bench.add(Row(section, case, "tokamax", floor_us=gu_floor, note=tokamax_note))
        else:
            row = bench.run(
                section,
                case,
                "tokamax (mosaic)",
                gu_floor,
                job(tokamax_call, x, w_gate_up, sizes),
            )
            row.note = f"{row.note} {tokamax_note}".strip()
        weights = (w_gate, w_up, w_down)
        later.append(
            functools.partial(_bench_expert_ffn, bench, shapes, ceilings, interpret, tokens, x,
                              sizes_np, weights)
        )  # fmt: skip
    return later


def _versus_ragged_dot(bench: Bench, section: str, case: str, floor, x, w, sizes) -> None:
    """Rows for jaxserve's grouped matmul and XLA's lax.ragged_dot on x @ w[g]."""
    import jax  # noqa: PLC0415

    from jaxserve.kernels import grouped_matmul as gmm  # noqa: PLC0415

    bench.run(section, case, "jaxserve", floor, job(gmm.grouped_matmul, x, w, sizes))
    bench.run(section, case, "lax.ragged_dot", floor, job(jax.lax.ragged_dot, x, w, sizes))


def _bench_expert_ffn(bench, shapes, ceilings, interpret, tokens, x, sizes_np, weights):
    """jaxserve's fused gate+up+SiLU kernel, the down projection (against
    lax.ragged_dot) and the whole expert FFN at one T."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxserve.kernels import grouped_matmul as gmm  # noqa: PLC0415
    from jaxserve.kernels.grouped_matmul_ref import moe_ffn_ref  # noqa: PLC0415

    e, h, i = shapes.experts, shapes.hidden, shapes.inter
    w_gate, w_up, w_down = weights
    m = x.shape[0]
    sizes = jnp.asarray(sizes_np)
    hidden = jax.random.normal(jax.random.key(3), (m, i), jnp.bfloat16)
    case = f"T={tokens} M={m}"
    fused_floor = floor_us(ceilings, gmm_bytes(m, h, i, sizes_np, weights=2), 2.0 * m * h * 2 * i)
    section = f"gate+up+SiLU [{e},{h},{i}]x2"
    bench.run(
        section,
        case,
        "jaxserve fused",
        fused_floor,
        job(gmm.grouped_matmul_gate_up, x, w_gate, w_up, sizes),
    )
    down_floor = floor_us(ceilings, gmm_bytes(m, i, h, sizes_np), 2.0 * m * i * h)
    section = f"gmm down [{e},{i},{h}]"
    _versus_ragged_dot(bench, section, case, down_floor, hidden, w_down, sizes)
    ffn_bytes = gmm_bytes(m, h, i, sizes_np, weights=2) + gmm_bytes(m, i, h, sizes_np)
    # The [M, I] intermediate is written once and read once, as the fused path does.
    ffn_floor = floor_us(ceilings, ffn_bytes, 2.0 * m * 3 * h * i)
    section = "moe_ffn (gate,up,down)"
    for fuse in (True, False):
        fn = functools.partial(gmm.moe_ffn, fuse_gate_up=fuse)
        bench.run(
            section,
            case,
            f"jaxserve fuse_gate_up={fuse}",
            ffn_floor,
            job(fn, x, sizes, w_gate, w_up, w_down),
        )
    if interpret:
        bench.run(
            section,
            case,
            "reference (jnp)",
            ffn_floor,
            job(moe_ffn_ref, x, sizes, w_gate, w_up, w_down),
        )


def _mgpu_example(x, w, sizes, cfg):
    """JAX's ragged_dot_mgpu example with one of its tile configs."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415

    block_m, block_n, block_k, steps, grid_block_n = cfg
    fn = functools.partial(
        ragged_dot_mgpu.ragged_dot,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        max_concurrent_steps=steps,
        grid_block_n=grid_block_n,
    )
    return (lambda x, w, s: fn(x, w, group_sizes=s)), (x, w, sizes)


# --- paged attention ------------------------------------------------------------------


def decode_batch(batch: int, context: int, block_size: int, rng: np.random.Generator):
    """A decode step: `batch` requests of `context` keys each, one query token each,
    blocks in random order (block 0 is the null block)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxserve.models.base import AttentionMetadata  # noqa: PLC0415

    per_req = math.ceil(context / block_size)
    blocks = 1 + rng.permutation(batch * per_req).astype(np.int32)
    tables = blocks.reshape(batch, per_req)
    positions = np.full(batch, context - 1, np.int32)
    slots = tables[:, -1] * block_size + (context - 1) % block_size
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.full((batch,), context, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
        token_req=jnp.arange(batch, dtype=jnp.int32),
    )
    return jnp.asarray(positions), metadata, 1 + batch * per_req


def attention_floor(ceilings: dict, shapes: Shapes, batch: int, context: int) -> float | None:
    """Decode attention reads every key and value once (bf16), q, the output, and the
    block tables; 4 FLOPs per (query head, key, dim)."""
    kv_bytes = 2.0 * 2 * batch * context * shapes.kv_heads * shapes.head_dim
    other = 2.0 * 2 * batch * shapes.heads * shapes.head_dim
    tables = 4.0 * batch * math.ceil(context / shapes.block_size)
    flops = 4.0 * batch * shapes.heads * context * shapes.head_dim
    return floor_us(ceilings, kv_bytes + other + tables, flops)


def bench_attention(bench: Bench, shapes: Shapes, ceilings: dict, batches: tuple[int, ...]):
    """Decode attention at `batches` x shapes.contexts: jaxserve's kernel as the model
    calls it, with the decode-only promise, and the XLA reference."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxserve.kernels import paged_attention, tile_table  # noqa: PLC0415
    from jaxserve.kernels.paged_attention_ref import paged_attention_ref  # noqa: PLC0415

    rng = np.random.default_rng(1)
    d, kvh, heads, bs = shapes.head_dim, shapes.kv_heads, shapes.heads, shapes.block_size
    scale = d**-0.5
    for batch in batches:
        for context in shapes.contexts:
            positions, metadata, num_blocks = decode_batch(batch, context, bs, rng)
            keys = jax.random.split(jax.random.key(batch * 7 + context), 3)
            q = jax.random.normal(keys[0], (batch, heads, d), jnp.bfloat16)
            k_cache = jax.random.normal(keys[1], (num_blocks, bs, kvh, d), jnp.bfloat16)
            v_cache = jax.random.normal(keys[2], (num_blocks, bs, kvh, d), jnp.bfloat16)
            floor = attention_floor(ceilings, shapes, batch, context)
            case = f"B={batch} ctx={context}"
            section = f"decode attention H={heads} KVH={kvh} D={d} bs={bs}"
            args = (q, k_cache, v_cache, positions, metadata)
            kernel = functools.partial(paged_attention.paged_attention, scale=scale)
            bench.run(section, case, "jaxserve", floor, job(kernel, *args))
            # The engine's decode-only steps can promise one token per request, which
            # allows splitting the keys over SMs when (requests x KV heads) < SMs.
            splits = paged_attention.num_kv_splits(
                batch, kvh, math.ceil(context / 64), tile_table.num_sms()
            )
            decode = functools.partial(kernel, max_query_len=1)
            bench.run(
                section,
                case,
                f"jaxserve max_query_len=1 ({splits} splits)",
                floor,
                job(decode, *args),
            )
            ref = functools.partial(paged_attention_ref, scale=scale)
            bench.run(section, case, "xla reference", floor, job(ref, *args))
            del k_cache, v_cache


# --- tile-table sweep -----------------------------------------------------------------


def sweep(bench: Bench, shapes: Shapes, ceilings: dict):
    """Time every tile-table candidate; print the winner per token count."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxserve.kernels import grouped_matmul as gmm  # noqa: PLC0415
    from jaxserve.kernels import paged_attention, tile_table  # noqa: PLC0415

    e, h, i = shapes.experts, shapes.hidden, shapes.inter
    keys = jax.random.split(jax.random.key(2), 5)
    w_gate, w_up = (jax.random.normal(k, (e, h, i), jnp.bfloat16) for k in keys[:2])
    w_down = jax.random.normal(keys[2], (e, i, h), jnp.bfloat16)
    rng = np.random.default_rng(0)
    winners, untimed = {}, {}  # (problem, T) -> (us, config); -> candidates not timed
    for tokens in shapes.tokens:
        m = tokens * shapes.top_k
        sizes_np = route(rng, tokens, e, shapes.top_k)
        sizes = jnp.asarray(sizes_np)
        x = jax.random.normal(keys[3], (m, h), jnp.bfloat16)
        hidden = jax.random.normal(keys[4], (m, i), jnp.bfloat16)
        case = f"T={tokens} rows/expert={m / e:.1f}"
        problems = {
            "gate": (h, i, gmm.grouped_matmul, (x, w_gate, sizes)),
            "down": (i, h, gmm.grouped_matmul, (hidden, w_down, sizes)),
            "fused": (h, i, gmm.grouped_matmul_gate_up, (x, w_gate, w_up, sizes)),
        }
        for name, (k, n, fn, fn_args) in problems.items():
            weights = 2 if name == "fused" else 1
            floor = floor_us(
                ceilings, gmm_bytes(m, k, n, sizes_np, weights), 2.0 * m * k * n * weights
            )
            for config in tile_table.GMM_CANDIDATES:
                if name == "fused":
                    config = dataclasses.replace(config, fuse_gate_up=True)
                smem = config.smem_bytes(weights, 2, 2)
                if n % config.block_n or smem > tile_table.SMEM_BYTES_PER_SM:
                    continue
                configured = functools.partial(fn, config=config)
                label = (
                    f"m{config.tile_m} n{config.tile_n} k{config.tile_k} "
                    f"s{config.max_concurrent_steps}"
                )
                row = bench.run(
                    f"sweep {name} K={k} N={n}", case, label, floor, job(configured, *fn_args)
                )
                if row.time_us is None:
                    untimed[(name, tokens)] = untimed.get((name, tokens), 0) + 1
                    continue
                best = winners.get((name, tokens))
                if best is None or row.time_us < best[0]:
                    winners[(name, tokens)] = (row.time_us, config)
    for batch in shapes.batches + shapes.split_batches:
        for context in shapes.contexts:
            positions, metadata, num_blocks = decode_batch(batch, context, shapes.block_size, rng)
            q = jax.random.normal(keys[0], (batch, shapes.heads, shapes.head_dim), jnp.bfloat16)
            cache = jax.random.normal(
                keys[1],
                (num_blocks, shapes.block_size, shapes.kv_heads, shapes.head_dim),
                jnp.bfloat16,
            )
            for block_kv in (64, 128):
                for stages in (2, 3, 4, 5, 6):
                    config = tile_table.AttentionConfig(block_kv, stages)
                    if config.smem_bytes(64, shapes.head_dim, 2) > tile_table.SMEM_BYTES_PER_SM:
                        continue
                    kernel = functools.partial(
                        paged_attention.paged_attention, scale=0.1, config=config
                    )
                    bench.run(
                        "sweep attention",
                        f"B={batch} ctx={context}",
                        f"block_kv={block_kv} stages={stages}",
                        attention_floor(ceilings, shapes, batch, context),
                        job(kernel, q, cache, cache, positions, metadata),
                    )
    print("\nBest grouped-matmul config per token count (paste into tile_table):")
    for (name, tokens), (us, config) in sorted(winners.items()):
        missing = untimed.get((name, tokens), 0)
        partial = f"  (partial: {missing} candidates not timed)" if missing else ""
        print(
            f"  {name:5s} T={tokens:5d} rows/expert={tokens * shapes.top_k / e:7.1f}: "
            f"{us:9.1f} us  {config!r}{partial}"
        )


# --- output ---------------------------------------------------------------------------

HEADER = (
    f"{'section':40s} {'case':18s} {'implementation':34s} "
    f"{'time us':>10s} {'floor us':>9s} {'x floor':>8s}  note"
)


def format_row(row: Row) -> str:
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    return (
        f"{row.section[:40]:40s} {row.case[:18]:18s} {row.impl[:34]:34s} "
        f"{fmt(row.time_us, '10.1f'):>10s} {fmt(row.floor_us, '9.1f'):>9s} "
        f"{fmt(row.ratio, '8.2f'):>8s}  {row.note}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_kernels.json"),
        help="JSON output path (default: %(default)s)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes; on the CPU the kernels run in the GPU interpreter",
    )
    parser.add_argument("--sweep", action="store_true", help="time tile-table candidates")
    parser.add_argument(
        "--tokens",
        type=lambda s: tuple(int(t) for t in s.split(",")),
        help="comma-separated token counts (default 16,64,256,1024,4096)",
    )
    parser.add_argument("--skip", default="", help="comma-separated: gmm,attention")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="stop starting measurements after this many seconds",
    )
    parser.add_argument(
        "--extra-path",
        action="append",
        default=[],
        help="prepend a directory to sys.path (e.g. a tokamax wheel target)",
    )
    args = parser.parse_args(argv)
    sys.path[:0] = args.extra_path

    import jax  # noqa: PLC0415

    on_gpu = jax.devices()[0].platform == "gpu"
    if not on_gpu and not args.dry_run:
        parser.error("no GPU: pass --dry-run to smoke-test on the CPU")
    shapes = DRY_RUN if args.dry_run else Shapes()
    if args.tokens:
        shapes = dataclasses.replace(shapes, tokens=args.tokens)
    interpret = not on_gpu
    device = jax.devices()[0]

    def report() -> dict:
        return {
            "device": device.device_kind,
            "platform": device.platform,
            "jax_version": jax.__version__,
            "timing": (
                "wall clock (GPU interpreter)"
                if interpret
                else "CUPTI device time"
                if bench.use_cupti
                else f"wall clock ({bench.cupti_error})"
            ),
            "shapes": dataclasses.asdict(shapes),
            "ceilings": ceilings,
            "rows": [dict(dataclasses.asdict(r), ratio=r.ratio) for r in bench.rows],
        }

    def write_report() -> None:
        # Rewritten after every row: a run stopped from outside keeps what it measured.
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(report(), indent=1))
        tmp.replace(args.out)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    ceilings: dict = {}
    bench = Bench(
        use_cupti=on_gpu,
        budget_s=args.budget_s,
        min_time_s=0.0 if interpret else 0.2,
        on_row=write_report,
    )
    print(
        f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"{'GPU interpreter' if interpret else 'CUPTI device time'}"
    )
    print(HEADER)
    skip = set(filter(None, args.skip.split(",")))
    context = _interpret_mode() if interpret else _null_context()
    with context:
        ceilings.update(measure_ceilings(bench, shapes))
        if args.sweep:
            sweep(bench, shapes, ceilings)
        else:
            # What the issue asks for first (grouped matmul against the alternatives,
            # decode attention at batch 64 and 256), then jaxserve's other kernels.
            later = []
            if "gmm" not in skip:
                later = bench_grouped_matmul(bench, shapes, ceilings, interpret)
            if "attention" not in skip:
                bench_attention(bench, shapes, ceilings, shapes.batches)
            for rows in later:
                rows()
            if "attention" not in skip:
                bench_attention(bench, shapes, ceilings, shapes.split_batches)
    write_report()
    print(f"\nwrote {args.out}")
    failed = [r for r in bench.rows if r.note.startswith("failed")]
    print(f"{len(bench.rows)} rows, {len(failed)} failed")
    return 0


def _interpret_mode():
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415

    return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())


class _null_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
