"""The sparse MoE block (`MoeBlock`): the top-k softmax gate (`route`), the experts call
through the model's `Parallelism`, and the per-slot expert-load counts that EPLB records
(`count_expert_tokens`); plus the expert-placement tables an expert-parallel block holds
as state (`PlacementTable`, `PLACEMENT_FIELDS`).

The expert computations themselves are `moe_experts.py` (one device) and
`jaxserve.sharding.moe_ep` (a mesh); the weights are declared with `layers.param`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.layers import ONE_DEVICE, Parallelism, param


class PlacementTable(nnx.Variable):
    """An int32 expert-placement table of an expert-parallel MoE block: model state
    (traced, so the load balancer can rewrite it without a recompile), not a weight."""


def route(
    x: jax.Array, gate: jax.Array, top_k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax gate (Shazeer et al. 2017; HF Qwen3-MoE / Mixtral order: softmax over
    all experts in float32, then top-k, then optional renormalization).

    x: [T, embed]; gate: [embed, experts].
    Returns (topk_weights [T, k] in x.dtype, topk_ids [T, k] int32).
    """
    logits = x @ gate
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


class MoeBlock(nnx.Module):
    """Sparse MoE block: gate -> top-k -> SwiGLU experts -> weighted sum.

    Weights: gate [embed, experts] (replicated: every device routes its own tokens);
    w_gate, w_up [experts, embed, expert_mlp]; w_down [experts, expert_mlp, embed].

    With `parallel` (a device mesh) the experts run expert-parallel, and the expert
    weights are indexed by physical slot: slot s holds logical expert
    `physical_to_logical[s]`. There are `parallel.num_expert_slots(E)` slots (E, plus
    any redundant slots for replicas of hot experts); the placement tables
    (`PlacementTable` state) start as `parallel.initial_placement(E)`: slot e holds
    expert e for e < E, the redundant slots replicas, so the loader fills slot s from
    the checkpoint's expert `physical_to_logical[s]`.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]"
            )
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.parallel = parallel = ONE_DEVICE if parallel is None else parallel
        self.num_experts = num_experts
        e, h, i = num_experts, hidden_size, moe_intermediate_size
        # Physical expert slots: E on one device, E + redundant slots on a mesh.
        s = parallel.num_expert_slots(e)
        self.gate = param(rngs, (h, e), ("embed", None), dtype)
        self.w_gate = param(rngs, (s, h, i), ("experts", "embed", "expert_mlp"), dtype)
        self.w_up = param(rngs, (s, h, i), ("experts", "embed", "expert_mlp"), dtype)
        self.w_down = param(rngs, (s, i, h), ("experts", "expert_mlp", "embed"), dtype)
        tables = self.initial_placement()
        for name, table in tables.items():
            setattr(self, name, PlacementTable(jnp.asarray(table)))
        self.placement_fields = tuple(tables)

    def initial_placement(self) -> dict[str, Any]:
        """The placement tables of a freshly loaded checkpoint (expert-parallel blocks
        only), by name (`PLACEMENT_FIELDS`), as host arrays: {} on one device."""
        return self.parallel.initial_placement(self.num_experts)

    def select_experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gate: x [T, embed] -> (topk_weights [T, k] in x.dtype, topk_ids [T, k]
        int32 logical experts). Softmax top-k here; a family with another gate (DeepSeek's
        grouped gate, `models/deepseek_moe.py`) overrides this method only."""
        return route(x, self.gate[...], self.top_k, self.norm_topk_prob)

    def __call__(
        self, x: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """x: [T, embed]; token_mask: [T] bool, False for padded tokens (None: all real).

        Returns (out [T, embed], slot_counts [S] int32): the MoE output, and how many
        (real token, top-k choice) pairs went to each physical slot (S = E on one device;
        on a mesh the slot each pair is dispatched to, replicas included), the expert load
        that EPLB records (`jaxserve.eplb.recorder`).
        """
        weights, ids = self.select_experts(x)
        experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
        num_slots = self.w_gate.shape[0]
        tables = {name: getattr(self, name)[...] for name in self.placement_fields}
        out = self.parallel.moe_experts(x, weights, ids, *experts, tables, token_mask)
        slots = self.parallel.expert_slots(ids, tables)
        return out, count_expert_tokens(slots, token_mask, num_slots)


# T * k * S up to which `count_expert_tokens` compares and sums instead of scattering
# (decode steps; a [T, k, S] comparison this small costs less than the scatter's ops).
SMALL_COUNT_ELEMENTS = 1 << 16


def count_expert_tokens(
    slots: jax.Array, token_mask: jax.Array | None, num_slots: int
) -> jax.Array:
    """Tokens routed to each expert slot: the per-layer load of vLLM's EPLB
    (`expert_load_pass`) and SGLang's ExpertDistributionRecorder, on device.

    slots: [T, k] int32 slot (or logical expert) of each token's top-k choices;
    token_mask: [T] bool, False for padded tokens, which are not counted (None: all
    real). Returns [num_slots] int32.
    """
    ones = jnp.ones(slots.shape, jnp.int32)
    if token_mask is not None:
        ones = ones * token_mask[:, None].astype(jnp.int32)
    if slots.size * num_slots <= SMALL_COUNT_ELEMENTS:
        # Decode sizes: one fused compare-and-sum over [T, k, S]. The scatter-add below
        # costs three ops on the CPU (a zeroed buffer, the index layout, the scatter), per
        # MoE layer and decode step. Same counts: the scatter's index rules (a negative
        # slot counts from the end, one out of range is dropped) and exact integer sums.
        wrapped = jnp.where(slots < 0, slots + num_slots, slots)
        hits = wrapped[..., None] == jnp.arange(num_slots, dtype=slots.dtype)
        return jnp.sum(jnp.where(hits, ones[..., None], 0), axis=(0, 1), dtype=jnp.int32)
    # A scatter-add of T*k ones: no [T, k, S] one-hot is materialized.
    return jnp.zeros(num_slots, jnp.int32).at[slots].add(ones, mode="drop")


# The placement tables of an expert-parallel MoE block (`PlacementTable` attributes).
PLACEMENT_FIELDS = ("logical_to_physical", "replica_counts", "physical_to_logical")
