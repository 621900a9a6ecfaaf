"""Kernels against NumPy oracles (kernel_oracles.py): the Mosaic GPU kernels under the
Pallas GPU interpreter (CPU, small shapes) and their pure-jnp references. Their lowering
for Hopper: test_kernel_lowering.py; the backend switch: test_kernel_dispatch.py; the
same checks at full size on a GPU: test_kernels_gpu.py.

Under the interpreter every buffer a kernel allocates starts as NaN, outputs included,
so an output element that no tile wrote fails the comparison
(`test_interpreter_poisons_unwritten_output` pins that down).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from conftest_gpu import skip_without_gpu  # noqa: F401 -- fixture used via pytestmark
from kernel_oracles import (
    assert_close,
    attention_batch,
    attention_oracle,
    bf16,
    gmm_oracle,
    kernel_writing_nothing,
    make_batch,
    moe_oracle,
)

from jaxserve.kernels import grouped_matmul, grouped_matmul_plan, paged_attention
from jaxserve.kernels.grouped_matmul_ref import grouped_matmul_ref, moe_ffn_ref
from jaxserve.kernels.paged_attention_ref import paged_attention_ref
from jaxserve.kernels.tile_table import AttentionConfig, GmmConfig

pytestmark = pytest.mark.usefixtures("skip_without_gpu")


@pytest.fixture
def interpret():
    """Trace Mosaic GPU kernels for the GPU interpreter: NaN-initialised buffers, races
    reported."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # noqa: PLC0415

    params = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
    with plgpu.force_gpu_interpret_mode(params):
        yield
    races = interpret_pallas_call.get_races()
    assert races is None or not races.races_found, "the interpreter detected a data race"


def jitted(kernel, **settings):
    """`kernel` with its static settings bound, under `jax.jit`: the interpreted kernel
    runs inside one compiled program, as in a model step. Dispatched op by op instead, the
    interpreter took about a third longer on these shapes (a grouped matmul 2.6 s against
    1.9 s, a paged attention 5.1 s against 3.8 s); the kernel and its outputs are the same."""
    return jax.jit(functools.partial(kernel, **settings))


# --- grouped matmul -----------------------------------------------------------------


# name: (rows M, group sizes); K = N = 128 keeps the interpreter fast.
GMM_CASES = {
    "skewed_with_empty_and_single_rows": (100, [1, 0, 70, 1, 0, 9, 19, 0]),
    "all_in_one_group": (136, [0, 0, 136, 0]),
    "rows_past_the_groups_are_zero": (150, [3, 40, 0, 1]),
    "fewer_rows_than_a_tile_not_multiple_of_8": (13, [5, 0, 8]),
    "every_group_one_row": (8, [1] * 8),
}


@pytest.mark.parametrize("name", GMM_CASES)
def test_grouped_matmul_kernel_matches_oracle(interpret, name):
    m, sizes = GMM_CASES[name]
    rng = np.random.default_rng(0)
    x, w = bf16(rng, (m, 128)), bf16(rng, (len(sizes), 128, 128))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    # K = 2 steps of a 2-deep ring: tiles chain; 2 CTAs each run several tiles.
    config = GmmConfig(tile_m=64, tile_n=64, max_concurrent_steps=2)
    out = jitted(grouped_matmul.grouped_matmul, config=config, num_sms=2)(x, w, group_sizes)
    assert out.dtype == jnp.bfloat16
    assert_close(out, gmm_oracle(x, w, group_sizes))


def test_grouped_matmul_kernel_float32_output_and_deep_k(interpret):
    """K spans several pipeline stages (4 steps, 3-deep ring: tiles are not chained);
    float32 output keeps the accumulator's precision."""
    rng = np.random.default_rng(1)
    x, w = bf16(rng, (96, 256)), bf16(rng, (3, 256, 128))
    group_sizes = jnp.asarray([30, 2, 64], jnp.int32)
    config = GmmConfig(tile_m=64, tile_n=64, max_concurrent_steps=3)
    out = jitted(grouped_matmul.grouped_matmul, preferred_element_type=jnp.float32, config=config)(
        x, w, group_sizes
    )
    assert out.dtype == jnp.float32
    assert_close(out, gmm_oracle(x, w, group_sizes), rtol=1e-5)


