"""The one table that maps logical axes to mesh axes, and the shardings derived from it.

Every weight declares its logical axes where it is defined (`models/layers.py`,
`models/moe.py`, metadata `out_sharding`); activations, the flat token batch and the paged
KV cache use the logical names below too. Changing how anything is sharded means changing
`LOGICAL_AXIS_RULES` and nothing else (the pattern of jax-ml/jax-llm-examples and
MaxText's `logical_axis_rules`).

Mesh axes (see `mesh.py`): "dp" (attention data parallel: each dp rank has its own
requests and KV cache) and "tp" (tensor parallel inside attention and dense layers).
Experts are sharded over both, ep = dp x tp ("wide EP").
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DP, TP = "dp", "tp"
# The expert-parallel group: every device of the mesh, dp-major (device index dp * tp + tp).
EP: tuple[str, str] = (DP, TP)

MeshAxes = str | tuple[str, ...] | None

# Logical axis -> mesh axes (None = replicated along that dimension).
LOGICAL_AXIS_RULES: dict[str, MeshAxes] = {
    # Weights.
    "vocab": None,
    "embed": None,
    "q_heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "mlp": TP,
    "experts": EP,
    "expert_mlp": None,
    # Activations and the KV cache: the flat batch of a step is the concatenation of the
    # dp ranks' batches, and each dp rank owns a contiguous range of KV blocks.
    "tokens": DP,
    "requests": DP,
    "kv_blocks": DP,
    "kv_block_slots": None,
}

# Logical axes of the arrays that are not weights.
KV_CACHE_AXES = ("kv_blocks", "kv_block_slots", "kv_heads", "head_dim")
# An MLA latent cache (`models.base.KVLayout`, shard_heads=False): one latent "head",
# replicated over tp.
KV_LATENT_AXES = ("kv_blocks", "kv_block_slots", None, "head_dim")
HIDDEN_AXES = ("tokens", "embed")


def logical_to_spec(axes: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec of an array whose dimensions have these logical axes.

    A None entry is a dimension that is never sharded.

    Raises:
        ValueError: a logical axis missing from `LOGICAL_AXIS_RULES` (names it), or two
            dimensions mapped to the same mesh axis.
    """
    mesh_axes: list[MeshAxes] = []
    for axis in axes:
        if axis is None:
            mesh_axes.append(None)
            continue
        if axis not in LOGICAL_AXIS_RULES:
            raise ValueError(
                f"logical axis {axis!r} has no sharding rule; known: {sorted(LOGICAL_AXIS_RULES)}"
            )
        mesh_axes.append(LOGICAL_AXIS_RULES[axis])
    used = [a for m in mesh_axes if m is not None for a in ((m,) if isinstance(m, str) else m)]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {tuple(axes)} map two dimensions onto one mesh axis")
    return PartitionSpec(*mesh_axes)


def named_sharding(mesh: Mesh, axes: Sequence[str | None]) -> NamedSharding:
    """NamedSharding on `mesh` for an array with logical `axes`."""
    return NamedSharding(mesh, logical_to_spec(axes))


def param_sharding_fn(mesh: Mesh):
    """The placement hook of `jaxserve.models.loader.load_model`:
    (parameter path, logical axes) -> NamedSharding. Parameters without logical axes
    (none today) are replicated."""

    def shardings(path: str, axes: tuple[str, ...]) -> jax.sharding.Sharding:
        del path  # placement depends only on the logical axes
        return named_sharding(mesh, axes)

    return shardings


def kv_cache_sharding(mesh: Mesh, shard_heads: bool = True) -> NamedSharding:
    """Sharding of one layer's K or V cache [dp * num_blocks, block_size, kv_heads,
    head_dim]: blocks over dp (each dp rank its own range), kv heads over tp (with
    shard_heads=False, an MLA latent cache, replicated over tp)."""
    return named_sharding(mesh, KV_CACHE_AXES if shard_heads else KV_LATENT_AXES)


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Sharding of a flat-batch array ([T] tokens, [dp * R] rows, [dp * R, B] block
    tables...): the leading dimension over dp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_AXIS_RULES["tokens"], *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())
