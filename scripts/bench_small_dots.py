"""XLA's CPU dot of a few rows by a weight that is a jit argument, by row count and layout.

The engine's projections (attention q/k/v/o, the LM head) are such dots: activations
[M, K] by a weight the step receives as an argument. This prints, per weight shape and
row count M, the median time of `x @ w` with w stored [K, N] (the layout the loader
gives today) and of the same product with w stored [N, K] (HF's own layout, contracted
on its second axis), alternating within each repetition (interleaved), the weight on
huge pages as the engine's are (`engine.huge_pages`), and the weight's bytes a second:
at M = 1 the dot streams the weight near the memory's bandwidth; past it, well below,
which is what a small-batch decode pays. Checks that both layouts agree (float32
rounding). Prints `uptime` before and after; JSON to --out.

    python scripts/bench_small_dots.py [--rows 1,2,4,8,16,32,64] [--repeats 7]
        [--shapes 128x4096,512x512,512x4096,1024x32768] [--out bench_results/small_dots.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _time(f, x, w, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        r = f(x, w)
    r.block_until_ready()
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> None:
    import jax
    import numpy as np

    from jaxserve.engine import huge_pages

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default="128x4096,512x512,512x4096,1024x32768")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench_results/small_dots.json")
    args = parser.parse_args(argv)
    print("#", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    ways = {
        "KxN": jax.jit(lambda x, w: x @ w),
        "NxK": jax.jit(lambda x, wt: jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())))),
    }
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"{'K x N':>12} {'M':>4} {'KxN us':>9} {'GB/s':>6} {'NxK us':>9} {'GB/s':>6} "
          f"{'KxN/NxK':>7}")  # fmt: skip
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        host = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
        weights = {"KxN": jax.device_put(host), "NxK": jax.device_put(np.ascontiguousarray(host.T))}
        huge_pages.advise_huge_pages(list(weights.values()))
        for m in (int(v) for v in args.rows.split(",")):
            x = jax.device_put(rng.standard_normal((m, k), np.float32))
            a, b = (np.asarray(ways[w](x, weights[w])) for w in ways)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
            calls = max(3, min(200, int(2e8 / (m * k * n + 1e5))))
            times = {w: [] for w in ways}
            for rep in range(args.repeats + 1):  # the first round warms up
                for w in ways if rep % 2 == 0 else reversed(ways):
                    t = _time(ways[w], x, weights[w], calls)
                    if rep:
                        times[w].append(t)
            med = {w: statistics.median(t) for w, t in times.items()}
            gb = {w: 4 * k * n / med[w] / 1e9 for w in ways}
            rows_out.append(dict(k=k, n=n, m=m, seconds=med, weight_gb_s=gb))
            ratio = med["KxN"] / med["NxK"]
            print(f"{shape:>12} {m:>4} {1e6 * med['KxN']:>9.1f} {gb['KxN']:>6.1f} "
                  f"{1e6 * med['NxK']:>9.1f} {gb['NxK']:>6.1f} {ratio:>7.2f}")  # fmt: skip
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("#", uptime)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), uptime_end=uptime, rows=rows_out)))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
