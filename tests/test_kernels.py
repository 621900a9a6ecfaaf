"""Kernels against NumPy oracles: the Mosaic GPU kernels under the Pallas GPU interpreter
(CPU, small shapes), their pure-jnp references, the one backend switch, lowering of the
kernels for Hopper at production shapes, and (marked `gpu`) the same checks at full size.

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

from jaxserve.kernels import (
    dispatch,
    grouped_matmul,
    grouped_matmul_plan,
    paged_attention,
    tile_table,
)
from jaxserve.kernels.grouped_matmul_ref import grouped_matmul_ref, moe_ffn_ref
from jaxserve.kernels.paged_attention_ref import paged_attention_ref
from jaxserve.kernels.tile_table import AttentionConfig, GmmConfig
from jaxserve.models.base import PAD_SLOT, AttentionMetadata

pytestmark = pytest.mark.usefixtures("skip_without_gpu")

BF16_RTOL = 1e-2  # max |out - oracle| / max |oracle|


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


def assert_close(out, oracle, rtol=BF16_RTOL):
    out = np.asarray(out, np.float64)
    assert out.shape == oracle.shape
    assert np.isfinite(out).all(), f"{np.sum(~np.isfinite(out))} elements not written/finite"
    scale = max(np.abs(oracle).max(), 1e-6)
    err = np.abs(out - oracle).max() / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# --- grouped matmul -----------------------------------------------------------------


def gmm_oracle(x, w, group_sizes):
    """NumPy float64: rows [start_g, end_g) times w[g]; rows past the groups are 0."""
    x, w = f64(x), f64(w)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), x.shape[0])
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def moe_oracle(x, group_sizes, w_gate, w_up, w_down):
    gate, up = gmm_oracle(x, w_gate, group_sizes), gmm_oracle(x, w_up, group_sizes)
    hidden = gate / (1.0 + np.exp(-gate)) * up
    return gmm_oracle(hidden, w_down, group_sizes)


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


def kernel_writing_nothing(shape: tuple[int, int]):
    """A Mosaic GPU kernel that takes one input and writes none of its [shape] bf16
    output."""

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        grid=(1,),
        grid_names=("sm",),
    )
    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    return writes_nothing


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


def make_batch(rng, requests, *, num_tokens, block_size, num_blocks, max_blocks):
    """A flat batch as the engine builds it. requests: (query_len, seq_len) each; the
    query tokens are the last query_len positions; blocks are a random permutation of
    1..num_blocks-1; tokens past the requests are padding."""
    free = list(rng.permutation(np.arange(1, num_blocks)))
    rows = len(requests) + 1  # one padded request row
    block_tables = np.zeros((rows, max_blocks), np.int32)
    qsl, positions, slots, token_req, seq_lens = [0], [], [], [], []
    for r, (q_len, seq_len) in enumerate(requests):
        blocks = -(-seq_len // block_size)
        block_tables[r, :blocks] = [free.pop() for _ in range(blocks)]
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            slots.append(block_tables[r, p // block_size] * block_size + p % block_size)
            token_req.append(r)
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(seq_len)
    pad = num_tokens - len(positions)
    assert pad >= 0
    positions += [0] * pad
    slots += [PAD_SLOT] * pad
    token_req += [len(requests)] * pad
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(block_tables),
        seq_lens=jnp.asarray(seq_lens + [0], jnp.int32),
        query_start_loc=jnp.asarray(qsl + [qsl[-1]], jnp.int32),
        token_req=jnp.asarray(token_req, jnp.int32),
    )
    return jnp.asarray(positions, jnp.int32), metadata


def attention_oracle(q, k_cache, v_cache, positions, metadata, scale, window=None):
    """NumPy float64, token by token: keys 0..pos (and < seq_len, inside the window) of
    the token's request, gathered slot by slot through its block table."""
    q, k_cache, v_cache = f64(q), f64(k_cache), f64(v_cache)
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl = np.asarray(metadata.query_start_loc)
    tables, seq_lens = np.asarray(metadata.block_tables), np.asarray(metadata.seq_lens)
    out = np.zeros_like(q)
    for r in range(len(qsl) - 1):
        for t in range(qsl[r], qsl[r + 1]):
            pos = int(positions[t])
            keys = [
                kp for kp in range(min(pos + 1, seq_lens[r])) if window is None or pos - kp < window
            ]
            blocks = tables[r, [kp // block_size for kp in keys]]
            offsets = [kp % block_size for kp in keys]
            for h in range(num_heads):
                k = k_cache[blocks, offsets, h // group]
                v = v_cache[blocks, offsets, h // group]
                s = k @ q[t, h] * scale
                p = np.exp(s - s.max())
                out[t, h] = p @ v / p.sum()
    return out


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
    positions, metadata = make_batch(
        rng,
        requests,
        num_tokens=num_tokens,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
    )
    q = bf16(rng, (num_tokens, num_heads, head_dim))
    k_cache = bf16(rng, (num_blocks, block_size, num_kv_heads, head_dim))
    v_cache = bf16(rng, (num_blocks, block_size, num_kv_heads, head_dim))
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


# --- lowering for Hopper at production shapes (CPU: Mosaic GPU's Python passes) ---------


def lower_for_cuda(fn, *args):
    """Lower through Mosaic GPU's layout inference and SMEM planning for sm_90; fails on
    kernels that the GPU compiler would reject at those stages."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


QWEN3_30B = dict(experts=128, hidden=2048, inter=768, top_k=8)


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


# --- the backend switch ---------------------------------------------------------------


@pytest.fixture
def env_backend(monkeypatch):
    """Set JAXSERVE_KERNELS for one test and re-read it."""

    def set_value(value):
        monkeypatch.setenv(dispatch.ENV_VAR, value)
        dispatch._backend_from_environment.cache_clear()

    yield set_value
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch._backend_from_environment.cache_clear()


def test_backend_defaults_to_reference_on_cpu(env_backend):
    env_backend("")
    assert dispatch.get_backend() == (
        dispatch.PALLAS_MGPU if dispatch.has_nvidia_gpu() else dispatch.REFERENCE
    )
    env_backend("interpret")
    assert dispatch.get_backend() == dispatch.INTERPRET


def test_backend_env_rejects_unknown_and_missing_gpu(env_backend):
    env_backend("triton")
    with pytest.raises(ValueError, match="JAXSERVE_KERNELS='triton'"):
        dispatch.get_backend()
    if not dispatch.has_nvidia_gpu():
        env_backend("pallas")
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            dispatch.get_backend()


def test_dispatch_routes_to_interpreted_kernels_and_reference():
    """The same calls give the same answers through both backends."""
    rng = np.random.default_rng(6)
    x, w = bf16(rng, (64, 128)), bf16(rng, (4, 128, 128), 0.1)
    group_sizes = jnp.asarray([20, 0, 43, 1], jnp.int32)
    positions, metadata = make_batch(
        rng, [(1, 9), (2, 70)], num_tokens=4, block_size=8, num_blocks=12, max_blocks=9
    )
    q = bf16(rng, (4, 16, 64))
    k_cache, v_cache = bf16(rng, (12, 8, 2, 64)), bf16(rng, (12, 8, 2, 64))
    outs = {}
    for backend in (dispatch.REFERENCE, dispatch.INTERPRET):
        with dispatch.backend_override(backend):
            assert dispatch.get_backend() == backend
            outs[backend] = (
                dispatch.grouped_matmul(x, w, group_sizes),
                dispatch.paged_attention(q, k_cache, v_cache, positions, metadata, 0.125),
            )
    for kernel, reference in zip(outs[dispatch.INTERPRET], outs[dispatch.REFERENCE], strict=True):
        assert_close(kernel, f64(reference))


def test_dispatch_falls_back_to_reference_for_unsupported_inputs(caplog):
    """A float32 model (or head_dim 32) runs the reference on a kernel backend, with a
    warning that names the cause."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.float32)
    group_sizes = jnp.asarray([10, 6], jnp.int32)
    positions, metadata = make_batch(
        rng, [(1, 5)], num_tokens=2, block_size=8, num_blocks=4, max_blocks=2
    )
    q, cache = bf16(rng, (2, 4, 32)), bf16(rng, (4, 8, 2, 32))
    with caplog.at_level("WARNING"), dispatch.backend_override(dispatch.INTERPRET):
        out = dispatch.grouped_matmul(x, w, group_sizes, preferred_element_type=jnp.float32)
        attn = dispatch.paged_attention(q, cache, cache, positions, metadata, 0.1)
    assert_close(out, gmm_oracle(x, w, group_sizes), rtol=1e-5)
    assert_close(attn, attention_oracle(q, cache, cache, positions, metadata, 0.1))
    assert "dtype float32" in caplog.text and "head_dim=32" in caplog.text


# --- full size, on a GPU --------------------------------------------------------------
#
# The same checks as above at Qwen3-30B-A3B sizes, against XLA (lax.ragged_dot, the
# jnp attention reference) rather than NumPy. A GPU has no interpreter to poison
# outputs, so `poison_device_memory` fills the free part of JAX's memory pool with NaN
# just before each kernel call: the call's output buffers are carved from that memory,
# and an element no tile writes stays NaN (`test_gpu_poison_reaches_kernel_outputs`
# pins that premise down on the device).


def poison_device_memory(min_bytes: int = 1 << 20, max_chunks: int = 256) -> int:
    """Fill the free chunks (of at least `min_bytes`) of the default device's allocator
    with NaN, then free them. XLA's BFC allocator keeps freed memory in its pool,
    unzeroed; filling the small chunks too matters, as best-fit would hand one of them to
    an output that fits. Chunks are powers of two, so the fills compile a few times only.
    `max_chunks` bounds the work: 256 chunks of up to 4 GiB cover an H200's pool.

    Returns the bytes poisoned (0 where the device reports no memory statistics: the
    value checks still run, and `test_gpu_poison_reaches_kernel_outputs` fails).
    """
    device = jax.devices()[0]
    held = []
    for _ in range(max_chunks):
        stats = device.memory_stats() or {}
        free = stats.get("largest_free_block_bytes")
        if free is None:
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        free -= 1024  # the allocator's rounding and chunk bookkeeping
        if free < min_bytes:
            break
        # The largest power of two that fits, at most 4 GiB (2^30 elements: int32 indexing).
        size = min(1 << (free.bit_length() - 1), 1 << 32)
        try:
            held.append(jnp.full((size // 4,), jnp.nan, jnp.float32).block_until_ready())
        except Exception:  # noqa: BLE001 -- out of memory (fragmentation): done
            break
    poisoned = sum(array.nbytes for array in held)
    for array in held:
        array.delete()
    return poisoned


def skewed_group_sizes(rng, rows: int, groups: int) -> jax.Array:
    """Random skewed rows per group summing to `rows`, with group 0 empty and group 1
    a single row."""
    sizes = rng.multinomial(rows - 1, rng.dirichlet(np.full(groups, 0.5)))
    big = 2 + int(np.argmax(sizes[2:]))
    sizes[big] += sizes[0] + sizes[1]
    sizes[0], sizes[1] = 0, 1
    return jnp.asarray(sizes, jnp.int32)


def ragged_dot_f32(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


@pytest.mark.gpu
def test_gpu_poison_reaches_kernel_outputs():
    """The premise of the poisoned-output checks on a GPU: after `poison_device_memory`,
    a kernel that writes nothing returns NaN."""
    writes_nothing = jax.jit(kernel_writing_nothing((4096, 128)))
    x = jnp.zeros((8, 64), jnp.bfloat16)
    assert poison_device_memory() > 0, "no device memory statistics to find free memory"
    assert np.isnan(np.asarray(writes_nothing(x), np.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 256, 4096])
def test_moe_ffn_full_size_on_gpu(tokens):
    """Grouped matmul, fused gate+up+SiLU and the expert FFN against lax.ragged_dot:
    skewed groups (one empty, one of a single row) and 5 rows past the groups."""
    rng = np.random.default_rng(7)
    e, h, i, k = (QWEN3_30B[n] for n in ("experts", "hidden", "inter", "top_k"))
    m = tokens * k
    x = bf16(rng, (m, h))
    w_gate, w_up = bf16(rng, (e, h, i), 0.02), bf16(rng, (e, h, i), 0.02)
    w_down = bf16(rng, (e, i, h), 0.02)
    group_sizes = skewed_group_sizes(rng, m - 5, e)

    @jax.jit
    def reference(x, group_sizes, w_gate, w_up, w_down):
        gate, up = ragged_dot_f32(x, w_gate, group_sizes), ragged_dot_f32(x, w_up, group_sizes)
        hidden = (gate * jax.nn.sigmoid(gate) * up).astype(x.dtype)
        return hidden, jax.lax.ragged_dot(hidden, w_down, group_sizes)

    hidden, expected = reference(x, group_sizes, w_gate, w_up, w_down)
    for fuse in (False, True):
        poison_device_memory()
        out = jax.jit(functools.partial(grouped_matmul.moe_ffn, fuse_gate_up=fuse))(
            x, group_sizes, w_gate, w_up, w_down
        )
        assert_close(out, f64(expected))
    poison_device_memory()
    out = jax.jit(grouped_matmul.grouped_matmul_gate_up)(x, w_gate, w_up, group_sizes)
    assert_close(out, f64(hidden))
    poison_device_memory()
    out = jax.jit(grouped_matmul.grouped_matmul)(x, w_gate, group_sizes)
    assert_close(out, f64(jax.lax.ragged_dot(x, w_gate, group_sizes)))


def full_size_attention_inputs(rng, requests, num_tokens, max_blocks):
    """Qwen3-30B-A3B attention shapes (32 query heads, 4 KV heads, head dim 128, block
    size 16) over `requests` (query_len, seq_len), blocks in random order."""
    heads, kv_heads, head_dim, block_size = 32, 4, 128, 16
    num_blocks = sum(-(-n // block_size) for _, n in requests) + 1
    positions, metadata = make_batch(
        rng,
        requests,
        num_tokens=num_tokens,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
    )
    q = bf16(rng, (num_tokens, heads, head_dim))
    k_cache = bf16(rng, (num_blocks, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (num_blocks, block_size, kv_heads, head_dim))
    return q, k_cache, v_cache, positions, metadata


def check_attention_on_gpu(inputs, scale, **options):
    """The kernel on poisoned memory against the jnp reference (XLA)."""
    expected = jax.jit(paged_attention_ref, static_argnums=(5,))(*inputs, scale)
    poison_device_memory()
    fn = functools.partial(paged_attention.paged_attention, scale=scale, **options)
    assert_close(jax.jit(fn)(*inputs), f64(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("max_query_len", [None, 1])
@pytest.mark.parametrize("batch, context", [(64, 1024), (8, 8192)])
def test_paged_decode_attention_full_size_on_gpu(batch, context, max_query_len):
    """Decode at random lengths, plus a context of one key and contexts that end at a
    block boundary and one past it; max_query_len=1 allows the split-KV launch."""
    rng = np.random.default_rng(8)
    lens = rng.integers(context // 2, context + 1, batch)
    lens[:4] = [1, context, context - 16, 16 * 5 + 1]
    requests = [(1, int(n)) for n in lens]
    inputs = full_size_attention_inputs(rng, requests, batch + 3, context // 16)
    check_attention_on_gpu(inputs, 128**-0.5, max_query_len=max_query_len)


@pytest.mark.gpu
def test_paged_prefill_attention_full_size_on_gpu():
    """A mixed step: prefill chunks (one from position 0, one continuing a context, one
    ending at a block boundary) among decode tokens, and padding tokens."""
    rng = np.random.default_rng(9)
    requests = [(512, 2048), (300, 300), (1, 4000), (100, 1000), (64, 1024)] + [(1, 700)] * 60
    tokens = sum(q for q, _ in requests) + 13
    inputs = full_size_attention_inputs(rng, requests, tokens, 4096 // 16)
    check_attention_on_gpu(inputs, 0.088)
