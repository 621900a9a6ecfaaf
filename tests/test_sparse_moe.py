"""The sparse MoE experts off the GPU (`jaxserve.models.moe_sparse`).

Oracles: the dense MoE (`moe_experts.moe_experts_dense`, every token through every
expert), a NumPy loop over the rows for the per-copy outputs, brute force over every routing for
the static padding bound, and the dot_general shapes of the traced program for the
FLOPs count.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from moe_oracle import expert_rows_oracle, random_experts

from jaxserve.kernels import cpu_moe, dispatch
from jaxserve.models import moe_loop, moe_sparse
from jaxserve.models.moe import route
from jaxserve.models.moe_experts import moe_experts_dense, moe_experts_local
from jaxserve.models.moe_sparse import (
    block_size_for,
    moe_experts_sparse,
    padded_rows,
    sparse_expert_ffn,
    sparse_moe_flops,
)

HIDDEN, INTER, EXPERTS = 16, 8, 8


@pytest.fixture(scope="module")
def experts():
    return random_experts(EXPERTS, HIDDEN, INTER)


def _tokens(num_tokens: int, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((num_tokens, HIDDEN)), jnp.float32)


@functools.cache
def _sparse(block_size: int | None):
    return jax.jit(functools.partial(moe_experts_sparse, block_size=block_size))


_dense = jax.jit(moe_experts_dense)


def _assert_close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_tokens,top_k,block_size",
    [(1, 2, None), (3, 4, None), (1, 8, 1), (5, 2, 2), (17, 2, 4), (64, 2, None),
     (64, 1, 8), (40, 4, 16), (33, 3, 64)],
)  # fmt: skip
def test_sparse_equals_dense_on_random_routing(experts, num_tokens, top_k, block_size):
    x = _tokens(num_tokens, seed=num_tokens * 10 + top_k)
    gate = jnp.asarray(np.random.default_rng(top_k).standard_normal((HIDDEN, EXPERTS)))
    weights, ids = route(x, gate.astype(jnp.float32), top_k, True)
    _assert_close(_sparse(block_size)(x, weights, ids, *experts), _dense(x, weights, ids, *experts))


def _adversarial(name: str, num_tokens: int, top_k: int):
    """(topk_weights, topk_ids) of a routing the block layout must survive."""
    rng = np.random.default_rng(3)
    weights = jnp.asarray(rng.random((num_tokens, top_k)), jnp.float32)
    if name == "one_expert":  # every copy to expert 5: one long group, the rest empty
        ids = np.full((num_tokens, top_k), 5)
    elif name == "two_experts":  # experts 0 and 7 only (the ends of the sort)
        ids = np.tile([0, 7], (num_tokens, top_k // 2 + 1))[:, :top_k]
    elif name == "ties":  # a gate with equal logits: top_k breaks the ties by index
        x = _tokens(num_tokens, seed=4)
        return route(x, jnp.zeros((HIDDEN, EXPERTS), jnp.float32), top_k, False)
    elif name == "group_edges":  # group sizes just above, at and below block multiples
        sizes = [9, 8, 7, 1, 0, 16, 0, 0][:EXPERTS]
        flat = np.concatenate([np.full(s, e) for e, s in enumerate(sizes)])
        flat = rng.permutation(np.resize(flat, num_tokens * top_k))
        ids = flat.reshape(num_tokens, top_k)
    else:
        raise AssertionError(name)
    return weights, jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("name", ["one_expert", "two_experts", "ties", "group_edges"])
@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_sparse_equals_dense_on_adversarial_routing(experts, name, block_size):
    num_tokens, top_k = 24, 2
    x = _tokens(num_tokens, seed=5)
    weights, ids = _adversarial(name, num_tokens, top_k)
    got = _sparse(block_size)(x, weights, ids, *experts)
    _assert_close(got, _dense(x, weights, ids, *experts))


@pytest.mark.parametrize("block_size", [1, 2, 8])
def test_empty_copies_give_zero_and_others_their_expert(experts, block_size):
    """Id E marks an empty copy (the expert-parallel receive buffer's padding)."""
    rng = np.random.default_rng(6)
    x = _tokens(20, seed=6)
    ids = jnp.asarray(rng.integers(0, EXPERTS + 1, (20, 1)), jnp.int32)
    assert (np.asarray(ids) == EXPERTS).any()
    got = jax.jit(functools.partial(sparse_expert_ffn, block_size=block_size))(x, ids, *experts)
    np.testing.assert_allclose(np.asarray(got), expert_rows_oracle(x, ids, *experts), atol=1e-5)
    assert not np.asarray(got)[np.asarray(ids)[:, 0] == EXPERTS].any()


def test_chunked_weight_gather_equals_one_gather(experts, monkeypatch):
    """Blocks run in chunks (lax.map) when their gathered weights would pass the bound."""
    x = _tokens(48, seed=7)
    weights, ids = route(x, jnp.asarray(np.eye(HIDDEN, EXPERTS), jnp.float32), 2, True)
    want = _dense(x, weights, ids, *experts)
    # 3 blocks' weights per chunk: 3 * HIDDEN * INTER elements each.
    monkeypatch.setattr(moe_sparse, "GATHER_ELEMENTS", 3 * 3 * HIDDEN * INTER)
    for block_size in (1, 4):
        got = jax.jit(functools.partial(moe_experts_sparse, block_size=block_size))
        _assert_close(got(x, weights, ids, *experts), want)


def test_bfloat16_matches_dense_to_bf16_rounding(experts):
    x = _tokens(12, seed=8).astype(jnp.bfloat16)
    bf16 = tuple(w.astype(jnp.bfloat16) for w in experts)
    weights, ids = route(x, jnp.ones((HIDDEN, EXPERTS), jnp.bfloat16), 2, True)
    got = _sparse(2)(x, weights, ids, *bf16)
    assert got.dtype == jnp.bfloat16
    want = _dense(*(a.astype(jnp.float32) for a in (x, weights)), ids, *experts)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)


