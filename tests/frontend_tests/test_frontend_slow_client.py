"""A client that opens a stream and never reads it (the real three-process server, mock
engine): past --max-stream-buffer-bytes its request is aborted in the engine (nothing
running, every KV block free), counted as abandoned with reason "slow_client", its
connection or call ends, the frontend's memory stays bounded, and a normal request
running beside it gets its exact tokens. Over HTTP (SSE) and gRPC (Generate)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import grpc
import pytest
from server_harness import free_port

from frontend_tests.helpers import RPC_TIMEOUT_S, MockServer, _expected_ids, _wait_idle
from jaxserve.frontend.client import JaxserveClient
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

LIMIT = 64 * 1024  # --max-stream-buffer-bytes: about one step of the hostile stream
# The hostile request: 16 samples of 3000 tokens with 20 top log-probs each, about
# 160 MB in the frontend (request_stream.token_bytes) were its output kept.
HOSTILE = {"n": 16, "max_tokens": 3000, "logprobs": 20}
TCP_CLOSE = 7  # linux/tcp_states.h
NORMAL_PROMPT = "def add(a, b):"
NORMAL_TOKENS = 300  # 1.5 s of mock steps: it runs while the hostile stream is cut


@pytest.fixture(scope="module")
def srv(model_dir):
    metrics_port = free_port()
    flags = ("--num-blocks", "8192", "--http-port", "0", "--metrics-port", str(metrics_port))
    flags += ("--max-stream-buffer-bytes", str(LIMIT))
    s = MockServer(model_dir, extra_args=flags).wait_ready()
    s.metrics_port = metrics_port
    yield s
    s.terminate(15)


@pytest.fixture(scope="module")
def client(srv):
    with JaxserveClient(srv.target) as c:
        yield c


def _slow_client_aborts(srv) -> float:
    """jaxserve_requests_abandoned_total{reason="slow_client"} (samples)."""
    with socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=RPC_TIMEOUT_S) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        text = _read_all(s).decode()
    pattern = r'^jaxserve_requests_abandoned_total\{[^}]*reason="slow_client"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _abort_lines(srv) -> int:
    """The server's log lines about a request aborted past its stream's bound."""
    return srv.log().count("aborted: its client left about")


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(line for line in f if line.startswith("VmRSS:")).split()[1]
    return int(kib) * 1024


def _wait_aborts(srv, count: float, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _slow_client_aborts(srv) < count:
        assert time.monotonic() < deadline, f"no slow_client abort in {timeout} s:\n{srv.log()}"
        time.sleep(0.05)


def _wait_closed(sock: socket.socket, timeout: float = 10.0) -> None:
    """Wait until the peer reset the TCP connection (Linux TCP_INFO's state: TCP_CLOSE)."""
    deadline = time.monotonic() + timeout
    while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_CLOSE:
        assert time.monotonic() < deadline, f"the server kept the connection {timeout} s"
        time.sleep(0.05)


class NormalRequest(threading.Thread):
    """A greedy request with known tokens (the mock's), run to its end beside the hostile
    stream; `.ids` its tokens, `.finish` its finish reason."""

    def __init__(self, client: JaxserveClient) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.ids: list[int] = []
        self.finish = None
        self.start()

    def run(self) -> None:
        params = dict(max_tokens=NORMAL_TOKENS, ignore_eos=True, return_token_ids=True)
        for delta in self.client.generate(NORMAL_PROMPT, timeout=RPC_TIMEOUT_S, **params):
            self.ids += delta.token_ids
            self.finish = delta.finish_reason or self.finish


def _check_normal(normal: NormalRequest, tok, vocab) -> None:
    normal.join(RPC_TIMEOUT_S)
    assert normal.finish == "length"
    assert normal.ids == _expected_ids(tok, vocab, NORMAL_PROMPT, NORMAL_TOKENS)


def test_unread_http_stream_is_aborted_and_its_connection_closed(srv, client, tok, vocab):
    _wait_idle(client)
    aborts, lines, rss = _slow_client_aborts(srv), _abort_lines(srv), _rss_bytes(srv.proc.pid)
    body = json.dumps({"prompt": "import ", "stream": True, "ignore_eos": True, **HOSTILE})
    host, port = srv.http_url.removeprefix("http://").split(":")
    normal = NormalRequest(client)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # read nothing, hold little
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
        )
        _wait_aborts(srv, aborts + HOSTILE["n"])  # every sample, not the normal request's
        grown = _rss_bytes(srv.proc.pid) - rss
        # The server aborts the connection (CUT_GRACE_S after the request), without a
        # byte read here (a read would let the last error event out): what it sent ends
        # without the stream's [DONE].
        _wait_closed(sock)
        sock.settimeout(RPC_TIMEOUT_S)
        try:
            sent = _read_all(sock)
        except ConnectionResetError:
            sent = b""
        assert b"data: [DONE]" not in sent
    _check_normal(normal, tok, vocab)
    _wait_idle(client)
    assert _slow_client_aborts(srv) == aborts + HOSTILE["n"]
    assert _abort_lines(srv) == lines + 1
    assert grown < 32 * 2**20, grown


def test_unread_grpc_stream_is_aborted_with_resource_exhausted(srv, client, tok, vocab):
    _wait_idle(client)
    aborts, lines = _slow_client_aborts(srv), _abort_lines(srv)
    normal = NormalRequest(client)
    request = pb.GenerateRequest(
        text="import ", max_tokens=HOSTILE["max_tokens"], logprobs=HOSTILE["logprobs"],
        ignore_eos=True, sampling=pb.SamplingParams(n=HOSTILE["n"]),
    )  # fmt: skip
    # A channel of its own whose HTTP/2 windows stay small (no BDP probing): the server's
    # writes stop after a few messages that nobody asks for.
    options = [("grpc.http2.lookahead_bytes", 4096), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(srv.target, options=options) as channel:
        call = pb_grpc.JaxserveStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        _wait_aborts(srv, aborts + HOSTILE["n"])
        _check_normal(normal, tok, vocab)
        _wait_idle(client)
        # Reading again: what was in flight, then the status naming the limit.
        with pytest.raises(grpc.RpcError) as error:
            for _ in call:
                pass
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-stream-buffer-bytes 65536" in error.value.details()
    assert _slow_client_aborts(srv) == aborts + HOSTILE["n"]
    assert _abort_lines(srv) == lines + 1
