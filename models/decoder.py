"""The decoder-only transformer stack shared by the MoE and the dense families.

A family (MoE: qwen3_moe.py, mixtral.py; dense: qwen3.py, qwen2.py, llama.py) subclasses
`DecoderOnlyLM`, choosing per-family options (q/k norm) and declaring the HF names of its
MoE block; the forward and the other weight names live here once. Options the config
carries (q/k/v biases, which layers are MoE) are read from `ModelConfig`.
The forward is the contract of `jaxserve.models.base.CausalLM`.

`parallel` (None: one device) is how the model runs on a device mesh; see
`jaxserve.models.layers.Parallelism` and `jaxserve.sharding.parallel`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.kernels.cpu_dense import project
from jaxserve.models.base import PAD_SLOT, AttentionMetadata, KVCache, KVLayout
from jaxserve.models.config import ModelConfig
from jaxserve.models.layers import (
    MLP,
    ONE_DEVICE,
    Attention,
    KVPair,
    Parallelism,
    RMSNorm,
    param,
)
from jaxserve.models.moe import MoeBlock
from jaxserve.models.weight_map import (
    WeightSpec,
    bias,
    copy,
    fused_down,
    fused_gate_up,
    linear,
    one,
    stacked_experts,
)


def _logits_dot(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """hidden [N, embed] . head [embed, vocab] -> [N, vocab] float32."""
    return jnp.matmul(hidden, head, preferred_element_type=jnp.float32)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); mlp is MoE or dense."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        qk_norm: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype, rngs)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            qk_norm=qk_norm,
            sliding_window=c.sliding_window,
            dtype=dtype,
            rngs=rngs,
            parallel=parallel,
            qkv_bias=c.attention_qkv_bias,
            rope_scaling=c.rope_scaling,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype, rngs)
        if c.is_moe_layer(layer):
            self.mlp = MoeBlock(
                c.hidden_size,
                c.moe_intermediate_size,
                c.num_experts,
                c.num_experts_per_tok,
                c.norm_topk_prob,
                dtype,
                rngs,
                parallel,
            )
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype, rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv: KVPair | None,
        metadata: AttentionMetadata | None,
        token_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVPair | None, jax.Array | None]:
        """x: [T, embed]; token_mask: [T] bool, False for padded tokens (None: all real).

        Returns ([T, embed], updated kv or None, slot counts [S] int32 of an MoE layer or
        None for a dense one; see `MoeBlock`).
        """
        attn_out, kv = self.self_attn(self.input_layernorm(x), positions, kv, metadata)
        h = x + attn_out
        normed = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoeBlock):
            mlp_out, counts = self.mlp(normed, token_mask)
        else:
            mlp_out, counts = self.mlp(normed), None
        return h + mlp_out, kv, counts


class DecoderOnlyLM(nnx.Module):
    """Embedding -> decoder layers -> final norm; `compute_logits` applies the LM head.

    Weights: embed_tokens [vocab, embed]; lm_head [embed, vocab] (absent when
    tie_word_embeddings: the embedding is reused).

    `parallel`: None (`layers.ONE_DEVICE`) on one device; on a mesh, a `Parallelism` (build it with
    `jaxserve.sharding.parallel.MeshParallelism`) that the attention and MoE layers
    call. The step's flat batch must then follow the DP layout it documents.
    """

    # Families set this: per-head RMSNorm on q and k before RoPE (Qwen3).
    QK_NORM: bool = False

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype = jnp.float32,
        *,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        self.config = config
        self.parallel = ONE_DEVICE if parallel is None else parallel
        c = config
        self.embed_tokens = param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List(
            self.make_layer(c, i, dtype, rngs, parallel) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype, rngs)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), dtype)
        )

    def make_layer(
        self,
        config: ModelConfig,
        layer: int,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None,
    ) -> nnx.Module:
        """Decoder layer `layer` (families with another layer type override this)."""
        return DecoderLayer(config, layer, self.QK_NORM, dtype, rngs, parallel)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache | None,
        metadata: AttentionMetadata | None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Run the flat batch of T tokens through the stack (the `CausalLM` contract).

        tokens, positions: [T] int32. With kv_cache (one (K, V) per layer) and metadata,
        attention reads/writes the paged cache and the updated cache is returned. With
        both None (cache-less mode, for training under `jax.vmap`), the T tokens are one
        causal sequence and the returned cache is None.

        Returns (hidden [T, embed] after the final norm, kv_cache).
        """
        hidden, kv_cache, _ = self.forward_with_expert_counts(tokens, positions, kv_cache, metadata)
        return hidden, kv_cache

    def forward_with_expert_counts(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache | None,
        metadata: AttentionMetadata | None,
    ) -> tuple[jax.Array, KVCache | None, jax.Array]:
        """`__call__`, plus the expert load of the step (what EPLB records).

        Returns (hidden, kv_cache, expert_counts): expert_counts is [M, S] int32, M =
        `len(moe_layers())`, S = physical expert slots (`num_expert_slots`): row m counts
        the (token, top-k choice) pairs of MoE layer moe_layers()[m] sent to each slot,
        real tokens only (a token with slot_mapping == PAD_SLOT is padding; cache-less,
        every token is real). A model without MoE layers returns a [0, 0] array.

        Why an extra return and not `nnx.sow` / `nnx.Intermediate`: the engine calls the
        model inside `lax.scan` (multi-step decode), where NNX refuses to write module
        state created outside the scan ("Cannot mutate ... from different trace level"),
        and it rebuilds the module from flat parameters on every call; a return value
        threads through scan, jit and shard_map like any array, and callers that drop it
        (`__call__`) leave dead code that XLA removes. The logits are unchanged: the
        counts only read the gate's top-k ids.
        """
        if (kv_cache is None) != (metadata is None):
            raise ValueError("kv_cache and metadata must be both given or both None")
        if kv_cache is not None and len(kv_cache) != len(self.layers):
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, model has {len(self.layers)}")
        token_mask = None if metadata is None else metadata.slot_mapping != PAD_SLOT
        x = self.embed_tokens[...][tokens]
        x = self.parallel.constrain_hidden(x)
        new_cache, counts = [], []
        for i, layer in enumerate(self.layers):
            kv = None if kv_cache is None else kv_cache[i]
            x, kv, layer_counts = layer(x, positions, kv, metadata, token_mask)
            new_cache.append(kv)
            if layer_counts is not None:
                counts.append(layer_counts)
        expert_counts = jnp.stack(counts) if counts else jnp.zeros((0, 0), jnp.int32)
        return self.norm(x), (None if kv_cache is None else new_cache), expert_counts

    def kv_layout(self) -> KVLayout:
        """What the paged cache holds per token and layer (per-head K and V here; MLA
        families override it with their latent layout)."""
        c = self.config
        return KVLayout.per_head(c.num_key_value_heads, c.head_dim)

    def moe_layers(self) -> tuple[int, ...]:
        """Decoder-layer indices of the MoE layers, in the row order of expert counts."""
        return tuple(i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoeBlock))

    @property
    def num_expert_slots(self) -> int:
        """S, physical expert slots per MoE layer (E on one device; 0 without MoE)."""
        moe = self.moe_layers()
        return self.layers[moe[0]].mlp.w_gate.shape[0] if moe else 0

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, embed] -> logits [N, vocab] float32."""
        if self.lm_head is None:
            head = self.embed_tokens[...].T
        else:
            head = self.lm_head[...]
        return project(hidden, head, _logits_dot)

    def dense_weights(self) -> list[tuple[tuple, int]]:
        """(state path, contracted leading axes) of every weight read through
        `cpu_dense.project` (what `cpu_dense.pack_params` may hold panel-major): the
        projections of each `Attention` and `MLP` module and the untied LM head (a tied
        one is the embedding too, which is read by rows)."""
        weights = [] if self.lm_head is None else [(("lm_head",), 1)]
        for path, node in nnx.iter_graph(self):
            if isinstance(node, (Attention, MLP)):
                weights += node.dense_weights(tuple(path))
        return weights

    def initial_buffers(self) -> dict[tuple, object]:
        """Values of the model state that is not a weight (`PlacementTable`s of
        expert-parallel MoE blocks), by state path, as host arrays; a loader fills them
        after the weights. Works on an abstract model (`nnx.eval_shape`)."""
        buffers = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, MoeBlock):
                for name, value in layer.mlp.initial_placement().items():
                    buffers[("layers", i, "mlp", name)] = value
        return buffers

    # ----- HF weight-name map -------------------------------------------------------------

    def hf_weight_specs(self) -> list[WeightSpec]:
        """Every parameter with the HF tensor names it loads from (see weight_map.py).

        The attention, norm, dense-MLP, embedding and LM-head names are common to the
        Llama-style families; the MoE block's names come from `moe_weight_specs`.
        """
        c = self.config
        h, d = c.hidden_size, c.head_dim
        nq, nkv = c.num_attention_heads, c.num_key_value_heads
        specs = [one(("embed_tokens",), copy("model.embed_tokens.weight", (c.vocab_size, h)))]
        for i in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{i}", ("layers", i)
            attn, hf_attn = (*ours, "self_attn"), f"{hf}.self_attn"
            specs += layer_norm_specs(hf, ours, h)
            specs += [
                one((*attn, "q_proj"), linear(f"{hf_attn}.q_proj.weight", nq * d, h, (h, nq, d))),
                one((*attn, "k_proj"), linear(f"{hf_attn}.k_proj.weight", nkv * d, h, (h, nkv, d))),
                one((*attn, "v_proj"), linear(f"{hf_attn}.v_proj.weight", nkv * d, h, (h, nkv, d))),
                one((*attn, "o_proj"), linear(f"{hf_attn}.o_proj.weight", h, nq * d, (nq, d, h))),
            ]
            if c.attention_qkv_bias:
                specs += [
                    one((*attn, "q_bias"), bias(f"{hf_attn}.q_proj.bias", (nq, d))),
                    one((*attn, "k_bias"), bias(f"{hf_attn}.k_proj.bias", (nkv, d))),
                    one((*attn, "v_bias"), bias(f"{hf_attn}.v_proj.bias", (nkv, d))),
                ]
            if self.QK_NORM:
                specs += [
                    one((*attn, "q_norm", "weight"), copy(f"{hf_attn}.q_norm.weight", (d,))),
                    one((*attn, "k_norm", "weight"), copy(f"{hf_attn}.k_norm.weight", (d,))),
                ]
            if c.is_moe_layer(i):
                specs += self.moe_weight_specs(i)
            else:
                specs += dense_mlp_specs(hf, ours, h, c.intermediate_size)
        return specs + final_specs(c, tied=self.lm_head is None)

    def moe_weight_specs(self, layer: int) -> list[WeightSpec]:
        """The MoE block's specs for decoder layer `layer` (family-specific names)."""
        raise NotImplementedError(f"{type(self).__name__} does not declare its MoE weight names")


