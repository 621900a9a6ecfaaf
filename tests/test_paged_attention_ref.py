"""`paged_attention_ref` against a NumPy brute force that reads each request's keys
position by position (no block gather), including GQA, a chunked-prefill request with
cached context, a decode, sliding windows and padded tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.kernels.paged_attention_ref import paged_attention_ref
from tests.model_utils import StepRequest, build_step

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 16, 5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _brute_force(q, k_cache, v_cache, requests, scale, window):
    out = []
    for req in requests:
        for i in range(len(req.tokens)):
            pos = req.start + i
            slots = [
                req.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(pos + 1)
                if window is None or pos - p < window
            ]
            keys = k_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots]  # [S, KVH, D]
            values = v_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots]
            row = []
            for h in range(HEADS):
                kv = h // (HEADS // KV_HEADS)
                s = keys[:, kv] @ q[len(out), h] * scale
                p = np.exp(s - s.max())
                row.append((p / p.sum()) @ values[:, kv])
            out.append(row)
    return np.asarray(out)


@pytest.mark.parametrize("window", [None, 3])
def test_matches_brute_force_and_padding_is_zero(window):
    rng = np.random.default_rng(0)
    k_cache = rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), np.float32)
    v_cache = rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), np.float32)
    requests = [
        StepRequest([1] * 5, 6, [9, 3, 12]),  # chunked prefill: positions 6..10
        StepRequest([2], 13, [4, 15, 7, 1]),  # decode at position 13
        StepRequest([3] * 3, 0, [11]),  # fresh prefill
    ]
    num_real = 9
    _, positions, metadata = build_step(requests, BLOCK_SIZE, MAX_BLOCKS, num_tokens=12, num_reqs=4)
    q = rng.standard_normal((12, HEADS, HEAD_DIM), np.float32)
    scale = HEAD_DIM**-0.5

    out = np.asarray(paged_attention_ref(q, k_cache, v_cache, positions, metadata, scale, window))
    expected = _brute_force(q, k_cache, v_cache, requests, scale, window)
    np.testing.assert_allclose(out[:num_real], expected, atol=1e-5, rtol=1e-5)
    assert np.all(out[num_real:] == 0.0)
