"""Flax NNX layers shared by the model families: RMSNorm, RoPE, GQA attention over the
paged KV cache and the dense SwiGLU MLP (the MoE block is `moe.py`).

Every weight is declared once, in its layer (here and in `moe.py`), with its shape, dtype
and *logical* axes (`param`: metadata `out_sharding`, read by `nnx.get_partition_spec`);
the sharding rules table that maps logical axes to mesh axes lives in
`jaxserve.sharding`, not here. Logical axis names: "vocab", "embed", "q_heads",
"kv_heads", "head_dim", "mlp", "experts", "expert_mlp"; None marks a dimension that is
never sharded (the gate's expert columns, as in MaxText).

A model is built with `parallel=` (a `Parallelism`): the paged attention and the MoE
experts call it. On one device (parallel=None, the default) it is `ONE_DEVICE`, which
runs the plain functions here and in `moe_experts.py`; on a device mesh,
`jaxserve.sharding.parallel.MeshParallelism`.

Numerics follow HF transformers (Qwen3-MoE / Mixtral): RMSNorm and RoPE in float32,
attention softmax in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.kernels import dispatch
from jaxserve.kernels.cpu_dense import project
from jaxserve.kernels.paged_attention_ref import masked_softmax
from jaxserve.models.base import PAD_SLOT, AttentionMetadata
from jaxserve.models.config import Llama3RopeScaling
from jaxserve.models.moe_experts import moe_experts_local

KVPair = tuple[jax.Array, jax.Array]
Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]

# HF models initialise linear weights with normal(0, initializer_range=0.02).
_DEFAULT_INIT: Initializer = nnx.initializers.normal(stddev=0.02)


class Parallelism(Protocol):
    """Where the mesh changes a model's computation: `OneDevice` (one device) or
    `jaxserve.sharding.parallel.MeshParallelism` (a dp x tp mesh)."""

    def constrain_hidden(self, x: jax.Array) -> jax.Array: ...

    def paged_attention(
        self, step: Callable, q, k, v, kv: KVPair, positions, metadata
    ) -> tuple[jax.Array, KVPair]: ...

    def mla_paged_attention(
        self,
        step: Callable,
        q_latent,
        q_rope,
        latent,
        k_rope,
        kv: KVPair,
        positions,
        metadata,
        *,
        scale: float,
    ) -> tuple[jax.Array, KVPair]: ...

    def moe_experts(
        self,
        x,
        topk_weights,
        topk_ids,
        w_gate,
        w_up,
        w_down,
        placement: dict[str, jax.Array],
        token_mask: jax.Array | None = None,
    ) -> jax.Array: ...

    def initial_placement(self, num_experts: int) -> dict[str, Any]: ...

    def num_expert_slots(self, num_experts: int) -> int: ...

    def expert_slots(self, topk_ids: jax.Array, placement: dict[str, jax.Array]) -> jax.Array: ...


@dataclass(frozen=True)
class OneDevice:
    """The `Parallelism` of one device: the plain functions of this module and of
    `moe_experts`, no placement tables (expert slot s holds logical expert s)."""

    def constrain_hidden(self, x: jax.Array) -> jax.Array:
        return x

    def paged_attention(self, step: Callable, q, k, v, kv: KVPair, positions, metadata):
        return step(q, k, v, kv, positions, metadata)

    def mla_paged_attention(self, step: Callable, *args, scale: float):
        return step(*args, scale=scale)

    def moe_experts(
        self, x, topk_weights, topk_ids, w_gate, w_up, w_down, placement, token_mask=None
    ):
        del placement
        if token_mask is not None and dispatch.sparse_reference_experts():
            # Padded tokens become empty copies (id E), which the sparse paths skip: a
            # 1-token step padded to a 16-token bucket would otherwise read the weights
            # of the experts its 15 padding rows route to (their outputs are dropped).
            topk_ids = jnp.where(token_mask[:, None], topk_ids, w_gate.shape[0])
        return moe_experts_local(x, topk_weights, topk_ids, w_gate, w_up, w_down)

    def initial_placement(self, num_experts: int) -> dict[str, Any]:
        return {}

    def num_expert_slots(self, num_experts: int) -> int:
        return num_experts

    def expert_slots(self, topk_ids: jax.Array, placement: dict[str, jax.Array]) -> jax.Array:
        return topk_ids


ONE_DEVICE = OneDevice()


def param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype: jnp.dtype,
    init: Initializer = _DEFAULT_INIT,
) -> nnx.Param:
    """A weight with its logical axes recorded as `out_sharding` metadata.

    `eager_sharding=False`: the weight is not placed at creation (the loader places each
    weight on its shard when it reads it), so building a model needs no mesh.
    """
    if len(shape) != len(axes):
        raise ValueError(f"param: shape {shape} and logical axes {axes} differ in rank")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


def _ones(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), HF order: normalize in float32,
    cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float, axis_name: str, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = param(rngs, (dim,), (axis_name,), dtype, _ones)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim], same dtype."""
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.weight[...] * normed


