"""The DeepSeek-V2/V3 parts of `ModelConfig`, parsed from HF `config.json` (no JAX here).

`DeepseekV3ForCausalLM` (also declared by DeepSeek-R1 and Kimi-K2 checkpoints) and
`DeepseekV2ForCausalLM` add three things to the Llama-style decoder:
- Multi-head Latent Attention (`MlaConfig`, DeepSeek-AI 2024, "DeepSeek-V2", sec. 2.1),
  with decoupled RoPE, optionally YaRN-scaled (`RopeScaling`, Peng et al. 2023);
- a MoE block with always-on shared experts and a group-limited top-k gate
  (`GroupedGateConfig`): V3's sigmoid scores with `e_score_correction_bias`, V2's
  softmax "group_limited_greedy";
- `first_k_dense_replace` dense layers (and `moe_layer_freq`), multi-token-prediction
  layers in the checkpoint (`num_nextn_predict_layers`, skipped at load).

Semantics follow transformers 5.x (`models/deepseek_v3`, `models/deepseek_v2`), which is
what the tests compare against. Two places where transformers departs from DeepSeek's
own reference code are noted where they are parsed: V2's gate never renormalizes
(`norm_topk_prob` is ignored), and `moe_layer_freq` (1 in every published checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

V3 = "DeepseekV3ForCausalLM"
V2 = "DeepseekV2ForCausalLM"
MLA_ARCHITECTURES = (V2, V3)

# transformers 5.x config defaults (configuration_deepseek_v{2,3}.py), by family.
_DEFAULTS = {
    V3: dict(
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    V2: dict(
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        n_group=None,
        topk_group=None,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
}

SIGMOID, SOFTMAX = "sigmoid", "softmax"
TOP2_SUM, MAX = "top2_sum", "max"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """YaRN RoPE scaling (Peng et al. 2023, "YaRN"), transformers `_compute_yarn_parameters`.

    factor: context extension factor; original_max_position_embeddings: pre-training
    length; beta_fast / beta_slow: the rotation counts that bound the ramp between
    extrapolated and interpolated frequencies; mscale / mscale_all_dim: DeepSeek's
    attention-magnitude terms; attention_factor: the cos/sin multiplier (None: derived);
    truncate: floor/ceil the correction range.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head Latent Attention sizes (elements per head or per token).

    q_lora_rank: rank of the query down-projection (None: a plain q_proj);
    kv_lora_rank: the compressed KV latent per token (what the cache holds, with the
    RoPE key part of qk_rope_head_dim); qk_nope_head_dim / qk_rope_head_dim: the
    position-free and the RoPE part of each query/key head; v_head_dim: value head.
    rope_interleave: RoPE rotates interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's
    layout; V2 always, V3 unless `rope_interleave: false`) instead of the two halves.
    rope_scaling: YaRN, or None for plain RoPE.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    rope_scaling: RopeScaling | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN
        (transformers `yarn_apply_mscale`)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale


