"""What the kernel tests (test_kernels.py, test_kernel_dispatch.py, test_kernels_gpu.py)
compare against and build their inputs with: NumPy float64 oracles of the grouped matmul,
the expert FFN and paged attention, a flat batch as the engine builds it, a kernel that
writes nothing (the premise of the poisoned-output checks) and Qwen3-30B-A3B's sizes."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from jaxserve.models.base import PAD_SLOT, AttentionMetadata

BF16_RTOL = 1e-2  # max |out - oracle| / max |oracle|
QWEN3_30B = dict(experts=128, hidden=2048, inter=768, top_k=8)


def assert_close(out, oracle, rtol=BF16_RTOL):
    out = np.asarray(out, np.float64)
    assert out.shape == oracle.shape
    assert np.isfinite(out).all(), f"{np.sum(~np.isfinite(out))} elements not written/finite"
    scale = max(np.abs(oracle).max(), 1e-6)
    err = np.abs(out - oracle).max() / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# --- grouped matmul -----------------------------------------------------------------


def gmm_oracle(x, w, group_sizes):
    """NumPy float64: rows [start_g, end_g) times w[g]; rows past the groups are 0."""
    x, w = f64(x), f64(w)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), x.shape[0])
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def moe_oracle(x, group_sizes, w_gate, w_up, w_down):
    gate, up = gmm_oracle(x, w_gate, group_sizes), gmm_oracle(x, w_up, group_sizes)
    hidden = gate / (1.0 + np.exp(-gate)) * up
    return gmm_oracle(hidden, w_down, group_sizes)


def kernel_writing_nothing(shape: tuple[int, int]):
    """A Mosaic GPU kernel that takes one input and writes none of its [shape] bf16
    output."""

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        grid=(1,),
        grid_names=("sm",),
    )
    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    return writes_nothing


# --- paged attention ------------------------------------------------------------------


def make_batch(rng, requests, *, num_tokens, block_size, num_blocks, max_blocks):
    """A flat batch as the engine builds it. requests: (query_len, seq_len) each; the
    query tokens are the last query_len positions; blocks are a random permutation of
    1..num_blocks-1; tokens past the requests are padding."""
    free = list(rng.permutation(np.arange(1, num_blocks)))
    rows = len(requests) + 1  # one padded request row
    block_tables = np.zeros((rows, max_blocks), np.int32)
    qsl, positions, slots, token_req, seq_lens = [0], [], [], [], []
    for r, (q_len, seq_len) in enumerate(requests):
        blocks = -(-seq_len // block_size)
        block_tables[r, :blocks] = [free.pop() for _ in range(blocks)]
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            slots.append(block_tables[r, p // block_size] * block_size + p % block_size)
            token_req.append(r)
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(seq_len)
    pad = num_tokens - len(positions)
    assert pad >= 0
    positions += [0] * pad
    slots += [PAD_SLOT] * pad
    token_req += [len(requests)] * pad
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(block_tables),
        seq_lens=jnp.asarray(seq_lens + [0], jnp.int32),
        query_start_loc=jnp.asarray(qsl + [qsl[-1]], jnp.int32),
        token_req=jnp.asarray(token_req, jnp.int32),
    )
    return jnp.asarray(positions, jnp.int32), metadata


def attention_batch(rng, requests, *, num_tokens, heads, kv_heads, head_dim, block_size,
                    num_blocks, max_blocks):  # fmt: skip
    """(q, k_cache, v_cache, positions, metadata): `make_batch`'s batch with random
    bfloat16 queries [num_tokens, heads, head_dim] and caches [num_blocks, block_size,
    kv_heads, head_dim]."""
    positions, metadata = make_batch(
        rng,
        requests,
        num_tokens=num_tokens,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
    )
    q = bf16(rng, (num_tokens, heads, head_dim))
    k_cache = bf16(rng, (num_blocks, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (num_blocks, block_size, kv_heads, head_dim))
    return q, k_cache, v_cache, positions, metadata


def attention_oracle(q, k_cache, v_cache, positions, metadata, scale, window=None):
    """NumPy float64, token by token: keys 0..pos (and < seq_len, inside the window) of
    the token's request, gathered slot by slot through its block table."""
    q, k_cache, v_cache = f64(q), f64(k_cache), f64(v_cache)
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl = np.asarray(metadata.query_start_loc)
    tables, seq_lens = np.asarray(metadata.block_tables), np.asarray(metadata.seq_lens)
    out = np.zeros_like(q)
    for r in range(len(qsl) - 1):
        for t in range(qsl[r], qsl[r + 1]):
            pos = int(positions[t])
            keys = [
                kp for kp in range(min(pos + 1, seq_lens[r])) if window is None or pos - kp < window
            ]
            blocks = tables[r, [kp // block_size for kp in keys]]
            offsets = [kp % block_size for kp in keys]
            for h in range(num_heads):
                k = k_cache[blocks, offsets, h // group]
                v = v_cache[blocks, offsets, h // group]
                s = k @ q[t, h] * scale
                p = np.exp(s - s.max())
                out[t, h] = p @ v / p.sum()
    return out
