"""The router's load of requests with n > 1 samples (`LoadTracker` groups): the samples
share their prompt's full blocks (all but the last token's) and that part's prefill, as
the engine's prefix cache shares them, so the load counts them once per request, not n
times. Checked against a brute-force recount of the distinct KV blocks and prompt
positions each replica holds or must still compute, over random traffic."""

from __future__ import annotations

import math
import random

from jaxserve.router.load import LoadTracker
from jaxserve.router.router import Decision, Router

BS = 4


def _recount(live: dict, replica: int, computed: set) -> tuple[set, set]:
    """(KV block names, prompt positions still to compute) of the replica's live samples:
    a group's shared blocks are named by the group, every other block by its sample;
    `computed`: the groups one of whose samples had an output (their shared part is)."""
    blocks, prefill = set(), set()
    for sid, s in live.items():
        if s["replica"] != replica:
            continue
        shared = (s["prompt"] - 1) // BS if s["group"] else 0
        for b in range(-(-s["tokens"] // BS)):
            blocks.add((s["group"], b) if b < shared else (sid, b))
        if not s["first"]:
            for pos in range(s["cached"], s["prompt"]):
                shared_pos = pos < shared * BS
                if shared_pos and s["group"] in computed:
                    continue
                prefill.add((s["group"], pos) if shared_pos else (sid, pos))
    return blocks, prefill


def test_samples_share_their_prompt_in_the_load():
    rng = random.Random(5)
    tracker = LoadTracker(BS)
    live: dict = {}
    computed: set = set()
    for step in range(2500):
        op = rng.random()
        if op < 0.3:
            n, r = rng.choice([1, 1, 2, 3, 5]), rng.randrange(3)
            prompt = rng.randrange(1, 30)
            cached = min(rng.randrange(0, 8) * BS, prompt - 1)
            group = f"g{step}" if n > 1 else None
            for j in range(n):
                sid = f"q{step}.{j}"
                tracker.dispatch(sid, r, prompt, cached, group)
                live[sid] = dict(
                    replica=r, prompt=prompt, cached=cached, tokens=prompt, first=False,
                    group=group,
                )  # fmt: skip
        elif live and op < 0.65:
            sid = rng.choice(sorted(live))
            tracker.first_token(sid)
            live[sid]["first"] = True
            computed.add(live[sid]["group"])
            k = rng.randrange(0, 7)
            tracker.add_tokens(sid, k)
            live[sid]["tokens"] += k
        elif live:
            sid = rng.choice(sorted(live))
            tracker.finish(sid)
            tracker.finish(sid)  # idempotent
            del live[sid]
        for r in range(3):
            blocks, prefill = _recount(live, r, computed)
            want = len(prefill) / BS + len(blocks)
            assert math.isclose(tracker.load(r), want, abs_tol=1e-9), (step, r)
            assert tracker.num_requests(r) == sum(s["replica"] == r for s in live.values())
    for sid in list(live):
        tracker.finish(sid)
    assert all(tracker.load(r) == 0 and tracker.num_requests(r) == 0 for r in range(3))


def test_router_counts_a_request_of_n_samples_once():
    router = Router(BS, "round-robin", seed=0)
    prompt = list(range(10 * BS))
    decision = Decision(replica=1, policy="round-robin", matched_blocks=2, num_blocks=10)
    for j in range(4):
        router.dispatch(f"a.{j}", decision, len(prompt), group="a")
    # One prompt's 9 shared blocks (its 10th holds the last token: each sample's own),
    # their uncached 7 blocks of prefill once, and 4 x (the last block's prefill + block).
    assert router.load.load(1) == 9 + 7 + 4 * (1 + 1)
    assert router.stats.decisions == {1: 1} and router.stats.matched_blocks == 2
    alone = Router(BS, "round-robin", seed=0)
    alone.dispatch("b", decision, len(prompt))
    one = Router(BS, "round-robin", seed=0)
    one.dispatch("c.0", decision, len(prompt), group="c")
    assert one.load.load(1) == alone.load.load(1) == (10 * BS - 2 * BS) / BS + 10
