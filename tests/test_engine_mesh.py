"""The engine on a (dp, tp) mesh of 8 emulated CPU devices (DP attention, wide EP).

A batch of mixed-length prompts runs through EngineCore on meshes 8x1, 4x2, 2x4 and 1x8;
its greedy tokens must equal the single-device engine's (the independent reference: no
mesh code runs there), with requests spread over every dp rank and no compilation after
start-up. Also: the Python API's `mesh=` argument, and the start-up error of a mesh that
cannot hold the model.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from engine_helpers import greedy, random_prompts, run_engine
from server_harness import ep_test_threshold
from sharding_utils import (
    MESH_BLOCK_SIZE,
    MESH_MAX_BATCHED_TOKENS,
    MESH_MAX_LEN,
    MESH_MAX_NUM_SEQS,
    mesh_engine_config,
)

from jaxserve.config import MeshConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.scheduler import Scheduler
from jaxserve.ipc import EngineRequest
from jaxserve.sharding.mesh import MeshError

NUM_NEW = 6

# The model (`mesh_model_dir`: heads and experts divisible by 8 devices) and the engines
# (`mesh_engine(dp, tp)`, `sharding_utils.mesh_engine_config`) are the session's
# (tests/conftest.py), shared with tests/test_multihost.py and test_eplb_multiprocess.py.


def _requests():
    prompts = random_prompts(random.Random(0), 10, 2, 20, 256)
    return [(f"r{i}", p, greedy(NUM_NEW)) for i, p in enumerate(prompts)]


def _tokens(engine) -> dict[str, list[int]]:
    results = run_engine(engine, _requests())
    return {rid: r.tokens for rid, r in results.items()}


@pytest.fixture(scope="module")
def reference_engine(mesh_engine):
    return mesh_engine(1, 1)


@pytest.fixture(scope="module")
def reference(reference_engine):
    """Greedy tokens of the single-device engine."""
    return _tokens(reference_engine)


def _logprob_requests():
    """Requests that take the full step variant (prompt log-probs, a penalty) and read
    sampled-token log-probs: every per-rank slice of the step's outputs."""
    prompts = random_prompts(random.Random(2), 5, 3, 12, 256)
    kw = dict(logprobs=2, prompt_logprobs=1, repetition_penalty=1.3)
    return [(f"p{i}", p, greedy(3, **kw)) for i, p in enumerate(prompts)]


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _flat(item)]
    return [x] if x is not None else []


