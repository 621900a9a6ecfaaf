"""Scheduler against a brute-force oracle, with a fake model that really reads the paged cache.

The fake device keeps a paged "KV cache" of token ids: a step writes each scheduled token
into the slot its block table names, then reads the whole context back through the block
table. Its next token is a fixed hash of that context. The oracle runs each request alone
with no cache at all (next token = the same hash of prompt + outputs), so any mistake in
block tables, chunking, prefix reuse or preemption shows up as a different output.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from jaxserve.engine.block_manager import NULL_BLOCK, BlockManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput, StepSamples
from jaxserve.sampling_params import SamplingParams

VOCAB = 50
BS = 4


def next_token(context: list[int]) -> int:
    return zlib.crc32(np.asarray(context, np.int32).tobytes()) % VOCAB


def oracle(prompt: list[int], max_tokens: int, stop_ids=(), eos=(), max_model_len=10**9):
    """Tokens a request produces alone, with the same stop rules as the engine."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop_ids or t in eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class FakeDevice:
    """A paged cache of token ids, written and read through block tables.

    Like the engine's step, it can run several decode steps in one call and take input
    tokens that the previous step sampled (async scheduling): `prev` is that step's
    (rows by sequence, sampled token ids [S, R]).
    """

    def __init__(self, num_blocks: int):
        self.kv = np.full((num_blocks, BS), -1, np.int64)

    def step(self, sched: SchedulerOutput, prev=None) -> StepSamples:
        k = sched.num_steps
        token_ids = np.zeros((k, len(sched.requests)), np.int32)
        for row, item in enumerate(sched.requests):
            seq, table = item.seq, item.seq.block_table
            assert NULL_BLOCK not in table
            end = item.start + item.num_tokens
            assert len(table) * BS >= end + k - 1, "block table too short for the chunk"
            assert k == 1 or (item.num_tokens == 1 and item.samples)

            for pos in range(item.start, end):
                self.kv[table[pos // BS], pos % BS] = self._input_token(seq, pos, prev)
            for j in range(k):
                if j:  # the next decode step's input is the token just sampled
                    pos = end + j - 1
                    self.kv[table[pos // BS], pos % BS] = token_ids[j - 1, row]
                context = [int(self.kv[table[p // BS], p % BS]) for p in range(end + j)]
                # Reading back the cache (prefix hits included) must give the real tokens.
                known = min(end, seq.num_tokens)
                assert context[:known] == seq.token_ids[:known]
                token_ids[j, row] = next_token(context)
        return StepSamples(token_ids=token_ids)

    @staticmethod
    def _input_token(seq: Request, pos: int, prev) -> int:
        if pos < seq.num_tokens:
            return seq.token_ids[pos]
        rows, prev_tokens = prev  # sampled by the previous step, not yet appended
        return int(prev_tokens[pos - seq.num_tokens, rows[seq]])


def make_scheduler(num_blocks=64, max_seqs=8, budget=32, max_model_len=256, **kw):
    bm = BlockManager(num_blocks, BS, kw.pop("enable_prefix_caching", True))
    return Scheduler(bm, max_seqs, budget, max_model_len, **kw), FakeDevice(num_blocks)


def add(sched: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    seq = Request(
        request_id=rid,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        params=SamplingParams(temperature=0.0, **params),
        seed=0,
    )
    sched.add(seq)
    return seq


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(out.requests) <= sched.max_num_seqs
    assert len({id(r.seq) for r in out.requests}) == len(out.requests)
    assert all(r.num_tokens >= 1 for r in out.requests)
    bm = sched.bm
    counts = [0] * bm.num_blocks
    for seq in sched.running:
        for b in seq.block_table:
            counts[b] += 1
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert counts == bm.ref_counts
    assert all((b in bm.free_queue) == (counts[b] == 0) for b in range(1, bm.num_blocks))


def run(sched: Scheduler, dev: FakeDevice, max_steps=10_000, on_step=None, overlap=False) -> dict:
    """Step until idle; return request_id -> (tokens, finish_reason, stop_reason), checking
    that every request has exactly one final output and nothing after it.

    overlap: drive the scheduler as EngineCore's async scheduling does: step N + 1 is
    scheduled and run before `update` has seen step N's tokens.
    """
    results: dict[str, list] = {}
    finals: dict[str, tuple] = {}
    inflight = None

    def collect(outputs):
        for o in outputs:
            assert o.request_id not in finals, "output after the final one"
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.request_id] = (o.finish_reason, o.stop_reason, o.error)

    for _ in range(max_steps):
        if not sched.has_unfinished() and inflight is None:
            break
        if inflight is None:
            before = {s.request_id: s.num_missing_tokens for s in sched.running}
            out = sched.schedule()
            check_step(sched, out)
            if on_step:
                on_step(sched, out, before)
            if out.is_empty:
                collect(sched.drain_finished())
                continue
            inflight = out, dev.step(out)
        out, samples = inflight
        inflight = None
        if overlap:
            nxt = sched.schedule()
            check_step(sched, nxt)
            if not nxt.is_empty:
                rows = {r.seq: row for row, r in enumerate(out.requests)}
                inflight = nxt, dev.step(nxt, prev=(rows, samples.token_ids))
        collect(sched.update(out, samples))
    else:
        raise AssertionError("scheduler did not drain")
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    return {rid: (results.get(rid, []), *finals[rid]) for rid in finals}


# (overlap, num_decode_steps): the engine's modes, each against the same oracle.
MODES = [(False, 1), (True, 1), (False, 4), (True, 4)]


def record_num_steps(sched: Scheduler) -> list[int]:
    """Make `sched.schedule` record the num_steps of every decision it returns."""
    steps: list[int] = []
    schedule = sched.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        steps.append(out.num_steps)
        return out

    sched.schedule = recording
    return steps


def random_prompts(rng: random.Random, n: int, lo=1, hi=40, shared=None):
    prompts = []
    for _ in range(n):
        p = [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]
        if shared is not None and rng.random() < 0.5:
            p = shared + p
        prompts.append(p)
    return prompts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_equal_oracle_random_workload(prefix_caching, mode):
    overlap, num_decode_steps = mode
    rng = random.Random(1)
    sched, dev = make_scheduler(
        num_blocks=40, enable_prefix_caching=prefix_caching, num_decode_steps=num_decode_steps
    )
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    prompts = random_prompts(rng, 24, shared=shared)
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        add(sched, f"r{i}", p, max_tokens=m)
    steps = record_num_steps(sched)
    results = run(sched, dev, overlap=overlap)
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        tokens, reason, _, _ = results[f"r{i}"]
        assert tokens == oracle(p, m)
        assert reason == "length"
    assert (sched.num_prefix_hits > 0) == prefix_caching
    assert max(steps) == num_decode_steps  # multi-step decode did run


def test_prefix_cache_second_request_computes_only_suffix():
    sched, dev = make_scheduler()
    prefix = list(range(3 * BS))
    add(sched, "a", prefix + [40, 41], max_tokens=3)
    first = run(sched, dev)
    computed = sched.num_prefill_tokens_computed
    seq = add(sched, "b", prefix + [42, 43, 44], max_tokens=3)
    second = run(sched, dev)
    assert seq.num_cached_tokens == 3 * BS
    assert sched.num_prefill_tokens_computed - computed == 3  # the suffix only
    assert first["a"][0] == oracle(prefix + [40, 41], 3)
    assert second["b"][0] == oracle(prefix + [42, 43, 44], 3)


def test_running_requests_share_prefix_blocks():
    sched, dev = make_scheduler()
    prefix = list(range(2 * BS))
    a = add(sched, "a", prefix + [1], max_tokens=10)
    out = sched.schedule()
    sched.update(out, dev.step(out))
    b = add(sched, "b", prefix + [2], max_tokens=10)
    out = sched.schedule()
    assert a.block_table[:2] == b.block_table[:2]
    assert sched.bm.ref_counts[a.block_table[0]] == 2
    sched.update(out, dev.step(out))
    run(sched, dev)
    assert a.output_token_ids == oracle(prefix + [1], 10)
    assert b.output_token_ids == oracle(prefix + [2], 10)


def test_chunked_prefill_keeps_decodes_going_every_step():
    budget = 16
    sched, dev = make_scheduler(num_blocks=128, budget=budget, max_model_len=512)
    rng = random.Random(2)
    short = [[rng.randrange(VOCAB) for _ in range(5)] for _ in range(4)]
    for i, p in enumerate(short):
        add(sched, f"d{i}", p, max_tokens=40)
    for _ in range(2):  # prefill the short ones; they are decoding now
        out = sched.schedule()
        sched.update(out, dev.step(out))
    long_prompt = [rng.randrange(VOCAB) for _ in range(10 * budget)]
    long = add(sched, "long", long_prompt, max_tokens=3)
    chunked_steps = []

    def on_step(sched, out, before):
        rows = {r.seq.request_id: r for r in out.requests}
        if "long" in rows and not rows["long"].samples:
            chunked_steps.append(rows["long"].num_tokens)
        if long.num_computed_tokens < long.num_prompt_tokens or "long" in rows:
            for rid, missing in before.items():
                if missing == 1:  # was decoding: must get exactly its one token
                    assert rows[rid].num_tokens == 1 and rows[rid].samples

    results = run(sched, dev, on_step=on_step)
    assert len(chunked_steps) >= 8
    assert results["long"][0] == oracle(long_prompt, 3)
    for i, p in enumerate(short):
        assert results[f"d{i}"][0][-38:] == oracle(p, 40)[-38:]


def test_chunked_equals_unchunked_outputs():
    rng = random.Random(3)
    prompts = random_prompts(rng, 10, lo=20, hi=60)
    runs = []
    for chunked in (True, False):
        sched, dev = make_scheduler(budget=64, enable_chunked_prefill=chunked)
        for i, p in enumerate(prompts):
            add(sched, f"r{i}", p, max_tokens=8)
        runs.append(run(sched, dev))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mode", MODES)
def test_preemption_tiny_pool_all_finish_equal_to_oracle(mode):
    overlap, num_decode_steps = mode
    rng = random.Random(4)
    # 32 requests of up to ~12 blocks each over a pool of 16 usable blocks.
    sched, dev = make_scheduler(
        num_blocks=17,
        max_seqs=16,
        budget=64,
        enable_prefix_caching=False,
        num_decode_steps=num_decode_steps,
    )
    prompts = random_prompts(rng, 32, lo=4, hi=30)
    for i, p in enumerate(prompts):
        add(sched, f"r{i}", p, max_tokens=16)
    results = run(sched, dev, overlap=overlap)
    assert sched.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert results[f"r{i}"][0] == oracle(p, 16)
        assert results[f"r{i}"][1] == "length"


def test_preemption_picks_newest_running():
    sched, dev = make_scheduler(num_blocks=5, max_seqs=4, budget=32)
    # 4 usable blocks; each request needs 3 at its longest, so they cannot both grow.
    old = add(sched, "old", list(range(3)), max_tokens=10)
    new = add(sched, "new", list(range(10, 13)), max_tokens=10)
    preempted = []
    while not old.is_finished:
        out = sched.schedule()
        if out.num_preempted:
            preempted.append(new.status)
        sched.update(out, dev.step(out))
    assert preempted and preempted[0] is RequestStatus.WAITING
    assert old.num_preemptions == 0 and new.num_preemptions > 0


def test_request_that_can_never_fit_gets_error():
    sched, dev = make_scheduler(num_blocks=5, max_model_len=100)  # 4 usable blocks = 16 tokens
    add(sched, "big", list(range(10)), max_tokens=20)
    add(sched, "long_prompt", list(range(100)), max_tokens=1)
    add(sched, "ok", list(range(5)), max_tokens=4)
    results = run(sched, dev)
    assert results["big"][1] == "error" and "KV blocks" in results["big"][3]
    assert results["long_prompt"][1] == "error" and "max_model_len" in results["long_prompt"][3]
    assert results["ok"][0] == oracle(list(range(5)), 4)


@pytest.mark.parametrize("mode", MODES)
def test_stop_rules(mode):
    """Stops inside a multi-step chunk end the request there: later tokens are dropped."""
    overlap, num_decode_steps = mode
    prompt = [1, 2, 3]
    ref = oracle(prompt, 30)
    eos = ref[6]
    k = ref.index(eos)  # first occurrence
    stop_id = ref[3]
    sched, dev = make_scheduler(eos_token_ids=[eos], num_decode_steps=num_decode_steps)
    add(sched, "eos", prompt, max_tokens=30)
    add(sched, "ignore_eos", prompt, max_tokens=30, ignore_eos=True)
    add(sched, "stop_id", prompt, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    add(sched, "len", prompt, max_tokens=2, ignore_eos=True)
    steps = record_num_steps(sched)
    r = run(sched, dev, overlap=overlap)
    assert max(steps) == num_decode_steps
    assert r["eos"][:3] == (ref[: k + 1], "stop", None)
    assert r["ignore_eos"][:2] == (ref, "length")
    j = ref.index(stop_id)
    assert r["stop_id"][:3] == (ref[: j + 1], "stop", stop_id)
    assert r["len"][:2] == (ref[:2], "length")


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_step_runs_past_max_tokens_and_drops_the_surplus(overlap):
    """A request with fewer than num_decode_steps tokens left does not force single
    steps: every decode call is multi-step, and each request still ends with exactly
    max_tokens tokens, the oracle's (the surplus sampled past the limit is dropped)."""
    sched, dev = make_scheduler(num_decode_steps=4)
    prompts = {"a": [5, 6, 7], "b": [8, 9], "c": [1, 2, 3, 4]}
    limits = {"a": 6, "b": 3, "c": 9}
    for rid, prompt in prompts.items():
        add(sched, rid, prompt, max_tokens=limits[rid], ignore_eos=True)
    decisions = []
    schedule = sched.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        decisions.append((out.num_steps, len(out.requests)))
        return out

    sched.schedule = recording
    results = run(sched, dev, overlap=overlap)
    for rid, prompt in prompts.items():
        assert results[rid][:2] == (oracle(prompt, limits[rid]), "length")
    decodes = [n for n, rows in decisions[1:] if rows]  # after the prefill step
    assert decodes and set(decodes) == {4}, decisions


def test_max_model_len_finishes_with_length():
    sched, dev = make_scheduler(max_model_len=12)
    add(sched, "a", list(range(8)), max_tokens=100)
    r = run(sched, dev)
    assert r["a"][:2] == (oracle(list(range(8)), 100, max_model_len=12), "length")
    assert len(r["a"][0]) == 4


def test_abort_waiting_and_running():
    sched, dev = make_scheduler(max_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", [i, i + 1, i + 2], max_tokens=50)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, dev.step(out))
    assert {s.request_id for s in sched.running} == {"r0", "r1"}
    sched.abort(["r0", "r3", "unknown"])
    sched.abort(["r0"])  # twice: still one final output
    finals: dict[str, list] = {}

    def collect(outs):
        for o in outs:
            if o.finish_reason is not None:
                finals.setdefault(o.request_id, []).append(o.finish_reason)

    out = sched.schedule()
    collect(sched.update(out, dev.step(out)))
    assert finals == {"r0": ["abort"], "r3": ["abort"]}
    assert all(r.seq.request_id not in ("r0", "r3") for r in out.requests)
    sched.abort(["r1", "r2"])
    collect(sched.drain_finished())
    assert finals["r1"] == ["abort"] and finals["r2"] == ["abort"]
    assert not sched.has_unfinished()
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks


def test_first_output_carries_prompt_and_sampling():
    sched, dev = make_scheduler()
    add(sched, "a", [5, 6, 7], max_tokens=2)
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs += sched.update(out, dev.step(out))
    assert outs[0].first["prompt_token_ids"].tolist() == [5, 6, 7]
    assert outs[0].first["sampling"]["max_tokens"] == 2
    assert all(o.first is None for o in outs[1:])


@pytest.mark.parametrize("overlap", [False, True])
def test_identical_prompts_arriving_together_share_the_prefix(overlap):
    sched, dev = make_scheduler(budget=64)
    prompt = list(range(5 * BS + 2))
    seqs = [add(sched, f"r{i}", prompt, max_tokens=4) for i in range(4)]
    results = run(sched, dev, overlap=overlap)
    assert sched.num_prefill_tokens_computed < 2 * len(prompt)
    assert all(s.num_cached_tokens == 5 * BS for s in seqs[1:])
    assert all(results[f"r{i}"][0] == oracle(prompt, 4) for i in range(4))


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_steps_follow_the_rows_and_outputs_equal_the_oracle(overlap):
    """With decode_steps_for_rows (the engine's CPU table: more steps for fewer rows),
    each multi-step call runs the steps of the rows running when it was decided, and
    every request still ends with the oracle's tokens, including one that reaches
    max_model_len (where a call of more steps than it has room for is refused)."""

    def steps_for(rows: int) -> int:
        return 8 if rows <= 2 else 4

    rng = random.Random(7)
    sched, dev = make_scheduler(
        num_blocks=80, max_model_len=64, num_decode_steps=4, decode_steps_for_rows=steps_for
    )
    prompts = random_prompts(rng, 6, lo=3, hi=12)
    limits = [rng.randint(5, 30) for _ in prompts]
    limits[0] = 100  # ends at max_model_len
    for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
        add(sched, f"r{i}", p, max_tokens=m, ignore_eos=True)
    decisions = []
    schedule = sched.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        running = len(sched.running)
        decisions.append((out.num_steps, running))
        return out

    sched.schedule = recording
    results = run(sched, dev, overlap=overlap)
    for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
        assert results[f"r{i}"][:2] == (oracle(p, m, max_model_len=64), "length")
    multi = [(k, running) for k, running in decisions if k > 1]
    assert {k for k, _ in multi} == {4, 8}, decisions  # both counts ran
    for k, running in multi:
        assert k == steps_for(running), decisions
