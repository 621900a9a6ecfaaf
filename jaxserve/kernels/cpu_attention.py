"""The CPU kernel of paged attention: each request's keys read in place, once per tile.

Why: in XLA, attention over a paged cache needs the blocks gathered (a copy of every key
a step reads, transposed) and a loop over them whose iterations cost tens of
microseconds each on the CPU (`paged_attention_blockwise`). At decode sizes that loop,
not the arithmetic, is the step's attention time: about a quarter of a decode step of
the random Qwen3-MoE at batch 1 and 8 (`scripts/bench_step_ops.py`). This kernel
(`cpu_paged_attention.cc`, an XLA FFI custom call) walks each request's block table
itself: work units of (request, up to 8 query tokens, all KV heads or one), the online
softmax of FlashAttention (Dao et al. 2022) over segments of up to 128 keys, no copy, no
padding.

Contract: that of `paged_attention_ref.paged_attention_ref` (the test oracle), for
float32 q and caches. Other dtypes take `paged_attention_blockwise`. Numerics: float32
scores, softmax and sums, in another order than the reference's (equal within float32
rounding).

It is compiled on first use (`cpu_build.py`); without a compiler, or if the build
fails, it logs one warning and `paged_attention_blockwise` runs (`available()` is
False). `dispatch.paged_attention` chooses it by `JAXSERVE_CPU_ATTENTION` (`kernel`, the
default).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu_build import build_library, compiler, register_kernel
from jaxserve.models.base import AttentionMetadata

SOURCE = Path(__file__).with_name("cpu_paged_attention.cc")
TARGET = "jaxserve_cpu_paged_attention"


def applies(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> bool:
    """Whether the kernel can run this attention: the CPU backend, float32 q and caches,
    the kernel built."""
    return (
        jax.default_backend() == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == jnp.float32
        and available()
    )


def paged_attention_cpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal GQA attention of a flat token batch over the paged KV cache, on the CPU kernel.

    Args:
        q: [T, H, D] float32 queries (RoPE applied); H a multiple of KVH.
        k_cache, v_cache: [num_blocks, block_size, KVH, D] float32, this step's K/V written.
        positions: [T] int32 position of each token in its request.
        metadata: `models.base.AttentionMetadata`; token t belongs to request r iff
            query_start_loc[r] <= t < query_start_loc[r + 1]; slot PAD_SLOT marks padding.
        scale: softmax scale (natural-log units).
        sliding_window: if set (> 0), token t sees keys with positions[t] - key < window.

    Returns:
        [T, H, D] float32; padded tokens and tokens of rows with seq_len 0 are 0.

    Raises:
        RuntimeError: if the kernel is not `available()`.
        ValueError: if sliding_window is not None and <= 0.
    """
    if not available():
        raise RuntimeError("the CPU attention kernel is not available (see the log for why)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: expected > 0 or None, got {sliding_window}")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(TARGET, out)(
        q, k_cache, v_cache, i32(positions), i32(metadata.block_tables),
        i32(metadata.seq_lens), i32(metadata.query_start_loc), i32(metadata.slot_mapping),
        scale=np.float32(scale), sliding_window=np.int32(sliding_window or 0),
    )  # fmt: skip


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on the first call)."""
    return register_kernel(
        lambda: build_library(SOURCE, compiler()), TARGET, "JaxservePagedAttention",
        "CPU attention kernel (using the blockwise XLA path)",
    )  # fmt: skip
