"""The jnp reference of absorbed MLA over the latent paged cache
(`jaxserve.kernels.paged_attention_mla_ref`) against a brute-force NumPy loop: per token,
its request's latents and RoPE keys read position by position through the block table,
softmax in float64."""

from __future__ import annotations

import numpy as np

from jaxserve.kernels.paged_attention_mla_ref import mla_paged_attention_ref
from jaxserve.models.base import PAD_SLOT
from tests.model_utils import StepRequest, build_step


def test_mla_ref_matches_brute_force():
    rng = np.random.default_rng(0)
    heads, rank, rope, bs, num_blocks, max_blocks = 3, 8, 4, 4, 16, 4
    latent = rng.normal(size=(num_blocks, bs, 1, rank)).astype(np.float32)
    ropes = rng.normal(size=(num_blocks, bs, 1, rope)).astype(np.float32)
    # A decode at position 9 and a 3-token prefill chunk at positions 4..6, padded.
    reqs = [StepRequest([1], 9, [7, 2, 11]), StepRequest([1, 2, 3], 4, [5, 9])]
    _, positions, md = build_step(reqs, bs, max_blocks, num_tokens=6, num_reqs=3)
    q_lat = rng.normal(size=(6, heads, rank)).astype(np.float32)
    q_rope = rng.normal(size=(6, heads, rope)).astype(np.float32)
    scale = 0.3
    got = np.asarray(mla_paged_attention_ref(q_lat, q_rope, latent, ropes, positions, md, scale))
    slots = np.asarray(md.slot_mapping)
    for t in range(6):
        if slots[t] == PAD_SLOT:
            np.testing.assert_array_equal(got[t], 0)
            continue
        r = int(md.token_req[t])
        table = reqs[r].block_table
        keys = range(int(positions[t]) + 1)
        c = np.stack([latent[table[p // bs], p % bs, 0] for p in keys]).astype(np.float64)
        k = np.stack([ropes[table[p // bs], p % bs, 0] for p in keys]).astype(np.float64)
        for h in range(heads):
            s = (c @ q_lat[t, h] + k @ q_rope[t, h]) * scale
            w = np.exp(s - s.max())
            want = (w / w.sum()) @ c
            np.testing.assert_allclose(got[t, h], want, atol=1e-5, rtol=0)
