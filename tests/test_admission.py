"""Admission control and deadlines (issue 12): each limit answered with
RESOURCE_EXHAUSTED naming it, at once; a request whose client deadline passed is
aborted in the engine and counted; frontend memory returns near idle after a burst of
large requests."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from hostile_helpers import generate_request, mock_server, status_of, wait_idle
from server_harness import free_port

from jaxserve.engine.control import EngineControl
from jaxserve.frontend.admission import (
    AdmissionController,
    AdmissionError,
    AdmissionGroup,
    AdmissionLimits,
)
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(mock_model_dir):
    metrics_port, http_port = free_port(), free_port()
    srv = mock_server(
        mock_model_dir,
        extra_args=(
            "--max-pending-requests", "4",
            "--max-queued-prompt-tokens", "64",
            "--max-inflight-request-bytes", "4000",
            "--stall-timeout-s", "60",
            "--metrics-port", str(metrics_port),
            "--http-port", str(http_port),
        ),
    )  # fmt: skip
    srv.metrics_port, srv.http_port = metrics_port, http_port
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.JaxserveStub(channel)


def _scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _open_streams(stub, prompts, max_tokens=600):
    # 600 tokens: 38 KV blocks of the mock's 256, so all of them run at once (3 s each).
    streams = []
    for i, prompt in enumerate(prompts):
        s = stub.Generate(generate_request(prompt, max_tokens, request_id=f"hold-{i}"), timeout=60)
        next(s)  # running
        streams.append(s)
    return streams


def test_past_max_pending_requests_is_resource_exhausted_at_once(server, stub):
    streams = _open_streams(stub, [[80, i] for i in range(3)])
    try:
        # 3 running + 2 samples > 4: refused at once, naming the limit and its flag.
        req = generate_request([81], 5, sampling=pb.SamplingParams(n=2))
        start = time.monotonic()
        code, details = status_of(lambda: stub.Generate(req, timeout=30))
        assert time.monotonic() - start < 2.0
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-pending-requests" in details and "limit of 4" in details
        # The HTTP API answers the same limit with 429.
        models = f"http://127.0.0.1:{server.http_port}/v1/models"
        model = json.loads(urllib.request.urlopen(models, timeout=10).read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": [81], "max_tokens": 5, "n": 2})
        http_req = urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}/v1/completions", data=body.encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(http_req, timeout=30)
        assert e.value.code == 429
        assert "--max-pending-requests" in json.loads(e.value.read())["error"]["message"]
        # One more sample fits.
        got = list(stub.Generate(generate_request([82], 3), timeout=30))
        assert got[-1].finish_reason == "length"
    finally:
        for s in streams:
            s.cancel()
    wait_idle(stub)


def _rejected(server) -> dict[str, float]:
    """jaxserve_requests_rejected_total by its limit label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in text.read().decode().splitlines():
        if line.startswith("jaxserve_requests_rejected_total{"):
            limit = line.split('limit="', 1)[1].split('"', 1)[0]
            out[limit] = out.get(limit, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_each_refused_request_counts_once_in_requests_rejected_by_its_limit(server, stub):
    """gRPC RESOURCE_EXHAUSTED and HTTP 429 each add exactly 1 to
    jaxserve_requests_rejected_total{limit="requests"}; a bad request (INVALID_ARGUMENT,
    HTTP 400) under the same load adds nothing: it is not refused by admission."""
    wait_idle(stub)
    before = _rejected(server)
    streams = _open_streams(stub, [[80, i] for i in range(3)])
    try:
        over = generate_request([81], 5, sampling=pb.SamplingParams(n=2))
        assert status_of(lambda: stub.Generate(over, timeout=30))[0] == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        after_grpc = _rejected(server)
        status, body = _post_completion(server, {"prompt": [81], "max_tokens": 5, "n": 2})
        assert status == 429, body
        after_http = _rejected(server)
        bad = generate_request([81], 0)  # max_tokens 0: a bad field, checked after bytes
        assert status_of(lambda: stub.Generate(bad, timeout=30))[0] == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        status, body = _post_completion(server, {"prompt": [81], "max_tokens": 0})
        assert status == 400, body
    finally:
        for s in streams:
            s.cancel()
    wait_idle(stub)
    after_bad = _rejected(server)
    assert after_grpc.get("requests", 0) - before.get("requests", 0) == 1
    assert after_http.get("requests", 0) - after_grpc.get("requests", 0) == 1
    assert after_bad == after_http
    assert set(after_bad) <= {"requests", "queued_prompt_tokens", "bytes"}


def _post_completion(server, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _refused(server) -> float:
    """jaxserve_requests_abandoned_total{reason="refused"}, summed over its other labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.read().decode().splitlines()
        if line.startswith("jaxserve_requests_abandoned_total{") and 'reason="refused"' in line
    )


def test_a_lone_http_call_of_more_prompts_than_the_limit_gets_in(server, stub):
    """An HTTP call's prompts are admitted as one request: alone, 5 prompts under
    --max-pending-requests 4 get in (as a lone gRPC request with n = 5 does); beside 3
    running requests the call is refused whole, with the others counted in the message,
    and its prompts already started count as refused, not as the client's cancels."""
    wait_idle(stub)
    status, body = _post_completion(
        server, {"prompt": [[90, i] for i in range(5)], "max_tokens": 3}
    )
    assert status == 200, body
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 5
    streams = _open_streams(stub, [[80, i] for i in range(3)])
    refused_before = _refused(server)
    try:
        status, body = _post_completion(server, {"prompt": [[91], [92]], "max_tokens": 3})
        assert status == 429, body
        message = body["error"]["message"]
        assert "3 requests are running or waiting; 2 more would pass the limit of 4" in message
    finally:
        for s in streams:
            s.cancel()
    wait_idle(stub)
    refused = _refused(server)
    assert refused - refused_before == 1  # the first prompt, started before the second was refused


def test_past_max_inflight_request_bytes_is_resource_exhausted(server, stub):
    big = generate_request([300] * 1000, 3000, request_id="big")  # ~2 KB on the wire
    assert 2000 < big.ByteSize() < 4000
    first = stub.Generate(big, timeout=60)
    next(first)
    before = _rejected(server).get("bytes", 0)
    try:
        other = generate_request([301] * 1000, 3)
        code, details = status_of(lambda: stub.Generate(other, timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-inflight-request-bytes" in details
        assert _rejected(server).get("bytes", 0) - before == 1
    finally:
        first.cancel()
    wait_idle(stub)
    got = list(stub.Generate(generate_request([301] * 1000, 3), timeout=30))  # room again
    assert got[-1].finish_reason == "length"


def test_past_max_queued_prompt_tokens_is_resource_exhausted(server, stub):
    """With the engine stopped, a 40-token prompt waits for prefill; another 40 would
    pass the limit of 64 queued prompt tokens."""
    engine_pid = server.child("jaxserve.engine.process")
    os.kill(engine_pid, signal.SIGSTOP)
    waiting = None
    try:
        waiting = stub.Generate(generate_request([85] * 40, 3, request_id="queued"), timeout=60)
        result: list = []
        reader = threading.Thread(target=lambda: result.extend(waiting))
        reader.start()
        time.sleep(0.3)  # the request reached the frontend's admission
        code, details = status_of(lambda: stub.Generate(generate_request([86] * 40, 3), timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-prompt-tokens" in details
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    reader.join(30)
    assert result and result[-1].finish_reason == "length"
    wait_idle(stub)


def test_a_passed_deadline_aborts_the_request_in_the_engine_and_is_counted(server, stub):
    before = _scrape(server.metrics_port, 'jaxserve_requests_abandoned_total{model="mock_model')
    code, _ = status_of(
        lambda: stub.Generate(generate_request([87, 1], 3000, request_id="late"), timeout=0.5)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(stub, timeout=3)  # the engine stopped computing it (3000 steps would be 15 s)
    deadline = time.monotonic() + 5
    while _scrape(server.metrics_port, "jaxserve_requests_abandoned_total") <= before:
        assert time.monotonic() < deadline, "the abandoned request was not counted"
        time.sleep(0.1)


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_frontend_memory_returns_near_idle_after_a_burst_of_large_requests(mock_model_dir):
    """24 concurrent requests of 7M prompt token ids (7 MB each on the wire, ~60 MB each
    once copied): during the burst the frontend grows by hundreds of MB; 2 s after it,
    its RSS is back within 200 MB of idle (before: +1.6 GB stayed, issue 12)."""
    srv = mock_server(mock_model_dir)
    try:
        options = [("grpc.max_send_message_length", 64 * 2**20)]
        with grpc.insecure_channel(srv.target, options=options) as channel:
            stub = pb_grpc.JaxserveStub(channel)
            list(stub.Generate(generate_request([5], 2), timeout=30))
            idle = _rss_mib(srv.proc.pid)
            req = generate_request([5] * 7_000_000, 4)

            def one():
                status_of(lambda: stub.Generate(req, timeout=60))

            threads = [threading.Thread(target=one) for _ in range(24)]
            peak = idle
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, _rss_mib(srv.proc.pid))
                time.sleep(0.02)
            time.sleep(2.0)
            after = _rss_mib(srv.proc.pid)
        assert peak > idle + 150, (idle, peak)  # the burst did cost memory
        assert after < idle + 200, (idle, peak, after)
    finally:
        srv.kill()


# ---------------------------------------------------------------- units


def test_admission_controller_counts_and_releases():
    ctl = AdmissionController(AdmissionLimits(max_requests=3, max_queued_prompt_tokens=10,
                                              max_request_bytes=100))  # fmt: skip
    a = ctl.reserve(60)
    a.admit(2, 8)
    with pytest.raises(AdmissionError, match="--max-inflight-request-bytes") as e:
        ctl.reserve(50)
    assert e.value.limit == "bytes"
    b = ctl.reserve(40)
    with pytest.raises(AdmissionError, match="--max-queued-prompt-tokens"):
        b.admit(1, 3)
    assert ctl.request_bytes == 60  # the refused ticket gave its bytes back
    a.prompt_done()
    c = ctl.reserve(40)
    with pytest.raises(AdmissionError, match="--max-pending-requests"):
        c.admit(2, 3)
    a.release()
    a.release()  # idempotent
    assert (ctl.num_requests, ctl.queued_prompt_tokens, ctl.request_bytes) == (0, 0, 0)
    # Alone, any request gets in.
    d = ctl.reserve(1000)
    d.admit(50, 500)
    d.release()


def test_an_admission_group_is_judged_as_one_request():
    """A group's requests do not count against each other: alone, a group of 3
    one-sample requests passes a limit of 2; beside another call it is refused at the
    request that passes the limit; releases return every count to 0."""
    ctl = AdmissionController(AdmissionLimits(max_requests=2, max_queued_prompt_tokens=5,
                                              max_request_bytes=10))  # fmt: skip
    group = AdmissionGroup()  # 18 bytes, 12 prompt tokens, 3 requests: all past a limit
    tickets = [ctl.reserve(6, group) for _ in range(3)]
    for t in tickets:
        t.admit(1, 4)
    assert (ctl.num_requests, ctl.queued_prompt_tokens, ctl.request_bytes) == (3, 12, 18)
    with pytest.raises(AdmissionError, match="--max-inflight-request-bytes"):
        ctl.reserve(1)  # another call: the limits hold against it
    for t in tickets:
        t.release()
    assert (group.samples, group.prompt_tokens, group.bytes) == (0, 0, 0)
    first = ctl.reserve(1)
    first.admit(1, 1)
    late = AdmissionGroup()
    a = ctl.reserve(1, late)
    a.admit(1, 1)  # 2 of 2: fits
    b = ctl.reserve(1, late)
    with pytest.raises(AdmissionError, match="1 request is running or waiting; 2 more"):
        b.admit(1, 1)
    a.release()
    first.release()
    assert (ctl.num_requests, ctl.queued_prompt_tokens, ctl.request_bytes) == (0, 0, 0)


def test_engine_control_deadlines_and_late_aborts():
    ctl = EngineControl()
    assert ctl.admit("a", deadline=10.0) and ctl.admit("b", deadline=20.0)
    assert ctl.admit("c", deadline=None)
    ctl.finished(["b"])
    assert ctl.expired(9.0) == [] and ctl.expired(25.0) == ["a"] and ctl.expired(99.0) == []
    assert ctl.num_expired == 1
    ctl.aborted(["late"])  # the abort overtook its request
    assert not ctl.admit("late", deadline=None) and ctl.num_dropped_late == 1
    assert ctl.admit("late2", deadline=None)


def test_engine_control_poll_timeout_follows_each_clock():
    """The heartbeat is on the monotonic clock, deadlines on the wall clock: with the
    real clocks (about 1.7e9 s apart), an idle loop blocks until the next heartbeat,
    not 1 ms (the old single-clock arithmetic spun an idle engine at ~14% of a core)."""
    ctl = EngineControl(heartbeat_interval_s=0.5)
    wall, mono = time.time(), time.monotonic()
    assert ctl.heartbeat_due(mono)
    assert 490 <= ctl.poll_timeout_ms(wall, mono) <= 500
    ctl.admit("r", deadline=wall + 0.2)  # a deadline sooner than the heartbeat
    assert 190 <= ctl.poll_timeout_ms(wall, mono) <= 200
    assert ctl.poll_timeout_ms(wall + 0.3, mono) == 1  # past it: do not block


def test_a_count_of_one_is_worded_in_the_singular():
    """Each limit's message counted one holding in the plural ("1 requests are running")."""
    ctl = AdmissionController(AdmissionLimits(max_requests=1, max_queued_prompt_tokens=1,
                                              max_request_bytes=1))  # fmt: skip
    first = ctl.reserve(1)
    with pytest.raises(AdmissionError, match="^overloaded: 1 byte of requests is in flight; 1 "):
        ctl.reserve(1)
    first.admit(0, 1)  # no sample, 1 prompt token: only the prompt-token limit is held
    second = ctl.reserve(0)
    with pytest.raises(AdmissionError, match="^overloaded: 1 prompt token waits for prefill; 1 "):
        second.admit(0, 1)
    first.prompt_done()
    first.release()
    first = ctl.reserve(0)
    first.admit(1, 0)
    second = ctl.reserve(0)
    with pytest.raises(AdmissionError, match="^overloaded: 1 request is running or waiting; 1 "):
        second.admit(1, 0)
    first.release()
    assert (ctl.num_requests, ctl.queued_prompt_tokens, ctl.request_bytes) == (0, 0, 0)
