"""The one switch between the Pallas kernels and their pure-jnp references.

The backend is chosen once per process, by platform: the Mosaic GPU kernels on an
NVIDIA GPU, the references elsewhere (the CPU). The environment variable
`JAXSERVE_KERNELS` overrides the choice:

    reference   pure-jnp references (any platform)
    pallas      Mosaic GPU kernels (needs an NVIDIA GPU)
    interpret   Mosaic GPU kernels run by the Pallas GPU interpreter on the CPU (tests;
                slow: small shapes only)

Model code calls only the functions here (`paged_attention`, `moe_ffn`,
`grouped_matmul`), never a kernel module, so the choice lives in this one place.

The MoE experts on the reference backend (`moe_reference_experts`) are the sparse path
over the stacked weights (`jaxserve.models.moe_sparse`, only the routed rows). The
environment variable `JAXSERVE_MOE_EXPERTS=sliced` holds them one array per expert on one
device instead (`jaxserve.models.moe_slices`; opt-in until it measures better at every
batch size), and `=dense` forces the dense oracle (every token through every expert),
for A/B benchmarks. The kernel backends always use the grouped matmul. The
choice is read when a function is traced, so set the variable (or use
`backend_override`) before the first jit of a model. Shapes or dtypes a kernel cannot
take (a float32 model, head_dim 32, ...) run the reference on any backend, with one
warning per cause in the log.

Where paged attention runs without a Pallas kernel (the CPU, or a fallback), it runs
the C++ CPU kernel (`cpu_attention`: float32 on the CPU backend, when it could be built),
else the blockwise jnp version (`paged_attention_blockwise`: cost follows the real
context), never the gather-everything oracle `paged_attention_ref` unless asked:
`JAXSERVE_CPU_ATTENTION=kernel` (the default), `blockwise` or `reference` (A/B
benchmarks). It is read at trace time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterator

import jax

from jaxserve.kernels import cpu_attention, grouped_matmul_ref
from jaxserve.kernels.paged_attention_blockwise import paged_attention_blockwise
from jaxserve.kernels.paged_attention_ref import paged_attention_ref
from jaxserve.models.base import AttentionMetadata

ENV_VAR = "JAXSERVE_KERNELS"
MOE_ENV_VAR = "JAXSERVE_MOE_EXPERTS"
MOE_SPARSE = "sparse"
MOE_SLICED = "sliced"
MOE_DENSE = "dense"
REFERENCE = "reference"
PALLAS_MGPU = "pallas_mgpu"
INTERPRET = "interpret"
_ENV_VALUES = {"reference": REFERENCE, "pallas": PALLAS_MGPU, "interpret": INTERPRET}
CPU_ATTENTION_ENV_VAR = "JAXSERVE_CPU_ATTENTION"
_CPU_ATTENTION_VALUES = ("kernel", "blockwise", "reference")

_override: str | None = None
_log = logging.getLogger(__name__)


def has_nvidia_gpu() -> bool:
    """Whether JAX's default device is an NVIDIA GPU (not ROCm, not the CPU)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    version = getattr(device.client, "platform_version", "").lower()
    return "cuda" in version or device.device_kind.lower().startswith("nvidia")


@functools.cache
def _backend_from_environment() -> str:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value:
        if value not in _ENV_VALUES:
            raise ValueError(
                f"{ENV_VAR}={value!r}: expected one of {', '.join(sorted(_ENV_VALUES))}"
            )
        backend = _ENV_VALUES[value]
        if backend == PALLAS_MGPU and not has_nvidia_gpu():
            raise ValueError(
                f"{ENV_VAR}=pallas needs an NVIDIA GPU, but JAX's default device is "
                f"{jax.devices()[0].platform}; use 'interpret' to run the kernels on the CPU"
            )
        return backend
    return PALLAS_MGPU if has_nvidia_gpu() else REFERENCE


def get_backend() -> str:
    """The kernel backend of this process: 'pallas_mgpu', 'reference' or 'interpret'.

    Raises ValueError if JAXSERVE_KERNELS holds an unknown value, or asks for 'pallas'
    where there is no NVIDIA GPU.
    """
    return _override or _backend_from_environment()


def moe_reference_experts() -> str:
    """How the MoE experts run on the reference backend: 'sparse' (default), 'sliced'
    (sparse, weights held per expert where `ModelRunner` can) or 'dense'
    (`JAXSERVE_MOE_EXPERTS`, read when a model is built and traced, so one process can
    A/B them).

    Raises ValueError if JAXSERVE_MOE_EXPERTS holds another value.
    """
    value = os.environ.get(MOE_ENV_VAR, "").strip().lower() or MOE_SPARSE
    if value not in (MOE_SPARSE, MOE_SLICED, MOE_DENSE):
        raise ValueError(
            f"{MOE_ENV_VAR}={value!r}: expected {MOE_SPARSE}, {MOE_SLICED} or {MOE_DENSE}"
        )
    return value


def sparse_reference_experts() -> bool:
    """Whether the MoE experts run a sparse reference path: the reference backend and
    `moe_reference_experts` not 'dense' (the one-device experts and the expert-parallel
    path's local experts both ask this)."""
    return get_backend() == REFERENCE and moe_reference_experts() != MOE_DENSE


