"""KV events from a real engine into the router's prefix index: the index mirrors the
engine's prefix cache (stores, evictions, resets), a gap resyncs from a snapshot, and a
restarted engine (new epoch) clears the replica's entries."""

from __future__ import annotations

import random

from conftest import swap_scheduler
from engine_helpers import greedy, run_engine

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.engine.kv_events import KvEventLog, attach
from jaxserve.ipc import KvEvents, KvSnapshot, decode, encode
from jaxserve.router.events import ReplicaEvents
from jaxserve.router.prefix_index import PrefixIndex


def _wire(msg):
    return decode(encode(msg))  # as the socket carries it


def _prompts(rng: random.Random, vocab: int, block: int) -> list[list[int]]:
    shared = [[rng.randrange(vocab) for _ in range(3 * block)] for _ in range(2)]
    out = []
    for _ in range(12):
        head = list(rng.choice(shared))[: rng.randrange(0, 4) * block]
        out.append(head + [rng.randrange(vocab) for _ in range(rng.randrange(1, 3 * block))])
    return out


def test_index_mirrors_the_engine_prefix_cache_and_a_gap_resyncs(tiny_engine):
    vocab = tiny_engine.model_config.vocab_size
    with swap_scheduler(tiny_engine, num_blocks=24) as sched:
        bm = sched.bm
        log = KvEventLog(epoch=7)
        bm.events = log
        index = PrefixIndex()
        asked: list[str] = []
        consumer = ReplicaEvents(0, index, asked.append)
        checks = {"steps": 0, "dropped": 0}

        def on_step(_outputs):
            batch = log.drain()
            checks["steps"] += 1
            if batch is not None and checks["steps"] == 5:
                checks["dropped"] += 1  # lose one batch: the next one shows the gap
                return
            if batch is not None:
                consumer.on_events(_wire(batch))
            if asked and consumer.resyncing:
                # The engine answers after sending the events before it (none pending).
                consumer.on_snapshot(_wire(log.snapshot()))
            if not consumer.resyncing:
                assert index.blocks(0) == set(bm.cached_blocks), checks["steps"]

        rng = random.Random(0)
        for round_ in range(3):
            reqs = [(f"r{round_}.{i}", p, greedy(4)) for i, p in enumerate(_prompts(rng, vocab, 8))]
            run_engine(tiny_engine, reqs, on_step=on_step)
        assert bm.num_evictions > 0  # the pool is small: blocks were evicted and removed
        assert checks["dropped"] == 1 and consumer.num_resyncs == 1
        assert consumer.num_snapshots == 1
        assert index.blocks(0) == set(bm.cached_blocks) and bm.cached_blocks

        bm.reset_prefix_cache()  # idle: every block is free, so every name goes
        consumer.on_events(_wire(log.drain()))
        assert not bm.cached_blocks and index.num_blocks(0) == 0


def test_a_restarted_engine_clears_the_replica_entries():
    index = PrefixIndex()
    consumer = ReplicaEvents(0, index, lambda reason: None)
    chain = hash_token_blocks(list(range(12)), 4)
    old = KvEventLog(epoch=1)
    old.stored(chain, [0, 1, 2])
    consumer.on_events(_wire(old.drain()))
    assert index.num_blocks(0) == 3
    new = KvEventLog(epoch=2)  # a new engine process: its events start at 0, `cleared`
    new.stored(chain, [0])
    consumer.on_events(_wire(new.drain()))
    assert index.blocks(0) == {chain[0]} and consumer.epoch == 2


def test_a_frontend_restart_rebuilds_from_a_snapshot_and_times_out_to_ask_again():
    log = KvEventLog(epoch=3)
    chain = hash_token_blocks(list(range(16)), 4)
    log.stored(chain, [0, 1, 2, 3])
    log.removed([chain[3]])
    log.drain()  # the old frontend got these
    index = PrefixIndex()
    asked: list[str] = []
    consumer = ReplicaEvents(0, index, asked.append, resync_timeout_s=1.0)
    consumer.start()
    assert len(asked) == 1
    log.stored(chain, [3])
    consumer.on_events(_wire(log.drain()))  # before the snapshot: dropped
    assert index.num_blocks(0) == 0
    consumer.poll(now=consumer.resyncing_since + 0.5)
    assert len(asked) == 1
    consumer.poll(now=consumer.resyncing_since + 1.5)  # the request was lost: ask again
    assert len(asked) == 2
    snap = _wire(log.snapshot())
    assert isinstance(snap, KvSnapshot) and snap.seq == log.next_seq - 1
    consumer.on_snapshot(snap)
    assert index.blocks(0) == set(chain) and not consumer.resyncing
    log.removed(chain[:1])
    consumer.on_events(_wire(log.drain()))
    assert index.blocks(0) == set(chain[1:])


def test_copies_in_several_dp_ranks_are_one_entry_until_the_last_goes():
    log = KvEventLog(epoch=0)
    chain = hash_token_blocks(list(range(12)), 4)
    log.drain()
    log.stored(chain, [0, 1])  # rank 0
    log.stored(chain, [0, 1, 2])  # rank 1: blocks 0, 1 are copies
    batch = log.drain()
    assert isinstance(batch, KvEvents)
    assert [e[1:] for e in batch.events] == [
        ["stored", None, chain[:2]],
        ["stored", chain[1], chain[2:3]],
    ]
    log.removed(chain[:2])  # rank 0 evicts its copies
    assert log.drain() is None
    log.removed(chain[:3])
    assert [e[1:] for e in log.drain().events] == [["removed", None, chain[:3]]]


def test_attach_skips_engines_without_prefix_caching():
    class Core:
        block_managers = [type("BM", (), {"enable_prefix_caching": False})()]

    assert attach(Core()) is None
    assert attach(object()) is None
