"""`MeshParallelism`: how a model built for one device runs on a (dp, tp) mesh.

A model takes one of these at construction (`parallel=`) and calls it at the
places where the mesh changes the computation; everything else (the projections, norms,
dense MLPs, the LM head) is partitioned by XLA from the weights' shardings (`rules.py`).

- `constrain_hidden`: the residual stream [T, H] is sharded over dp (DP attention: the
  flat batch is the dp ranks' batches concatenated) and replicated over tp.
- `paged_attention`: KV-cache writes and paged attention run per device in `shard_map`:
  each dp rank's tokens read only its own KV blocks (block ids in the metadata are local
  to the rank), each tp rank its own KV heads.
- `moe_experts`: expert parallelism over all devices (`moe_ep.py`), through the
  all_to_all path or, for steps of at most `replicated_max_tokens` tokens, the
  replicated-token path; the choice is static per step shape and logged.
- `expert_slots`: the slot each routed token is dispatched to, for the expert-load
  counts that EPLB records (the same rule as the dispatch, outside shard_map).
- `num_expert_slots` / `initial_placement`: S = E + num_redundant_experts physical
  slots per MoE layer, the first E holding experts 0..E-1 and the redundant ones
  replicas (of experts 0, 1, ...), in tables of a fixed width so that EPLB's new
  tables keep their shapes.

The single-device model (parallel=None) never touches this module.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.models.base import AttentionMetadata
from jaxserve.sharding import moe_ep
from jaxserve.sharding.dispatch_capacity import DEFAULT_CAPACITY_FACTOR
from jaxserve.sharding.placement import ExpertPlacement, choose_slots, placement_from_slots
from jaxserve.sharding.rules import (
    DP,
    HIDDEN_AXES,
    KV_CACHE_AXES,
    KV_LATENT_AXES,
    TP,
    logical_to_spec,
)

logger = logging.getLogger(__name__)

KVPair = tuple[jax.Array, jax.Array]
# (q, k, v, (k_cache, v_cache), positions, metadata) -> (out, (k_cache, v_cache)), on one
# device's shard: see `jaxserve.models.layers.paged_attention_step`.
AttentionStep = Callable[..., tuple[jax.Array, KVPair]]


@dataclass(frozen=True)
class MeshParallelism:
    """The mesh-dependent parts of the forward (static: hashed into the model graph).

    mesh: the (dp, tp) mesh of Auto axes (`mesh.build_mesh`).
    replicated_max_tokens: MoE steps of at most this many tokens (the whole flat batch,
        all dp ranks) take the replicated-token path; 0 = always all_to_all. Measure it
        with `ep_calibration.measure_replicated_max_tokens`.
    num_redundant_experts: R, expert slots per MoE layer beyond the E logical experts
        (replicas of hot experts, DeepSeek-V3's redundant experts); E + R must be
        divisible by the mesh size (checked by `sharding.mesh.check_model_fits`).
    capacity_factor: the all_to_all path's routing-sized dispatch
        (`dispatch_capacity`); None = worst-case buffers.
    """

    mesh: Mesh
    replicated_max_tokens: int = 0
    num_redundant_experts: int = 0
    capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR

    @property
    def dp(self) -> int:
        return self.mesh.shape[DP]

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP]

    def constrain_hidden(self, x: jax.Array) -> jax.Array:
        """[T, H] activations: tokens over dp, replicated over tp."""
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, logical_to_spec(HIDDEN_AXES))
        )

    def paged_attention(
        self,
        step: AttentionStep,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv: KVPair,
        positions: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVPair]:
        """Run `step` (KV write + paged attention of one device's shard) on every device.

        Shapes (global): q [T, Hq, D]; k, v [T, Hkv, D]; kv caches [dp * N, block_size,
        Hkv, D]; positions [T]; metadata in the DP layout: every field is the dp ranks'
        fields concatenated along its first axis, each rank's in the single-device
        layout of `models/base.py` with rank-local block ids, slots and rows.

        Raises:
            ValueError: a first dimension not divisible by dp (names the array).
        """
        self._check_dp_divisible(
            tokens=q.shape[0],
            kv_cache_blocks=kv[0].shape[0],
            **{f"metadata.{f}": getattr(metadata, f).shape[0] for f in _METADATA_FIELDS},
        )
        heads = P(DP, TP, None)
        cache = logical_to_spec(KV_CACHE_AXES)
        # P(DP) is a prefix of every metadata field: first axis over dp, the rest whole.
        sharded = jax.shard_map(
            step,
            mesh=self.mesh,
            in_specs=(heads, heads, heads, (cache, cache), P(DP), P(DP)),
            out_specs=(heads, (cache, cache)),
        )
        return sharded(q, k, v, kv, positions, metadata)

    def mla_paged_attention(
        self,
        step: AttentionStep,
        q_latent: jax.Array,
        q_rope: jax.Array,
        latent: jax.Array,
        k_rope: jax.Array,
        kv: KVPair,
        positions: jax.Array,
        metadata: AttentionMetadata,
        *,
        scale: float,
    ) -> tuple[jax.Array, KVPair]:
        """Multi-head Latent Attention's `step` (`models.mla.mla_paged_step`: latent-cache
        write + absorbed attention) on every device.

        What tp does with the latent: it is one "head" shared by all query heads, so it
        cannot be split by head. The query heads (q_latent [T, H, L], q_rope [T, H, R])
        are split over tp; the step's latent [T, 1, L] / k_rope [T, 1, R] and the latent
        cache [dp * N, block_size, 1, L or R] are replicated over tp (blocks over dp, as
        for GQA): every tp device writes the same latent and attends its H / tp heads
        against the whole of it (vLLM's MLA backend does the same under TP). The output
        [T, H, L] is split by head, for W_UV and o_proj, which are split by head too.

        Raises:
            ValueError: a first dimension not divisible by dp (names the array).
        """
        self._check_dp_divisible(
            tokens=q_latent.shape[0],
            kv_cache_blocks=kv[0].shape[0],
            **{f"metadata.{f}": getattr(metadata, f).shape[0] for f in _METADATA_FIELDS},
        )
        heads, shared = P(DP, TP, None), P(DP, None, None)
        cache = logical_to_spec(KV_LATENT_AXES)
        sharded = jax.shard_map(
            functools.partial(step, scale=scale),
            mesh=self.mesh,
            in_specs=(heads, heads, shared, shared, (cache, cache), P(DP), P(DP)),
            out_specs=(heads, (cache, cache)),
        )
        return sharded(q_latent, q_rope, latent, k_rope, kv, positions, metadata)

    def moe_path(self, num_tokens: int) -> str:
        """The MoE path for a step of `num_tokens` tokens (logged once per shape)."""
        path = moe_ep.REPLICATED if num_tokens <= self.replicated_max_tokens else moe_ep.ALL_TO_ALL
        _log_path_once(num_tokens, path, self.replicated_max_tokens, self.dp, self.tp)
        return path

    def moe_experts(
        self,
        x: jax.Array,
        topk_weights: jax.Array,
        topk_ids: jax.Array,
        w_gate: jax.Array,
        w_up: jax.Array,
        w_down: jax.Array,
        placement: dict[str, jax.Array],
        token_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Expert-parallel experts; see `moe_ep.expert_parallel_moe` for shapes.
        `placement` holds the `ExpertPlacement` fields by name (the model's state).
        `token_mask` is not used: padded tokens are dispatched like real ones (their
        outputs are dropped), as the dispatch buffers' static shapes cost the same."""
        del token_mask
        return moe_ep.expert_parallel_moe(
            x,
            topk_weights,
            topk_ids,
            w_gate,
            w_up,
            w_down,
            ExpertPlacement(**placement),
            mesh=self.mesh,
            path=self.moe_path(x.shape[0]),
            capacity_factor=self.capacity_factor,
        )

    def expert_slots(self, topk_ids: jax.Array, placement: dict[str, jax.Array]) -> jax.Array:
        """The physical slot each (token, choice) is dispatched to, by both MoE paths:
        `choose_slots` with the token's index in the global flat batch (the index the
        shard_map bodies compute from their dp/tp position). For EPLB's load counts.

        topk_ids: [T, k] int32 logical experts (the dp ranks' tokens concatenated);
        placement: the `ExpertPlacement` fields by name. Returns [T, k] int32 in [0, S).
        """
        token = jnp.arange(topk_ids.shape[0], dtype=jnp.int32)
        return choose_slots(topk_ids, token, ExpertPlacement(**placement))

    def num_expert_slots(self, num_experts: int) -> int:
        """S = E + num_redundant_experts physical slots per MoE layer."""
        return num_experts + self.num_redundant_experts

    @property
    def max_replicas(self) -> int:
        """Width of the logical_to_physical table: R + 1, the most slots one expert
        can get, so any re-placement of the S slots fits the same table shape."""
        return self.num_redundant_experts + 1

    def initial_placement(self, num_experts: int) -> dict[str, np.ndarray]:
        """Placement tables of a freshly loaded checkpoint, by `ExpertPlacement` field
        name, as host int32 arrays: slot s holds expert s % E (the identity for the
        first E slots; redundant slot E + r a replica of expert r % E), with
        logical_to_physical max_replicas wide. R = 0: the identity, [E, 1]."""
        slots = np.arange(self.num_expert_slots(num_experts)) % num_experts
        return dataclasses.asdict(placement_from_slots(slots, num_experts, self.max_replicas))

    def _check_dp_divisible(self, **sizes: int) -> None:
        for name, size in sizes.items():
            if size % self.dp:
                raise ValueError(
                    f"DP attention: {name} has {size} rows, not divisible by dp={self.dp} "
                    "(the step must be the dp ranks' equal-size batches concatenated)"
                )


_METADATA_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "token_req")

_logged_paths: set[tuple[int, str, int, int, int]] = set()


def _log_path_once(num_tokens: int, path: str, threshold: int, dp: int, tp: int) -> None:
    key = (num_tokens, path, threshold, dp, tp)
    if key not in _logged_paths:
        _logged_paths.add(key)
        logger.info(
            "MoE step of %d tokens on dp=%d,tp=%d: %s path (replicated_max_tokens=%d)",
            num_tokens,
            dp,
            tp,
            path,
            threshold,
        )
