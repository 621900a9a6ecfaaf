"""The checks of test_kernels.py at Qwen3-30B-A3B sizes, on a GPU (marked `gpu`; skipped
without one), against XLA (lax.ragged_dot, the jnp attention reference) rather than
NumPy. A GPU has no interpreter to poison outputs, so `poison_device_memory` fills the
free part of JAX's memory pool with NaN just before each kernel call: the call's output
buffers are carved from that memory, and an element no tile writes stays NaN
(`test_gpu_poison_reaches_kernel_outputs` pins that premise down on the device).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest_gpu import skip_without_gpu  # noqa: F401 -- fixture used via pytestmark
from kernel_oracles import (
    QWEN3_30B,
    assert_close,
    attention_batch,
    bf16,
    f64,
    kernel_writing_nothing,
)

from jaxserve.kernels import grouped_matmul, paged_attention
from jaxserve.kernels.paged_attention_ref import paged_attention_ref

pytestmark = pytest.mark.usefixtures("skip_without_gpu")


def poison_device_memory(min_bytes: int = 1 << 20, max_chunks: int = 256) -> int:
    """Fill the free chunks (of at least `min_bytes`) of the default device's allocator
    with NaN, then free them. XLA's BFC allocator keeps freed memory in its pool,
    unzeroed; filling the small chunks too matters, as best-fit would hand one of them to
    an output that fits. Chunks are powers of two, so the fills compile a few times only.
    `max_chunks` bounds the work: 256 chunks of up to 4 GiB cover an H200's pool.

    Returns the bytes poisoned (0 where the device reports no memory statistics: the
    value checks still run, and `test_gpu_poison_reaches_kernel_outputs` fails).
    """
    device = jax.devices()[0]
    held = []
    for _ in range(max_chunks):
        stats = device.memory_stats() or {}
        free = stats.get("largest_free_block_bytes")
        if free is None:
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        free -= 1024  # the allocator's rounding and chunk bookkeeping
        if free < min_bytes:
            break
        # The largest power of two that fits, at most 4 GiB (2^30 elements: int32 indexing).
        size = min(1 << (free.bit_length() - 1), 1 << 32)
        try:
            held.append(jnp.full((size // 4,), jnp.nan, jnp.float32).block_until_ready())
        except Exception:  # noqa: BLE001 -- out of memory (fragmentation): done
            break
    poisoned = sum(array.nbytes for array in held)
    for array in held:
        array.delete()
    return poisoned


def skewed_group_sizes(rng, rows: int, groups: int) -> jax.Array:
    """Random skewed rows per group summing to `rows`, with group 0 empty and group 1
    a single row."""
    sizes = rng.multinomial(rows - 1, rng.dirichlet(np.full(groups, 0.5)))
    big = 2 + int(np.argmax(sizes[2:]))
    sizes[big] += sizes[0] + sizes[1]
    sizes[0], sizes[1] = 0, 1
    return jnp.asarray(sizes, jnp.int32)


def ragged_dot_f32(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


@pytest.mark.gpu
def test_gpu_poison_reaches_kernel_outputs():
    """The premise of the poisoned-output checks on a GPU: after `poison_device_memory`,
    a kernel that writes nothing returns NaN."""
    writes_nothing = jax.jit(kernel_writing_nothing((4096, 128)))
    x = jnp.zeros((8, 64), jnp.bfloat16)
    assert poison_device_memory() > 0, "no device memory statistics to find free memory"
    assert np.isnan(np.asarray(writes_nothing(x), np.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 256, 4096])
def test_moe_ffn_full_size_on_gpu(tokens):
    """Grouped matmul, fused gate+up+SiLU and the expert FFN against lax.ragged_dot:
    skewed groups (one empty, one of a single row) and 5 rows past the groups."""
    rng = np.random.default_rng(7)
    e, h, i, k = (QWEN3_30B[n] for n in ("experts", "hidden", "inter", "top_k"))
    m = tokens * k
    x = bf16(rng, (m, h))
    w_gate, w_up = bf16(rng, (e, h, i), 0.02), bf16(rng, (e, h, i), 0.02)
    w_down = bf16(rng, (e, i, h), 0.02)
    group_sizes = skewed_group_sizes(rng, m - 5, e)

    @jax.jit
    def reference(x, group_sizes, w_gate, w_up, w_down):
        gate, up = ragged_dot_f32(x, w_gate, group_sizes), ragged_dot_f32(x, w_up, group_sizes)
        hidden = (gate * jax.nn.sigmoid(gate) * up).astype(x.dtype)
        return hidden, jax.lax.ragged_dot(hidden, w_down, group_sizes)

    hidden, expected = reference(x, group_sizes, w_gate, w_up, w_down)
    for fuse in (False, True):
        poison_device_memory()
        out = jax.jit(functools.partial(grouped_matmul.moe_ffn, fuse_gate_up=fuse))(
            x, group_sizes, w_gate, w_up, w_down
        )
        assert_close(out, f64(expected))
    poison_device_memory()
    out = jax.jit(grouped_matmul.grouped_matmul_gate_up)(x, w_gate, w_up, group_sizes)
    assert_close(out, f64(hidden))
    poison_device_memory()
    out = jax.jit(grouped_matmul.grouped_matmul)(x, w_gate, group_sizes)
    assert_close(out, f64(jax.lax.ragged_dot(x, w_gate, group_sizes)))


def full_size_attention_inputs(rng, requests, num_tokens, max_blocks):
    """Qwen3-30B-A3B attention shapes (32 query heads, 4 KV heads, head dim 128, block
    size 16) over `requests` (query_len, seq_len), blocks in random order."""
    heads, kv_heads, head_dim, block_size = 32, 4, 128, 16
    num_blocks = sum(-(-n // block_size) for _, n in requests) + 1
    return attention_batch(
        rng, requests, num_tokens=num_tokens, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, max_blocks=max_blocks,
    )  # fmt: skip


def check_attention_on_gpu(inputs, scale, **options):
    """The kernel on poisoned memory against the jnp reference (XLA)."""
    expected = jax.jit(paged_attention_ref, static_argnums=(5,))(*inputs, scale)
    poison_device_memory()
    fn = functools.partial(paged_attention.paged_attention, scale=scale, **options)
    assert_close(jax.jit(fn)(*inputs), f64(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("max_query_len", [None, 1])
@pytest.mark.parametrize("batch, context", [(64, 1024), (8, 8192)])
def test_paged_decode_attention_full_size_on_gpu(batch, context, max_query_len):
    """Decode at random lengths, plus a context of one key and contexts that end at a
    block boundary and one past it; max_query_len=1 allows the split-KV launch."""
    rng = np.random.default_rng(8)
    lens = rng.integers(context // 2, context + 1, batch)
    lens[:4] = [1, context, context - 16, 16 * 5 + 1]
    requests = [(1, int(n)) for n in lens]
    inputs = full_size_attention_inputs(rng, requests, batch + 3, context // 16)
    check_attention_on_gpu(inputs, 128**-0.5, max_query_len=max_query_len)


@pytest.mark.gpu
def test_paged_prefill_attention_full_size_on_gpu():
    """A mixed step: prefill chunks (one from position 0, one continuing a context, one
    ending at a block boundary) among decode tokens, and padding tokens."""
    rng = np.random.default_rng(9)
    requests = [(512, 2048), (300, 300), (1, 4000), (100, 1000), (64, 1024)] + [(1, 700)] * 60
    tokens = sum(q for q, _ in requests) + 13
    inputs = full_size_attention_inputs(rng, requests, tokens, 4096 // 16)
    check_attention_on_gpu(inputs, 0.088)
