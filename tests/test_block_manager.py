"""BlockManager and the chained block hash, against brute-force oracles.

The oracle tracks what each block physically holds (the token prefix whose K/V were
written into it) and who owns it, independently of the manager's own bookkeeping.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from jaxserve.engine.block_hash import ROOT_HASH, hash_block, hash_token_blocks
from jaxserve.engine.block_manager import NULL_BLOCK, BlockManager
from jaxserve.engine.request import Request
from jaxserve.sampling_params import SamplingParams

BS = 4


def make_seq(tokens, rid="r", **fields) -> Request:
    return Request(
        request_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        seed=0,
        **fields,
    )


def check_invariants(bm: BlockManager, live: list[Request]) -> None:
    """Ref counts equal table occurrences; free <=> unreferenced; block 0 never used."""
    counts = [0] * bm.num_blocks
    for seq in live:
        for block in seq.block_table:
            counts[block] += 1
    assert counts[NULL_BLOCK] == 0
    assert counts == bm.ref_counts
    free = set(bm.free_queue)
    assert NULL_BLOCK not in free
    for block in range(1, bm.num_blocks):
        assert (block in free) == (counts[block] == 0), block
    for block_hash, block in bm.cached_blocks.items():
        assert bm.block_hash[block] == block_hash


# ----- block hash -------------------------------------------------------------------------


def test_hash_is_chained_and_deterministic_across_processes():
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, BS)
    assert len(hashes) == 2  # the trailing partial block has no name
    assert hashes[0] == hash_block(None, tokens[:4]) == hash_block(ROOT_HASH, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # Same block contents under a different parent get a different name.
    assert hash_block(None, tokens[4:8]) != hashes[1]
    assert hash_block(None, tokens[:4], extra_keys=("lora", 1)) != hashes[0]
    # Another interpreter (a different PYTHONHASHSEED) computes the same names.
    code = (
        "from jaxserve.engine.block_hash import hash_token_blocks;"
        "print(hash_token_blocks(list(range(10)), 4)[1].hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "JAX_PLATFORMS": "cpu"},
    )
    assert other.stdout.strip() == hashes[1].hex()


def test_hash_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        hash_token_blocks([1, 2], 0)


# ----- allocation -------------------------------------------------------------------------


def test_allocate_free_and_null_block():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = make_seq(range(9), "a")
    assert bm.allocate(a, 9)
    assert len(a.block_table) == 3 and NULL_BLOCK not in a.block_table
    assert bm.num_free_blocks == 1
    b = make_seq(range(8), "b")
    assert not bm.allocate(b, 8)  # needs 2, 1 free: nothing changes
    assert b.block_table == [] and bm.num_free_blocks == 1
    check_invariants(bm, [a, b])
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.allocate(b, 8)
    check_invariants(bm, [b])


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_seq(prefix + [1, 2], "a")
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.register_computed(a)
    b = make_seq(prefix + [7], "b")
    hit = bm.lookup_prefix(b)
    assert hit == a.block_table[:3]
    assert bm.allocate(b, b.num_tokens, hit)
    assert b.block_table[:3] == a.block_table[:3]
    assert all(bm.ref_counts[x] == 2 for x in hit)
    check_invariants(bm, [a, b])
    # A prompt that is exactly the cached prefix must still compute its last token.
    c = make_seq(prefix, "c")
    assert len(bm.lookup_prefix(c)) == 2
    # Different first block -> no hit even though later blocks' tokens match.
    d = make_seq([0] + prefix[1:] + [5], "d")
    assert bm.lookup_prefix(d) == []


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(13), "a")
    bm.allocate(a, 13)
    a.num_computed_tokens = 13
    bm.register_computed(a)
    assert bm.num_cached_blocks == 0
    assert bm.lookup_prefix(make_seq(range(13), "b")) == []


def test_cache_group_shares_within_the_group_only_when_caching_is_off():
    """The n samples of a prompt (one cache group) share its full blocks; nobody else
    does, not even a request with the same tokens."""
    for enabled in (False, True):
        bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=enabled)
        a = make_seq(range(13), "a", cache_group="g")
        bm.allocate(a, 13)
        a.num_computed_tokens = 13
        bm.register_computed(a)
        sibling = make_seq(range(13), "b", cache_group="g")
        assert bm.lookup_prefix(sibling) == a.block_table[:3]
        other_group = make_seq(range(13), "c", cache_group="h")
        stranger = make_seq(range(13), "d")
        expected = a.block_table[:3] if enabled else []  # with caching on, names are global
        assert bm.lookup_prefix(other_group) == expected
        assert bm.lookup_prefix(stranger) == expected


def test_pending_tokens_are_not_named_and_prompt_logprobs_skip_the_cache():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(7), "a")
    bm.allocate(a, 9)
    # Scheduled through position 8; the token at position 7 is still being sampled.
    a.num_computed_tokens, a.num_pending_tokens = 8, 1
    bm.register_computed(a)
    assert bm.num_cached_blocks == 1  # block 1 needs its last token's id
    a.token_ids.append(3)
    a.num_pending_tokens = 0
    bm.register_computed(a)
    assert bm.num_cached_blocks == 2
    wants = make_seq(range(7), "b", prompt_logprobs=[])
    assert bm.lookup_prefix(wants) == []  # every prompt position must be computed
    done = make_seq(range(7), "c", prompt_logprobs=[[0.0, []]] * 6)
    assert bm.lookup_prefix(done) == a.block_table[:1]


def test_only_computed_blocks_are_named():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(12), "a")
    bm.allocate(a, 12)
    a.num_computed_tokens = 5  # one full block computed so far
    bm.register_computed(a)
    assert bm.num_cached_blocks == 1
    assert bm.lookup_prefix(make_seq(range(12), "b")) == a.block_table[:1]


def test_blocks_filled_by_decoding_are_named():
    """A prompt's partial last block and the blocks its outputs fill get names once full
    and computed, so the next turn of a chat (this prompt + its answer + more) hits
    them all; a block still filling stays unnamed."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(6), "a")  # one full block and 2 tokens of the next
    assert bm.allocate(a, 6)
    a.num_computed_tokens = 6
    bm.register_computed(a)
    assert bm.num_cached_blocks == 1
    for t in range(7):  # decode 7 tokens, one step each: the engine's order
        a.token_ids.append(100 + t)  # sampled by the last step
        assert bm.allocate(a, a.num_tokens)  # this step writes its K/V
        a.num_computed_tokens = a.num_tokens
        bm.register_computed(a)
    assert a.num_tokens == 13 and bm.num_cached_blocks == 3  # [0, 12) full, 12 filling
    next_turn = make_seq(a.token_ids + [7, 8, 9, 10], "b")
    named = a.block_table[:3]
    assert bm.lookup_prefix(next_turn) == named
    bm.free(a)
    assert bm.lookup_prefix(next_turn) == named  # still cached while free


