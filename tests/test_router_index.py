"""The router's prefix index against a brute-force oracle (one set of hashes per replica)."""

from __future__ import annotations

import random

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.prefix_index import PrefixIndex

BS = 4


def _oracle_match(blocks: dict[int, set[bytes]], hashes: list[bytes], replica: int) -> int:
    n = 0
    for h in hashes:
        if h not in blocks.get(replica, set()):
            break
        n += 1
    return n


def _random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    base = list(rng.choice(prefixes))[: rng.randrange(0, 7) * BS]
    return base + [rng.randrange(20) for _ in range(rng.randrange(0, 5) * BS + rng.randrange(BS))]


def test_match_agrees_with_brute_force_over_random_stores_removes_and_clears():
    rng = random.Random(0)
    index = PrefixIndex()
    oracle: dict[int, set[bytes]] = {}
    # A few shared prefixes so that chains overlap across replicas.
    prefixes = [[rng.randrange(20) for _ in range(6 * BS)] for _ in range(3)]
    replicas = [0, 1, 2, 3]
    for step in range(3000):
        op = rng.random()
        r = rng.choice(replicas)
        if op < 0.5:
            hashes = hash_token_blocks(_random_prompt(rng, prefixes), BS)
            start = rng.randrange(len(hashes) + 1)
            parent = hashes[start - 1] if start else None
            index.store(r, parent, hashes[start:])
            oracle.setdefault(r, set()).update(hashes[start:])
        elif op < 0.85:
            mine = sorted(oracle.get(r, set()))
            gone = rng.sample(mine, min(len(mine), rng.randrange(1, 4)))
            index.remove(r, gone)
            oracle.get(r, set()).difference_update(gone)
        elif op < 0.87:
            index.clear(r)
            oracle.pop(r, None)
        query = hash_token_blocks(_random_prompt(rng, prefixes), BS)
        got = index.match(query, replicas)
        want = {q: _oracle_match(oracle, query, q) for q in replicas}
        assert got == want, f"step {step}"
        for q in replicas:
            assert index.num_blocks(q) == len(oracle.get(q, set()))
    # Every node left is cached by someone or has children: removing all empties the tree.
    for r in replicas:
        index.clear(r)
    assert index.num_nodes == 0


def test_a_replica_missing_an_inner_block_matches_only_up_to_it():
    hashes = hash_token_blocks(list(range(5 * BS)), BS)
    index = PrefixIndex()
    index.store("a", None, hashes)
    index.store("b", None, hashes)
    index.remove("b", [hashes[2]])
    assert index.match(hashes) == {"a": 5, "b": 2}
    assert index.match(hashes[:1], ["a", "c"]) == {"a": 1, "c": 0}
    assert index.match([], ["a"]) == {"a": 0}


def test_store_and_remove_are_idempotent():
    hashes = hash_token_blocks(list(range(3 * BS)), BS)
    index = PrefixIndex()
    index.store(0, None, hashes)
    index.store(0, hashes[0], hashes[1:])  # overlaps the first store
    assert index.num_blocks(0) == 3 and index.num_nodes == 3
    index.remove(0, hashes)
    index.remove(0, hashes)
    index.remove(1, hashes)  # a replica the index never saw
    assert index.num_blocks(0) == 0 and index.num_nodes == 0