def layer_norm_specs(hf: str, ours: tuple, hidden: int) -> list[WeightSpec]:
    """A decoder layer's two RMSNorm weights (input and post-attention), common to every
    family here (Llama-style and DeepSeek)."""
    return [
        one((*ours, name, "weight"), copy(f"{hf}.{name}.weight", (hidden,)))
        for name in ("input_layernorm", "post_attention_layernorm")
    ]


def final_specs(config: ModelConfig, *, tied: bool) -> list[WeightSpec]:
    """The final norm and, unless the embeddings are tied, the LM head [embed, vocab]."""
    h, v = config.hidden_size, config.vocab_size
    specs = [one(("norm", "weight"), copy("model.norm.weight", (h,)))]
    if not tied:
        specs.append(one(("lm_head",), linear("lm_head.weight", v, h, (h, v))))
    return specs


def dense_mlp_specs(hf: str, ours: tuple, hidden: int, inter: int) -> list[WeightSpec]:
    mlp, hf_mlp = (*ours, "mlp"), f"{hf}.mlp"
    return [
        one(
            (*mlp, "gate_proj"),
            linear(f"{hf_mlp}.gate_proj.weight", inter, hidden, (hidden, inter)),
        ),
        one((*mlp, "up_proj"), linear(f"{hf_mlp}.up_proj.weight", inter, hidden, (hidden, inter))),
        one(
            (*mlp, "down_proj"),
            linear(f"{hf_mlp}.down_proj.weight", hidden, inter, (inter, hidden)),
        ),
    ]