# ----- the static padding and the FLOPs --------------------------------------------------


def test_padded_rows_is_the_worst_case_over_every_routing():
    """padded_rows equals the most rows any routing of N rows over E experts fills, by
    enumerating every vector of group sizes (empty copies included: sum <= N)."""
    for num_rows, num_experts, block in itertools.product(range(0, 9), (1, 2, 3, 4), (1, 2, 3, 5)):
        worst = max(
            sum(math.ceil(g / block) for g in sizes) * block
            for sizes in itertools.product(range(num_rows + 1), repeat=num_experts)
            if sum(sizes) <= num_rows
        )
        assert padded_rows(num_rows, num_experts, block) == worst, (num_rows, num_experts, block)


def _dot_flops(jaxpr) -> int:
    """2 * multiply-adds of every dot_general in a jaxpr (scan bodies times their length)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in contract)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * k
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in _sub_jaxprs(eqn.params):
            total += times * _dot_flops(sub)
    return total


def _sub_jaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


@pytest.mark.parametrize(
    "num_tokens,top_k,block_size", [(1, 2, 1), (4, 8, 1), (24, 2, 4), (64, 4, 8), (100, 2, 16)]
)
def test_flops_count_matches_the_traced_program(experts, num_tokens, top_k, block_size):
    x = _tokens(num_tokens, seed=9)
    ids = jnp.zeros((num_tokens, top_k), jnp.int32)
    fn = functools.partial(sparse_expert_ffn, block_size=block_size)
    traced = _dot_flops(jax.make_jaxpr(fn)(x, ids, *experts).jaxpr)
    assert traced == sparse_moe_flops(num_tokens, top_k, EXPERTS, block_size, HIDDEN, INTER)


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (32, 4), (128, 8), (16, 1)])
def test_chosen_block_size_keeps_flops_within_1_3x_of_routed(num_experts, top_k):
    routed_per_row = 6 * HIDDEN * INTER
    for num_tokens in range(1, 2049):
        block = block_size_for(num_tokens * top_k, num_experts)
        flops = sparse_moe_flops(num_tokens, top_k, num_experts, block, HIDDEN, INTER)
        assert flops <= 1.3 * num_tokens * top_k * routed_per_row, (num_tokens, block)
    assert block_size_for(2048 * top_k, num_experts) > 1  # large batches do use blocks


# ----- the selection ---------------------------------------------------------------------


def test_cpu_path_is_sparse_unless_forced_dense(experts, monkeypatch):
    """moe_experts_local traces the sparse path by default (no [T, E, I] intermediate)
    and the dense oracle under JAXSERVE_MOE_EXPERTS=dense; a bad value names the
    variable."""
    x = _tokens(6, seed=10)
    weights, ids = route(x, jnp.ones((HIDDEN, EXPERTS), jnp.float32), 2, True)
    args = (x, weights, ids, *experts)

    def intermediates():
        # A fresh function each time: JAX's trace cache does not see the variable.
        jaxpr = jax.make_jaxpr(lambda *a: moe_experts_local(*a))(*args).jaxpr
        return {v.aval.shape for eqn in jaxpr.eqns for v in eqn.outvars}

    with dispatch.backend_override(dispatch.REFERENCE):
        monkeypatch.delenv(dispatch.MOE_ENV_VAR, raising=False)
        assert (6, EXPERTS, INTER) not in intermediates()
        monkeypatch.setenv(dispatch.MOE_ENV_VAR, "dense")
        assert (6, EXPERTS, INTER) in intermediates()
        monkeypatch.setenv(dispatch.MOE_ENV_VAR, "sparce")
        with pytest.raises(ValueError, match="JAXSERVE_MOE_EXPERTS"):
            moe_experts_local(*args)


def test_bad_shapes_are_named():
    x = jnp.zeros((4, HIDDEN))
    w = jnp.zeros((EXPERTS, HIDDEN, INTER))
    with pytest.raises(ValueError, match="ids"):
        sparse_expert_ffn(
            x, jnp.zeros((3, 2), jnp.int32), w, w, jnp.zeros((EXPERTS, INTER, HIDDEN))
        )
    with pytest.raises(ValueError, match="w_down"):
        sparse_expert_ffn(x, jnp.zeros((4, 2), jnp.int32), w, w, w)
    with pytest.raises(ValueError, match="block_size"):
        padded_rows(8, EXPERTS, 0)


# ----- the expert loop (each expert's weights read once) ---------------------------------


@functools.cache
def _loop(chunk: int, levels: int = moe_loop.LOOP_LEVELS):
    return jax.jit(functools.partial(moe_loop.expert_loop_ffn, chunk=chunk, levels=levels))


@pytest.mark.parametrize("name", ["one_expert", "two_experts", "ties", "group_edges"])
@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
@pytest.mark.parametrize("levels", [1, 3])
def test_expert_loop_equals_the_row_oracle(experts, name, chunk, levels):
    """Every routing the block layout must survive, through the expert loop at chunk
    sizes below, at and above the group sizes (a chunk running past its expert's rows),
    with one chunk size and with several (whole large chunks, then the rest)."""
    num_tokens, top_k = 24, 2
    x = _tokens(num_tokens, seed=5)
    _, ids = _adversarial(name, num_tokens, top_k)
    got = _loop(chunk, levels)(x, ids, *experts)
    np.testing.assert_allclose(np.asarray(got), expert_rows_oracle(x, ids, *experts), atol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 4, 5, 15, 16, 17, 21, 37])
@pytest.mark.parametrize("chunk", [1, 3])
def test_expert_loop_levels_cover_every_group_size(experts, group, chunk):
    """One expert with `group` rows and another with the rest, levels 3 (chunk 1: sizes
    16, 4, 1; chunk 3: 48, 12, 3, the last chunk running into the next expert's rows):
    every mix of whole large chunks, middle ones and the rest equals the oracle."""
    num_tokens = 40
    x = _tokens(num_tokens, seed=group)
    ids = np.full((num_tokens, 1), 1, np.int32)
    ids[:group, 0] = 0
    got = _loop(chunk, 3)(x, jnp.asarray(ids), *experts)
    np.testing.assert_allclose(np.asarray(got), expert_rows_oracle(x, ids, *experts), atol=1e-5)


def test_loop_chunk_sizes_are_powers_of_four_of_the_chunk():
    assert moe_loop.loop_chunk_sizes(4, 3) == (64, 16, 4)
    assert moe_loop.loop_chunk_sizes(3, 1) == (3,)
    with pytest.raises(ValueError, match="chunk"):
        moe_loop.loop_chunk_sizes(0)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_expert_loop_gives_empty_copies_zero(experts, chunk):
    rng = np.random.default_rng(11)
    x = _tokens(20, seed=11)
    ids = jnp.asarray(rng.integers(0, EXPERTS + 1, (20, 2)), jnp.int32)
    ids = ids.at[-1].set(EXPERTS)  # the last sorted rows are empty copies
    got = np.asarray(_loop(chunk)(x, ids, *experts))
    np.testing.assert_allclose(got, expert_rows_oracle(x, ids, *experts), atol=1e-5)
    assert not got[np.asarray(ids) == EXPERTS].any()


def test_default_path_is_the_expert_loop_from_loop_min_rows(experts, monkeypatch):
    """block_size None, XLA's layouts (the CPU kernel off): the block layout below
    LOOP_MIN_ROWS routed rows, the expert loop (a while loop, no per-block weight gather)
    from there; both equal the dense oracle."""
    monkeypatch.setenv(cpu_moe.ENV_VAR, "0")
    for num_tokens in (moe_sparse.LOOP_MIN_ROWS // 2 - 1, moe_sparse.LOOP_MIN_ROWS // 2 + 3):
        x = _tokens(num_tokens, seed=13)
        weights, ids = route(x, jnp.asarray(np.eye(HIDDEN, EXPERTS), jnp.float32), 2, True)
        jaxpr = jax.make_jaxpr(functools.partial(moe_experts_sparse, block_size=None))(
            x, weights, ids, *experts
        )
        loops = {e.primitive.name for e in jaxpr.jaxpr.eqns} & {"while"}
        assert bool(loops) == (num_tokens * 2 >= moe_sparse.LOOP_MIN_ROWS)
        _assert_close(_sparse(None)(x, weights, ids, *experts), _dense(x, weights, ids, *experts))


def test_loop_levels_keep_the_sizes_up_to_the_mean_group():
    """Against the rule spelled out: sizes chunk * 4^i (i < LOOP_LEVELS) that are at most
    max(chunk, ceil(rows / experts)); the smallest is always kept."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows, experts = int(rng.integers(16, 5000)), int(rng.integers(1, 300))
        chunk = int(2 ** rng.integers(0, 7))
        top = max(chunk, math.ceil(rows / experts))
        want = sum(chunk * 4**i <= top for i in range(moe_loop.LOOP_LEVELS))
        assert moe_loop.loop_levels_for(rows, experts, chunk) == want >= 1
    # Decode with a row or two per expert: one size, the loop without levels.
    assert moe_loop.loop_levels_for(64, 32, 1) == 1


def test_one_device_experts_skip_padded_tokens(experts, monkeypatch):
    """With a token mask, `OneDevice.moe_experts` gives padded tokens no expert work on
    the sparse path (their copies are empty: output 0) and real tokens the dense
    oracle's output; the dense oracle (JAXSERVE_MOE_EXPERTS=dense) ignores the mask."""
    from jaxserve.models.layers import ONE_DEVICE  # noqa: PLC0415

    x = _tokens(7, seed=11)
    weights, ids = route(x, jnp.ones((HIDDEN, EXPERTS), jnp.float32), 2, True)
    mask = jnp.asarray([True, False, True, True, False, False, True])
    want = _dense(x, weights, ids, *experts)
    with dispatch.backend_override(dispatch.REFERENCE):
        monkeypatch.delenv(dispatch.MOE_ENV_VAR, raising=False)
        got = ONE_DEVICE.moe_experts(x, weights, ids, *experts, {}, mask)
        _assert_close(got[np.asarray(mask)], want[np.asarray(mask)])
        assert np.all(np.asarray(got)[~np.asarray(mask)] == 0.0)
        monkeypatch.setenv(dispatch.MOE_ENV_VAR, "dense")
        _assert_close(ONE_DEVICE.moe_experts(x, weights, ids, *experts, {}, mask), want)
