"""Expert placement: which physical expert slot holds which logical expert.

Placement is data, not code: the tables are int32 arrays that the MoE step reads as
traced inputs, so the expert-parallel load balancer (EPLB) re-places experts by writing
new tables (and moving the weights of the slots it changed) without a recompile. The
number of physical slots S is fixed at start-up; S >= E, and the S - E extra slots
hold replicas of hot experts (DeepSeek-V3's "redundant experts"; the table layout
follows DeepSeek's EPLB, github.com/deepseek-ai/EPLB).

Slots are spread evenly over the ep = dp * tp devices in device order: device d holds
slots [d * S/ep, (d + 1) * S/ep).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertPlacement:
    """The placement tables of one MoE layer (jax or NumPy arrays).

    logical_to_physical: [E, max_replicas] int32; row e lists the slots holding expert
        e. Entries at or past replica_counts[e] repeat the first slot (so any index is a
        valid slot; they are never chosen).
    replica_counts: [E] int32 in [1, max_replicas], number of slots holding expert e.
    physical_to_logical: [S] int32, the logical expert in each slot.
    """

    logical_to_physical: jax.Array
    replica_counts: jax.Array
    physical_to_logical: jax.Array

    @property
    def num_experts(self) -> int:
        return self.logical_to_physical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def max_replicas(self) -> int:
        return self.logical_to_physical.shape[1]


def placement_from_slots(
    physical_to_logical: np.ndarray, num_experts: int, max_replicas: int | None = None
) -> ExpertPlacement:
    """Build the tables (NumPy int32) from the logical expert of every slot.

    Args:
        physical_to_logical: [S] ints in [0, num_experts).
        num_experts: E, the number of logical experts.
        max_replicas: width of logical_to_physical; default the most replicas any expert
            has. Keep it fixed across re-placements so the table shapes (and the compiled
            step) do not change.

    Raises:
        ValueError: a slot names an expert outside [0, E); an expert has no slot; an
            expert has more than max_replicas slots.
    """
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    if p2l.ndim != 1:
        raise ValueError(f"physical_to_logical: expected [S], got shape {p2l.shape}")
    if p2l.size and (p2l.min() < 0 or p2l.max() >= num_experts):
        raise ValueError(f"physical_to_logical: entries must be in [0, {num_experts})")
    counts = np.bincount(p2l, minlength=num_experts)
    if (counts == 0).any():
        missing = np.flatnonzero(counts == 0).tolist()
        raise ValueError(f"physical_to_logical: experts {missing[:10]} have no slot")
    width = int(counts.max()) if max_replicas is None else max_replicas
    if counts.max() > width:
        raise ValueError(
            f"physical_to_logical: expert {int(counts.argmax())} has {int(counts.max())} "
            f"replicas, more than max_replicas={width}"
        )
    l2p = np.empty((num_experts, width), np.int32)
    for e in range(num_experts):
        slots = np.flatnonzero(p2l == e)
        l2p[e, : len(slots)] = slots
        l2p[e, len(slots) :] = slots[0]
    return ExpertPlacement(
        logical_to_physical=l2p,
        replica_counts=counts.astype(np.int32),
        physical_to_logical=p2l.astype(np.int32),
    )


def identity_placement(num_experts: int, max_replicas: int = 1) -> ExpertPlacement:
    """Slot s holds expert s (S = E): the placement of a freshly loaded checkpoint."""
    return placement_from_slots(np.arange(num_experts), num_experts, max_replicas)


def choose_slots(
    topk_ids: jax.Array, token_index: jax.Array, placement: ExpertPlacement
) -> jax.Array:
    """The physical slot that serves each (token, choice).

    A token picks replica `token_index % replica_counts[e]` of expert e, so the tokens
    of a hot expert are spread evenly over its replicas, deterministically (the same
    global token index gives the same slot on every device and in every MoE path).

    topk_ids: [N, k] int32 logical experts; token_index: [N] int32 global token index.
    Returns [N, k] int32 slots in [0, S).
    """
    counts = placement.replica_counts[topk_ids]
    replica = token_index[:, None] % counts
    return placement.logical_to_physical[topk_ids, replica].astype(jnp.int32)
