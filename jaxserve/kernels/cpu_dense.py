"""The CPU kernel of a dense projection of a few rows, on weights repacked once at load.

Why: at decode sizes (a few rows a step) XLA's CPU dot of activations by a weight that
is a runtime argument (YNNPACK) repacks the weight on every call, so at 8 rows it
streams the weight 4-5x slower per byte than at one row (`scripts/bench_small_dots.py`;
the demo model's LM head [128, 4096]: 56 us at 1 row, 229 us at 8; the largest single op
of a demo batch-8 decode step, `scripts/bench_step_ops.py`). A kernel reading the
row-major [K, N] weight in place (session 20) gained only 1.0-1.2x: a 16-column panel
of it is K runs of 64 bytes, N * 4 bytes apart. So the engine repacks each projection
weight once, at load, panel-major (`PanelMajor`: [ceil(N / 16), K, 16], each panel one
contiguous stream, as llama.cpp and oneDNN pack theirs), and this kernel
(`cpu_dense_panels.cc`, an XLA FFI custom call) runs register tiles over the panels,
shared with XLA's intra-op pool.

Measured inside `LLM.generate` (`scripts/bench_step_ops.py --model demo --batches 8`,
64 tokens, AVX2 EPYC VM, 2 cores): the LM head's 64 decode calls took 12.0 ms of an
88 ms run on XLA's dot (185 us a call, the largest op) and 8.3 ms of 75 on the kernel
(130 us; in a loop alone it runs 61-77 us, XLA 91-167). End to end (`compare_hf.py
--baseline-python` main, 3 interleaved repeats, load 0.9-1.9): demo batch 1 / 8 / 32
1.00 / 1.01 / 1.13x (spreads 23 / 23 / 6%), qwen3moe batch 8 1.09x (spread 6%).

Where: `pack_params` (called by the engine's `ModelRunner` on one CPU device) replaces
the float32 weights of `layers.Attention` (q/k/v/o), `layers.MLP` and the untied LM head
by their `PanelMajor` after loading, so the checkpoint loader, the sharding rules and
EPLB (which moves expert weights only) see the logical arrays; the packed array
replaces the original in the engine's parameters (the model object the loader built
still holds the original until the engine's build returns, so the packed weights exist
twice for that moment). A tied LM head is the embedding too, read by rows: not packed.
The layers call `project`, which runs the kernel on a `PanelMajor` up to `MAX_ROWS`
rows (a default prefill chunk, `max_num_batched_tokens` 512, included) and XLA's dot on
the panels past it (1.0-1.3x slower than on the row-major weight), and their own dot
on a plain array (every other backend, dtype and mesh: unchanged).

It is compiled on first use (`cpu_build.py`: g++ for this CPU, cached). Without a
compiler, if the build fails, or on a CPU without AVX2 + FMA (or AVX-512) nothing is
packed (`applies()` False). `JAXSERVE_CPU_DENSE_KERNEL=0` turns it off (read when the
engine packs and at trace time, for A/B benchmarks).

Numerics: float32 only: float32 products and sums in k order per output, so equal to
XLA's within float32 rounding (its summation order differs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.kernels.cpu_build import build_library, compiler, register_kernel, switch_on
from jaxserve.kernels.cpu_moe import has_tiles
from jaxserve.kernels.packed_weight import PackedWeight
from jaxserve.models.base import replace_params

ENV_VAR = "JAXSERVE_CPU_DENSE_KERNEL"
SOURCE = Path(__file__).with_name("cpu_dense_panels.cc")
TARGET = "jaxserve_cpu_dense_panels"
PANEL = 16  # columns of a panel (one zmm, two ymm registers)
# Rows up to which the kernel runs; past them XLA's dot on the panels. Since the kernel
# reads x in place (no serial pack of x before the threads start) it is at least level
# with XLA's dot up to a prefill chunk of 512 rows. Measured (`scripts/bench_dense_panels.py`,
# AVX-512 EPYC VM, 2 cores, load 1.3-1.7, old and new kernel alternating 3x, medians), us
# at 8 / 32 / 128 / 256 / 512 rows, kernel / XLA's dot on the row-major weight / XLA's
# dot on the panels (the path past MAX_ROWS): [512, 512] 27 / 31 / 78, 95 / 144 / 168,
# 587 / 591 / 582, 842 / 869 / 913, 1401 / 1525 / 1724; [512, 4096] 174 / 228 / 577,
# 776 / 873 / 1395, 2700 / 3301 / 3816, 4976 / 5826 / 6672, 10000 / 10961 / 12092. The
# kernel with the pack: 1.0-1.3x slower on [512, 512] at 8-256 rows, 1.6x at 512. (Measured
# before the kernel's small work units, which made it 1.5-1.6x faster again at 128 rows
# [512, 512]: 332-372 us, XLA's dot 415-463: cpu_dense_panels.cc's kUnitsPerThread.) On the
# AVX2 EPYC VM (session 22, with the pack) the kernel's speed-up over XLA's dot on the
# row-major weight at 1 / 8 / 32 / 128 / 256 rows was [512, 4096] 1.21 / 1.24 / 1.48 /
# 0.99 / 0.92x, [512, 512] 0.83 / 1.65 / 0.88 / 0.91 / 0.75x (not re-measured there).
MAX_ROWS = 512
# Smallest weight (K * N floats) the engine packs: on smaller ones (the demo model's
# [128, 128] attention projections) XLA's dot is as fast or faster at every row count
# (`scripts/bench_dense_panels.py`), and they fit in L2 anyway. 1 << 17 packs the random
# Qwen3-MoE's k/v projections [512, 256]: at 128 rows the kernel (since its small work
# units) 184 us against XLA's 248, 8-32 rows 1.0-1.3x, 512 rows 0.83-1.0x; end to end
# (`compare_hf.py --models qwen3moe --baseline-python` 1 << 18, 3 interleaved repeats,
# AVX-512 EPYC VM, load 0.6-1.6) batch 32 / 128 1.10 / 1.08x, every repeat ahead.
MIN_WEIGHT_FLOATS = 1 << 17


@jax.tree_util.register_pytree_node_class
class PanelMajor(PackedWeight):
    """A float32 weight of logical shape [*k_dims, *n_dims] held panel-major.

    The product contracts the first `k_ndim` axes (K = their product) and keeps the rest
    (N = their product): `panels` is [ceil(N / 16), K, 16] with panels[p, k, j] =
    W[k, 16 p + j] of the [K, N] reshape (zero past N). A `PackedWeight`: what the model
    code sees of it.
    """

    def __init__(self, panels: jax.Array, shape: tuple[int, ...], k_ndim: int):
        self.panels = panels
        self.shape = tuple(shape)
        self.k_ndim = k_ndim

    @classmethod
    def pack(cls, w: jax.Array, k_ndim: int = 1) -> PanelMajor:
        """The panel-major copy of `w` (a new array: the caller drops `w`)."""
        k, n = math.prod(w.shape[:k_ndim]), math.prod(w.shape[k_ndim:])
        p = -(-n // PANEL)
        flat = jnp.pad(w.reshape(k, n), ((0, 0), (0, p * PANEL - n)))
        return cls(jnp.transpose(flat.reshape(k, p, PANEL), (1, 0, 2)), w.shape, k_ndim)

    def unpack(self) -> jax.Array:
        """The logical array (a copy)."""
        p, k, _ = self.panels.shape
        n = math.prod(self.shape[self.k_ndim :])
        return (
            jnp.transpose(self.panels, (1, 0, 2)).reshape(k, p * PANEL)[:, :n].reshape(self.shape)
        )

    def tree_flatten(self):
        return (self.panels,), (self.shape, self.k_ndim)

    @classmethod
    def tree_unflatten(cls, aux, children) -> PanelMajor:
        return cls(children[0], *aux)


def project(x: jax.Array, w, xla_dot) -> jax.Array:
    """x [T, *k_dims] times w [*k_dims, *n_dims] -> [T, *n_dims] float32.

    A `PanelMajor` w runs the kernel (up to MAX_ROWS rows and enabled) or XLA's dot on
    its panels; any other w runs `xla_dot(x, w)`, the caller's own product.
    """
    if not isinstance(w, PanelMajor):
        return xla_dot(x, w)
    k = math.prod(w.shape[: w.k_ndim])
    n_dims = w.shape[w.k_ndim :]
    n = math.prod(n_dims)
    rows = x.reshape(-1, k)
    if rows.shape[0] <= MAX_ROWS and enabled():
        y = dense_panels(rows, w.panels, n)
    else:
        y = jnp.einsum("tk,pkj->tpj", rows, w.panels, preferred_element_type=jnp.float32)
        y = y.reshape(rows.shape[0], -1)[:, :n]
    return y.reshape(*x.shape[: x.ndim - w.k_ndim], *n_dims)


def dense_panels(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x @ W on the kernel.

    Args:
        x: [M, K] float32.
        panels: [ceil(n / 16), K, 16] float32, `PanelMajor.panels` of W [K, n].
        n: W's columns.

    Returns:
        [M, n] float32.

    Raises:
        ValueError: if the shapes do not chain or a dtype is not float32.
        RuntimeError: if the kernel is not `available()`.
    """
    if x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], PANEL):
        raise ValueError(f"dense_panels: x {x.shape}, panels {panels.shape}: expected "
                         "[M, K], [P, K, 16]")  # fmt: skip
    if panels.shape[0] != -(-n // PANEL):
        raise ValueError(f"dense_panels: {panels.shape[0]} panels do not hold {n} columns")
    if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        raise ValueError(f"dense_panels: float32 only, got {x.dtype} @ {panels.dtype}")
    if not available():
        raise RuntimeError("the CPU dense kernel is not available (see the log for why)")
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, panels)


