"""KV cache sizing at start-up: how many blocks to allocate, and the max_model_len they hold.

No JAX computation: byte counts from the model config, the device's memory statistics.
"""

from __future__ import annotations

import logging
import math
import os

import jax
import jax.numpy as jnp

from jaxserve.config import DEFAULT_MEMORY_FRACTION
from jaxserve.models.base import KVLayout
from jaxserve.models.config import ModelConfig

logger = logging.getLogger(__name__)

# On the CPU (no device memory statistics) the KV cache gets at most this many bytes.
CPU_KV_CACHE_BYTES = 256 * 2**20


def kv_block_bytes(
    config: ModelConfig, block_size: int, dtype: jnp.dtype, layout: KVLayout | None = None
) -> int:
    """Bytes of one KV block over all layers (both arrays of each layer's pair), in the
    model's `layout` (`model.kv_layout()`; None: per-head K and V from the config)."""
    return block_size * kv_token_bytes(config, dtype, layout)


def kv_token_bytes(config: ModelConfig, dtype: jnp.dtype, layout: KVLayout | None = None) -> int:
    """Bytes of one token's KV over all layers in `layout` (None: per-head K and V):
    2 * layers * kv_heads * head_dim * itemsize for GQA, layers * (kv_lora_rank +
    qk_rope_head_dim) * itemsize for an MLA latent cache."""
    layout = layout or KVLayout.per_head(config.num_key_value_heads, config.head_dim)
    return layout.bytes_per_token(config.num_hidden_layers, dtype)


def num_kv_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: jnp.dtype,
    memory_fraction: float | None,
    max_num_seqs: int,
    max_model_len: int,
    device: jax.Device | None = None,
    kv_head_shards: int = 1,
    layout: KVLayout | None = None,
) -> int:
    """How many KV blocks (null block included) to allocate when the user did not say.

    On a device with memory statistics: `memory_fraction` (None: DEFAULT_MEMORY_FRACTION)
    of the memory still free after the weights. Elsewhere (the CPU): with a
    `memory_fraction`, that fraction of the host's available memory (`os.sysconf`
    SC_AVPHYS_PAGES); without, enough for `max_num_seqs` requests of `max_model_len`
    tokens, capped at CPU_KV_CACHE_BYTES. On a mesh this is the count of
    one dp rank, whose devices each hold 1 / kv_head_shards (tp) of every block, or all
    of it for a layout that is not sharded by head (an MLA latent, replicated over tp).
    """
    per_block = _device_block_bytes(config, block_size, dtype, kv_head_shards, layout)
    device = device or jax.devices()[0]
    stats = _memory_stats(device)
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        return max(2, int(free * fraction) // per_block)
    if memory_fraction is not None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(2, int(available * memory_fraction) // per_block)
    wanted = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    return max(2, min(wanted, CPU_KV_CACHE_BYTES // per_block))


def check_num_blocks(
    num_blocks: int,
    config: ModelConfig,
    block_size: int,
    dtype: jnp.dtype,
    device: jax.Device | None = None,
    kv_head_shards: int = 1,
    layout: KVLayout | None = None,
) -> None:
    """Raises ValueError("num_blocks: ...") when a `num_blocks` the user gave needs more
    KV cache bytes than the device holds in all (its `bytes_limit`; on the CPU, the host's
    physical memory): the allocation would end in a bare MemoryError or an out-of-memory
    kill rather than an error naming the flag. Arguments as `num_kv_blocks`."""
    need = num_blocks * _device_block_bytes(config, block_size, dtype, kv_head_shards, layout)
    device = device or jax.devices()[0]
    stats = _memory_stats(device)
    if stats and "bytes_limit" in stats:
        have, where = stats["bytes_limit"], f"the {device.platform} device"
    else:
        have, where = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this host"
    if need > have:
        raise ValueError(
            f"num_blocks: {num_blocks} blocks of {block_size} tokens need "
            f"{need / 2**30:.3g} GiB of KV cache, more than the {have / 2**30:.3g} GiB "
            f"{where} has in all"
        )


def _device_block_bytes(
    config: ModelConfig,
    block_size: int,
    dtype: jnp.dtype,
    kv_head_shards: int,
    layout: KVLayout | None,
) -> int:
    """Bytes of one KV block on one device: 1 / kv_head_shards of it, or all of it for a
    layout that is not sharded by head (an MLA latent, replicated over tp)."""
    if layout is not None and not layout.shard_heads:
        kv_head_shards = 1
    return kv_block_bytes(config, block_size, dtype, layout) // kv_head_shards


def _memory_stats(device: jax.Device) -> dict | None:
    """The device's memory statistics; None on the CPU (the host's memory is asked of
    os.sysconf instead)."""
    return device.memory_stats() if device.platform != "cpu" else None


def check_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """The max_model_len asked for (default: the model's max_position_embeddings).

    Raises:
        ValueError: `requested` outside [2, max_position_embeddings].
    """
    if requested is None:
        return max_position_embeddings
    if not 2 <= requested <= max_position_embeddings:
        raise ValueError(
            f"max_model_len: must be in [2, {max_position_embeddings}] "
            f"(the model's max_position_embeddings), got {requested}"
        )
    return requested


def fit_kv_cache(max_model_len: int, explicit: bool, num_blocks: int, block_size: int) -> int:
    """The max_model_len that one dp rank's KV pool can hold, as vLLM checks at start-up.

    Every token of a sequence has a slot in its rank's pool, which has `num_blocks`
    blocks of `block_size` tokens, one of them the null block: the capacity is
    (num_blocks - 1) * block_size tokens. A longer max_model_len would admit requests
    that can never run (they would wait or be preempted forever).

    Args:
        max_model_len: tokens (prompt + output) of one request, from the user or from
            the model's max_position_embeddings.
        explicit: whether the user set max_model_len (then it is never lowered).
        num_blocks: KV blocks of one dp rank, null block included.
        block_size: tokens per KV block.

    Returns:
        max_model_len, or the capacity when that is smaller and max_model_len came from
        the model (with a warning in the log).

    Raises:
        ValueError: an explicit max_model_len above the capacity, or a capacity below 2
            tokens (one prompt token and one output token).
    """
    capacity = (num_blocks - 1) * block_size
    if max_model_len <= capacity:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens do not fit in the KV cache, which holds "
            f"{capacity} tokens per dp rank ({num_blocks - 1} usable blocks of {block_size}); "
            f"pass --max-model-len {capacity} or less, or give the KV cache more blocks "
            f"(--num-blocks, a larger memory fraction, or more device memory)"
        )
    if capacity < 2:
        raise ValueError(
            f"num_blocks: the KV cache holds {capacity} token(s) per dp rank "
            f"({num_blocks - 1} usable blocks of {block_size}); a request needs at least 2"
        )
    logger.warning(
        "max_model_len: the model's %d tokens do not fit in the KV cache (%d tokens per dp "
        "rank: %d usable blocks of %d); serving max_model_len %d. Set --max-model-len, or "
        "give the KV cache more blocks or memory.",
        max_model_len, capacity, num_blocks - 1, block_size, capacity,
    )  # fmt: skip
    return capacity
