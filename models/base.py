"""The model contract: what every model family implements and what the engine relies on.

A model is an `nnx.Module` whose forward is a pure function of
(tokens, positions, kv_cache, attention metadata) -> (hidden states, kv_cache),
in the style of vLLM's tpu-inference. Scheduling, sampling and batching live outside.

Batches are *flat*: the T tokens of a step are the concatenation of every scheduled
request's new tokens (prefill chunks and decodes alike), padded to a bucket size.

KV cache layout (per layer, one array for K and one for V):
    [num_blocks, block_size, num_kv_heads, head_dim]
A token at position p of a request lives in slot
    block_table[p // block_size] * block_size + p % block_size.
Block 0 is the *null block*: never handed to a request, so padded block-table entries
may point at it safely.

A model declares its own layout (`KVLayout`, from the model's `kv_layout()`): the
per-head K/V above, or for Multi-head Latent Attention (DeepSeek-V2/V3) one latent
"head" per token, the pair holding the compressed latent [.., 1, kv_lora_rank] and the
RoPE key part [.., 1, qk_rope_head_dim]. The engine sizes and allocates the pool from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp

# One (K, V) pair per layer.
KVCache = list[tuple[jax.Array, jax.Array]]

# Padded tokens carry this slot; the model drops their K/V writes.
PAD_SLOT = -1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a flat batch reads and writes the paged KV cache.

    T = padded number of tokens in the step, R = padded number of requests,
    B = max blocks per request (max_model_len / block_size, rounded up).

    slot_mapping: [T] int32, flat slot to write token t's K/V; PAD_SLOT (-1) for padding.
    block_tables: [R, B] int32, KV block ids of request r; unused entries are 0 (null block).
    seq_lens: [R] int32, context length of request r once this step's tokens are written
        (0 for padded rows).
    query_start_loc: [R + 1] int32, token t belongs to request r iff
        query_start_loc[r] <= t < query_start_loc[r + 1]; padded rows repeat the last value.
    token_req: [T] int32, the request row of token t (padded tokens point at a padded row
        or any row; their outputs are ignored).
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    token_req: jax.Array


class CausalLM(Protocol):
    """What the engine calls on a model (all arrays on device, inside jit)."""

    def __call__(
        self,
        tokens: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32, position of each token in its request
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # hidden [T, hidden_size], updated cache
        ...

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, H] -> [N, vocab] float32
        ...

    def forward_with_expert_counts(
        self,
        tokens: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache, jax.Array]:
        """`__call__` plus the expert load: (hidden [T, H], cache, counts [M, S] int32),
        counts[m, s] = (token, top-k choice) pairs of MoE layer moe_layers()[m] sent to
        expert slot s, real tokens only (seq_lens > 0); [0, 0] for a dense model. What
        the engine's step calls (the counts feed EPLB and the balancedness metrics)."""
        ...

    def moe_layers(self) -> tuple[int, ...]:
        """Decoder-layer indices of the MoE layers, ascending (M = their count)."""
        ...

    @property
    def num_expert_slots(self) -> int:
        """S: physical expert slots per MoE layer (experts + redundant replicas; 0 dense)."""
        ...


# Expert-weight access (EPLB). The slot-indexed expert weights of MoE layer `layer`, in
# the order EPLB moves them, are the NNX state leaves at `expert_param_path(layer, name)`
# for name in EXPERT_WEIGHTS: w_gate [S, H, I], w_up [S, H, I], w_down [S, I, H]; its
# placement tables (models.moe.PLACEMENT_FIELDS, present on an expert-parallel mesh)
# are at expert_param_path(layer, field). A model family that lays out its MoE block
# elsewhere overrides nothing here: it must keep these paths (the engine swaps arrays at
# them between steps, without recompiling).
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def expert_param_path(layer: int, name: str) -> tuple:
    """The NNX state path of MoE layer `layer`'s expert weight or placement table `name`
    (e.g. ("layers", 3, "mlp", "w_gate")): the model contract's expert-weight access."""
    return ("layers", layer, "mlp", name)


def replace_params(
    params: list,
    param_index: dict[tuple, int],
    replacements: Iterable[tuple[tuple, Callable[[object], object]]],
    caller: str,
) -> list:
    """The engine's flat parameter list (`jax.tree.flatten` leaves of the model state)
    with the value at each (state path, replace) pair's path replaced by replace(value),
    which may return the value unchanged; the list given is not modified. param_index:
    state path -> index in params. The engine's held forms of weights are made so
    (`moe_slices.split_expert_params`, `cpu_dense.pack_params`, `cpu_moe.pack_experts`).

    Raises KeyError naming `caller` and a path that is not a parameter.
    """
    out = list(params)
    for path, replace in replacements:
        if path not in param_index:
            raise KeyError(f"{caller}: no parameter {'.'.join(map(str, path))}")
        i = param_index[path]
        out[i] = replace(out[i])
    return out


@dataclass(frozen=True)
class KVLayout:
    """What one token of one layer occupies in the paged cache: the two arrays of the
    layer's pair are [num_blocks, block_size, k_heads, k_dim] and [.., v_heads, v_dim].

    Per-head K/V (GQA): k = v = (num_kv_heads, head_dim), heads sharded over tp.
    MLA latent: k = (1, kv_lora_rank) the compressed latent c_kv, v = (1,
    qk_rope_head_dim) the RoPE key part; `shard_heads=False`: one latent "head" cannot
    be split, so tp replicates the latent cache (each tp device attends its own query
    heads against the whole latent, as vLLM's MLA backend does).
    """

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    shard_heads: bool = True
    label: str = "per-head K/V"

    @classmethod
    def per_head(cls, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls(num_kv_heads, head_dim, num_kv_heads, head_dim)

    def values_per_token(self) -> int:
        """Cached values per token and layer (both arrays)."""
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def bytes_per_token(self, num_layers: int, dtype) -> int:
        """Bytes of one token's KV over all layers (one device's share on tp > 1 is this
        / tp when `shard_heads`, all of it otherwise)."""
        return num_layers * self.values_per_token() * jnp.dtype(dtype).itemsize

    def allocate(
        self, num_layers: int, num_blocks: int, block_size: int, dtype=jnp.float32, sharding=None
    ) -> KVCache:
        """Zero-filled cache in this layout: one pair per layer."""
        k_shape = (num_blocks, block_size, self.k_heads, self.k_dim)
        v_shape = (num_blocks, block_size, self.v_heads, self.v_dim)
        make_k = jax.jit(lambda: jnp.zeros(k_shape, dtype), out_shardings=sharding)
        make_v = jax.jit(lambda: jnp.zeros(v_shape, dtype), out_shardings=sharding)
        return [(make_k(), make_v()) for _ in range(num_layers)]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """Shape of one layer's K (or V) cache array."""
    return (num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    sharding=None,
) -> KVCache:
    """Zero-filled KV cache: one (K, V) pair of [num_blocks, block_size, kv_heads, head_dim]."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(make(), make()) for _ in range(num_layers)]
