"""The MoE experts off the GPU: dense (every token through every expert) vs sparse
(`jaxserve.models.moe_sparse`, only the routed rows); prints tables.

    .venv/bin/python scripts/bench_moe.py                  # dense vs sparse
    .venv/bin/python scripts/bench_moe.py --sweep          # + sparse at each block size

One jitted MoE experts call (`moe_experts_dense` / `moe_experts_sparse`, top-k from a
random gate) per (config, tokens), on the CPU, float32. Variants are interleaved within
each repeat (so machine load hits them alike); the table shows medians, the sparse
block size, and the sparse FLOPs over the routed FLOPs (`sparse_moe_flops`). Configs: the
demo model (jaxserve/demo_model/config.json) and a Qwen3-MoE-like layer (hidden 512, 32
experts, top-4, moe_intermediate 256); `--configs top8 --tokens 1,2,4` adds a top-8 layer
(hidden 128, 64 experts) at decode sizes. `--sweep` adds the sparse path at each block size
(ignoring the padding rule), the measurement behind `moe_sparse.MAX_BLOCK_SIZE`;
`--gather 24,21` the sparse path with other weight-gather chunks (2^24, 2^21 elements),
the measurement behind `moe_sparse.GATHER_ELEMENTS`; `--loop 4,16` the expert loop
(`moe_loop.expert_loop_ffn`, each expert's weights read once) at those smallest chunk
sizes, `--loop-levels 1,3` with those numbers of chunk sizes (`moe_loop.loop_chunk_sizes`;
1: one size, the loop before the levels), its flops/routed the rows it ran on that routing;
with `--loop`, also the default path (`loop@auto`: smallest chunk `block_size_for`, levels
`loop_levels_for`) beside it with one level (`loop@auto/1`). `--slices` adds the experts
held one array per expert (`moe_slices`, what the one-device engine runs on the CPU;
`slices`) beside `loop@auto`, the same loop over the stacked weights. `--capacity` adds the
default path where it takes the capacity layout (`moe_capacity`; `capacity`) beside
`loop@auto`, the loop it replaced there, and `--overflow-chunks 1,4` that layout with other
`moe_capacity.OVERFLOW_CHUNK`s (`capacity/oN`); their flops/routed are the rows the chosen
layout ran on that routing. `--cpu-kernel` adds the CPU kernel
(`jaxserve.kernels.cpu_moe`; `cpu-kernel`, at every size: the default path takes it below
`cpu_moe.MAX_MEAN_GROUP` routed rows per expert) beside the default path with the kernel
off (`xla@auto`, XLA's layouts); `--weight-sets 8` cycles each call through 8 copies of
the weights, so that they come from memory as a model's layers do, not from the L3.
Writes bench_results/bench_moe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _configs() -> dict[str, tuple[int, int, int, int]]:
    demo = json.loads((ROOT / "jaxserve/demo_model/config.json").read_text())
    return {
        "demo": (
            demo["hidden_size"],
            demo["moe_intermediate_size"],
            demo["num_experts"],
            demo["num_experts_per_tok"],
        ),
        "qwen3-moe-like": (512, 256, 32, 4),
        # Decode with top-8 (Qwen3-30B-A3B's k), narrow so that dense stays measurable.
        "top8": (128, 128, 64, 8),
    }


def _time(fn, calls: list[tuple], repeats_inner: int) -> float:
    """Seconds per call: the mean of `repeats_inner` back-to-back calls, cycling through
    `calls` (argument tuples: one per weight set), a sample; the table shows the median
    of the samples."""
    start = time.perf_counter()
    for i in range(repeats_inner):
        out = fn(*calls[i % len(calls)])
    out.block_until_ready()
    return (time.perf_counter() - start) / repeats_inner


def _capacity_run_rows(sizes, chunk: int, overflow_chunk: int) -> int:
    """Rows the capacity layout runs on expert group sizes `sizes` (NumPy [E]): the
    largest capacity whose `executed_rows` fit MAX_PADDING, else the loop's."""
    from jaxserve.models import moe_capacity, moe_sparse

    n, num_experts = int(sizes.sum()), len(sizes)
    run = int((-(-sizes // chunk) * chunk).sum())  # the loop alone
    for c in moe_capacity.capacities_for(n, num_experts):  # ascending: the last fit wins
        rows = int(moe_capacity.executed_rows(sizes, c, overflow_chunk))
        run = rows if rows <= moe_sparse.MAX_PADDING * n else run
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,32,128,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sweep", action="store_true", help="also other block sizes")
    parser.add_argument("--configs", default="demo,qwen3-moe-like")
    parser.add_argument(
        "--gather", default="", help="also sparse at these log2 GATHER_ELEMENTS, e.g. 24,21"
    )
    parser.add_argument(
        "--loop", default="", help="also the expert loop at these chunk sizes, e.g. 4,16"
    )
    parser.add_argument(
        "--loop-levels",
        default="",
        help="the expert loop's numbers of chunk sizes to try, e.g. 1,3 (loop@C/L in the "
        "table; default: moe_loop.LOOP_LEVELS)",
    )
    parser.add_argument(
        "--slices",
        action="store_true",
        help="also the experts held one array per expert (moe_slices; 'slices') beside the "
        "default path over the stacked weights",
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="also the capacity layout (moe_capacity; 'capacity') beside the expert loop",
    )
    parser.add_argument(
        "--overflow-chunks", default="", help="with --capacity: these OVERFLOW_CHUNKs, e.g. 1,4"
    )
    parser.add_argument(
        "--cpu-kernel",
        action="store_true",
        help="also the CPU kernel (cpu_moe; 'cpu-kernel') beside the XLA default path",
    )
    parser.add_argument(
        "--weight-sets", type=int, default=1, help="copies of the weights, cycled per call"
    )
    parser.add_argument("--out", default=str(ROOT / "bench_results/bench_moe.json"))
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.kernels import cpu_moe
    from jaxserve.models import moe_capacity, moe_loop, moe_sparse
    from jaxserve.models.moe import route
    from jaxserve.models.moe_experts import moe_experts_dense
    from jaxserve.models.moe_slices import MIN_CHUNK, ExpertSlices, moe_experts_sliced
    from jaxserve.models.moe_sparse import (
        block_size_for,
        combine_copies,
        moe_experts_sparse,
        sparse_moe_flops,
    )

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {load}", flush=True)
    results = []
    configs = _configs()
    loop_levels = [int(v) for v in args.loop_levels.split(",") if v]
    loop_levels = loop_levels or [moe_loop.LOOP_LEVELS]

    def _loop_moe(chunk: int, levels: int):
        """The expert loop at `chunk` / `levels` as a whole MoE call (weighted sum)."""
        loop = functools.partial(moe_loop.expert_loop_ffn, chunk=chunk, levels=levels)

        def moe(x, tw, ids, wg, wu, wd):
            return jnp.einsum("tk,tkh->th", tw, loop(x, ids, wg, wu, wd))

        return jax.jit(moe)

    for name in args.configs.split(","):
        hidden, inter, experts, top_k = configs[name]
        rng = np.random.default_rng(0)

        def w(*shape, rng=rng):
            return jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)

        weight_sets = [
            (w(experts, hidden, inter), w(experts, hidden, inter), w(experts, inter, hidden))
            for _ in range(args.weight_sets)
        ]
        weights = weight_sets[0]
        gate = w(hidden, experts) * 20
        print(
            f"\n{name}: hidden {hidden}, moe_intermediate {inter}, {experts} experts, top-{top_k}"
        )
        print(
            f"{'tokens':>6} {'variant':>10} {'block':>5} {'ms':>9} {'vs dense':>8} "
            f"{'flops/routed':>12}"
        )
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
            tw, ids = route(x, gate, top_k, True)
            call = (x, tw, ids, *weights)
            calls = [(x, tw, ids, *ws) for ws in weight_sets]
            auto = block_size_for(tokens * top_k, experts)
            variants = {"dense": (jax.jit(moe_experts_dense), None)}
            blocks = [auto]
            if args.sweep:
                # Powers of two from auto/4 to 8*auto (smaller ones gather far more weights).
                blocks += [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if auto / 4 <= b <= 8 * auto]
                blocks = sorted(set(blocks), key=lambda b: b != auto)
            for b in blocks:
                label = "sparse" if b == auto else f"sparse@{b}"
                fn = jax.jit(functools.partial(moe_experts_sparse, block_size=b))
                variants[label] = (fn, b)
            n = tokens * top_k
            if (args.loop or args.slices or args.capacity) and n >= moe_sparse.LOOP_MIN_ROWS:
                # The expert loop as the default path runs it, its levels chosen.
                levels = moe_loop.loop_levels_for(n, experts, auto)
                variants["loop@auto"] = (_loop_moe(auto, levels), -auto)
                # The same with one chunk size (the default before the levels).
                variants["loop@auto/1"] = (_loop_moe(auto, 1), -auto)
            if args.slices:
                # Its weights are other arrays: the call's stacked ones are ignored.
                sliced_fn = jax.jit(moe_experts_sliced)
                sliced = [ExpertSlices.split(a) for a in weights]
                variants["slices"] = (
                    lambda x, tw, ids, *_, fn=sliced_fn, ws=sliced: fn(x, tw, ids, *ws),
                    -max(MIN_CHUNK, auto),
                )
            for c in [int(c) for c in args.loop.split(",") if c]:
                for lv in loop_levels:
                    variants[f"loop@{c}/{lv}"] = (_loop_moe(c, lv), -c)
            if args.capacity and moe_capacity.uses_capacity(n, experts):
                default = functools.partial(moe_experts_sparse, block_size=None)
                os.environ[cpu_moe.ENV_VAR] = "0"  # XLA's capacity layout, not the CPU kernel
                variants["capacity"] = (jax.jit(default).lower(*call).compile(), "cap")
                default_chunk = moe_capacity.OVERFLOW_CHUNK
                for oc in [int(c) for c in args.overflow_chunks.split(",") if c]:
                    moe_capacity.OVERFLOW_CHUNK = oc  # read when traced: trace it now
                    variants[f"capacity/o{oc}"] = (jax.jit(default).lower(*call).compile(), oc)
                    moe_capacity.OVERFLOW_CHUNK = default_chunk
                del os.environ[cpu_moe.ENV_VAR]
            if args.cpu_kernel and cpu_moe.available():
                # The kernel at every size, past MAX_MEAN_GROUP too (where the default
                # path leaves it): the measurement behind that limit.
                def kernel_moe(x, tw, ids, wg, wu, wd):
                    return combine_copies(tw, cpu_moe.moe_rows_ffn(x, ids, wg, wu, wd), x.dtype)

                variants["cpu-kernel"] = (jax.jit(kernel_moe), "kernel")
                # The switch is read when traced: trace it now, from another function
                # object (jax reuses a trace of the same one, whatever the environment).
                os.environ[cpu_moe.ENV_VAR] = "0"
                xla = functools.partial(moe_experts_sparse, block_size=None)
                variants["xla@auto"] = (jax.jit(xla).lower(*call).compile(), "xla")
                del os.environ[cpu_moe.ENV_VAR]
            default_gather = moe_sparse.GATHER_ELEMENTS
            for log2 in [int(g) for g in args.gather.split(",") if g]:
                # The chunk size is read when the function is traced: trace it now.
                moe_sparse.GATHER_ELEMENTS = 1 << log2
                fn = jax.jit(functools.partial(moe_experts_sparse, block_size=auto))
                variants[f"sparse/g{log2}"] = (fn.lower(*call).compile(), auto)
                moe_sparse.GATHER_ELEMENTS = default_gather
            times: dict[str, list[float]] = {v: [] for v in variants}
            inner = {}
            for label, (fn, _) in variants.items():
                fn(*call).block_until_ready()  # compile
                # Calls per sample: about 50 ms of them.
                inner[label] = max(1, min(200, int(0.05 / _time(fn, calls, 1))))
            for _ in range(args.repeats):
                for label, (fn, _) in variants.items():
                    times[label].append(_time(fn, calls, inner[label]))
            dense_ms = statistics.median(times["dense"]) * 1e3
            routed = tokens * top_k * 6 * hidden * inter
            for label, (_, b) in variants.items():
                ms = statistics.median(times[label]) * 1e3
                g = np.bincount(np.asarray(ids).ravel(), minlength=experts)
                if b is None:
                    flops = tokens * experts * 6 * hidden * inter
                elif b == "kernel":  # exactly the routed rows
                    flops = routed
                elif b == "xla":  # the XLA layout the default path takes here
                    flops = sparse_moe_flops(tokens, top_k, experts, auto, hidden, inter)
                    if moe_capacity.uses_capacity(n, experts):
                        oc = moe_capacity.OVERFLOW_CHUNK
                        flops = _capacity_run_rows(g, auto, oc) * 6 * hidden * inter
                    elif n >= moe_sparse.LOOP_MIN_ROWS:
                        flops = int((-(-g // -auto) * -auto).sum()) * 6 * hidden * inter
                elif label.startswith("capacity"):
                    oc = moe_capacity.OVERFLOW_CHUNK if b == "cap" else b
                    flops = _capacity_run_rows(g, auto, oc) * 6 * hidden * inter
                elif b < 0:  # the expert loop: the rows it runs on this routing
                    flops = int((-(-g // -b) * -b).sum()) * 6 * hidden * inter
                else:
                    flops = sparse_moe_flops(tokens, top_k, experts, b, hidden, inter)
                ratio = flops / routed
                row = f"{tokens:>6} {label:>10} {b or '-':>5} {ms:>9.3f} {dense_ms / ms:>7.2f}x "
                print(f"{row}{ratio:>12.2f}", flush=True)
                results.append(
                    dict(config=name, tokens=tokens, variant=label, block_size=b, ms=ms,
                         speedup_vs_dense=dense_ms / ms, flops_over_routed=ratio)
                )  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"uptime": load, "results": results}, indent=1))
    print(f"\nuptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
