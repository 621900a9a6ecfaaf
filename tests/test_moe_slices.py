"""MoE experts held one array per expert (`jaxserve.models.moe_slices`).

Oracles: a NumPy float64 loop over the token copies (each through its own expert) and
the dense MoE (`moe_experts.moe_experts_dense`); for the engine, the start-up rule in
`ModelRunner` checked on fresh runners of the tiny checkpoint. The engine tests against
transformers (test_engine.py) run the session engine, which holds its experts this way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_oracle import expert_rows_oracle, random_experts

from jaxserve.engine import model_runner
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.kernels import dispatch
from jaxserve.models.loader import load_model
from jaxserve.models.moe import route
from jaxserve.models.moe_experts import moe_experts_dense, moe_experts_local
from jaxserve.models.moe_slices import ExpertSlices, moe_experts_sliced, sliced_expert_ffn

HIDDEN, INTER, EXPERTS = 16, 8, 8


@pytest.fixture(scope="module")
def stacked():
    return random_experts(EXPERTS, HIDDEN, INTER)


@pytest.fixture(scope="module")
def sliced(stacked):
    return tuple(ExpertSlices.split(w) for w in stacked)


def _tokens(num_tokens: int, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((num_tokens, HIDDEN)), jnp.float32)


def _routing(name: str, num_tokens: int, top_k: int) -> np.ndarray:
    """[T, k] expert ids of a routing the loop must survive."""
    rng = np.random.default_rng(3)
    if name == "random":
        return np.stack([rng.permutation(EXPERTS)[:top_k] for _ in range(num_tokens)])
    if name == "one_expert":  # every copy to expert 5: one long group, the rest empty
        return np.full((num_tokens, top_k), 5)
    if name == "two_experts":  # experts 0 and 7 only (the first and last branch)
        return np.tile([0, 7], (num_tokens, top_k // 2 + 1))[:, :top_k]
    if name == "empty_copies":  # id E: an empty copy (expert-parallel padding), output 0
        ids = rng.integers(0, EXPERTS + 1, (num_tokens, top_k))
        ids[-1] = EXPERTS
        return ids
    raise AssertionError(name)


_ffn = jax.jit(sliced_expert_ffn)


@pytest.mark.parametrize("name", ["random", "one_expert", "two_experts", "empty_copies"])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 2), (3, 2), (24, 2), (64, 4)])
def test_sliced_ffn_equals_the_row_oracle(stacked, sliced, name, num_tokens, top_k):
    """Decode sizes (a copy or two per expert, chunks of MIN_CHUNK rows running past an
    expert's rows) to groups of dozens (several chunk sizes), and empty copies."""
    x = _tokens(num_tokens, seed=num_tokens + top_k)
    ids = _routing(name, num_tokens, top_k)
    got = np.asarray(_ffn(x, jnp.asarray(ids, jnp.int32), *sliced))
    np.testing.assert_allclose(got, expert_rows_oracle(x, ids, *stacked), atol=1e-5)
    assert not got[ids == EXPERTS].any()


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_moe_experts_local_with_slices_equals_dense(stacked, sliced, monkeypatch, num_tokens):
    """The model's entry point takes `ExpertSlices` on the reference backend: the sliced
    path by default, the weights stacked back under JAXSERVE_MOE_EXPERTS=dense."""
    x = _tokens(num_tokens, seed=7)
    gate = jnp.asarray(np.random.default_rng(8).standard_normal((HIDDEN, EXPERTS)), jnp.float32)
    weights, ids = route(x, gate, 2, True)
    want = moe_experts_dense(x, weights, ids, *stacked)
    with dispatch.backend_override(dispatch.REFERENCE):
        monkeypatch.delenv(dispatch.MOE_ENV_VAR, raising=False)
        got = jax.jit(lambda *a: moe_experts_local(*a))(x, weights, ids, *sliced)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        monkeypatch.setenv(dispatch.MOE_ENV_VAR, dispatch.MOE_DENSE)
        got = jax.jit(lambda *a: moe_experts_local(*a))(x, weights, ids, *sliced)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    direct = jax.jit(moe_experts_sliced)(x, weights, ids, *sliced)
    np.testing.assert_allclose(np.asarray(direct), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_expert_slices_is_a_pytree_standing_in_for_the_stacked_array(stacked, sliced):
    w, s = stacked[0], sliced[0]
    assert s.shape == w.shape and s.dtype == w.dtype and s.ndim == 3
    assert s[...] is s
    with pytest.raises(TypeError, match=r"\[\.\.\.\]"):
        s[0]
    np.testing.assert_array_equal(np.asarray(s.stacked()), np.asarray(w))
    leaves = jax.tree.leaves(s)
    assert len(leaves) == EXPERTS and all(a.shape == w.shape[1:] for a in leaves)
    doubled = jax.jit(lambda t: jax.tree.map(lambda a: 2 * a, t))(s)
    assert isinstance(doubled, ExpertSlices)
    np.testing.assert_array_equal(np.asarray(doubled.stacked()), 2 * np.asarray(w))


def test_bad_shapes_are_named(sliced):
    x = jnp.zeros((4, HIDDEN))
    with pytest.raises(ValueError, match="ids"):
        sliced_expert_ffn(x, jnp.zeros((3, 2), jnp.int32), *sliced)
    with pytest.raises(ValueError, match="w_down"):
        sliced_expert_ffn(x, jnp.zeros((4, 2), jnp.int32), sliced[0], sliced[1], sliced[0])


# ----- the engine's start-up rule --------------------------------------------------------


@functools.cache
def _model(model_dir: str):
    return load_model(model_dir, jnp.float32)


def _holds_slices(tiny_moe_dir) -> bool:
    """Whether a fresh runner of the tiny checkpoint holds its experts per expert."""
    model, mc = _model(str(tiny_moe_dir))
    runner = ModelRunner(
        model, mc, num_blocks=16, block_size=8, max_model_len=64, max_num_seqs=4,
        max_num_batched_tokens=16,
    )  # fmt: skip
    kinds = {type(w) for layer in runner.expert_weights() for w in layer}
    assert len(kinds) == 1, kinds  # all or none
    return kinds == {ExpertSlices}


def test_runner_holds_experts_per_expert_when_asked_within_the_cap(
    tiny_engine, tiny_moe_dir, monkeypatch
):
    """Stacked by default (the session engine too); held per expert under
    JAXSERVE_MOE_EXPERTS=sliced, unless over MAX_EXPERT_BRANCHES experts over all MoE
    layers."""
    held = [w for ws in tiny_engine.runner.expert_weights() for w in ws]
    assert not any(isinstance(w, ExpertSlices) for w in held)
    branches = held[0].shape[0] * len(tiny_engine.runner.moe_layers)
    monkeypatch.delenv(dispatch.MOE_ENV_VAR, raising=False)
    with dispatch.backend_override(dispatch.REFERENCE):
        assert not _holds_slices(tiny_moe_dir)
        monkeypatch.setenv(dispatch.MOE_ENV_VAR, dispatch.MOE_SLICED)
        assert _holds_slices(tiny_moe_dir)
        monkeypatch.setattr(model_runner, "MAX_EXPERT_BRANCHES", branches - 1)
        assert not _holds_slices(tiny_moe_dir)
        monkeypatch.setattr(model_runner, "MAX_EXPERT_BRANCHES", branches)
        assert _holds_slices(tiny_moe_dir)


def test_sliced_engine_greedy_equals_hf(tiny_engine_config, hf_model, monkeypatch):
    """An engine holding its experts per expert (its deepest path: async scheduling,
    4-step decode calls, chunked prefill) generates transformers' greedy tokens. One
    token bucket (T = 16: the longer prompts are chunked) compiles 5 step shapes instead
    of the session config's 9, for the same paths."""
    import dataclasses

    from engine_helpers import greedy, hf_greedy, run_engine

    from jaxserve.engine.core import EngineCore

    monkeypatch.setenv(dispatch.MOE_ENV_VAR, dispatch.MOE_SLICED)
    sc = dataclasses.replace(tiny_engine_config.scheduler, max_num_batched_tokens=16)
    engine = EngineCore(dataclasses.replace(tiny_engine_config, scheduler=sc))
    assert engine.runner.token_buckets == (16,)
    assert isinstance(engine.runner.expert_weights()[0][0], ExpertSlices)
    rng = np.random.default_rng(12)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 23, 40)]
    requests = [(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    results = run_engine(engine, requests)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].tokens == hf_greedy(hf_model, p, 12), f"prompt {i}"
