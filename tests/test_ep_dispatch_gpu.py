"""The ragged expert-parallel dispatch on an NVIDIA GPU (`lax.ragged_all_to_all`, which
the CPU lacks), against the dense single-device MoE. Run by scripts/gpu_check.sh; skips
without a GPU (conftest_gpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest_gpu import skip_without_gpu  # noqa: F401 -- fixture used via pytestmark

from jaxserve.models.moe_experts import moe_experts_dense
from jaxserve.sharding import moe_ep
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.moe_ragged import ragged_supported
from jaxserve.sharding.placement import identity_placement

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("skip_without_gpu")]


def test_ragged_dispatch_on_the_gpu_matches_the_dense_moe():
    assert ragged_supported()
    hidden, inter, num_experts, top_k, num_tokens = 64, 32, 8, 2, 48
    rng = np.random.default_rng(0)
    experts = [
        (rng.standard_normal(s) * 0.3).astype(np.float32)
        for s in [(num_experts, hidden, inter)] * 2 + [(num_experts, inter, hidden)]
    ]
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in x]).astype(np.int32)
    w = np.full((num_tokens, top_k), 1 / top_k, np.float32)
    mesh = build_mesh(jax.device_count(), 1)
    fn = jax.jit(lambda *a: moe_ep.expert_parallel_moe(*a, mesh=mesh, capacity_factor=1.25))
    placement = jax.tree.map(jnp.asarray, identity_placement(num_experts))
    hlo = fn.lower(x, w, ids, *experts, placement).compile().as_text()
    assert "ragged-all-to-all" in hlo
    out = np.asarray(fn(x, w, ids, *experts, placement))
    want = moe_experts_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), *experts)
    np.testing.assert_allclose(out, np.asarray(want), atol=2e-3, rtol=2e-3)
