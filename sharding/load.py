"""Load a model onto a (dp, tp) mesh: check it fits, build its `MeshParallelism`, place
every weight on its shard by the rules table.

Accepts a Hugging Face folder (weights read tensor by tensor from safetensors, each put
straight onto its shards) or a folder written by `jaxserve convert` (Orbax checkpoint,
restored directly onto the shards); `jaxserve.models.loader.load_model` tells them
apart.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import DecoderOnlyLM
from jaxserve.models.loader import load_config, load_model
from jaxserve.sharding.mesh import as_auto_mesh, check_model_fits
from jaxserve.sharding.parallel import MeshParallelism
from jaxserve.sharding.rules import param_sharding_fn


def load_sharded_model(
    model_dir: str | Path,
    mesh: Mesh,
    dtype: jnp.dtype | str = jnp.float32,
    *,
    replicated_max_tokens: int = 0,
    num_redundant_experts: int = 0,
) -> tuple[DecoderOnlyLM, ModelConfig]:
    """The model of `model_dir` on `mesh`, sharded by `rules.LOGICAL_AXIS_RULES`.

    Args:
        model_dir: HF folder or `jaxserve convert` output.
        mesh: a (dp, tp) mesh (`mesh.build_mesh`); Explicit axes are rebuilt as Auto.
        dtype: parameter dtype.
        replicated_max_tokens: MoE steps of at most this many tokens take the
            replicated-token path (see `MeshParallelism`; measure it with
            `ep_calibration.measure_replicated_max_tokens`).
        num_redundant_experts: R, extra expert slots per MoE layer (E + R slots, the
            extra ones filled with replicas; see `MeshParallelism.initial_placement`).

    Returns:
        (model, config). The model's forward expects the DP flat-batch layout
        (`MeshParallelism.paged_attention`) and a KV cache placed with
        `rules.kv_cache_sharding(mesh)`.

    Raises:
        MeshError: the mesh cannot hold the model (names the field); and
        `load_model`'s errors.
    """
    mesh = as_auto_mesh(mesh)
    config = load_config(model_dir)
    slots = config.num_experts + num_redundant_experts if num_redundant_experts else None
    check_model_fits(config, mesh, num_physical_experts=slots)
    parallel = MeshParallelism(mesh, replicated_max_tokens, num_redundant_experts)
    return load_model(
        model_dir, dtype, mesh=mesh, shardings=param_sharding_fn(mesh), parallel=parallel
    )
