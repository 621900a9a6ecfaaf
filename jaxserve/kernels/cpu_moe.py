"""The CPU kernel of the sparse MoE experts at small batches: routed rows, weights in place.

Why: XLA's CPU backend copies an expert's weights out of the stacked [E, H, I] arrays
(a `dynamic-slice` or `gather` into a new buffer) before every dot that reads them, so
at decode sizes, where each expert has a row or a few, the experts read their weights
three times (copy in, copy out, dot) and the copies are most of a decode step. This
kernel (`cpu_moe_rows.cc`, an XLA FFI custom call) reads them in place: the copies are
grouped by expert (a counting sort) and each expert's rows, in blocks of 4, stream its
three matrices once; the work is shared with XLA's intra-op thread pool.

Measured (`scripts/bench_moe.py --cpu-kernel`; Qwen3-MoE-like layer, hidden 512, 32
experts, top-4, 8 layers' weights cycled so that they come from memory, not cache):
faster than the XLA sparse path up to about 8 rows per expert, slower past it, where the
matmuls are compute-bound and XLA's GEMM (YNNPACK) wins. So `sparse_expert_ffn` uses it
below `MAX_MEAN_GROUP` routed rows per expert. On a CPU with AVX-512 (or AVX2 and FMA) an
expert with 8 rows or more runs register tiles instead (`cpu_tile_matmul.h`), which beat
XLA's layouts at every size measured (random routing, one layer, ms, kernel vs XLA: 3.7 vs 5.3 at 64
tokens, 3.7-4.3 vs 6.3-8.7 at 128 (108 GFLOP/s, 63% of the f32 matmul ceiling), 5.8 vs
8.3 at 256, 10.5 vs 14.2 at 512, 45 vs 82 at 2048), so there it runs below
`MAX_MEAN_GROUP_TILED` rows per expert (the largest size measured). Since the tiles
prefetch each weight row two panels ahead (see `cpu_tile_matmul.h`), the kernel measured
(same script, interleaved with the one before, Zen 4, load ~1.8) 3.28 vs 3.60 ms at 64
tokens, 3.09 vs 3.57 at 128 (1.16x), 5.45-5.49 vs 5.60-5.90 at 256.
On an AVX2-only CPU (an EPYC VM without AVX-512) the tiles on 8-lane registers against
XLA's path, end to end (`compare_hf.py --baseline-python`, 3 interleaved repeats, load
1.1-1.3): qwen3moe batch 128 1344 vs 914 tok/s (1.47x), batch 32 1.17x; demo batch 128
1.22x, batch 32 1.00x.

It is compiled on first use (`cpu_build.py`: g++ for this CPU, cached). Without a
compiler, or if the build fails, it logs one warning and the XLA path runs
(`available()` is False). `JAXSERVE_CPU_MOE_KERNEL=0` turns it off
(read at trace time, for A/B benchmarks).

Numerics: float32 only (other dtypes take the XLA path): float32 products and sums (the
summation order differs from XLA's, so equal within float32 rounding), SiLU(gate) * up
in float32, as `moe_loop.swiglu_rows` with a float32 model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.kernels.cpu_build import (
    build_library,
    compiler,
    cpu_flags,
    register_kernel,
    switch_on,
)

ENV_VAR = "JAXSERVE_CPU_MOE_KERNEL"
SOURCE = Path(__file__).with_name("cpu_moe_rows.cc")
TARGET = "jaxserve_cpu_moe_rows"
# Routed rows per expert (N / E) below which the kernel beats XLA's sparse path (module
# docstring; `scripts/bench_moe.py --cpu-kernel`).
MAX_MEAN_GROUP = 8
# The same with the register tiles (AVX-512): 2048 tokens x top-4 over 32 experts.
MAX_MEAN_GROUP_TILED = 256


def enabled() -> bool:
    """Whether `JAXSERVE_CPU_MOE_KERNEL` allows the kernel (`cpu_build.switch_on`)."""
    return switch_on(ENV_VAR)


def applies(x: jax.Array, num_rows: int, num_experts: int, weights) -> bool:
    """Whether `sparse_expert_ffn` should run the kernel: the CPU backend, float32
    activations and stacked float32 weights, fewer than MAX_MEAN_GROUP routed rows per
    expert (MAX_MEAN_GROUP_TILED where the CPU has AVX-512), the kernel enabled and
    built."""
    limit = MAX_MEAN_GROUP_TILED if has_tiles() else MAX_MEAN_GROUP
    return (
        jax.default_backend() == "cpu"
        and 0 < num_rows < limit * num_experts
        and x.dtype == jnp.float32
        and all(isinstance(w, jax.Array) and w.dtype == jnp.float32 for w in weights)
        and enabled()
        and available()
    )


def moe_rows_ffn(
    x: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """SwiGLU of each token copy with its own expert, on the CPU kernel.

    Args:
        x: [T, H] float32 activations.
        ids: [T, k] int32 expert of each copy in [0, E]; E (or any id outside [0, E))
            marks an empty copy, whose output is 0.
        w_gate, w_up: [E, H, I] float32; w_down: [E, I, H] float32.

    Returns:
        [T, k, H] float32: expert_{ids[t, j]}(x[t]).

    Raises:
        RuntimeError: if the kernel is not `available()`.
    """
    if not available():
        raise RuntimeError("the CPU MoE kernel is not available (see the log for why)")
    num_tokens, top_k = ids.shape
    out = jax.ShapeDtypeStruct((num_tokens, top_k, x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, ids.astype(jnp.int32), w_gate, w_up, w_down)


@functools.cache
def has_tiles() -> bool:
    """Whether the kernel is built with its register tiles: the CPU has AVX-512F, or AVX2
    and FMA (the build is -march=native; `cpu_tile_matmul.h`)."""
    flags = cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on the first call)."""
    return register_kernel(_build, TARGET, "JaxserveMoeRows", "CPU MoE kernel (using the XLA path)")


def _build() -> Path:
    """The kernel's shared library (`cpu_build.build_library`; RuntimeError if it cannot
    be built)."""
    return build_library(SOURCE, compiler())
