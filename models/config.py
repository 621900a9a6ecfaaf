"""`ModelConfig`: the architecture hyper-parameters of a model, parsed from HF `config.json`.

This module only reads plain dicts; it must not import JAX or build anything. Both the
transformers 4.x spellings (`rope_theta`, `rope_scaling`, `num_experts`) and the 5.x ones
(`rope_parameters`, `num_local_experts`) are accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxserve.models import deepseek_config, fp8
from jaxserve.models.deepseek_config import MLA_ARCHITECTURES, GroupedGateConfig, MlaConfig

# The families this project implements, by HF `architectures` name (`registry.py` maps
# each to its class; a test checks that the two agree). Dense families have no expert
# fields in their config.json.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", *MLA_ARCHITECTURES)
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(sorted(MOE_ARCHITECTURES + DENSE_ARCHITECTURES))

# Families whose q/k/v projections always carry a bias (no config flag; HF Qwen2Attention).
_QKV_BIAS = ("Qwen2ForCausalLM",)

# Architectures whose MoE gate always renormalizes its top-k probabilities (no config flag).
_ALWAYS_RENORMALIZE = ("MixtralForCausalLM",)

# Per-family RoPE base when config.json omits it (transformers' `default_theta`).
_DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1_000_000.0}
_FALLBACK_ROPE_THETA = 10_000.0


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """RoPE frequency scaling of Llama 3.1+ (`rope_type: "llama3"`): wavelengths above
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those
    below original / high_freq_factor kept, the ones between interpolated (transformers'
    `_compute_llama3_parameters`; Meta's llama-models `apply_scaling`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters shared by the decoder-only families, MoE and dense.

    Sizes are in elements; `moe_intermediate_size` is one expert's SwiGLU width and
    `intermediate_size` the dense MLP's (Mixtral: both are `intermediate_size`). A dense
    family has num_experts = num_experts_per_tok = 0 (every layer a dense MLP).
    `attention_qkv_bias`: q/k/v projections with a bias (Qwen2).
    `eos_token_ids` is always a tuple (HF allows an int, a list or null).
    `sliding_window` is None for full attention, else the number of most recent keys
    (including the query's own) each query sees.
    DeepSeek-V2/V3 (`deepseek_config`): `mla` (Multi-head Latent Attention; then
    num_key_value_heads = 1, the latent, and head_dim = qk_head_dim), `grouped_gate` (the
    gate and shared experts), `num_mtp_layers` (multi-token-prediction layers the
    checkpoint may hold after the decoder layers; not served). None / 0 elsewhere.
    `fp8_weight_block`: (rows, cols) of the scale blocks of an FP8 block-quantized
    checkpoint (`quantization_config`, see `fp8.py`), None for a plain one.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_qkv_bias: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    mla: MlaConfig | None = None
    grouped_gate: GroupedGateConfig | None = None
    num_mtp_layers: int = 0
    fp8_weight_block: tuple[int, int] | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) uses the MoE block instead of a dense MLP.

        Follows HF `Qwen3MoeDecoderLayer` exactly; Mixtral configs (step 1, no
        mlp_only_layers) make every layer MoE.
        """
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a HF `config.json` dict.

        Raises:
            ValueError: an architecture not in SUPPORTED_ARCHITECTURES (checked first, so
                whatever else the config lacks, the message lists the supported ones), a
                required field is missing, or the config asks for something these
                families do not implement (rope scaling, attention/MLP bias, a non-SiLU
                activation, sliding-window layers outside Mixtral), or a value no
                model can have (max_position_embeddings < 2, rope_theta <= 0, head_dim
                < 1); the message names the field.
        """
        config = cls._parse(hf)
        _check_values(config)
        return config

    @classmethod
    def _parse(cls, hf: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(hf)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architecture {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = _require(hf, "hidden_size", int)
        heads = _require(hf, "num_attention_heads", int)
        block = fp8.weight_block(hf)
        if architecture in MLA_ARCHITECTURES:
            return cls._from_hf_deepseek(hf, architecture, block)
        if architecture in MOE_ARCHITECTURES:
            num_experts = hf.get("num_local_experts", hf.get("num_experts"))
            if num_experts is None:
                raise ValueError("config.json: missing 'num_local_experts' (or 'num_experts')")
            top_k = _require(hf, "num_experts_per_tok", int)
        else:
            num_experts, top_k = 0, 0
        intermediate = _require(hf, "intermediate_size", int)
        _check_supported(hf, architecture)
        return cls(
            architecture=architecture,
            vocab_size=_require(hf, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=intermediate,
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or intermediate),
            num_hidden_layers=_require(hf, "num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=_head_dim(hf, hidden, heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf, architecture),
            max_position_embeddings=_require(hf, "max_position_embeddings", int),
            num_experts=int(num_experts),
            num_experts_per_tok=top_k,
            norm_topk_prob=architecture in _ALWAYS_RENORMALIZE
            or bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf, architecture),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=normalize_token_ids(hf.get("eos_token_id")),
            attention_qkv_bias=architecture in _QKV_BIAS,
            fp8_weight_block=block,
            rope_scaling=_rope_scaling(hf),
        )

    @classmethod
    def _from_hf_deepseek(
        cls, hf: dict[str, Any], architecture: str, block: tuple[int, int] | None
    ) -> ModelConfig:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        _require(hf, "num_hidden_layers", int)
        _require(hf, "max_position_embeddings", int)
        intermediate = _require(hf, "intermediate_size", int)
        return cls(
            architecture=architecture,
            vocab_size=_require(hf, "vocab_size", int),
            hidden_size=_require(hf, "hidden_size", int),
            intermediate_size=intermediate,
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or intermediate),
            num_hidden_layers=_require(hf, "num_hidden_layers", int),
            num_attention_heads=_require(hf, "num_attention_heads", int),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=deepseek_config.rope_theta(hf),
            max_position_embeddings=_require(hf, "max_position_embeddings", int),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=normalize_token_ids(hf.get("eos_token_id")),
            fp8_weight_block=block,
            **deepseek_config.parse_deepseek(hf, architecture),
        )


def _check_values(config: ModelConfig) -> None:
    """Refuse values that parse but that no model can have: they would otherwise fail
    inside the engine's warm-up with a message that names no field (a KeyError, numpy's
    "negative dimensions"). max_position_embeddings >= 2 as --max-model-len's own bound
    (a prompt token and an output token)."""
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if getattr(config, name) < 1:  # else a checkpoint shape error naming no field
            raise ValueError(f"config.json: {name} must be >= 1, got {getattr(config, name)}")
    if config.max_position_embeddings < 2:
        raise ValueError(
            "config.json: max_position_embeddings must be >= 2, "
            f"got {config.max_position_embeddings}"
        )
    if not 0 < config.rope_theta < math.inf:  # NaN too
        raise ValueError(f"config.json: rope_theta must be > 0, got {config.rope_theta}")


def normalize_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """HF token-id fields may be an int, a list or null; return a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures")
    if isinstance(archs, str):
        archs = [archs]
    if not archs or not isinstance(archs, list):
        raise ValueError(
            "config.json: missing 'architectures' (a list with one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return str(archs[0])


def _require(hf: dict[str, Any], key: str, kind: type) -> Any:
    """hf[key] as `kind`. Raises ValueError naming the field when it is missing, null, or
    not a `kind` (int("x") alone would say "invalid literal" and name nothing)."""
    value = hf.get(key)
    if value is None:
        raise ValueError(f"config.json: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, kind):  # "4" and true too
        raise ValueError(f"config.json: {key} must be {kind.__name__}, got {value!r}")
    return value


def _head_dim(hf: dict[str, Any], hidden: int, heads: int) -> int:
    """config.json's head_dim; absent or null: hidden_size // num_attention_heads (HF's
    default). 0, a negative or a fraction is refused by name: the engine would fail in its
    warm-up (0 used to fall back silently, a negative to numpy's "negative dimensions")."""
    value = hf.get("head_dim")
    if value is None:
        if heads < 1:
            raise ValueError(f"config.json: num_attention_heads must be >= 1, got {heads}")
        return hidden // heads
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: head_dim must be an integer >= 1, got {value!r}")
    return value


def _rope_theta(hf: dict[str, Any], architecture: str) -> float:
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        theta = _DEFAULT_ROPE_THETA.get(architecture, _FALLBACK_ROPE_THETA)
    return float(theta)


def _rope_scaling(hf: dict[str, Any]) -> Llama3RopeScaling | None:
    """The "llama3" RoPE scaling of rope_parameters (5.x) or rope_scaling (4.x), or None.
    Raises ValueError naming a missing or non-numeric field of it."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        if rope.get("rope_type", rope.get("type")) != "llama3":
            continue
        values = {}
        for name in Llama3RopeScaling.__slots__:
            value = rope.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"config.json: {key}.{name}: a number is required, got {value!r}")
            values[name] = value
        if not values["high_freq_factor"] > values["low_freq_factor"] > 0 < values["factor"]:
            raise ValueError(
                f"config.json: {key}: expected high_freq_factor > low_freq_factor > 0 and "
                f"factor > 0, got {values}"
            )
        values["original_max_position_embeddings"] = int(values["original_max_position_embeddings"])
        return Llama3RopeScaling(**values)
    return None


def _check_supported(hf: dict[str, Any], architecture: str) -> None:
    # transformers 5.x keeps the rope type in rope_parameters; 4.x in rope_scaling.
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(
                f"config.json: {key}.rope_type={rope_type!r} is not supported "
                "(only plain RoPE, rope_type 'default', and Llama 3.1's 'llama3')"
            )
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    if architecture != "MixtralForCausalLM" and hf.get("use_sliding_window"):
        raise ValueError(
            f"config.json: use_sliding_window=true is not supported for {architecture}"
        )
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    if architecture != "MixtralForCausalLM" and kinds:
        raise ValueError(
            f"config.json: layer_types {sorted(kinds)} are not supported for {architecture} "
            "(only 'full_attention')"
        )


def _sliding_window(hf: dict[str, Any], architecture: str) -> int | None:
    # Qwen3 configs carry a sliding_window value that only applies with use_sliding_window.
    if architecture != "MixtralForCausalLM":
        return None
    window = hf.get("sliding_window")
    return None if window is None else int(window)
