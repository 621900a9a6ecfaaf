"""Shared by the frontend tests: the mock-engine server and small helpers."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from mock_engine import mock_tokens
from server_harness import ServerProcess

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = TESTS_DIR.parent
STEP_DELAY_S = 0.005  # mock engine step time: a 1000-token stream lasts >= 5 s
START_TIMEOUT_S = 60
RPC_TIMEOUT_S = 30
FFFD = "\ufffd"


def MockServer(
    model_dir: Path, *, start_delay_s: float = 0.0, warmup_s: float = 0.0, extra_args=()
) -> ServerProcess:
    """The real three-process server with the mock engine in the engine process
    (`warmup_s`: seconds it reports step shapes compiling in the background)."""
    args = ("--num-blocks", "256", "--block-size", "16")
    args += ("--engine-class", "mock_engine:MockEngineCore", *extra_args)
    env = {
        "JAXSERVE_MOCK_STEP_DELAY_S": str(STEP_DELAY_S),
        "JAXSERVE_MOCK_START_DELAY_S": str(start_delay_s),
        "JAXSERVE_MOCK_WARMUP_S": str(warmup_s),
    }
    return ServerProcess(model_dir, extra_args=args, env=env, start_timeout_s=START_TIMEOUT_S)


def _expected_ids(tok, vocab, prompt, n, seed=None):
    prompt_ids = tok.encode(prompt).ids if isinstance(prompt, str) else prompt
    return mock_tokens(prompt_ids, seed, n, *vocab)


def _wait_idle(client, timeout=5.0):
    """Poll GetServerInfo until no request runs and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info(timeout=RPC_TIMEOUT_S)
        if info.num_running == 0 and info.num_waiting == 0:
            if info.kv_blocks_free == info.kv_blocks_total:
                return info
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {info}"
        time.sleep(0.02)


def _wait_running(client, timeout=5.0):
    """Poll GetServerInfo until a request runs (stats trail the tokens by a few ms)."""
    deadline = time.monotonic() + timeout
    while (info := client.server_info(timeout=RPC_TIMEOUT_S)).num_running == 0:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)
    return info


def _assert_invalid(stub, req, field, name):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert info.value.details().startswith(f"{field}:"), (name, info.value.details())