@pytest.mark.parametrize("fuse_gate_up", [True, False])
def test_moe_ffn_kernels_match_oracle(interpret, fuse_gate_up):
    rng = np.random.default_rng(2)
    m, hidden, inter, sizes = 80, 128, 128, [9, 0, 1, 50, 12]  # 8 rows past the groups
    x = bf16(rng, (m, hidden))
    w_gate, w_up = bf16(rng, (5, hidden, inter), 0.1), bf16(rng, (5, hidden, inter), 0.1)
    w_down = bf16(rng, (5, inter, hidden), 0.1)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    ffn = jitted(grouped_matmul.moe_ffn, fuse_gate_up=fuse_gate_up)
    out = ffn(x, group_sizes, w_gate, w_up, w_down)
    assert_close(out, moe_oracle(x, group_sizes, w_gate, w_up, w_down))


@pytest.mark.parametrize(
    "name",
    ["skewed_with_empty_and_single_rows", "rows_past_the_groups_are_zero", "every_group_one_row"],
)
def test_fused_gate_up_kernel_matches_oracle(interpret, name):
    """The fused gate+up+SiLU kernel on its own: every row of its [M, I] output, rows
    past the groups included (moe_ffn's down projection never reads those)."""
    m, sizes = GMM_CASES[name]
    rng = np.random.default_rng(12)
    x = bf16(rng, (m, 128))
    w_gate, w_up = bf16(rng, (len(sizes), 128, 128), 0.1), bf16(rng, (len(sizes), 128, 128), 0.1)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = GmmConfig(tile_m=64, tile_n=64, max_concurrent_steps=2, fuse_gate_up=True)
    out = jitted(grouped_matmul.grouped_matmul_gate_up, config=config, num_sms=2)(
        x, w_gate, w_up, group_sizes
    )
    gate, up = gmm_oracle(x, w_gate, group_sizes), gmm_oracle(x, w_up, group_sizes)
    assert_close(out, gate / (1.0 + np.exp(-gate)) * up)


