"""The blockwise CPU paged attention (`paged_attention_blockwise`) against the reference
(`paged_attention_ref`, the oracle) on random steps: shuffled block tables, mixed prefill
and decode rows, contexts of 1..N keys ending on and off block boundaries, padded tokens
and rows, GQA, sliding windows, bfloat16."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.paged_attention_blockwise import paged_attention_blockwise
from jaxserve.kernels.paged_attention_ref import paged_attention_ref
from jaxserve.models.base import PAD_SLOT, AttentionMetadata

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 64, 12


def random_step(rng, requests, num_tokens, num_rows, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE):
    """A flat batch as the engine packs it. requests: (query_len, seq_len) each, the query
    tokens being the last query_len positions; blocks (of block_size tokens) are drawn
    shuffled from 1..num_blocks-1; tokens past the requests are padding (PAD_SLOT, the
    last row), rows past them are padding (seq_len 0)."""
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((num_rows, MAX_BLOCKS), np.int32)
    seq_lens = np.zeros(num_rows, np.int32)
    qsl = np.zeros(num_rows + 1, np.int32)
    positions, slots, token_req = [], [], []
    for r, (q_len, seq_len) in enumerate(requests):
        n_blocks = -(-seq_len // block_size)
        tables[r, :n_blocks] = [free.pop() for _ in range(n_blocks)]
        seq_lens[r] = seq_len
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            slots.append(tables[r, p // block_size] * block_size + p % block_size)
            token_req.append(r)
        qsl[r + 1] = qsl[r] + q_len
    qsl[len(requests) + 1 :] = qsl[len(requests)]
    pad = num_tokens - len(positions)
    assert pad >= 0
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots + [PAD_SLOT] * pad, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens),
        query_start_loc=jnp.asarray(qsl),
        token_req=jnp.asarray(token_req + [num_rows - 1] * pad, jnp.int32),
    )
    return jnp.asarray(positions + [0] * pad, jnp.int32), metadata


def random_requests(rng, num_requests, max_query=6):
    """Random (query_len, seq_len): a third decode rows, the rest prefill chunks, some
    with cached context; a few contexts land exactly on a block boundary."""
    requests = []
    for _ in range(num_requests):
        seq_len = int(rng.integers(1, MAX_BLOCKS * BLOCK_SIZE + 1))
        if rng.random() < 0.25:
            seq_len = BLOCK_SIZE * int(rng.integers(1, MAX_BLOCKS + 1))
        q_len = 1 if rng.random() < 0.35 else int(rng.integers(1, min(max_query, seq_len) + 1))
        requests.append((q_len, seq_len))
    return requests


def arrays(rng, num_tokens, heads, kv_heads, head_dim=8, dtype=jnp.float32, block_size=BLOCK_SIZE):
    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    cache_shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    return normal((num_tokens, heads, head_dim)), normal(cache_shape), normal(cache_shape)


@functools.cache
def _jitted(scale, window, query_chunk):
    """One jitted function per static setting, shared by the tests (compiles are slow)."""
    return jax.jit(lambda *a: paged_attention_blockwise(*a, scale, window, query_chunk=query_chunk))


def assert_matches_reference(q, k, v, positions, metadata, window, query_chunk=None, atol=2e-6):
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_ref(q, k, v, positions, metadata, scale, window)
    out = _jitted(scale, window, query_chunk)(q, k, v, positions, metadata)
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=atol, rtol=atol
    )
    return out


@pytest.mark.parametrize("query_chunk", [None, 1, 3, 16])
def test_random_mixed_steps_match_reference(query_chunk):
    """Random steps of one padded shape (T = 48 tokens, R = 8 rows), so that one
    compiled function serves every context length."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        requests = random_requests(rng, int(rng.integers(1, 8)))
        q, k, v = arrays(rng, 48, heads=4, kv_heads=2)
        positions, metadata = random_step(rng, requests, 48, 8)
        out = assert_matches_reference(q, k, v, positions, metadata, None, query_chunk)
        num_real = sum(q for q, _ in requests)
        assert np.all(np.asarray(out[num_real:]) == 0.0)  # padded tokens


