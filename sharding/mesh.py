"""The (dp, tp) device mesh, and the start-up check that a model fits on it.

Axes are `AxisType.Auto`: XLA's partitioner (GSPMD) propagates shardings through the
dense parts of the model from the weights' and inputs' shardings, and the MoE block and
the paged attention run inside `shard_map`, whose collectives are written out by hand.
(`jax.make_mesh` in JAX 0.11 makes *Explicit* axes, whose sharding-in-types rules
reject the model's implicit resharding; a mesh the caller built with Explicit axes is
rebuilt as Auto by `as_auto_mesh`.)

Device order: `jax.devices()` is ordered by process, so reshaping it to (dp, tp) keeps
each tp group inside one host (tp collectives on the fastest links) as long as tp
divides the number of devices per host.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxserve.config import MeshConfig
from jaxserve.models.config import ModelConfig
from jaxserve.sharding.rules import DP, TP


class MeshError(ValueError):
    """The mesh cannot be built, or cannot hold the model."""


def build_mesh(dp: int, tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A dp x tp mesh of Auto axes ("dp", "tp") over the first dp * tp devices.

    Args:
        dp: attention data-parallel ranks (>= 1).
        tp: tensor-parallel ranks (>= 1).
        devices: devices to use, default `jax.devices()` (all processes').

    Raises:
        MeshError: dp or tp < 1; fewer devices than dp * tp; or, with several processes,
            a mesh that does not span every process's devices.
    """
    if dp < 1 or tp < 1:
        raise MeshError(f"mesh: dp and tp must be >= 1, got dp={dp}, tp={tp}")
    devices = list(jax.devices() if devices is None else devices)
    size = dp * tp
    if size > len(devices):
        visible = f"{len(devices)} {'is' if len(devices) == 1 else 'are'} visible"
        raise MeshError(
            f"mesh dp={dp},tp={tp} needs {size} devices, but only {visible} "
            f"({devices[0].platform}; on the CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N to emulate N devices)"
        )
    if jax.process_count() > 1 and size != len(devices):
        raise MeshError(
            f"mesh dp={dp},tp={tp} ({size} devices) must span all {len(devices)} devices of "
            f"the {jax.process_count()} processes"
        )
    grid = np.array(devices[:size], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto))


def build_mesh_from_config(config: MeshConfig) -> Mesh:
    """`build_mesh(config.dp, config.tp)`."""
    return build_mesh(config.dp, config.tp)


def as_auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis `AxisType.Auto`.

    Raises:
        MeshError: the mesh's axes are not ("dp", "tp").
    """
    if tuple(mesh.axis_names) != (DP, TP):
        raise MeshError(f"mesh: expected axes ('dp', 'tp'), got {tuple(mesh.axis_names)}")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """(dp, tp) of a mesh built by `build_mesh`."""
    return mesh.shape[DP], mesh.shape[TP]


def check_model_fits(config: ModelConfig, mesh: Mesh, num_physical_experts: int | None = None):
    """Raise a clear error at start-up if `mesh` cannot hold the model.

    Experts (physical slots, `num_physical_experts`, default config.num_experts) are
    sharded over all dp * tp devices; query and KV heads over tp.

    Raises:
        MeshError: naming the config field and the mesh axis that do not divide.
    """
    dp, tp = mesh_shape(mesh)
    ep = dp * tp
    where = f"mesh dp={dp},tp={tp} cannot hold {config.architecture}"
    slots = config.num_experts if num_physical_experts is None else num_physical_experts
    if config.num_experts > 0 and slots % ep:
        field = "num_experts" if num_physical_experts is None else "num_physical_experts"
        raise MeshError(
            f"{where}: {field}={slots} is not divisible by ep = dp*tp = {ep} "
            "(experts are sharded over every device)"
        )
    if config.num_attention_heads % tp:
        raise MeshError(
            f"{where}: num_attention_heads={config.num_attention_heads} is not divisible by "
            f"tp={tp} (query heads are sharded over tp)"
        )
    # An MLA latent (DeepSeek) is one KV "head" replicated over tp, never split.
    if config.mla is None and config.num_key_value_heads % tp:
        raise MeshError(
            f"{where}: num_key_value_heads={config.num_key_value_heads} is not divisible by "
            f"tp={tp} (KV heads and the KV cache are sharded over tp)"
        )
    if config.intermediate_size % tp and any(
        not config.is_moe_layer(i) for i in range(config.num_hidden_layers)
    ):
        raise MeshError(
            f"{where}: intermediate_size={config.intermediate_size} is not divisible by "
            f"tp={tp} (dense MLP layers are sharded over tp)"
        )
    gate = config.grouped_gate
    if gate is not None and (config.moe_intermediate_size * gate.n_shared_experts) % tp:
        raise MeshError(
            f"{where}: moe_intermediate_size * n_shared_experts = "
            f"{config.moe_intermediate_size * gate.n_shared_experts} is not divisible by "
            f"tp={tp} (the shared experts are a dense MLP sharded over tp)"
        )
