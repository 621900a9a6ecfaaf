"""Decode attention on the CPU kernel (`jaxserve.kernels.cpu_attention`) alone: microseconds
a call and GFLOP/s at a few (rows, context) pairs, with the random Qwen3-MoE's attention
shapes (8 query heads, 4 KV heads, head_dim 64, block 16; `compare_hf.py`) by default;
`--heads 4 --kv-heads 2 --head-dim 32` are the demo model's (`jaxserve/demo_model`).
`--query N` times prefill chunks instead: each row's last N tokens attend.

Each request has its own blocks, so the KV cache read per call is rows x context x KV
heads x head_dim x 8 bytes (K and V, float32): 12.6 MB at 128 x 48 (in a large L3), 52 MB
at 128 x 200 (from memory). One jitted `lax.scan` of `--calls` kernel calls is timed;
medians of `--repeats`. `--layers L` gives the calls L caches of their own, taken in turn,
as a model's layers are (L x the KV MB per call: out of L3, as in an engine's decode step,
where the 8 layers' caches and the experts' weights pass through between two reads of a
layer). For an A/B of a kernel change, run it at both commits.

    python scripts/bench_attention_cpu.py [--cases 1x48,8x48,128x48,128x200,32x1000]
        [--heads 8 --kv-heads 4 --head-dim 64 --block 16] [--query 1] [--layers 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def decode_case(
    rows: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    query: int = 1,
    layers: int = 1,
):
    """q [rows * query, heads, head_dim], caches, positions and metadata of one step: each
    row's last `query` tokens (1: decode, more: a prefill chunk), the last at position
    context - 1; each row's blocks its own. With `layers` > 1 the caches hold that many
    layers' blocks, and block_tables is [layers, rows, width]: layer l's its own blocks."""
    from jaxserve.models.base import AttentionMetadata

    rng = np.random.default_rng(0)
    width = -(-context // block)
    shape = (layers * rows * width + 1, block, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32))
    v = jnp.asarray(rng.standard_normal(shape, np.float32))
    q = jnp.asarray(rng.standard_normal((rows * query, heads, head_dim), np.float32))
    # 0: the null block
    all_tables = np.arange(layers * rows * width, dtype=np.int32).reshape(layers, rows, width) + 1
    tables = all_tables[0]
    positions = np.tile(np.arange(context - query, context, dtype=np.int32), rows)
    row = np.repeat(np.arange(rows, dtype=np.int32), query)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(tables[row, positions // block] * block + positions % block),
        block_tables=jnp.asarray(all_tables if layers > 1 else tables),
        seq_lens=jnp.full(rows, context, jnp.int32),
        query_start_loc=jnp.arange(rows + 1, dtype=jnp.int32) * query,
        token_req=jnp.asarray(row),
    )
    return q, k, v, jnp.asarray(positions), md


def time_case(rows: int, context: int, args: argparse.Namespace) -> float:
    """Median microseconds of one kernel call."""
    from jaxserve.kernels import cpu_attention

    q, k, v, positions, md = decode_case(
        rows, context, args.heads, args.kv_heads, args.head_dim, args.block, args.query,
        args.layers,
    )  # fmt: skip
    scale = args.head_dim**-0.5
    calls = args.calls
    layer = jnp.arange(calls, dtype=jnp.int32) % args.layers

    @jax.jit
    def many(q):
        def body(carry, layer_id):
            tables = md.block_tables[layer_id] if args.layers > 1 else md.block_tables
            out = cpu_attention.paged_attention_cpu(
                carry, k, v, positions, dataclasses.replace(md, block_tables=tables), scale
            )
            return carry + out * 1e-6, None  # a data dependence: the calls cannot merge

        return jax.lax.scan(body, q, layer)[0]

    many(q).block_until_ready()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        many(q).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1x48,8x48,128x48,128x200,32x1000")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--query", type=int, default=1, help="query tokens a row (> 1: prefill)")
    parser.add_argument("--layers", type=int, default=1, help="caches taken in turn (1: one)")
    args = parser.parse_args()
    from jaxserve.kernels import cpu_attention

    if not cpu_attention.available():
        raise SystemExit("the CPU attention kernel is not available (no C++ compiler?)")
    print(f"# {os.uname().nodename}: {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print(f"# {cpu_attention.__file__}: heads {args.heads}, KV heads {args.kv_heads}, "
          f"head_dim {args.head_dim}, block {args.block}, query {args.query}, "
          f"layers {args.layers}")  # fmt: skip
    print(f"{'rows':>5} {'context':>7} {'us/call':>9} {'GFLOP/s':>8} {'KV MB':>7} {'GB/s':>6}")
    for case in args.cases.split(","):
        rows, context = (int(x) for x in case.split("x"))
        us = time_case(rows, context, args)
        keys = sum(range(context - args.query + 1, context + 1))  # causal: per query token
        flops = 4 * rows * args.heads * keys * args.head_dim  # q.k, p.v: 2 FLOPs a mul-add
        kv_bytes = 8 * rows * context * args.kv_heads * args.head_dim
        print(f"{rows:>5} {context:>7} {us:>9.1f} {flops / us / 1e3:>8.1f} "
              f"{kv_bytes / 1e6:>7.1f} {kv_bytes / us / 1e3:>6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
