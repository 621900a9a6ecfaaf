"""The capacity layout of the sparse experts (`models/moe_capacity.py`): every capacity
and the loop fallback against the float64 per-copy oracle, and the per-step choice
against a brute-force count of the rows each layout runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_oracle import expert_rows_oracle, random_experts

from jaxserve.kernels import cpu_moe
from jaxserve.models import moe_sparse
from jaxserve.models.moe_capacity import (
    OVERFLOW_CHUNK,
    capacities_for,
    capacity_branch,
    capacity_rows,
    uses_capacity,
)
from jaxserve.models.moe_loop import SortedRows
from jaxserve.models.moe_sparse import MAX_PADDING

EXPERTS, HIDDEN, INTER = 8, 16, 8


@pytest.fixture(scope="module")
def experts():
    return random_experts(EXPERTS, HIDDEN, INTER, seed=4)


def _tokens(n: int, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, HIDDEN)), jnp.float32)


def _routing(name: str, num_tokens: int, top_k: int, seed: int = 0) -> np.ndarray:
    """[T, k] int32 expert ids: distinct per token except where the name says."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((num_tokens, EXPERTS))
    if name == "skewed":  # Zipf-like: low ids hot
        scores += 3.0 / (1 + np.arange(EXPERTS))
    ids = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    if name == "one_device":  # every copy on experts 0 and 1
        ids = np.tile(np.arange(top_k, dtype=np.int32) % 2, (num_tokens, 1))
    if name == "balanced":  # exactly N / E rows each
        ids = (np.arange(num_tokens * top_k, dtype=np.int32) % EXPERTS).reshape(num_tokens, top_k)
    if name == "empties":  # 30% empty copies (id E), as the expert-parallel path sends
        ids[rng.random(ids.shape) < 0.3] = EXPERTS
    return ids


def _brute_rows(sizes: np.ndarray, capacity: int) -> int:
    """Rows the capacity layout runs, counted one expert and one chunk at a time."""
    total = 0
    for g in sizes:
        total += capacity  # the batched slots, used or not
        left = max(int(g) - capacity, 0)
        while left > 0:  # the overflow, in whole chunks
            total += OVERFLOW_CHUNK
            left -= OVERFLOW_CHUNK
    return total


@functools.cache
def _capacity_rows_fn(capacity: int):
    def run(x, ids, w_gate, w_up, w_down):
        rows = SortedRows.of(x, ids, EXPERTS, OVERFLOW_CHUNK)
        return rows.unsort(capacity_rows(rows, (w_gate, w_up, w_down), capacity, x.dtype))

    return jax.jit(run)


@pytest.mark.parametrize("name", ["random", "skewed", "one_device", "balanced", "empties"])
@pytest.mark.parametrize("capacity", [1, 3, 8, 40])
def test_every_capacity_equals_the_row_oracle(experts, name, capacity):
    """Each capacity, forced, on routings that overflow a little, a lot (every copy on
    two experts) or not at all (capacity 40 > any group), with empty copies: equal to
    each copy through its own expert, so no overflow row is lost or doubled."""
    num_tokens, top_k = 32, 2
    x = _tokens(num_tokens, seed=capacity)
    ids = _routing(name, num_tokens, top_k, seed=capacity)
    got = np.asarray(_capacity_rows_fn(capacity)(x, jnp.asarray(ids), *experts))
    np.testing.assert_allclose(got, expert_rows_oracle(x, ids, *experts), atol=1e-5)
    assert not got[ids == EXPERTS].any()


@pytest.mark.parametrize("name", ["random", "skewed", "one_device", "balanced", "empties"])
def test_default_path_equals_the_row_oracle(experts, name):
    """sparse_expert_ffn's default path at a batch that takes the capacity layout, on
    routings that pick a capacity (balanced, random) and the loop (one_device)."""
    num_tokens, top_k = 48, 2
    assert uses_capacity(num_tokens * top_k, EXPERTS)
    x = _tokens(num_tokens, seed=7)
    ids = _routing(name, num_tokens, top_k, seed=7)
    fn = jax.jit(moe_sparse.sparse_expert_ffn)
    got = np.asarray(fn(x, jnp.asarray(ids), *experts))
    np.testing.assert_allclose(got, expert_rows_oracle(x, ids, *experts), atol=1e-5)


def test_the_chosen_layout_is_the_largest_capacity_within_max_padding():
    """capacity_branch against brute force on random and skewed group sizes: the
    largest capacity whose counted rows fit MAX_PADDING x the routed rows, else the
    loop; so the chosen layout never runs more than MAX_PADDING x the routed rows."""
    rng = np.random.default_rng(0)
    chosen = set()
    for trial in range(300):
        num_experts = int(rng.choice([8, 32, 64]))
        n = int(rng.integers(4 * num_experts, 40 * num_experts))
        p = rng.dirichlet(np.full(num_experts, float(rng.choice([0.3, 3.0, 100.0]))))
        sizes = rng.multinomial(n, p).astype(np.int32)
        capacities = capacities_for(n, num_experts)
        fitting = [
            i + 1 for i, c in enumerate(capacities) if _brute_rows(sizes, c) <= MAX_PADDING * n
        ]
        want = max(fitting, default=0)
        got = int(capacity_branch(jnp.asarray(sizes), capacities, MAX_PADDING))
        assert got == want, (trial, sizes.tolist(), capacities)
        chosen.add(got)
    assert chosen == {0, 1, 2, 3}  # every branch was exercised


def test_capacities_are_the_mean_group_times_the_factors():
    assert capacities_for(512, 32) == (16, 18, 20)
    assert capacities_for(128, 32) == (4, 5)  # floor of 4.0, 4.5, 5.0, distinct
    assert not uses_capacity(4 * EXPERTS - 1, EXPERTS)
    assert uses_capacity(4 * EXPERTS, EXPERTS)


def test_capacity_layout_is_one_batched_matmul_over_the_stacked_weights(experts, monkeypatch):
    """The traced default path of XLA's layouts (the CPU kernel off: with AVX-512 it takes
    this size) holds a dot with the experts as a batch dimension ([E, C, H] x [E, H, I]):
    the weights are read in place, not sliced per expert."""
    monkeypatch.setenv(cpu_moe.ENV_VAR, "0")
    num_tokens, top_k = 64, 2
    x = _tokens(num_tokens, seed=1)
    ids = jnp.asarray(_routing("random", num_tokens, top_k))
    jaxpr = jax.make_jaxpr(moe_sparse.sparse_expert_ffn)(x, ids, *experts)
    batched = [
        eqn
        for eqn in _all_eqns(jaxpr.jaxpr)
        if eqn.primitive.name == "dot_general"
        and eqn.params["dimension_numbers"][1][0]  # lhs batch dims
        and eqn.invars[1].aval.shape[0] == EXPERTS
    ]
    assert batched, "no batched expert matmul in the capacity layout"


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, jax.extend.core.ClosedJaxpr):
                    yield from _all_eqns(item.jaxpr)
                elif isinstance(item, jax.extend.core.Jaxpr):
                    yield from _all_eqns(item)