@pytest.mark.parametrize(("dp", "tp"), [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_mesh_greedy_equals_single_device(mesh_engine, reference, dp, tp):
    engine = mesh_engine(dp, tp)
    assigned = list(engine.scheduler.num_assigned) if dp > 1 else []
    tokens = _tokens(engine)
    assert tokens == reference
    assert all(len(t) == NUM_NEW for t in tokens.values())
    assert engine.num_compilations == 0
    if dp > 1:
        assert isinstance(engine.scheduler, Scheduler) and len(engine.scheduler.ranks) == dp
        # This batch reached every dp rank (the engine is the session's: count its part).
        now = engine.scheduler.num_assigned
        assert all(n > a for n, a in zip(now, assigned, strict=True)), (assigned, now)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total


@pytest.fixture(scope="module")
def llm_2x2(mesh_model_dir):
    """The Python API's `LLM` on a mesh string; its engine serves the 2x2 tests below.
    Its decode steps take the replicated-token MoE path and its token-bucket steps the
    all_to_all path (the session's mesh engines run every step replicated)."""
    from jaxserve.llm import LLM

    return LLM(
        model=str(mesh_model_dir),
        mesh="dp=2,tp=2",
        ep_replicated_max_tokens=ep_test_threshold(2, MESH_MAX_NUM_SEQS),
        max_num_seqs=MESH_MAX_NUM_SEQS,
        max_num_batched_tokens=MESH_MAX_BATCHED_TOKENS,
        block_size=MESH_BLOCK_SIZE,
        num_blocks=1 + MESH_MAX_NUM_SEQS * MESH_MAX_LEN // MESH_BLOCK_SIZE,
    )


def test_llm_accepts_mesh_string_and_config(llm_2x2, reference):
    from jaxserve.llm import build_engine_config

    assert build_engine_config("m", mesh=MeshConfig(4, 2)).mesh == MeshConfig(4, 2)
    with pytest.raises(ValueError, match="mesh"):
        build_engine_config("m", mesh="dp=two")
    threshold = ep_test_threshold(2, MESH_MAX_NUM_SEQS)
    assert llm_2x2.engine.config.mesh == MeshConfig(2, 2, threshold)
    assert _tokens(llm_2x2.engine) == reference
    # Both MoE paths were compiled into its steps (each choice is logged once, when traced):
    # decode steps of up to 2 x 4 rows replicated, the 2 x 16-token steps all_to_all.
    from jaxserve.sharding import moe_ep, parallel

    mine = (threshold, 2, 2)  # (replicated_max_tokens, dp, tp) of this engine's model
    taken = {(n, path) for n, path, *rest in parallel._logged_paths if tuple(rest) == mine}
    assert (2 * MESH_MAX_BATCHED_TOKENS, moe_ep.ALL_TO_ALL) in taken
    assert {path for _, path in taken} == {moe_ep.REPLICATED, moe_ep.ALL_TO_ALL}


@pytest.fixture(scope="module")
def engine_2x2(llm_2x2):
    return llm_2x2.engine


def test_mesh_logprobs_equal_single_device(engine_2x2, reference_engine):
    engine = engine_2x2
    got = run_engine(engine, _logprob_requests())
    want = run_engine(reference_engine, _logprob_requests())
    assert all(n > 0 for n in engine.scheduler.num_assigned)
    for rid, w in want.items():
        g = got[rid]
        assert g.tokens == w.tokens
        for go, wo in zip(g.outputs, w.outputs, strict=True):
            for field in ("logprobs", "prompt_logprobs"):
                a, b = _flat(getattr(go, field)), _flat(getattr(wo, field))
                assert len(a) == len(b) > 0 or getattr(wo, field) is None, (rid, field)
                assert a == pytest.approx(b, abs=1e-4), (rid, field)


def test_mesh_unpackable_row_ends_with_error_and_others_continue(engine_2x2, reference):
    """Defence in depth on DP ranks: a request whose sampling parameters turn unpackable
    after validation (changed here, as no valid request can) ends with an error on its
    rank; the requests of both ranks give the single-device engine's tokens."""
    from jaxserve.sampling_params import MAX_LOGIT_BIAS

    engine = engine_2x2
    requests = _requests()
    for rid, prompt, sampling in requests:
        engine.add_request(EngineRequest(rid, np.asarray(prompt, np.int32), sampling))
    engine.add_request(EngineRequest("victim", np.arange(1, 9, dtype=np.int32), greedy(20)))
    engine.scheduler.requests["victim"].params.logit_bias = dict.fromkeys(
        range(MAX_LOGIT_BIAS + 1), 1.0
    )
    results = run_engine(engine, [])
    assert results["victim"].finish_reason == "error"
    assert results["victim"].error.startswith("logit_bias: at most"), results["victim"].error
    assert {rid: results[rid].tokens for rid, _, _ in requests} == reference
    assert all(n > 0 for n in engine.scheduler.num_assigned)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_mesh_that_cannot_hold_the_model(mesh_model_dir):
    # 16 experts over 3 x 1 devices, and 16 query heads over tp = 3.
    with pytest.raises(MeshError, match="num_experts"):
        EngineCore(mesh_engine_config(mesh_model_dir, 3, 1))
    with pytest.raises(MeshError, match="num_attention_heads|num_experts"):
        EngineCore(mesh_engine_config(mesh_model_dir, 1, 3))


def test_dp_scheduler_assigns_prefix_hits_else_least_loaded():
    """Host only: rank choice by cached prefix first, then by load, then by index."""
    import numpy as np

    from jaxserve.engine.block_manager import BlockManager
    from jaxserve.engine.outputs import StepSamples
    from jaxserve.engine.request import Request
    from jaxserve.sampling_params import SamplingParams

    dp = Scheduler([BlockManager(32, 4, True) for _ in range(2)], 4, 32, 64)
    ranks = dp.ranks

    def add(rid: str, prompt: list[int]) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        dp.add(Request(rid, list(prompt), len(prompt), params, seed=0))
        return next(k for k, s in enumerate(ranks) if dp.requests[rid] in s.waiting)

    shared = list(range(100, 112))  # three full blocks
    assert add("a", shared + [1]) == 0  # tie: lowest index
    assert add("b", [7, 8, 9]) == 1  # least loaded
    assert add("c", [5, 6]) == 0  # tie again
    sched = dp.schedule()
    assert [sum(r.seq.rank == k for r in sched.requests) for k in range(2)] == [2, 1]
    samples = StepSamples(np.zeros((1, len(sched.requests)), np.int32))
    dp.update(sched, samples)  # a's prompt blocks are now cached on rank 0
    # Rank 0 is busier (a, c against b), but holds the shared prefix.
    assert add("d", shared + [2]) == 0
    assert add("e", [3, 3, 3]) == 1
    assert dp.num_assigned == [3, 2]
    with pytest.raises(ValueError, match="already running"):
        add("a", [1, 2])
