"""Shared by the hostile-request, admission and TLS/auth tests: a mock-engine server and
small gRPC helpers (kept out of test_frontend.py, which another change is splitting)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from server_harness import ServerProcess

from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

START_TIMEOUT_S = 60
RPC_TIMEOUT_S = 30


def mock_server(
    model_dir: Path, *, step_delay_s: float = 0.005, extra_args=(), env=None
) -> ServerProcess:
    """`jaxserve serve` with the mock engine (tests/mock_engine.py), ready."""
    args = ("--num-blocks", "256", "--block-size", "16")
    args += ("--engine-class", "mock_engine:MockEngineCore", *extra_args)
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": str(step_delay_s), **(env or {})}
    return ServerProcess(
        model_dir, extra_args=args, env=env, start_timeout_s=START_TIMEOUT_S
    ).wait_ready()


def generate_request(prompt_ids, max_tokens: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=list(prompt_ids)), max_tokens=max_tokens, **kw
    )


def stream_gaps(stub: pb_grpc.JaxserveStub, req: pb.GenerateRequest, metadata=None):
    """Run one Generate; returns (responses, the gaps in seconds between responses)."""
    out, gaps, last = [], [], None
    for resp in stub.Generate(req, timeout=RPC_TIMEOUT_S, metadata=metadata):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        out.append(resp)
    return out, gaps


def status_of(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a call that must fail."""
    try:
        for _ in call() if callable(call) else call:
            pass
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


def wait_idle(stub: pb_grpc.JaxserveStub, timeout: float = 5.0, metadata=None) -> pb.ServerInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=metadata)
        if info.num_running == 0 and info.num_waiting == 0:
            if info.kv_blocks_free == info.kv_blocks_total:
                return info
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {info}"
        time.sleep(0.02)