def moe_block_specs(
    config: ModelConfig,
    layer: int,
    *,
    gate_names: tuple[str, ...],
    experts_prefix: str,
    expert_names: tuple[str, str, str],
    fused_prefix: str,
) -> list[WeightSpec]:
    """Specs of one `MoeBlock` (decoder layer `layer`).

    gate_names: candidate names of the gate (the top-k layer) weight [E, embed] (first
        present wins).
    experts_prefix / expert_names: per-expert layout, tensors
        f"{experts_prefix}.{e}.{name}.weight" for name in (gate, up, down) — the layout of
        checkpoints on the Hub and of transformers' `save_pretrained`; written on export.
    fused_prefix: transformers 5.x in-memory layout, f"{fused_prefix}.gate_up_proj"
        [E, 2*inter, embed] and f"{fused_prefix}.down_proj" [E, embed, inter].
    """
    c = config
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    ours = ("layers", layer, "mlp")
    gate, up, down = expert_names

    def per_expert(name: str, out_features: int, in_features: int):
        names = [f"{experts_prefix}.{x}.{name}.weight" for x in range(e)]
        return stacked_experts(names, out_features, in_features)

    gate_sources = tuple(linear(n, e, h, (h, e)) for n in gate_names)
    return [
        WeightSpec((*ours, "gate"), gate_sources),
        WeightSpec(
            (*ours, "w_gate"),
            (per_expert(gate, i, h), fused_gate_up(f"{fused_prefix}.gate_up_proj", e, i, h, 0)),
        ),
        WeightSpec(
            (*ours, "w_up"),
            (per_expert(up, i, h), fused_gate_up(f"{fused_prefix}.gate_up_proj", e, i, h, 1)),
        ),
        WeightSpec(
            (*ours, "w_down"),
            (per_expert(down, h, i), fused_down(f"{fused_prefix}.down_proj", e, i, h)),
        ),
    ]