@dataclass(frozen=True, slots=True)
class GroupedGateConfig:
    """The DeepSeek MoE gate and shared experts.

    scoring: SIGMOID (V3; `e_score_correction_bias` is added for the choice only) or
    SOFTMAX (V2). n_group / topk_group: experts are split into n_group equal groups and
    each token picks among the experts of its topk_group best groups (n_group <= 1: no
    group limit); a group's score is group_score: TOP2_SUM (V3, sum of its two best
    biased scores) or MAX (V2). norm_topk_prob: renormalize the k chosen weights;
    routed_scaling_factor multiplies them. n_shared_experts: always-on experts, one
    SwiGLU MLP of n_shared_experts * moe_intermediate_size.
    """

    scoring: str
    n_group: int
    topk_group: int
    group_score: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int

    @property
    def correction_bias(self) -> bool:
        return self.scoring == SIGMOID


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude term: 0.1 * mscale * ln(scale) + 1 (1 if scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def parse_deepseek(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a DeepSeek config.json: the Llama-style ones that
    differ (num_key_value_heads = 1 latent "head", head_dim = qk_head_dim) plus `mla`,
    `grouped_gate`, `mlp_only_layers` (the dense layers) and `num_mtp_layers`.

    Raises:
        ValueError: a field out of range or unsupported, named in the message.
    """
    d = _DEFAULTS[architecture]

    def get(key: str):
        value = hf.get(key)
        return d.get(key) if value is None and key not in hf else value

    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(get(key), int) or get(key) <= 0:
            raise ValueError(f"config.json: {key} must be a positive integer, got {get(key)!r}")
    if get("qk_rope_head_dim") % 2:
        raise ValueError("config.json: qk_rope_head_dim must be even (RoPE rotates pairs)")
    q_lora = get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ValueError(
            f"config.json: q_lora_rank must be null or a positive integer, got {q_lora!r}"
        )
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported")
    mla = MlaConfig(
        q_lora_rank=q_lora,
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        # transformers' V2 always rotates interleaved pairs (complex multiply).
        rope_interleave=True if architecture == V2 else bool(hf.get("rope_interleave", True)),
        rope_scaling=_rope_scaling(hf),
    )
    num_layers = int(hf["num_hidden_layers"])
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json: missing 'n_routed_experts'")
    experts = int(experts)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(
            f"config.json: num_experts_per_tok={top_k} must be in [1, n_routed_experts={experts}]"
        )
    first_dense = int(get("first_k_dense_replace") or 0)
    # DeepSeek's reference code: MoE iff layer >= first_k_dense_replace and
    # layer % moe_layer_freq == 0 (transformers ignores moe_layer_freq; every published
    # checkpoint has 1, where both agree).
    freq = int(hf.get("moe_layer_freq") or 1)
    dense = tuple(i for i in range(num_layers) if i < first_dense or i % freq)
    gate = _grouped_gate(hf, architecture, experts, top_k, get)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=gate.norm_topk_prob,
        mlp_only_layers=dense,
        num_key_value_heads=1,
        head_dim=mla.qk_head_dim,
        mla=mla,
        grouped_gate=gate,
        # DeepSeek's name; transformers 5.x writes num_mtp_layers.
        num_mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0),
    )


def _grouped_gate(hf, architecture, experts, top_k, get) -> GroupedGateConfig:
    n_group = int(get("n_group") or 1)
    topk_group = int(get("topk_group") or n_group)
    if architecture == V3:
        scoring, group_score = SIGMOID, TOP2_SUM
        norm = bool(get("norm_topk_prob"))
        scoring_func = hf.get("scoring_func", SIGMOID)
        if scoring_func != SIGMOID:
            raise ValueError(
                f"config.json: scoring_func={scoring_func!r} is not supported (sigmoid)"
            )
    else:
        scoring, group_score = SOFTMAX, MAX
        # transformers' DeepseekV2TopkRouter never renormalizes the top-k weights.
        norm = False
        method = hf.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"config.json: topk_method={method!r} is not supported "
                "('greedy' or 'group_limited_greedy')"
            )
        if method == "greedy":
            n_group = topk_group = 1
    if n_group > 1:
        if experts % n_group:
            raise ValueError(
                f"config.json: n_routed_experts={experts} is not divisible by n_group={n_group}"
            )
        if not 0 < topk_group <= n_group:
            raise ValueError(
                f"config.json: topk_group={topk_group} must be in [1, n_group={n_group}]"
            )
        if group_score == TOP2_SUM and experts // n_group < 2:
            raise ValueError("config.json: n_group leaves fewer than 2 experts per group")
        if top_k > topk_group * (experts // n_group):
            raise ValueError(
                f"config.json: num_experts_per_tok={top_k} exceeds the experts of topk_group="
                f"{topk_group} groups"
            )
    shared = int(get("n_shared_experts") or 0)
    return GroupedGateConfig(
        scoring=scoring,
        n_group=n_group,
        topk_group=topk_group,
        group_score=group_score,
        norm_topk_prob=norm,
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_shared_experts=shared,
    )


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    # transformers 5.x: rope_parameters; DeepSeek's own config.json: rope_scaling.
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(
            f"config.json: rope_scaling type {rope_type!r} is not supported ('yarn' or default)"
        )
    original = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    return RopeScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def rope_theta(hf: dict[str, Any]) -> float:
    """The RoPE base of a DeepSeek config (rope_parameters, then rope_theta, else 1e4)."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta")) or 10_000.0)