def llama3_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling) -> np.ndarray:
    """[head_dim / 2] float32: RoPE inverse frequencies with Llama 3.1's scaling
    (`Llama3RopeScaling`; the arithmetic of transformers' `_compute_llama3_parameters`,
    in float32 as there)."""
    f32 = np.float32
    inv_freq = f32(1.0) / (f32(theta) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / f32(scaling.factor), inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / f32(scaling.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    scaling: Llama3RopeScaling | None = None,
) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer), HF `rotate_half` convention:
    the two halves of head_dim (not interleaved pairs) form the rotated pairs.

    x: [T, heads, head_dim]; positions: [T] int. Math in float32, result in x.dtype.
    scaling: Llama 3.1's frequency scaling (`llama3_inv_freq`), or None for plain RoPE.
    """
    head_dim = x.shape[-1]
    if scaling is not None:
        inv_freq = jnp.asarray(llama3_inv_freq(head_dim, theta, scaling))
    else:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, head_dim]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def write_kv(cache: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter this step's K (or V) into the paged cache.

    cache: [num_blocks, block_size, kv_heads, head_dim]; new: [T, kv_heads, head_dim];
    slot_mapping: [T] int32 flat slots, PAD_SLOT for padded tokens (their writes are
    dropped by pointing them past the end; a lone padded token (T = 1) writes into the
    null block instead, which no request reads).
    """
    num_blocks, block_size = cache.shape[:2]
    num_slots = num_blocks * block_size
    if slot_mapping.shape[0] == 1:
        # One token (batch-1 decode): a dynamic-update-slice on the cache's own shape.
        # XLA turns a one-index scatter into one guarded by a read of the old slot (the
        # out-of-bounds drop), and through the flat reshape it does not update the cache
        # in place inside the multi-step scan: a copy of the whole cache per layer and
        # step. A padded token writes into the null block (block 0: never read as data).
        slot = jnp.where(slot_mapping[0] == PAD_SLOT, 0, slot_mapping[0])
        start = (slot // block_size, slot % block_size) + (0,) * (cache.ndim - 2)
        return jax.lax.dynamic_update_slice(cache, new[None].astype(cache.dtype), start)
    flat = cache.reshape(num_slots, *cache.shape[2:])
    slots = jnp.where(slot_mapping == PAD_SLOT, num_slots, slot_mapping)
    flat = flat.at[slots].set(new.astype(cache.dtype), mode="drop")
    return flat.reshape(cache.shape)


def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float, sliding_window: int | None = None
) -> jax.Array:
    """Causal GQA attention of T tokens forming one sequence (no cache; training path).

    q: [T, num_heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("tkgd,skd->tkgs", qg.astype(jnp.float32), k.astype(jnp.float32)) * scale
    idx = jnp.arange(num_tokens)
    mask = idx[None, :] <= idx[:, None]
    if sliding_window is not None:
        mask &= idx[:, None] - idx[None, :] < sliding_window
    probs = masked_softmax(scores, mask[:, None, None, :])
    out = jnp.einsum("tkgs,skd->tkgd", probs, v.astype(jnp.float32))
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def paged_attention_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: KVPair,
    positions: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
) -> tuple[jax.Array, KVPair]:
    """Write this step's K/V into the paged cache, then attend over it.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; kv: (K, V) caches
    [num_blocks, block_size, kv_heads, head_dim]. Returns ([T, heads, head_dim], (K, V)).
    On a mesh this runs per device (`Parallelism.paged_attention`) on its shard.
    """
    k_cache = write_kv(kv[0], k, metadata.slot_mapping)
    v_cache = write_kv(kv[1], v, metadata.slot_mapping)
    # The one switch (jaxserve/kernels/dispatch.py): the Pallas kernel on a GPU, the
    # pure-jnp reference (paged_attention_ref) on the CPU.
    out = dispatch.paged_attention(q, k_cache, v_cache, positions, metadata, scale, sliding_window)
    return out, (k_cache, v_cache)


def merge_heads(x: jax.Array, w: jax.Array) -> jax.Array:
    """The output projection: x [T, heads, D] . w [heads, D, embed] -> [T, embed], in
    x's dtype, contracting heads and D in that order.

    One `dot_general` rather than `jnp.einsum("thd,hde->te")`: einsum orders the
    contraction (D, heads), so XLA's CPU backend re-lays-out the whole weight (1 MB a
    layer at Qwen3-MoE-like shapes) on every call before the dot.
    """
    return jax.lax.dot_general(x, w, (((1, 2), (0, 1)), ((), ())))


class Attention(nnx.Module):
    """Grouped-query attention (Ainslie et al. 2023) with RoPE, optional per-head q/k
    RMSNorm (Qwen3) and optional q/k/v biases (Qwen2), reading and writing the paged KV
    cache.

    Weights: q_proj [embed, q_heads, head_dim], k_proj/v_proj [embed, kv_heads, head_dim],
    o_proj [q_heads, head_dim, embed]; with qkv_bias, q_bias [q_heads, head_dim] and
    k_bias/v_bias [kv_heads, head_dim].
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float,
        rms_norm_eps: float,
        qk_norm: bool,
        sliding_window: int | None,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
        qkv_bias: bool = False,
        rope_scaling: Llama3RopeScaling | None = None,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.sliding_window = sliding_window
        self.parallel = ONE_DEVICE if parallel is None else parallel
        self.scale = head_dim**-0.5
        self.q_proj = param(
            rngs, (hidden_size, num_heads, head_dim), ("embed", "q_heads", "head_dim"), dtype
        )
        self.k_proj = param(
            rngs, (hidden_size, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), dtype
        )
        self.v_proj = param(
            rngs, (hidden_size, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), dtype
        )
        self.o_proj = param(
            rngs, (num_heads, head_dim, hidden_size), ("q_heads", "head_dim", "embed"), dtype
        )
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, "head_dim", dtype, rngs) if qk_norm else None
        if qkv_bias:
            self.q_bias = param(rngs, (num_heads, head_dim), ("q_heads", "head_dim"), dtype)
            self.k_bias = param(rngs, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), dtype)
            self.v_bias = param(rngs, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), dtype)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, "head_dim", dtype, rngs) if qk_norm else None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv: KVPair | None,
        metadata: AttentionMetadata | None,
    ) -> tuple[jax.Array, KVPair | None]:
        """x: [T, embed]; positions: [T]; kv: this layer's (K, V) cache or None together
        with metadata None (cache-less: the T tokens are one causal sequence).

        Returns ([T, embed], updated (K, V) or None).
        """
        q = project(x, self.q_proj[...], _heads_dot)
        k = project(x, self.k_proj[...], _heads_dot)
        v = project(x, self.v_proj[...], _heads_dot)
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.rope_theta, self.rope_scaling)
        k = apply_rope(k, positions, self.rope_theta, self.rope_scaling)

        if kv is None:
            if metadata is not None:
                raise ValueError("Attention: metadata given without a KV cache")
            out = dense_causal_attention(q, k, v, self.scale, self.sliding_window)
        else:
            step = functools.partial(
                paged_attention_step, scale=self.scale, sliding_window=self.sliding_window
            )
            out, kv = self.parallel.paged_attention(step, q, k, v, kv, positions, metadata)
        return project(out, self.o_proj[...], merge_heads), kv

    def dense_weights(self, path: tuple) -> list[tuple[tuple, int]]:
        """(state path, contracted leading axes) of the weights `project` reads: what the
        engine may hold panel-major (`cpu_dense.pack_params`); path: this module's.
        q/k/v contract embed, o_proj (heads, head_dim)."""
        qkv = [((*path, name), 1) for name in ("q_proj", "k_proj", "v_proj")]
        return [*qkv, ((*path, "o_proj"), 2)]


class MLP(nnx.Module):
    """Dense SwiGLU MLP (Shazeer 2020): down(silu(x @ gate) * (x @ up))."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = param(rngs, (hidden_size, intermediate_size), ("embed", "mlp"), dtype)
        self.up_proj = param(rngs, (hidden_size, intermediate_size), ("embed", "mlp"), dtype)
        self.down_proj = param(rngs, (intermediate_size, hidden_size), ("mlp", "embed"), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, embed] -> [T, embed]."""
        h = jax.nn.silu(project(x, self.gate_proj[...], jnp.matmul))
        h = h * project(x, self.up_proj[...], jnp.matmul)
        return project(h, self.down_proj[...], jnp.matmul)

    def dense_weights(self, path: tuple) -> list[tuple[tuple, int]]:
        """(state path, contracted leading axes) of the weights `project` reads: what the
        engine may hold panel-major (`cpu_dense.pack_params`); path: this module's."""
        return [((*path, name), 1) for name in ("gate_proj", "up_proj", "down_proj")]


def _heads_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, embed] . w [embed, heads, D] -> [T, heads, D] (q/k/v projections)."""
    return jnp.einsum("te,ehd->thd", x, w)