def test_lru_eviction_order_tail_first():
    bm = BlockManager(num_blocks=7, block_size=BS)
    a = make_seq(range(12), "a")  # 3 blocks
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.register_computed(a)
    blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    # 3 never-used blocks go first, then a's tail block, keeping a's first two.
    b = make_seq(range(50, 66), "b")
    assert bm.allocate(b, 16)
    assert bm.num_evictions == 1
    assert blocks[2] in b.block_table and blocks[0] not in b.block_table
    hit = bm.lookup_prefix(make_seq(range(12), "c"))
    assert hit == blocks[:2]


def test_eviction_never_frees_a_block_in_use_random():
    """Random workload over a small alphabet (many shared prefixes) with an oracle."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=12, block_size=BS)
    content: dict[int, tuple] = {}  # block -> token prefix whose K/V it physically holds
    live: list[Request] = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 3):
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        else:
            n = rng.randint(1, 4 * BS)
            seq = make_seq([rng.randint(0, 1) for _ in range(n)], f"s{step}")
            hit = bm.lookup_prefix(seq)
            in_use_before = {b for s in live for b in s.block_table}
            free_before = set(bm.free_queue)
            if not bm.allocate(seq, seq.num_tokens, hit):
                continue
            for i, block in enumerate(seq.block_table):
                if i < len(hit):
                    # A hit holds exactly this prefix's K/V.
                    assert content[block] == tuple(seq.token_ids[: (i + 1) * BS])
                else:
                    # A fresh block was free and held by nobody: writing it is safe.
                    assert block in free_before and block not in in_use_before
                    content[block] = tuple(seq.token_ids[: (i + 1) * BS])
            seq.num_computed_tokens = seq.num_tokens
            bm.register_computed(seq)
            live.append(seq)
        check_invariants(bm, live)
    assert bm.num_evictions > 0
