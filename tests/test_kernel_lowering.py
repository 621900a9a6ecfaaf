"""The kernels lowered for Hopper at production shapes on the CPU (Mosaic GPU's Python
passes: layout inference, shared-memory planning for sm_90), and the tile table's
configurations within shared memory."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest_gpu import skip_without_gpu  # noqa: F401 -- fixture used via pytestmark
from kernel_oracles import QWEN3_30B

from jaxserve.kernels import grouped_matmul, paged_attention, tile_table
from jaxserve.models.base import AttentionMetadata

pytestmark = pytest.mark.usefixtures("skip_without_gpu")


def lower_for_cuda(fn, *args):
    """Lower through Mosaic GPU's layout inference and SMEM planning for sm_90; fails on
    kernels that the GPU compiler would reject at those stages."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("tokens", [16, 4096])
def test_grouped_matmul_lowers_for_hopper_at_qwen3_shapes(tokens):
    e, h, i = QWEN3_30B["experts"], QWEN3_30B["hidden"], QWEN3_30B["inter"]
    m = tokens * QWEN3_30B["top_k"]
    sds = jax.ShapeDtypeStruct
    x, sizes = sds((m, h), jnp.bfloat16), sds((e,), jnp.int32)
    w_in, w_out = sds((e, h, i), jnp.bfloat16), sds((e, i, h), jnp.bfloat16)
    kernel = functools.partial(grouped_matmul.grouped_matmul, num_sms=132)
    fused = functools.partial(grouped_matmul.grouped_matmul_gate_up, num_sms=132)
    assert "mosaic_gpu" in lower_for_cuda(kernel, x, w_in, sizes).as_text()
    assert "mosaic_gpu" in lower_for_cuda(kernel, sds((m, i), jnp.bfloat16), w_out, sizes).as_text()
    assert "mosaic_gpu" in lower_for_cuda(fused, x, w_in, w_in, sizes).as_text()


@pytest.mark.parametrize(
    "num_heads, block_size, reqs, max_query_len",
    [(32, 16, 256, None), (16, 64, 256, None), (32, 16, 8, 1), (32, 128, 8, None)],
)
def test_paged_attention_lowers_for_hopper(num_heads, block_size, reqs, max_query_len):
    tokens, kv_heads, head_dim, blocks = 256, 4, 128, 4096
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    metadata = AttentionMetadata(
        sds((tokens,), i32),
        sds((reqs, 8192 // block_size), i32),
        sds((reqs,), i32),
        sds((reqs + 1,), i32),
        sds((tokens,), i32),
    )
    cache = sds((blocks, block_size, kv_heads, head_dim), jnp.bfloat16)
    fn = functools.partial(
        paged_attention.paged_attention, scale=0.088, max_query_len=max_query_len, num_sms=132
    )
    lowered = lower_for_cuda(
        fn,
        sds((tokens, num_heads, head_dim), jnp.bfloat16),
        cache,
        cache,
        sds((tokens,), i32),
        metadata,
    )
    assert "mosaic_gpu" in lowered.as_text()


def test_tile_table_configs_fit_in_shared_memory():
    for m in (128, 2048, 32768):
        for fused in (False, True):
            config = tile_table.gmm_config(m, 2048, 768, 128, fused=fused)
            assert config.smem_bytes(2 if fused else 1, 2, 2) <= tile_table.SMEM_BYTES_PER_SM
    with pytest.raises(ValueError, match="K=100"):
        tile_table.gmm_config(64, 100, 128, 4)
    config = tile_table.attention_config(256, 16)
    assert config.smem_bytes(64, 256, 2) <= tile_table.SMEM_BYTES_PER_SM