@contextlib.contextmanager
def backend_override(backend: str) -> Iterator[None]:
    """Use `backend` for calls traced inside the block (tests and benchmarks)."""
    global _override
    if backend not in (REFERENCE, PALLAS_MGPU, INTERPRET):
        raise ValueError(f"backend: expected reference, pallas_mgpu or interpret, got {backend!r}")
    previous, _override = _override, backend
    try:
        yield
    finally:
        _override = previous


@contextlib.contextmanager
def _kernel_mode(backend: str) -> Iterator[None]:
    """Run Mosaic GPU kernels traced here under the GPU interpreter if asked to."""
    if backend != INTERPRET:
        yield
        return
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415 -- only when used

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield


def _kernels(module: str):
    """A kernel module, imported on first use (keeps Pallas off the reference path)."""
    return importlib.import_module(f"jaxserve.kernels.{module}")


@functools.cache
def _fall_back(op: str, reason: str) -> None:
    """Log once per (op, reason) that a kernel backend runs the reference instead."""
    _log.warning("%s: the Pallas kernel cannot run %s; using the jnp reference", op, reason)


def _kernel_backend(op: str, reason: Callable[[], str | None]) -> str | None:
    """The kernel backend to run `op` on, or None for the reference (the reference
    backend, or a shape/dtype the kernel cannot take: `reason()` says why)."""
    backend = get_backend()
    if backend == REFERENCE:
        return None
    why = reason()
    if why is not None:
        _fall_back(op, why)
        return None
    return backend


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None
) -> jax.Array:
    """x [M, K] @ w[g] [G, K, N] over rows sorted by group -> [M, N] (`lax.ragged_dot`
    semantics: rows past sum(group_sizes) are 0; float32 accumulation).

    See `grouped_matmul.grouped_matmul` for shapes, dtypes and errors.
    """
    backend = _kernel_backend(
        "grouped_matmul",
        lambda: _kernels("grouped_matmul").unsupported_reason(x.shape[-1], w.shape[-1], x.dtype),
    )
    if backend is None:
        return grouped_matmul_ref.grouped_matmul_ref(
            x, w, group_sizes, preferred_element_type=preferred_element_type
        )
    with _kernel_mode(backend):
        return _kernels("grouped_matmul").grouped_matmul(
            x, w, group_sizes, preferred_element_type=preferred_element_type
        )


def moe_ffn(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """SwiGLU expert MLP over rows sorted by expert: [M, H] -> [M, H].

    w_gate, w_up: [E, H, I]; w_down: [E, I, H]; group_sizes: [E] int32. Rows past
    sum(group_sizes) give 0. See `grouped_matmul_ref.moe_ffn_ref` for the contract.
    """
    hidden, inter = w_gate.shape[-2], w_gate.shape[-1]

    def reason():
        check = _kernels("grouped_matmul").unsupported_reason
        return check(hidden, inter, x_sorted.dtype) or check(inter, hidden, x_sorted.dtype)

    backend = _kernel_backend("moe_ffn", reason)
    if backend is None:
        return grouped_matmul_ref.moe_ffn_ref(x_sorted, group_sizes, w_gate, w_up, w_down)
    with _kernel_mode(backend):
        return _kernels("grouped_matmul").moe_ffn(x_sorted, group_sizes, w_gate, w_up, w_down)


def _cpu_attention() -> str:
    """The paged attention to run without a Pallas kernel: 'kernel' (the CPU kernel where
    it applies, else blockwise), 'blockwise' or 'reference'.

    Raises ValueError naming JAXSERVE_CPU_ATTENTION for another value.
    """
    value = os.environ.get(CPU_ATTENTION_ENV_VAR, "").strip().lower() or "kernel"
    if value not in _CPU_ATTENTION_VALUES:
        raise ValueError(
            f"{CPU_ATTENTION_ENV_VAR}={value!r}: expected one of {', '.join(_CPU_ATTENTION_VALUES)}"
        )
    return value


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
) -> jax.Array:
    """Causal GQA attention of a flat token batch over the paged KV cache.

    Same contract as `paged_attention_ref.paged_attention_ref`: q [T, H, D], caches
    [num_blocks, block_size, KVH, D] -> [T, H, D] in q.dtype; padded tokens give zeros.
    Without a Pallas kernel it runs the CPU kernel, `paged_attention_blockwise` or the
    reference (see the module docstring); raises ValueError for a bad
    JAXSERVE_CPU_ATTENTION.
    max_query_len: optional static promise about the step (1 = decode-only), which lets
    the GPU kernel split long contexts over SMs when there are few requests; the
    reference ignores it.
    """
    backend = _kernel_backend(
        "paged_attention",
        lambda: _kernels("paged_attention").unsupported_reason(q.shape, k_cache.shape, q.dtype),
    )
    if backend is None:
        choice = _cpu_attention()
        if choice == "kernel" and cpu_attention.applies(q, k_cache, v_cache):
            attend = cpu_attention.paged_attention_cpu
        elif choice == "reference":
            attend = paged_attention_ref
        else:
            attend = paged_attention_blockwise
        return attend(q, k_cache, v_cache, positions, metadata, scale, sliding_window)
    with _kernel_mode(backend):
        return _kernels("paged_attention").paged_attention(
            q, k_cache, v_cache, positions, metadata, scale, sliding_window,
            max_query_len=max_query_len,
        )  # fmt: skip
