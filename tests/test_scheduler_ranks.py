"""The scheduler over several dp ranks against the brute-force oracle of test_scheduler.

Each rank has its own paged cache of token ids (block ids are rank-local, so one fake
device per rank); a step's rows of rank k run on rank k's device. Every request must
produce what it produces alone with no cache, stay on the rank it was assigned to, and
every rank must respect its own budgets and free all its blocks at the end.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_scheduler import BS, VOCAB, FakeDevice, oracle, random_prompts

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput, StepSamples
from jaxserve.sampling_params import SamplingParams

DP = 2
MAX_SEQS, BUDGET = 4, 16


def step_ranks(devices: list[FakeDevice], out: SchedulerOutput, prev=None) -> StepSamples:
    """Run each rank's rows on its own device; samples in the decision's row order."""
    token_ids = np.zeros((out.num_steps, len(out.requests)), np.int32)
    for k, dev in enumerate(devices):
        rows = [i for i, r in enumerate(out.requests) if r.seq.rank == k]
        part = SchedulerOutput([out.requests[i] for i in rows], num_steps=out.num_steps)
        if rows:
            token_ids[:, rows] = dev.step(part, prev).token_ids
    return StepSamples(token_ids)


@pytest.mark.parametrize(("overlap", "num_decode_steps"), [(False, 1), (True, 1), (True, 4)])
def test_ranks_outputs_equal_oracle(overlap, num_decode_steps):
    rng = random.Random(3)
    num_blocks = 24
    sched = Scheduler(
        [BlockManager(num_blocks, BS, True) for _ in range(DP)],
        MAX_SEQS,
        BUDGET,
        256,
        num_decode_steps=num_decode_steps,
    )
    devices = [FakeDevice(num_blocks) for _ in range(DP)]
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    prompts = random_prompts(rng, 16, shared=shared)
    max_tokens = [rng.randint(1, 12) for _ in prompts]
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        sched.add(Request(f"r{i}", list(p), len(p), params, seed=0))
    assigned = {rid: seq.rank for rid, seq in sched.requests.items()}
    assert set(assigned.values()) == set(range(DP))

    results: dict[str, list[int]] = {}
    finals: set[str] = set()
    inflight = None
    for _ in range(2000):
        if not sched.has_unfinished() and inflight is None:
            break
        if inflight is None:
            out = sched.schedule()
            if out.is_empty:
                continue
            inflight = out, step_ranks(devices, out)
        out, samples = inflight
        inflight = None
        for k in range(DP):
            mine = [r for r in out.requests if r.seq.rank == k]
            assert len(mine) <= MAX_SEQS
            if out.num_steps == 1:
                assert sum(r.num_tokens for r in mine) <= BUDGET
        assert all(r.seq.rank == assigned[r.seq.request_id] for r in out.requests)
        if overlap:
            nxt = sched.schedule()
            if not nxt.is_empty:
                rows = {r.seq: row for row, r in enumerate(out.requests)}
                inflight = nxt, step_ranks(devices, nxt, prev=(rows, samples.token_ids))
        for o in sched.update(out, samples):
            assert o.request_id not in finals
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals.add(o.request_id)
    else:
        raise AssertionError("scheduler did not drain")

    assert finals == set(assigned)
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert results[f"r{i}"] == oracle(p, n)
    assert all(bm.num_free_blocks == bm.num_usable_blocks for bm in sched.block_managers)
    assert sched.num_assigned == [sum(k == r for r in assigned.values()) for k in range(DP)]
    assert sched.num_preemptions > 0  # the pools are small enough to preempt
