"""The CPU paged attention kernel (`cpu_attention`, C++) against the reference
(`paged_attention_ref`, the oracle) on random steps as the engine packs them (helpers of
`test_attention_cpu`): mixed prefill and decode rows, query tiles cut mid-request,
contexts ending on and off block boundaries, padded tokens and rows, GQA, sliding
windows; and how `dispatch.paged_attention` chooses it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_cpu import NUM_BLOCKS, arrays, random_requests, random_step

from jaxserve.kernels import cpu_attention, dispatch
from jaxserve.kernels.paged_attention_ref import paged_attention_ref

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler: test_kernel_builds_where_a_compiler_is"
)


@functools.cache
def _jitted(scale, window):
    return jax.jit(lambda *a: cpu_attention.paged_attention_cpu(*a, scale, window))


def assert_matches_reference(q, k, v, positions, metadata, window=None, expected=None):
    scale = q.shape[-1] ** -0.5
    if expected is None:
        expected = paged_attention_ref(q, k, v, positions, metadata, scale, window)
    out = _jitted(scale, window)(q, k, v, positions, metadata)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-6, rtol=2e-6)
    return out


def test_kernel_builds_where_a_compiler_is():
    assert cpu_attention.available() or cpu_attention.compiler() is None


@pytest.mark.parametrize("window", [None, 1, 6])
def test_random_mixed_steps_match_reference(window):
    """Prefill chunks up to 20 tokens (so tiles of 8 split requests), decode rows, padded
    tokens and rows; GQA with 2 and 4 query heads per KV head."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        requests = random_requests(rng, int(rng.integers(1, 8)), max_query=20)
        num_real = sum(q for q, _ in requests)
        heads, kv_heads = (4, 2) if seed % 2 else (8, 2)
        q, k, v = arrays(rng, num_real + 5, heads=heads, kv_heads=kv_heads, head_dim=24)
        positions, metadata = random_step(rng, requests, num_real + 5, 9)
        out = assert_matches_reference(q, k, v, positions, metadata, window)
        assert np.all(np.asarray(out[num_real:]) == 0.0)  # padded tokens


@pytest.mark.parametrize("window", [None, 5])
def test_many_requests_match_reference(window):
    """A step with 16 (request, query tile) pairs or more, where a work unit takes all KV
    heads (`kMinTilesAllHeads`): decode rows and prefill chunks over up to 3 blocks each,
    GQA with 2 query heads per KV head, padded tokens and rows."""
    rng = np.random.default_rng(20)
    requests = []
    for _ in range(20):
        seq_len = int(rng.integers(1, 13))
        requests.append((1 if rng.random() < 0.6 else int(rng.integers(1, seq_len + 1)), seq_len))
    num_real = sum(q for q, _ in requests)
    q, k, v = arrays(rng, num_real + 3, heads=8, kv_heads=4, head_dim=16)
    positions, metadata = random_step(rng, requests, num_real + 3, 22)
    out = assert_matches_reference(q, k, v, positions, metadata, window)
    assert np.all(np.asarray(out[num_real:]) == 0.0)  # padded tokens


def test_decode_rows_at_every_block_boundary_and_wide_heads():
    """One query token per request at contexts 1..48 around block boundaries; head_dim
    64 (the models' size: whole SIMD lanes) and 20 (a remainder)."""
    for head_dim in (64, 20):
        rng = np.random.default_rng(head_dim)
        requests = [(1, n) for n in (1, 3, 4, 5, 8, 9, 16, 17, 47, 48)]
        q, k, v = arrays(rng, 12, heads=8, kv_heads=4, head_dim=head_dim)
        positions, metadata = random_step(rng, requests, 12, 12)
        assert_matches_reference(q, k, v, positions, metadata)


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim", "window"),
    [
        (16, 8, 4, 64, None),  # the random Qwen3-MoE's shapes
        (16, 4, 2, 32, 19),  # the demo model's, with a window
        (32, 4, 4, 40, None),
        (8, 12, 3, 8, None),
        (16, 6, 2, 24, 7),
    ],
)
def test_block_sizes_head_dims_and_groups_match_reference(
    block_size, heads, kv_heads, head_dim, window
):
    """The kernel scores up to 16 keys of a block at a time (blocks of 8: one partial
    chunk; 16: one whole; 32: two) and head_dim 16 lanes at a time (64 and 32: whole
    lanes; 40, 24: a remainder; 8: only one), and takes a token's query heads two at a
    time (1, 2, 3, 4 per KV head: pairs sharing a KV head or not, one left over). Decode
    rows at contexts around block and chunk boundaries and prefill chunks; a step with 16
    (request, query tile) pairs or more (units of all KV heads) and one with a few (a KV
    head each)."""
    rng = np.random.default_rng(block_size * 100 + head_dim)
    decode = [(1, n) for n in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 70)]
    requests = decode + [(20, 40), (9, 9), (13, 50)]
    for step in (requests, requests[-3:] + decode[-2:]):
        num_real = sum(q for q, _ in step)
        q, k, v = arrays(rng, num_real + 2, heads, kv_heads, head_dim, block_size=block_size)
        positions, metadata = random_step(
            rng, step, num_real + 2, len(step) + 1, block_size=block_size
        )
        out = assert_matches_reference(q, k, v, positions, metadata, window)
        assert np.all(np.asarray(out[num_real:]) == 0.0)  # padded tokens