def pack_params(params: list, param_index: dict[tuple, int], weights: Sequence[tuple]) -> list:
    """The engine's flat parameter list with each float32 weight of `weights` of at
    least MIN_WEIGHT_FLOATS floats replaced by its `PanelMajor`, where the kernel
    `applies()`; else `params` unchanged.

    params: `jax.tree.flatten` leaves of the model state; param_index: state path ->
    index in params; weights: (state path, k_ndim) pairs (`dense_weights`). Raises
    KeyError naming a path that is not a parameter.
    """
    if not applies():
        return params

    def packer(k_ndim: int):
        def pack(w):
            packs = isinstance(w, jax.Array) and w.dtype == jnp.float32
            return PanelMajor.pack(w, k_ndim) if packs and w.size >= MIN_WEIGHT_FLOATS else w

        return pack

    pairs = ((path, packer(k_ndim)) for path, k_ndim in weights)
    return replace_params(params, param_index, pairs, "pack_params")


def enabled() -> bool:
    """Whether `JAXSERVE_CPU_DENSE_KERNEL` allows the kernel (`cpu_build.switch_on`)."""
    return switch_on(ENV_VAR)


def applies() -> bool:
    """Whether the engine should pack its weights: the CPU backend, a CPU with register
    tiles, the kernel enabled and built."""
    return jax.default_backend() == "cpu" and has_tiles() and enabled() and available()


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on the first call)."""
    return register_kernel(
        lambda: build_library(SOURCE, compiler()),
        TARGET,
        "JaxserveDensePanels",
        "CPU dense kernel (using XLA's dot)",
    )
