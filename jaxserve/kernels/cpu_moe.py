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

Layout: on one CPU device the engine holds the experts panel-major (`ExpertPanels`:
each expert's [K, N] matrix as [ceil(N / 16)][K][16], each 16-column panel one
contiguous stream, as `cpu_dense.PanelMajor` does for the projections), and the kernel's
second target reads them so, every expert on register tiles (`cpu_moe_rows.cc`). In the
row-major [E, H, I] layout a panel is K runs of 64 bytes N * 4 bytes apart, which the
tiles prefetch by hand (`cpu_tile_matmul.h`, `cpu_moe_chunks.h`). `pack_experts`, called by
the engine's `ModelRunner` after loading, packs them where the kernel has tiles, is
enabled and built, on one device with stacked float32 experts and no placement tables:
the checkpoint loader, the sharding rules and EPLB (off on one device; it moves only
stacked arrays) see the logical arrays, and expert-parallel meshes, `moe_slices`' per-expert
storage and GPUs keep them (the mesh's local experts run the row-major target). Cost: no
extra memory once built (the packed array replaces the original; shapes a multiple of
16, as Qwen3-MoE's, are not padded), but the model object the loader built holds the
originals until the engine's build returns, so the expert weights exist twice for that
moment; and the XLA paths (a prefill past MAX_MEAN_GROUP_TILED rows an expert, the
kernel switched off at trace time, `JAXSERVE_MOE_EXPERTS=dense`) take them unpacked, a
transposing copy inside each such step. Measured on a 2-core Zen 4 (AVX-512), shared,
load 1.1-1.6, panel-major against row-major: the kernel alone
(`scripts/native/bench_moe_kernel.cc` base vs pm, interleaved medians) 1.13 / 1.47 /
1.01 / 1.06x at 8 / 32 / 128 / 512 tokens, and with an AVX2 build (-mno-avx512f) 1.08 /
1.44 / 1.25 / 1.13x. End to end
(`compare_hf.py --models qwen3moe --baseline-python` main, interleaved medians), batch
8 / 128: 0.97 / 1.11x, 0.94 / 1.04x (5 repeats), 1.08 / 0.90x (spreads 1-55%); batch
32 / 128: 1.32 / 0.93x (spreads 11 / 13%; at 32, 4 rows an expert, the row-major
weights take the row path, the panels the tiles); AVX2 builds on both sides, batch 8 /
128: 1.04 / 1.01x; merged with main (session 23, 3 repeats, load 0.75-1.1), batch 1 /
32 / 128: 1.02 / 1.14 / 1.04x. No gain at batch 128 beyond the noise: on AVX-512 the
panels are no faster there (the experts are about half of a batch-128 decode step,
`scripts/bench_step_ops.py`).
Since the panel tiles take up to 24 rows on AVX-512 (an expert's rows at 128 tokens in
one tile, each weight line read once, prefetched 128 lines ahead into L2: see
`cpu_tile_matmul.h`'s kPanelsTileRows), the kernel alone (processes of b0fead8's and
the new alternating 3x, Zen 4, load 1.0-1.4, medians) 1.59 -> 1.55 / 2.66 -> 2.09 /
8.48 -> 7.67 ms at 32 / 128 / 512 tokens (1.02 / 1.28 / 1.11x; 193 GFLOP/s at 128), and
end to end (`compare_hf.py --models qwen3moe --baseline-python` b0fead8, 3 interleaved
repeats, load 1.0-1.6, ceiling 215-221 GFLOP/s; three runs) batch 128 2083 vs 1885
tok/s (1.11x, 61% MFU, spread 14%), 2291 vs 2141 (1.07x, 69%, spread 4%) and 2331 vs
2037 (1.14x, 69%, spread 11%); batch 32 0.99x.

It is compiled on first use (`cpu_build.py`: g++ for this CPU, cached). Without a
compiler, or if the build fails, it logs one warning and the XLA path runs
(`available()` is False). `JAXSERVE_CPU_MOE_KERNEL=0` turns it off, and so the packing
(read when the engine packs and at trace time, for A/B benchmarks).

Numerics: float32 only (other dtypes take the XLA path): float32 products and sums (the
summation order differs from XLA's, so equal within float32 rounding), SiLU(gate) * up
in float32, as `moe_loop.swiglu_rows` with a float32 model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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
from jaxserve.kernels.packed_weight import PackedWeight
from jaxserve.models.base import replace_params

ENV_VAR = "JAXSERVE_CPU_MOE_KERNEL"
SOURCE = Path(__file__).with_name("cpu_moe_rows.cc")
TARGET = "jaxserve_cpu_moe_rows"
PANELS_TARGET = "jaxserve_cpu_moe_panels"  # the same on `ExpertPanels` weights
PANEL = 16  # columns of a panel (one zmm, two ymm registers)
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
    activations and stacked float32 weights (arrays or `ExpertPanels`), fewer than
    MAX_MEAN_GROUP routed rows per expert (MAX_MEAN_GROUP_TILED where the CPU has register
    tiles), the kernel enabled and built."""
    limit = MAX_MEAN_GROUP_TILED if has_tiles() else MAX_MEAN_GROUP
    return (
        jax.default_backend() == "cpu"
        and 0 < num_rows < limit * num_experts
        and x.dtype == jnp.float32
        and all(
            isinstance(w, (jax.Array, ExpertPanels)) and w.dtype == jnp.float32 for w in weights
        )
        and enabled()
        and available()
    )


@jax.tree_util.register_pytree_node_class
class ExpertPanels(PackedWeight):
    """A stacked float32 expert weight of logical shape [E, K, N] held panel-major.

    `panels` is [E, ceil(N / 16), K, 16] with panels[e, p, k, j] = W[e, k, 16 p + j] (zero
    past N): each expert's 16-column panel is one contiguous stream, which the kernel
    reads sequentially (module docstring). A `PackedWeight`: what the model code sees of
    it.
    """

    def __init__(self, panels: jax.Array, shape: tuple[int, ...]):
        self.panels = panels
        self.shape = tuple(shape)

    @classmethod
    def pack(cls, w: jax.Array) -> ExpertPanels:
        """The panel-major copy of w [E, K, N] (a new array: the caller drops `w`)."""
        e, k, n = w.shape
        p = -(-n // PANEL)
        padded = jnp.pad(w, ((0, 0), (0, 0), (0, p * PANEL - n)))
        return cls(jnp.transpose(padded.reshape(e, k, p, PANEL), (0, 2, 1, 3)), w.shape)

    def unpack(self) -> jax.Array:
        """The logical [E, K, N] array (a copy)."""
        e, p, k, _ = self.panels.shape
        flat = jnp.transpose(self.panels, (0, 2, 1, 3)).reshape(e, k, p * PANEL)
        return flat[:, :, : self.shape[2]]

    def tree_flatten(self):
        return (self.panels,), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children) -> ExpertPanels:
        return cls(children[0], shape)


def logical(w):
    """w as a plain [E, K, N] array: an `ExpertPanels` unpacked (a copy), else w."""
    return w.unpack() if isinstance(w, ExpertPanels) else w


def packs_experts() -> bool:
    """Whether the engine should hold its float32 expert weights as `ExpertPanels`: the
    CPU backend, a CPU with register tiles, the kernel enabled and built."""
    return jax.default_backend() == "cpu" and has_tiles() and enabled() and available()


def pack_experts(params: list, param_index: dict[tuple, int], paths: Sequence[tuple]) -> list:
    """The engine's flat parameter list with each float32 [E, K, N] expert weight at
    `paths` replaced by its `ExpertPanels`, where `packs_experts()`; else `params`
    unchanged.

    params: `jax.tree.flatten` leaves of the model state; param_index: state path ->
    index in params; paths: the expert weights' state paths (`base.expert_param_path`).
    Raises KeyError naming a path that is not a parameter.
    """
    if not packs_experts():
        return params

    def pack(w):
        packs = isinstance(w, jax.Array) and w.dtype == jnp.float32 and w.ndim == 3
        return ExpertPanels.pack(w) if packs else w

    return replace_params(params, param_index, ((p, pack) for p in paths), "pack_experts")


def moe_rows_ffn(
    x: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """SwiGLU of each token copy with its own expert, on the CPU kernel.

    Args:
        x: [T, H] float32 activations.
        ids: [T, k] int32 expert of each copy in [0, E]; E (or any id outside [0, E))
            marks an empty copy, whose output is 0.
        w_gate, w_up: [E, H, I] float32; w_down: [E, I, H] float32: all three arrays
            (the row-major target) or all three `ExpertPanels` (the panel-major one).

    Returns:
        [T, k, H] float32: expert_{ids[t, j]}(x[t]).

    Raises:
        ValueError: if some weights are `ExpertPanels` and some not.
        RuntimeError: if the kernel is not `available()`.
    """
    if not available():
        raise RuntimeError("the CPU MoE kernel is not available (see the log for why)")
    weights = (w_gate, w_up, w_down)
    panels = [isinstance(w, ExpertPanels) for w in weights]
    if any(panels) and not all(panels):
        raise ValueError("moe_rows_ffn: w_gate, w_up, w_down: all ExpertPanels or none")
    target = PANELS_TARGET if all(panels) else TARGET
    if all(panels):
        weights = tuple(w.panels for w in weights)
    num_tokens, top_k = ids.shape
    out = jax.ShapeDtypeStruct((num_tokens, top_k, x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, ids.astype(jnp.int32), *weights)


@functools.cache
def has_tiles() -> bool:
    """Whether the kernel is built with its register tiles: the CPU has AVX-512F, or AVX2
    and FMA (the build is -march=native; `cpu_tile_matmul.h`)."""
    flags = cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


@functools.cache
def available() -> bool:
    """Whether the kernel (both targets) is built and registered with XLA (built on the
    first call)."""
    what = "CPU MoE kernel (using the XLA path)"
    return register_kernel(_build, TARGET, "JaxserveMoeRows", what) and register_kernel(
        _build, PANELS_TARGET, "JaxserveMoePanels", what
    )


def _build() -> Path:
    """The kernel's shared library (`cpu_build.build_library`; RuntimeError if it cannot
    be built)."""
    return build_library(SOURCE, compiler())