def test_interpreter_poisons_unwritten_output(interpret):
    """The premise of the 'every element written' checks: a kernel that writes nothing
    returns NaN under the interpreter."""
    out = kernel_writing_nothing((8, 64))(jnp.zeros((8, 64), jnp.bfloat16))
    assert np.isnan(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("seed", range(4))
def test_group_metadata_tiles_every_row_once(seed):
    """Brute force over random skewed groups: the stored rows of all tiles cover each
    grouped row exactly once, inside its own group, at TMA-aligned loads."""
    rng = np.random.default_rng(seed)
    num_groups, tile_m = int(rng.integers(1, 20)), int(rng.choice([64, 128]))
    m = int(rng.integers(1, 600))
    padded_m = max(-(-m // 8) * 8, tile_m)
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.full(num_groups, 0.3)))
    sizes[rng.random(num_groups) < 0.3] = 0
    meta, counts = grouped_matmul_plan.group_metadata(
        jnp.asarray(sizes, jnp.int32), m, padded_m, tile_m
    )
    meta, counts = np.asarray(meta), np.asarray(counts)
    ends = np.minimum(np.cumsum(sizes), m)
    owner = np.searchsorted(ends, np.arange(m), side="right")
    hits = np.zeros(m, int)
    for group, load_row, offset, rows in meta.T[: counts[0]]:
        assert load_row % 8 == 0 and 0 <= load_row <= padded_m - tile_m
        assert 0 <= offset and offset + rows <= tile_m
        stored = np.arange(load_row + offset, load_row + offset + rows)
        assert (owner[stored] == group).all()
        hits[stored] += 1
    assert (meta[3, counts[0] :] == 0).all()
    assert counts[1] == ends[-1]
    assert (hits[: ends[-1]] == 1).all() and (hits[ends[-1] :] == 0).all()


def test_grouped_matmul_reference_matches_oracle():
    rng = np.random.default_rng(3)
    x, w = bf16(rng, (40, 32)), bf16(rng, (4, 32, 24))
    group_sizes = jnp.asarray([7, 0, 30, 1], jnp.int32)  # 2 rows past the groups
    out = grouped_matmul_ref(x, w, group_sizes, preferred_element_type=jnp.float32)
    assert_close(out, gmm_oracle(x, w, group_sizes), rtol=1e-6)
    moe = moe_ffn_ref(x, group_sizes, w, w, bf16(rng, (4, 24, 32)))
    assert moe.shape == (40, 32) and moe.dtype == jnp.bfloat16


def test_grouped_matmul_rejects_bad_shapes():
    x, w = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul.grouped_matmul(x, w, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="w: expected"):
        grouped_matmul.grouped_matmul(x, w[:, :64], jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="N=96"):
        grouped_matmul.grouped_matmul(
            x, jnp.zeros((2, 128, 96), jnp.bfloat16), jnp.zeros((2,), jnp.int32)
        )


# --- paged attention ------------------------------------------------------------------


# block_size 8, one 64-key stage = 8 blocks; tiles hold 8 tokens for both layouts.
MIXED = [(1, 21), (11, 16), (1, 8), (3, 40), (9, 9), (1, 1), (1, 65)]
DECODE = [(1, n) for n in (1, 7, 8, 9, 64, 65, 100, 128)]
ATTENTION_CASES = {
    # name: (query heads, KV heads, requests, tokens, sliding window, block size)
    "mixed_gqa8_in_place_layout": (16, 2, MIXED, 32, None, 8),
    "mixed_gqa2_packed_layout": (4, 2, MIXED, 32, None, 8),
    "decode_mha_packed_layout": (2, 2, DECODE, 10, None, 8),
    "mixed_sliding_window": (16, 2, MIXED, 32, 6, 8),
    "single_token_batch": (16, 2, [(1, 9)], 1, None, 8),
    # A 64-key stage is half a block: loads start inside blocks.
    "mixed_blocks_larger_than_a_stage": (16, 2, MIXED, 32, None, 128),
}


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_paged_attention_kernel_matches_oracle(interpret, name):
    num_heads, num_kv_heads, requests, num_tokens, window, block_size = ATTENTION_CASES[name]
    rng = np.random.default_rng(4)
    head_dim, num_blocks, max_blocks = 64, 64, 17
    q, k_cache, v_cache, positions, metadata = attention_batch(
        rng, requests, num_tokens=num_tokens, heads=num_heads, kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, max_blocks=max_blocks,
    )  # fmt: skip
    scale = head_dim**-0.5
    config = AttentionConfig(block_kv=64, num_stages=2)
    attention = jitted(
        paged_attention.paged_attention, scale=scale, sliding_window=window, config=config
    )
    out = attention(q, k_cache, v_cache, positions, metadata)
    oracle = attention_oracle(q, k_cache, v_cache, positions, metadata, scale, window)
    assert_close(out, oracle)
    reference = paged_attention_ref(q, k_cache, v_cache, positions, metadata, scale, window)
    assert_close(reference, oracle)


@pytest.mark.parametrize(
    "num_heads, requests",
    [
        (16, [(1, 100), (1, 130)]),
        (4, [(1, 100), (1, 130)]),
        # Contexts of 1 key and of exactly one and eight blocks: some splits are empty.
        (16, [(1, 1), (1, 8), (1, 64)]),
    ],
)
def test_split_kv_decode_launch_matches_oracle(interpret, num_heads, requests):
    """max_query_len=1 with few requests: keys split over CTAs, partials merged."""
    rng = np.random.default_rng(10)
    num_tokens = len(requests) + 1  # one padding token
    positions, metadata = make_batch(
        rng, requests, num_tokens=num_tokens, block_size=8, num_blocks=40, max_blocks=17
    )
    q = bf16(rng, (num_tokens, num_heads, 64))
    k_cache, v_cache = bf16(rng, (40, 8, 2, 64)), bf16(rng, (40, 8, 2, 64))
    # (requests + 1 padded row) x 2 KV heads on 24 CTAs: >= 3 splits wanted, 3 key
    # stages allowed.
    assert paged_attention.num_kv_splits(len(requests) + 1, 2, 3, 24) == 3
    attention = jitted(
        paged_attention.paged_attention, scale=0.125,
        max_query_len=1, config=AttentionConfig(block_kv=64, num_stages=2), num_sms=24,
    )  # fmt: skip
    out = attention(q, k_cache, v_cache, positions, metadata)
    assert_close(out, attention_oracle(q, k_cache, v_cache, positions, metadata, 0.125))


def test_paged_attention_rejects_bad_inputs():
    rng = np.random.default_rng(5)
    positions, metadata = make_batch(
        rng, [(1, 5)], num_tokens=2, block_size=8, num_blocks=4, max_blocks=2
    )
    cache = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        paged_attention.paged_attention(
            jnp.zeros((2, 3, 64), jnp.bfloat16), cache, cache, positions, metadata, 1.0
        )
    with pytest.raises(ValueError, match="head_dim=32"):
        small = jnp.zeros((4, 8, 2, 32), jnp.bfloat16)
        paged_attention.paged_attention(
            jnp.zeros((2, 4, 32), jnp.bfloat16), small, small, positions, metadata, 1.0
        )
    with pytest.raises(ValueError, match="positions"):
        paged_attention.paged_attention(
            jnp.zeros((2, 4, 64), jnp.bfloat16), cache, cache, positions[:1], metadata, 1.0
        )
