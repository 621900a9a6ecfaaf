"""The SwiGLU experts of an MoE layer on one device: the dense oracle, the grouped-matmul
kernel path, and `moe_experts_local`, which picks between them and the sparse paths
(`moe_sparse`, `moe_slices`), all with `moe_experts_dense`'s contract. The gate that
makes topk_ids, and the block around the experts, are `moe.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels import cpu_moe, dispatch
from jaxserve.models.moe_slices import ExpertSlices, moe_experts_sliced
from jaxserve.models.moe_sparse import moe_experts_sparse


def moe_experts_dense(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """SwiGLU experts computed densely: every token through every expert, unselected
    experts weighted zero (E/k times the routed work). The oracle of the sparse
    (`moe_sparse.moe_experts_sparse`) and kernel paths, and their A/B baseline.

    x: [T, embed]; topk_weights: [T, k]; topk_ids: [T, k] int32;
    w_gate, w_up: [E, embed, expert_mlp]; w_down: [E, expert_mlp, embed]. Returns [T, embed].
    """
    num_tokens = x.shape[0]
    num_experts = w_gate.shape[0]
    combine = jnp.zeros((num_tokens, num_experts), x.dtype)
    combine = combine.at[jnp.arange(num_tokens)[:, None], topk_ids].add(topk_weights)
    gate = jnp.einsum("te,Eei->tEi", x, w_gate)
    up = jnp.einsum("te,Eei->tEi", x, w_up)
    h = jax.nn.silu(gate) * up
    out = jnp.einsum("tEi,Eie->tEe", h, w_down)
    return jnp.einsum("tEe,tE->te", out, combine)


def moe_experts_grouped(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """SwiGLU experts over token copies sorted by expert, through the grouped-matmul
    kernel (`dispatch.moe_ffn`): each expert's weights are read once for its rows, and
    no work is spent on unselected experts. Same contract as `moe_experts_dense`.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # [T*k] token copies grouped by expert
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    out = dispatch.moe_ffn(x[order // top_k], group_sizes, w_gate, w_up, w_down)
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkh,tk->th", unsorted, topk_weights.astype(out.dtype)).astype(x.dtype)


def moe_experts_local(*args) -> jax.Array:
    """The single-device experts: the grouped-matmul kernel where a kernel backend is
    active (NVIDIA GPU); elsewhere the sparse path (only the routed rows: `moe_slices`
    for weights held per expert, else `moe_sparse`, which takes the CPU kernel's
    panel-major `cpu_moe.ExpertPanels` too), or the dense oracle if
    `JAXSERVE_MOE_EXPERTS=dense` (`dispatch.moe_reference_experts`; on `ExpertPanels`
    unpacked, a copy)."""
    sparse = dispatch.sparse_reference_experts()
    if isinstance(args[3], cpu_moe.ExpertPanels) and not sparse:  # held panel-major
        args = (*args[:3], *(w.unpack() for w in args[3:]))
    if isinstance(args[3], ExpertSlices):  # w_gate held per expert (`moe_slices`)
        if sparse:
            return moe_experts_sliced(*args)
        args = (*args[:3], *(w.stacked() for w in args[3:]))
    if sparse:
        return moe_experts_sparse(*args)
    if dispatch.get_backend() != dispatch.REFERENCE:
        return moe_experts_grouped(*args)
    return moe_experts_dense(*args)