@pytest.mark.parametrize(("window", "query_chunk"), [(1, None), (6, None), (6, 5)])
def test_sliding_window_matches_reference(window, query_chunk):
    rng = np.random.default_rng(10 + window)
    requests = [(9, 30), (1, 17), (4, 4), (1, 48), (7, 13)]
    q, k, v = arrays(rng, 26, heads=4, kv_heads=1)
    positions, metadata = random_step(rng, requests, 26, 6)
    assert_matches_reference(q, k, v, positions, metadata, window, query_chunk)


def test_decode_only_steps_and_block_boundaries_match_reference():
    """Decode rows (the one-token-chunk branch) at contexts 1..N, every block boundary."""
    rng = np.random.default_rng(3)
    requests = [(1, n) for n in (1, 3, 4, 5, 8, 9, 16, 17, 47, 48)]
    q, k, v = arrays(rng, 12, heads=8, kv_heads=2)
    positions, metadata = random_step(rng, requests, 12, 12)
    assert_matches_reference(q, k, v, positions, metadata, None)


def test_single_long_prefill_and_single_token():
    rng = np.random.default_rng(4)
    q, k, v = arrays(rng, 40, heads=2, kv_heads=2)
    positions, metadata = random_step(rng, [(37, 45)], 40, 1)
    assert_matches_reference(q, k, v, positions, metadata, None)
    q1, k1, v1 = arrays(rng, 1, heads=2, kv_heads=2)
    positions, metadata = random_step(rng, [(1, 21)], 1, 1)
    assert_matches_reference(q1, k1, v1, positions, metadata, None)


def test_all_padding_step_is_zero():
    rng = np.random.default_rng(5)
    q, k, v = arrays(rng, 8, heads=4, kv_heads=2)
    positions, metadata = random_step(rng, [], 8, 4)
    out = paged_attention_blockwise(q, k, v, positions, metadata, 0.3)
    assert np.all(np.asarray(out) == 0.0)


def test_bfloat16_matches_reference():
    rng = np.random.default_rng(6)
    requests = [(5, 22), (1, 9), (1, 33), (12, 12)]
    q, k, v = arrays(rng, 20, heads=4, kv_heads=2, head_dim=16, dtype=jnp.bfloat16)
    positions, metadata = random_step(rng, requests, 20, 5)
    assert_matches_reference(q, k, v, positions, metadata, None, atol=1e-2)


def test_blocks_outside_the_context_are_never_read():
    """Cache blocks no request owns (the null block included, which every unused table
    entry points at) hold NaN: the result stays equal to the reference computed with
    them zeroed, so no key past a request's context is read."""
    rng = np.random.default_rng(7)
    requests = [(3, 10), (1, 5), (1, 24)]
    q, k, v = arrays(rng, 8, heads=4, kv_heads=2)
    positions, metadata = random_step(rng, requests, 8, 4)
    owned = np.zeros(NUM_BLOCKS, bool)
    for r, (_, seq_len) in enumerate(requests):
        owned[np.asarray(metadata.block_tables)[r, : -(-seq_len // BLOCK_SIZE)]] = True
    unowned = jnp.asarray(~owned)[:, None, None, None]
    k_nan, v_nan = (jnp.where(unowned, jnp.nan, x) for x in (k, v))
    k_zero, v_zero = (jnp.where(unowned, 0.0, x) for x in (k, v))
    scale = 8**-0.5
    expected = paged_attention_ref(q, k_zero, v_zero, positions, metadata, scale)
    for chunk in (None, 1, 4):
        out = _jitted(scale, None, chunk)(q, k_nan, v_nan, positions, metadata)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-6, rtol=2e-6)
