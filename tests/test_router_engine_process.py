"""KV events over the engine process's sockets (a real engine process on the tiny model):
a router that starts late, or restarts, rebuilds the replica's entries from a snapshot
and then follows its events; the engine's events name exactly the prompts' blocks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
from engine_helpers import greedy

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.ipc import (
    EngineOutputs,
    EngineRequest,
    EngineStats,
    IpcAddresses,
    KvEvents,
    KvSnapshot,
    KvSnapshotRequest,
    decode,
    encode,
    make_socket,
)
from jaxserve.router.events import ReplicaEvents
from jaxserve.router.prefix_index import PrefixIndex

START_TIMEOUT_S = 600


class _Router:
    """A router's end of one replica's KV events: its socket and its index."""

    def __init__(self, ctx: zmq.Context, addresses: IpcAddresses) -> None:
        self.sock = make_socket(ctx, zmq.PULL, addresses.kv_events, bind=True)
        self.control = make_socket(ctx, zmq.PUSH, addresses.engine_control, bind=False)
        self.index = PrefixIndex()
        self.events = ReplicaEvents(
            0, self.index, lambda r: self.control.send(encode(KvSnapshotRequest(r)))
        )

    def pump(self, until, timeout: float = 60.0) -> None:
        """Apply what arrives until `until()`; a snapshot request that got no answer is
        sent again after `resync_timeout_s`, as the frontend's router loop does (a
        request sent while the engine's socket still reconnects to a restarted router's
        may be lost: a CI run waited 60 s for it)."""
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "condition not met in time"
            self.events.poll()
            if self.sock.poll(100):
                msg = decode(self.sock.recv())
                if isinstance(msg, KvEvents):
                    self.events.on_events(msg)
                elif isinstance(msg, KvSnapshot):
                    self.events.on_snapshot(msg)

    def close(self) -> None:
        self.sock.close()
        self.control.close()


@pytest.fixture(scope="module")
def engine(tiny_engine_config, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    addresses = IpcAddresses.in_dir(folder)
    addresses = dataclasses.replace(addresses, kv_events=f"ipc://{folder}/kv")
    ctx = zmq.Context()
    outputs = make_socket(ctx, zmq.PULL, addresses.detokenizer_input, bind=True)
    cmd = [
        sys.executable, "-m", "jaxserve.engine.process",
        "--config-json", json.dumps(tiny_engine_config.to_dict()),
        "--engine-input", addresses.engine_input,
        "--detokenizer-input", addresses.detokenizer_input,
        "--engine-control", addresses.engine_control,
        "--kv-events", addresses.kv_events, "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    requests = make_socket(ctx, zmq.PUSH, addresses.engine_input, bind=False)
    assert outputs.poll(START_TIMEOUT_S * 1000), "the engine did not start"
    assert isinstance(decode(outputs.recv()), EngineStats)
    yield ctx, addresses, requests, outputs
    proc.kill()
    proc.wait(30)
    # destroy, not term: a socket a failed test left open would make term wait forever.
    ctx.destroy(linger=0)


def _run(requests, outputs, rid: str, prompt: list[int]) -> None:
    requests.send(encode(EngineRequest(rid, np.asarray(prompt, np.int32), greedy(3))))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not outputs.poll(100):
            continue
        msg = decode(outputs.recv())
        if isinstance(msg, EngineOutputs) and any(
            o.request_id == rid and o.finish_reason for o in msg.outputs
        ):
            return
    raise AssertionError(f"{rid} did not finish")


def test_late_and_restarted_routers_rebuild_from_snapshots(engine, tiny_engine_config):
    ctx, addresses, requests, outputs = engine
    bs = tiny_engine_config.cache.block_size
    prompts = [[3 + (i * 7 + j) % 200 for j in range(4 * bs + 3)] for i in range(3)]
    first = _Router(ctx, addresses)
    first.events.start()  # started after the engine: it knows nothing yet
    first.pump(lambda: first.events.num_snapshots >= 1)
    asked = first.events.num_resyncs  # 1, more if a request was lost and sent again
    for i, prompt in enumerate(prompts[:2]):
        _run(requests, outputs, f"a{i}", prompt)
    names = [set(hash_token_blocks(p, bs)) for p in prompts]
    first.pump(lambda: names[0] | names[1] <= first.index.blocks(0))
    assert first.events.num_resyncs == asked  # in order since the snapshot: no gap
    first.close()

    second = _Router(ctx, addresses)  # a restarted frontend
    second.events.start()
    second.pump(lambda: second.events.num_snapshots >= 1)
    asked = second.events.num_resyncs
    assert second.index.blocks(0) == first.index.blocks(0)
    _run(requests, outputs, "b0", prompts[2])  # followed by events after the snapshot
    second.pump(lambda: names[2] <= second.index.blocks(0))
    assert second.events.num_resyncs == asked
    second.close()
