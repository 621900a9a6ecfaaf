"""Multi-head Latent Attention (DeepSeek-AI 2024, "DeepSeek-V2", sec. 2.1) over the
latent paged KV cache, with decoupled RoPE and YaRN (Peng et al. 2023).

Per token: an optional low-rank query (q_a_proj -> RMSNorm -> q_b_proj, or one q_proj)
gives H heads of [q_nope (qk_nope_head_dim), q_rope (qk_rope_head_dim)];
kv_a_proj_with_mqa gives the latent c_kv (kv_lora_rank, RMS-normalized) and one shared
RoPE key k_rope. The cache holds (c_kv, k_rope) per token (`KVLayout` of `mla_kv_layout`),
not per-head K/V.

Two mathematically equal forms (transformers `DeepseekV3Attention` expands):
- paged steps use the *absorbed* form (vLLM's MLA backend): q_latent = q_nope @ W_UK^T
  per head, attention over the cached latent
  (`jaxserve.kernels.paged_attention_mla_ref`), then W_UV and o_proj. It serves prefill
  chunks and decodes alike, so mixed steps need one path;
- the cache-less path (training, one sequence) expands kv_b_proj into per-head K and V.

On a mesh, the query heads (and W_UK/W_UV/o_proj by head) are split over tp while the
latent, one "head", is replicated over tp: each tp device attends its heads against the
whole latent (see `MlaAttention.__call__`).

RoPE follows transformers exactly: DeepSeek's interleaved pairs (x0, x1), (x2, x3)...
(`rope_interleave`, and always for V2) or the two halves; YaRN's inverse frequencies and
cos/sin factor from `_compute_yarn_parameters`; the softmax scale from
`yarn_apply_mscale`. Pairs are returned as [rotated evens, rotated odds] for q and k
alike (transformers V3's layout; dot products do not depend on it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.kernels.paged_attention_ref import masked_softmax
from jaxserve.models.base import AttentionMetadata, KVLayout
from jaxserve.models.config import ModelConfig
from jaxserve.models.deepseek_config import MlaConfig, RopeScaling, yarn_mscale
from jaxserve.models.layers import (
    ONE_DEVICE,
    KVPair,
    Parallelism,
    RMSNorm,
    merge_heads,
    param,
    write_kv,
)

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps.
_LORA_NORM_EPS = 1e-6


def mla_kv_layout(mla: MlaConfig) -> KVLayout:
    """The latent cache: (c_kv [.., 1, kv_lora_rank], k_rope [.., 1, qk_rope_head_dim])
    per token and layer, replicated over tp."""
    return KVLayout(
        1, mla.kv_lora_rank, 1, mla.qk_rope_head_dim, shard_heads=False, label="MLA latent"
    )


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim/2] float32, cos/sin factor) of plain RoPE or YaRN,
    transformers `_compute_default_rope_parameters` / `_compute_yarn_parameters`."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if scaling is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    s = scaling
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def apply_mla_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float, interleave: bool
) -> jax.Array:
    """RoPE on the rope part of q or k. x: [T, heads, dim]; positions: [T]. Math in
    float32 (cos/sin times `factor`, YaRN's attention factor), result in x.dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = (jnp.cos(freqs) * factor)[:, None, :]  # [T, 1, dim/2]
    sin = (jnp.sin(freqs) * factor)[:, None, :]
    x32 = x.astype(jnp.float32)
    if interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def mla_paged_step(
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
    """Write this step's (c_kv, k_rope) into the latent cache, then absorbed attention.

    q_latent: [T, H, L]; q_rope: [T, H, R]; latent: [T, 1, L]; k_rope: [T, 1, R];
    kv: ([N, bs, 1, L], [N, bs, 1, R]). Returns ([T, H, L], updated kv). On a mesh this
    runs per device on its dp shard and its tp share of the heads.
    """
    from jaxserve.kernels.paged_attention_mla_ref import mla_paged_attention_ref

    latent_cache = write_kv(kv[0], latent, metadata.slot_mapping)
    rope_cache = write_kv(kv[1], k_rope, metadata.slot_mapping)
    out = mla_paged_attention_ref(
        q_latent, q_rope, latent_cache, rope_cache, positions, metadata, scale
    )
    return out, (latent_cache, rope_cache)


class MlaAttention(nnx.Module):
    """MLA with the latent paged cache (see the module docstring).

    Weights (H heads, E = hidden, L = kv_lora_rank, dn/dr/dv the nope/rope/value head
    dims): q_proj [E, H, dn+dr] or q_a_proj [E, q_lora_rank], q_a_layernorm,
    q_b_proj [q_lora_rank, H, dn+dr]; kv_a_proj_with_mqa [E, L+dr]; kv_a_layernorm [L];
    kv_b_proj [L, H, dn+dv] (W_UK then W_UV per head); o_proj [H, dv, E].
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        m = config.mla
        if m is None:
            raise ValueError(f"{config.architecture}: MlaAttention needs an MLA config")
        self.mla = m
        self.parallel = ONE_DEVICE if parallel is None else parallel
        h, n = config.hidden_size, config.num_attention_heads
        dq = m.qk_head_dim
        inv_freq, factor = rope_inv_freq(m.qk_rope_head_dim, config.rope_theta, m.rope_scaling)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: not model state
        self.rope_factor = factor
        self.scale = m.softmax_scale()
        heads = ("q_heads", "head_dim")
        if m.q_lora_rank is None:
            self.q_proj = param(rngs, (h, n, dq), ("embed", *heads), dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = param(rngs, (h, m.q_lora_rank), ("embed", None), dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS, None, dtype, rngs)
            self.q_b_proj = param(rngs, (m.q_lora_rank, n, dq), (None, *heads), dtype)
        self.kv_a_proj_with_mqa = param(rngs, (h, m.latent_dim), ("embed", None), dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS, None, dtype, rngs)
        self.kv_b_proj = param(
            rngs, (m.kv_lora_rank, n, m.qk_nope_head_dim + m.v_head_dim), (None, *heads), dtype
        )
        self.o_proj = param(rngs, (n, m.v_head_dim, h), (*heads, "embed"), dtype)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        inv_freq = np.asarray(self.inv_freq, np.float32)
        return apply_mla_rope(x, positions, inv_freq, self.rope_factor, self.mla.rope_interleave)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv: KVPair | None,
        metadata: AttentionMetadata | None,
    ) -> tuple[jax.Array, KVPair | None]:
        """x: [T, embed]; positions: [T]; kv: this layer's latent cache pair, or None
        with metadata None (cache-less: the T tokens are one causal sequence).

        Returns ([T, embed], updated kv or None).
        """
        m = self.mla
        dn = m.qk_nope_head_dim
        if self.q_proj is not None:
            q = jnp.einsum("te,ehd->thd", x, self.q_proj[...])
        else:
            q_low = self.q_a_layernorm(x @ self.q_a_proj[...])
            q = jnp.einsum("tr,rhd->thd", q_low, self.q_b_proj[...])
        q_nope, q_rope = q[..., :dn], self._rope(q[..., dn:], positions)
        compressed = x @ self.kv_a_proj_with_mqa[...]
        latent = self.kv_a_layernorm(compressed[:, : m.kv_lora_rank])  # [T, L]
        k_rope = self._rope(compressed[:, None, m.kv_lora_rank :], positions)  # [T, 1, R]
        w_uk = self.kv_b_proj[...][..., :dn]  # [L, H, dn]
        w_uv = self.kv_b_proj[...][..., dn:]  # [L, H, dv]

        if kv is None:
            if metadata is not None:
                raise ValueError("MlaAttention: metadata given without a KV cache")
            out = _expanded_causal_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, self.scale)
        else:
            q_latent = jnp.einsum("thd,lhd->thl", q_nope, w_uk)
            step_args = (q_latent, q_rope, latent[:, None, :], k_rope, kv, positions, metadata)
            out_latent, kv = self.parallel.mla_paged_attention(
                mla_paged_step, *step_args, scale=self.scale
            )
            out = jnp.einsum("thl,lhv->thv", out_latent, w_uv)
        return merge_heads(out, self.o_proj[...]), kv


def _expanded_causal_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale):
    """Cache-less MLA of one causal sequence, K/V expanded per head (transformers' form).

    q_nope [T, H, dn], q_rope [T, H, R], latent [T, L], k_rope [T, 1, R] -> [T, H, dv].
    """
    k_nope = jnp.einsum("sl,lhd->shd", latent, w_uk)
    v = jnp.einsum("sl,lhv->shv", latent, w_uv)
    f32 = jnp.float32
    scores = jnp.einsum("thd,shd->ths", q_nope.astype(f32), k_nope.astype(f32))
    scores += jnp.einsum("thr,sr->ths", q_rope.astype(f32), k_rope[:, 0].astype(f32))
    idx = jnp.arange(latent.shape[0])
    probs = masked_softmax(scores * scale, (idx[None, :] <= idx[:, None])[:, None, :])
    return jnp.einsum("ths,shv->thv", probs, v.astype(f32)).astype(q_nope.dtype)
