"""The CPU dense kernel on panel-major weights (`jaxserve.kernels.cpu_dense`) against
XLA's dot, by rows: what sets `cpu_dense.MAX_ROWS`.

For each weight shape [K, N] and row count M, three products of x [M, K] by a weight
that is a jit argument, as in the engine's step: XLA's `x @ w` on the row-major [K, N]
weight (today's path), the kernel on its `PanelMajor` panels, and XLA's dot on the
panels (the path past MAX_ROWS). Each runs `--inner` times inside one jitted
`fori_loop` (the next x depends on the last product, so none is skipped), as the
engine's multi-step decode runs its dots back to back, so the per-call dispatch of a
tiny product does not hide its cost. `--repeats` rounds, the three alternating within
a round (interleaved); medians in us a product, the kernel's speed-up over XLA, its
GFLOP/s, and the largest difference from XLA's result (float32 rounding). Weights on
huge pages as the engine's. Prints `uptime` before and after; JSON to --out.

    python scripts/bench_dense_panels.py [--rows 1,2,4,8,16,32,64,128] [--repeats 5]
        [--shapes 128x256,128x128,128x4096,512x4096,1024x32768] [--out ...]
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


def _loop(product, inner: int):
    """A jitted fn(x, w) running `product(x, w)` `inner` times, each x nudged by the last
    result (a data dependence, so XLA runs every product)."""
    import jax
    import jax.numpy as jnp

    def run(x, w):
        def body(_, carry):
            x, acc = carry
            y = product(x, w)
            return x + (y[0, 0] * 1e-30).astype(x.dtype), acc + y[-1, -1]

        return jax.lax.fori_loop(0, inner, body, (x, jnp.float32(0)))[1]

    return jax.jit(run)


def _time(f, x, w) -> float:
    start = time.perf_counter()
    f(x, w).block_until_ready()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.engine import huge_pages
    from jaxserve.kernels import cpu_dense

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--shapes", default="128x256,128x128,128x4096,512x4096,1024x32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_results/dense_panels.json")
    args = parser.parse_args(argv)
    if not cpu_dense.applies():
        raise SystemExit("the CPU dense kernel does not apply on this machine (see the log)")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("#", uptime)
    rng = np.random.default_rng(0)
    paths = {
        "xla": lambda x, w: x @ w,
        "kernel": lambda x, p: cpu_dense.dense_panels(x, p.panels, p.shape[1]),
        "xla_panels": lambda x, p: jnp.einsum("tk,pkj->tpj", x, p.panels).reshape(
            x.shape[0], -1)[:, : p.shape[1]],
    }  # fmt: skip
    rows_out = []
    print(f"{'K x N':>12} {'M':>4} {'XLA us':>9} {'kernel us':>9} {'XLA-pan us':>10} "
          f"{'speed-up':>8} {'kern GF/s':>9} {'max diff':>9}")  # fmt: skip
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w = jax.device_put(rng.standard_normal((k, n), np.float32) / np.sqrt(k))
        packed = cpu_dense.PanelMajor.pack(w)
        huge_pages.advise_huge_pages([w, packed.panels])
        for m in (int(v) for v in args.rows.split(",")):
            x = jax.device_put(rng.standard_normal((m, k), np.float32))
            got = np.asarray(jax.jit(paths["kernel"])(x, packed))
            diff = float(np.abs(np.asarray(paths["xla"](x, w)) - got).max())
            inner = max(4, min(400, int(4e8 / (m * k * n + 2e5))))
            fns = {name: _loop(f, inner) for name, f in paths.items()}
            weight = {"xla": w, "kernel": packed, "xla_panels": packed}
            for name, f in fns.items():
                _time(f, x, weight[name])  # compile and warm
            times = {name: [] for name in fns}
            for rep in range(args.repeats):
                names = list(fns) if rep % 2 == 0 else list(fns)[::-1]
                for name in names:
                    times[name].append(_time(fns[name], x, weight[name]) / inner)
            med = {name: statistics.median(t) for name, t in times.items()}
            row = dict(k=k, n=n, m=m, inner=inner, xla_s=med["xla"], kernel_s=med["kernel"],
                       xla_panels_s=med["xla_panels"], speedup=med["xla"] / med["kernel"],
                       kernel_gflop_s=2 * m * k * n / med["kernel"] / 1e9,
                       max_abs_diff=diff)  # fmt: skip
            rows_out.append(row)
            print(f"{shape:>12} {m:>4} {med['xla'] * 1e6:9.1f} {med['kernel'] * 1e6:9.1f} "
                  f"{med['xla_panels'] * 1e6:10.1f} {row['speedup']:8.2f} "
                  f"{row['kernel_gflop_s']:9.1f} {diff:9.2e}", flush=True)  # fmt: skip
    uptime_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("#", uptime_end)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), uptime=uptime, uptime_end=uptime_end,
                                   rows=rows_out), indent=1))  # fmt: skip
    print("# wrote", out)


if __name__ == "__main__":
    main()
