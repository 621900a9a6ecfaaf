"""DeepSeek's MoE block: the group-limited top-k gate and always-on shared experts.

The routed experts are `MoeBlock`'s (same weights, same expert paths on one device and
expert-parallel on a mesh, same EPLB slot tables); this block only replaces the gate
(`MoeBlock.select_experts`) and adds the shared experts, a dense SwiGLU MLP of
n_shared_experts * moe_intermediate_size that every token passes (DeepSeek-AI 2024,
"DeepSeekMoE" / "DeepSeek-V3", sec. 2.1.2). EPLB moves routed experts only; the shared
experts are an ordinary dense weight (tp-sharded like any MLP).

Gate semantics are transformers' `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.deepseek_config import SIGMOID, TOP2_SUM, GroupedGateConfig
from jaxserve.models.layers import MLP, Parallelism, param
from jaxserve.models.moe import MoeBlock


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def grouped_topk(
    x: jax.Array,
    gate: jax.Array,
    correction_bias: jax.Array | None,
    top_k: int,
    cfg: GroupedGateConfig,
) -> tuple[jax.Array, jax.Array]:
    """Group-limited top-k gate.

    x: [T, embed]; gate: [embed, E]; correction_bias: [E] (sigmoid scoring) or None.
    Logits in float32; scores = sigmoid (V3) or softmax (V2) of them. The choice uses
    scores + correction_bias (V3's auxiliary-loss-free balancing bias): the experts are
    cut into n_group groups, each scored by its two best (V3) or its best (V2) choice
    scores, the topk_group best groups kept, and the top_k experts chosen among them.
    The weights are the unbiased scores of the chosen experts, renormalized if
    norm_topk_prob (sum + 1e-20), times routed_scaling_factor.

    Returns (topk_weights [T, k] in x.dtype, topk_ids [T, k] int32).
    """
    logits = jnp.matmul(x.astype(jnp.float32), gate.astype(jnp.float32))
    if cfg.scoring == SIGMOID:
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    num_tokens, num_experts = choice.shape
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        if cfg.group_score == TOP2_SUM:
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, best_groups = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
        keep = jnp.zeros((num_tokens, cfg.n_group), bool)
        keep = keep.at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        keep = jnp.repeat(keep, num_experts // cfg.n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return weights.astype(x.dtype), ids.astype(jnp.int32)


class DeepseekMoeBlock(MoeBlock):
    """`MoeBlock` with DeepSeek's grouped gate and shared experts.

    Weights beyond `MoeBlock`'s: gate [embed, E] and e_score_correction_bias [E] (V3
    only) kept in float32 whatever the serving dtype (as transformers'
    `_keep_in_fp32_modules_strict`); shared_experts, an `MLP` of
    n_shared_experts * moe_intermediate_size (None if n_shared_experts == 0).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        c, g = config, config.grouped_gate
        super().__init__(
            c.hidden_size,
            c.moe_intermediate_size,
            c.num_experts,
            c.num_experts_per_tok,
            g.norm_topk_prob,
            dtype,
            rngs,
            parallel,
        )
        self.gate_config = g
        self.gate = param(rngs, (c.hidden_size, c.num_experts), ("embed", None), jnp.float32)
        self.e_score_correction_bias = (
            param(rngs, (c.num_experts,), (None,), jnp.float32, _zeros)
            if g.correction_bias
            else None
        )
        self.shared_experts = (
            MLP(c.hidden_size, c.moe_intermediate_size * g.n_shared_experts, dtype, rngs)
            if g.n_shared_experts
            else None
        )

    def select_experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        return grouped_topk(x, self.gate[...], bias, self.top_k, self.gate_config)

    def __call__(
        self, x: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """x: [T, embed] -> (routed + shared output [T, embed], slot counts [S] int32 of
        the routed experts; see `MoeBlock.__call__`)."""
        out, counts = super().__call__(x, token_mask)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, counts
