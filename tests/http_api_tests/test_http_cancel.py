"""The OpenAI-compatible HTTP API: a client that leaves cancels its request in the
engine (streamed or not, every sample), its KV blocks return and it counts as an abort.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from server_harness import wait_idle

from http_api_tests.helpers import CHAT, TIMEOUT_S, http_request

pytestmark = pytest.mark.slow


def _aborted(server) -> float:
    """Samples counted as finished with reason "abort" (the server's metrics)."""
    text = http_request("GET", f"http://127.0.0.1:{server.metrics_port}/metrics").text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("jaxserve_request_success_total{") and 'finish_reason="abort"' in line
    )


def _wait_running(grpc_client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while grpc_client.server_info(timeout=TIMEOUT_S).num_running == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)


def test_disconnect_mid_stream_returns_kv_blocks(server, client, grpc_client, model_name):
    idle = wait_idle(grpc_client)
    aborted = _aborted(server)
    stream = client.completions.create(
        model=model_name, prompt="import ", temperature=0, max_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for n, _ in enumerate(stream):
        if n == 3:
            break
    assert grpc_client.server_info(timeout=TIMEOUT_S).num_running == 1
    stream.close()  # closes the connection
    assert wait_idle(grpc_client).kv_blocks_free == idle.kv_blocks_free
    assert _aborted(server) == aborted + 1  # cancelled, not run to its end
    # A client that leaves while waiting for a whole (non-streamed) answer cancels it too:
    # every one of its n samples.
    body = json.dumps(
        {"messages": CHAT, "max_tokens": 450, "n": 4, "ignore_eos": True, "temperature": 0}
    ).encode()
    host, port = server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        _wait_running(grpc_client)
    assert wait_idle(grpc_client).kv_blocks_free == idle.kv_blocks_free
    assert _aborted(server) == aborted + 1 + 4
