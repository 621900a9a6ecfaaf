"""Clean edges (issue 12): garbage bytes to health and reflection, aborts while the
engine is stopped, request-id reuse right after a cancel, socket folders of dead
servers, the JAX coordinator's bind address; and stall detection (SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hostile_helpers import generate_request, mock_server, status_of, wait_idle

from jaxserve import socket_dirs
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

STALL_TIMEOUT_S = 1.5
GARBAGE = b"\x0a\x05\xff\xfe\xfd\xfc\xfb"  # field 1, length 5, invalid UTF-8


@pytest.fixture(scope="module")
def server(mock_model_dir):
    srv = mock_server(mock_model_dir, extra_args=("--stall-timeout-s", str(STALL_TIMEOUT_S)))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _raw(channel, method: str, streaming: str):
    ident = lambda b: b  # noqa: E731 -- raw bytes in and out
    make = getattr(channel, streaming)
    return make(method, request_serializer=ident, response_deserializer=ident)


@pytest.mark.parametrize(
    "method, kind",
    [
        ("/grpc.health.v1.Health/Check", "unary_unary"),
        ("/grpc.health.v1.Health/Watch", "unary_stream"),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream"),
    ],
)
def test_garbage_bytes_to_health_and_reflection_are_invalid_argument(server, channel, method, kind):
    before = server.log()
    call = _raw(channel, method, kind)
    arg = iter([GARBAGE]) if kind == "stream_stream" else GARBAGE
    try:
        result = call(arg, timeout=10)
        if kind != "unary_unary":
            list(result)
        raise AssertionError("garbage was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details().startswith("request: not a valid")
    time.sleep(0.2)
    assert "Traceback" not in server.log()[len(before) :]


def test_request_id_is_free_the_moment_its_stream_ends(channel):
    """Cancel a stream and reuse its id at once, 60 times: never "already running"."""
    stub = pb_grpc.JaxserveStub(channel)
    for attempt in range(60):
        old = stub.Generate(generate_request([61, attempt], 2000, request_id="reuse"), timeout=30)
        next(old)
        old.cancel()
        got = list(stub.Generate(generate_request([62], 3, request_id="reuse"), timeout=30))
        assert got[-1].finish_reason == "length", attempt
    wait_idle(stub, timeout=5)


def test_stalled_engine_health_requests_aborts_and_recovery(server, channel):
    """SIGSTOP the engine: health turns NOT_SERVING, new requests get UNAVAILABLE naming
    the engine, the open stream is told (UNAVAILABLE), Abort answers; after SIGCONT all
    recovers: the stream's abort reached the engine (it computes nothing for it: every
    KV block comes back), health is SERVING and requests complete."""
    stub = pb_grpc.JaxserveStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    wait_idle(stub)
    stream = stub.Generate(generate_request([70, 1], 3000, request_id="open"), timeout=60)
    next(stream)
    engine_pid = server.child("jaxserve.engine.process")
    log_start = len(server.log())
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        code, details = status_of(stream)
        assert code == grpc.StatusCode.UNAVAILABLE and "engine process is stalled" in details
        resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, details = status_of(lambda: stub.Generate(generate_request([5], 3), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE and "engine process is stalled" in details
        # Aborts answer at once, whatever the engine does (never UNKNOWN).
        for i in range(2000):
            assert stub.Abort(pb.AbortRequest(request_id=f"none-{i}"), timeout=5).found is False
        time.sleep(1.0)  # several liveness checks while still stalled
        # One stall, one error line (the reason's seconds count up; no line per check).
        assert server.log()[log_start:].count("stalled: the engine process") == 1
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != (
        health_pb2.HealthCheckResponse.SERVING
    ):
        assert time.monotonic() < deadline, "health did not recover"
        time.sleep(0.05)
    got = list(stub.Generate(generate_request([71], 5, request_id="open"), timeout=30))
    assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 5
    wait_idle(stub, timeout=5)  # the stalled stream's 3000 tokens were never computed


def test_a_new_serve_removes_socket_folders_of_dead_servers(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"jaxserve-{dead.pid}-abc123"
    (stale / "sub").mkdir(parents=True)
    live = tmp_path / f"jaxserve-{os.getpid()}-def456"
    live.mkdir()
    parent_live = tmp_path / f"jaxserve-{os.getppid()}-ghi789"
    parent_live.mkdir()
    other = tmp_path / "jaxserve-notapid"
    other.mkdir()
    removed = socket_dirs.remove_dead_socket_dirs(str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists() and live.exists() and parent_live.exists() and other.exists()


def test_socket_folder_is_named_by_pid():
    path = socket_dirs.make_socket_dir()
    try:
        assert os.path.basename(path).startswith(f"jaxserve-{os.getpid()}-")
    finally:
        os.rmdir(path)


def test_coordinator_binds_only_the_given_address(monkeypatch):
    jax = pytest.importorskip("jax")
    from jaxserve import distributed

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: seen.update(kw))
    config = distributed.DistributedConfig(
        coordinator_address="127.0.0.1:41234", num_processes=2, process_id=0
    )
    distributed.initialize(config)
    assert seen["coordinator_bind_address"] == "127.0.0.1:41234"


def test_aborts_the_engine_cannot_take_wait_and_are_sent_later():
    """The control socket refuses (a stalled engine): Abort still answers, the ids wait,
    coalesced, and go out once the socket takes them again; none is dropped."""
    import asyncio

    import numpy as np

    from jaxserve.frontend.engine_client import AsyncEngineClient
    from jaxserve.frontend.request_stream import EngineDeadError
    from jaxserve.ipc import AbortRequest, EngineRequest, IpcAddresses

    async def scenario():
        engine = AsyncEngineClient(IpcAddresses.in_dir("/nonexistent"))
        engine._ready.set()
        sent, full = [], [True]

        def send(msg):
            if isinstance(msg, AbortRequest) and full[0]:
                raise EngineDeadError("the engine is not taking requests")
            sent.append(msg)

        engine._send = send
        prompt = np.asarray([1, 2], np.int32)
        streams = [
            engine.add_request(f"r{i}", [EngineRequest(f"r{i}", prompt, {"n": 1})])
            for i in range(5)
        ]
        assert all(engine.abort(f"r{i}") for i in range(3))  # answered, not raised
        engine.release(streams[4])
        assert engine.num_pending_aborts == 4
        await asyncio.sleep(0.2)  # retried meanwhile, still refused
        assert engine.num_pending_aborts == 4
        full[0] = False
        await asyncio.sleep(0.2)
        aborts = [m for m in sent if isinstance(m, AbortRequest)]
        assert len(aborts) == 1  # coalesced into one message
        expected = {streams[i].engine_ids[0] for i in (0, 1, 2, 4)}
        assert set(aborts[0].request_ids) == expected
        assert engine.num_pending_aborts == 0

    asyncio.run(scenario())


def test_a_stalled_sidecar_is_named(mock_model_dir):
    srv = mock_server(mock_model_dir, extra_args=("--stall-timeout-s", str(STALL_TIMEOUT_S)))
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb_grpc.JaxserveStub(ch)
            pid = srv.child("jaxserve.frontend.detokenizer_process")
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(STALL_TIMEOUT_S + 1.0)
                code, details = status_of(lambda: stub.Generate(generate_request([5], 3)))
                assert code == grpc.StatusCode.UNAVAILABLE
                assert "detokenizer process is stalled" in details
            finally:
                os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while True:
                try:
                    got = list(stub.Generate(generate_request([5], 3), timeout=10))
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "did not recover"
                    time.sleep(0.1)
            assert got[-1].finish_reason == "length"
    finally:
        srv.kill()
