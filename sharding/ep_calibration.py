"""Measure where the replicated-token MoE path stops beating the all_to_all path.

Both paths of `moe_ep.expert_parallel_moe` give the same result; which is faster depends
on the batch, the model's shapes and the interconnect. At start-up the engine times
both on its own mesh, with the model's MoE shapes, for each step size it compiles, and
passes the crossover to `MeshParallelism(replicated_max_tokens=...)`. The timings and
the decision are logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.sharding import moe_ep
from jaxserve.sharding.dispatch_capacity import DEFAULT_CAPACITY_FACTOR
from jaxserve.sharding.placement import identity_placement
from jaxserve.sharding.rules import batch_sharding, named_sharding, replicated

logger = logging.getLogger(__name__)


def replicated_threshold(timings: dict[int, tuple[float, float]]) -> int:
    """The largest token count T such that the replicated path was faster at every
    measured count <= T (0 if it never was).

    timings: {num_tokens: (all_to_all seconds, replicated seconds)}.
    """
    threshold = 0
    for num_tokens in sorted(timings):
        all_to_all_s, replicated_s = timings[num_tokens]
        if replicated_s >= all_to_all_s:
            break
        threshold = num_tokens
    return threshold


def time_moe_paths(
    mesh: Mesh,
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    dtype: jnp.dtype = jnp.float32,
    repeats: int = 5,
    seed: int = 0,
    capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR,
) -> dict[str, float]:
    """Median seconds of one MoE-experts call per path, on random inputs of these shapes
    with uniform random routing (compilation excluded). capacity_factor: the all_to_all
    path's, as `MeshParallelism` runs it (`dispatch_capacity`).

    num_tokens is the whole flat batch (a multiple of dp); experts are sharded over the
    mesh as in the model.
    """
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    x = jax.device_put(
        rng.standard_normal((num_tokens, hidden)).astype(dtype), batch_sharding(mesh, 2)
    )
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
    ids = jax.device_put(ids.astype(np.int32), batch_sharding(mesh, 2))
    weights = jax.device_put(
        np.full((num_tokens, top_k), 1.0 / top_k, dtype), batch_sharding(mesh, 2)
    )
    experts = named_sharding(mesh, ("experts", None, None))
    scale = 1.0 / np.sqrt(hidden)
    w_gate, w_up = (
        jax.device_put(
            (rng.standard_normal((num_experts, hidden, intermediate)) * scale).astype(dtype),
            experts,
        )
        for _ in range(2)
    )
    w_down = jax.device_put(
        (rng.standard_normal((num_experts, intermediate, hidden)) * scale).astype(dtype), experts
    )
    placement = jax.device_put(identity_placement(num_experts), replicated(mesh))
    seconds = {}
    for path in (moe_ep.ALL_TO_ALL, moe_ep.REPLICATED):
        fn = jax.jit(
            lambda *a, path=path: moe_ep.expert_parallel_moe(
                *a, mesh=mesh, path=path, capacity_factor=capacity_factor
            )
        )
        args = (x, weights, ids, w_gate, w_up, w_down, placement)
        fn(*args).block_until_ready()  # compile and warm up
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            runs.append(time.perf_counter() - start)
        seconds[path] = float(np.median(runs))
    return seconds


def measure_replicated_max_tokens(
    mesh: Mesh,
    token_counts: Sequence[int],
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    dtype: jnp.dtype = jnp.float32,
) -> int:
    """Time both MoE paths at each of `token_counts` (whole-batch sizes, multiples of
    dp, e.g. the engine's token buckets times dp) and return `replicated_threshold`.

    Logs one line per count and the decision. Costs two small compilations per count; in
    one process the counts above the first where the replicated path loses are skipped
    (they cannot raise the threshold: start-up time). With several processes, all must
    call it and all measure every count (their collectives must match); process 0's
    result is returned everywhere.
    """
    timings = {}
    for num_tokens in sorted(token_counts):
        s = time_moe_paths(mesh, num_tokens, hidden, intermediate, num_experts, top_k, dtype)
        timings[num_tokens] = (s[moe_ep.ALL_TO_ALL], s[moe_ep.REPLICATED])
        logger.info(
            "MoE path timing, %d tokens: all_to_all %.1f us, replicated %.1f us",
            num_tokens,
            1e6 * timings[num_tokens][0],
            1e6 * timings[num_tokens][1],
        )
        if jax.process_count() == 1 and timings[num_tokens][1] >= timings[num_tokens][0]:
            break
    threshold = replicated_threshold(timings)
    if jax.process_count() > 1:
        # Every process must compile the same path, or the collectives would not match:
        # process 0's measurement decides.
        from jax.experimental import multihost_utils  # noqa: PLC0415

        threshold = int(multihost_utils.broadcast_one_to_all(np.int32(threshold)))
    logger.info(
        "MoE on dp=%d,tp=%d: replicated-token path for steps of <= %d tokens, all_to_all above",
        mesh.shape["dp"],
        mesh.shape["tp"],
        threshold,
    )
    return threshold