@pytest.mark.parametrize("window", [None, 50])
def test_contexts_over_one_segment_match_reference(window):
    """The kernel holds the scores of up to 8 chunks (128 keys at block 16) at once, and
    carries each row's running max, sum and output from one such segment to the next:
    decode rows and a prefill tile at contexts past 128 keys, with the Qwen3-MoE's shapes
    (a window makes the first segments of the longest rows see nothing)."""
    rng = np.random.default_rng(11 if window is None else 12)
    requests = [(1, 128), (1, 129), (1, 150), (8, 192)]
    num_real = sum(q for q, _ in requests)
    q, k, v = arrays(rng, num_real + 1, heads=8, kv_heads=4, head_dim=64, block_size=16)
    positions, metadata = random_step(rng, requests, num_real + 1, 5, block_size=16)
    assert_matches_reference(q, k, v, positions, metadata, window)


def test_long_prefill_and_all_padding():
    rng = np.random.default_rng(4)
    q, k, v = arrays(rng, 40, heads=2, kv_heads=2)
    positions, metadata = random_step(rng, [(37, 45)], 40, 1)
    assert_matches_reference(q, k, v, positions, metadata)
    positions, metadata = random_step(rng, [], 8, 4)
    out = cpu_attention.paged_attention_cpu(q[:8], k, v, positions, metadata, 0.3)
    assert np.all(np.asarray(out) == 0.0)


def test_blocks_outside_the_context_are_never_read():
    """Blocks no request owns (the null block too) hold NaN: the result equals the
    reference with them zeroed, so no key past a request's context is read."""
    rng = np.random.default_rng(7)
    requests = [(3, 10), (1, 5), (1, 24), (9, 9)]
    q, k, v = arrays(rng, 16, heads=4, kv_heads=2)
    positions, metadata = random_step(rng, requests, 16, 5)
    owned = np.zeros(NUM_BLOCKS, bool)
    for r, (_, seq_len) in enumerate(requests):
        owned[np.asarray(metadata.block_tables)[r, : -(-seq_len // 4)]] = True
    unowned = jnp.asarray(~owned)[:, None, None, None]
    k_nan, v_nan = (jnp.where(unowned, jnp.nan, x) for x in (k, v))
    k_zero, v_zero = (jnp.where(unowned, 0.0, x) for x in (k, v))
    expected = paged_attention_ref(q, k_zero, v_zero, positions, metadata, 8**-0.5)
    assert_matches_reference(q, k_nan, v_nan, positions, metadata, expected=expected)


def test_dispatch_takes_the_kernel_for_float32_and_blockwise_otherwise(monkeypatch):
    """By default (JAXSERVE_CPU_ATTENTION unset or `kernel`) float32 runs the kernel and
    bfloat16 the blockwise jnp path; `blockwise` and `reference` ask for those; another
    value is a ValueError naming the variable."""
    rng = np.random.default_rng(8)
    q, k, v = arrays(rng, 6, heads=4, kv_heads=2)
    positions, metadata = random_step(rng, [(4, 9), (1, 30)], 6, 3)
    calls = []
    for name in ("paged_attention_blockwise", "paged_attention_ref"):
        monkeypatch.setattr(dispatch, name, lambda *a, name=name, **kw: calls.append(name))
    monkeypatch.setattr(
        cpu_attention, "paged_attention_cpu", lambda *a, **kw: calls.append("kernel")
    )
    with dispatch.backend_override(dispatch.REFERENCE):
        for value in (None, "kernel", "blockwise", "reference"):
            if value is None:
                monkeypatch.delenv(dispatch.CPU_ATTENTION_ENV_VAR, raising=False)
            else:
                monkeypatch.setenv(dispatch.CPU_ATTENTION_ENV_VAR, value)
            dispatch.paged_attention(q, k, v, positions, metadata, 0.3)
        monkeypatch.setenv(dispatch.CPU_ATTENTION_ENV_VAR, "paged")
        with pytest.raises(ValueError, match=dispatch.CPU_ATTENTION_ENV_VAR):
            dispatch.paged_attention(q, k, v, positions, metadata, 0.3)
        monkeypatch.delenv(dispatch.CPU_ATTENTION_ENV_VAR)
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        dispatch.paged_attention(*bf16, positions, metadata, 0.3)
    assert calls == [
        "kernel", "kernel", "paged_attention_blockwise", "paged_attention_ref",
        "paged_attention_blockwise",
    ]  # fmt: skip


def test_without_a_compiler_dispatch_runs_blockwise(monkeypatch, tmp_path, caplog):
    """No compiler: one warning naming the cause, `available()` False, and dispatch runs
    the blockwise path with the reference's result."""
    monkeypatch.setattr(cpu_attention, "compiler", lambda: None)
    monkeypatch.setenv("JAXSERVE_CACHE_ROOT", str(tmp_path))
    cpu_attention.available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not cpu_attention.available()
        assert "no C++ compiler" in caplog.text
        rng = np.random.default_rng(9)
        q, k, v = arrays(rng, 6, heads=4, kv_heads=2)
        positions, metadata = random_step(rng, [(4, 9), (1, 30)], 6, 3)
        with dispatch.backend_override(dispatch.REFERENCE):
            out = dispatch.paged_attention(q, k, v, positions, metadata, 0.3)
        expected = paged_attention_ref(q, k, v, positions, metadata, 0.3)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-6)
        with pytest.raises(RuntimeError, match="not available"):
            cpu_attention.paged_attention_cpu(q, k, v, positions, metadata, 0.3)
    finally:
        cpu_attention.available.cache_clear()
