"""The router's load when running requests share a prompt prefix (`LoadTracker` given
the prompts' block hashes): a full block before a prompt's last token is held once by
its replica however many running requests have it (the engine's prefix cache shares
it), as NVIDIA Dynamo's router counts unique active blocks. Checked against a
brute-force recount of the distinct KV blocks and prompt positions each replica holds
or must still compute, over random traffic of chats on a few system prompts, with and
without the hashes, alone and in groups of n samples."""

from __future__ import annotations

import math
import random

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.load import LoadTracker
from jaxserve.router.router import Router

BS = 4


def _recount(live: dict, replica: int, computed: set) -> tuple[set, set]:
    """(KV blocks, prompt positions still to compute) of the replica's live samples.

    A block before the prompt's last token is named by its hash when the sample came
    with hashes (shared with every sample holding that hash), by its group when it came
    in a group without them, else by the sample; every later block by the sample.
    `computed`: the groups one of whose samples had an output."""
    blocks, prefill = set(), set()
    for sid, s in live.items():
        if s["replica"] != replica:
            continue
        shared = (s["prompt"] - 1) // BS
        for b in range(-(-s["tokens"] // BS)):
            if b < shared and s["hashes"] is not None:
                blocks.add(("hash", s["hashes"][b]))
            elif b < shared and s["group"]:
                blocks.add((s["group"], b))
            else:
                blocks.add((sid, b))
        if not s["first"]:
            for pos in range(s["cached"], s["prompt"]):
                in_group = s["group"] and pos < shared * BS
                if in_group and s["group"] in computed:
                    continue
                prefill.add((s["group"], pos) if in_group else (sid, pos))
    return blocks, prefill


def test_running_requests_hold_a_shared_prefix_once():
    rng = random.Random(7)
    systems = [[rng.randrange(50) for _ in range(n)] for n in (3 * BS, 5 * BS + 2, 2 * BS - 1)]
    tracker = LoadTracker(BS)
    live: dict = {}
    computed: set = set()
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            n, r = rng.choice([1, 1, 1, 2, 3]), rng.randrange(3)
            prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(8))]
            hashes = hash_token_blocks(prompt, BS) if rng.random() < 0.8 else None
            cached = min(rng.randrange(0, 6) * BS, len(prompt) - 1)
            group = f"g{step}" if n > 1 else None
            for j in range(n):
                sid = f"q{step}.{j}"
                tracker.dispatch(sid, r, len(prompt), cached, group, hashes)
                live[sid] = dict(
                    replica=r, prompt=len(prompt), cached=cached, tokens=len(prompt),
                    first=False, group=group, hashes=hashes,
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


def test_a_system_prompt_under_several_chats_is_not_charged_per_chat():
    """Replica 0 runs 4 chats on one 8-block system prompt and caches a fifth chat's
    history; replica 1 is idle. The fifth chat's next turn stays on 0: its load is the
    system prompt once plus each chat's own blocks (8 + 4 x 1), not 4 x 9 blocks, which
    would outweigh the 13 blocks its cache saves (cost 1 + 12 there against 14 on 1)."""
    rng = random.Random(0)
    system = [rng.randrange(50) for _ in range(8 * BS)]
    router = Router(BS, "kv", seed=0)
    router.index.store(0, None, hash_token_blocks(system, BS))
    for i in range(4):
        prompt = system + [rng.randrange(50) for _ in range(3)]
        assert router.route(f"chat{i}", prompt, [0]).replica == 0
        router.on_output(f"chat{i}", 1, finished=False)  # prefilled: decoding now
    assert router.load.load(0) == 8 + 4 * 1
    history = system + [rng.randrange(50) for _ in range(5 * BS)]
    router.index.store(0, None, hash_token_blocks(history, BS))
    turn = history + [rng.randrange(50) for _ in range(BS)]  # 14 blocks, 13 cached on 0
    decision = router.route("next", turn, [0, 1])
    assert decision.replica == 0 and decision.matched_blocks == 13
