"""Hostile requests against a live server (mock engine): limits answered with
INVALID_ARGUMENT naming the field, and requests at the limits beside a normal stream
whose gaps stay small."""

from __future__ import annotations

import threading

import grpc
import pytest
from hostile_helpers import generate_request, mock_server, status_of, stream_gaps, wait_idle

from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOTAL_BYTES,
)

STEP_DELAY_S = 0.005
# The normal stream's largest gap between responses, beside the hostile requests. Steps
# are 5 ms; the 59 s freeze this guards against (issue 12) is four orders larger, and
# the bound leaves room for a loaded 2-core test machine.
MAX_GAP_S = 1.0


@pytest.fixture(scope="module")
def server(mock_model_dir):
    srv = mock_server(mock_model_dir, step_delay_s=STEP_DELAY_S)
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.JaxserveStub(channel)


@pytest.mark.parametrize(
    "stop, field, what",
    [
        (["s"] * (MAX_STOP_STRINGS + 1), "stop: ", "stop strings"),
        (["x" * (MAX_STOP_STRING_CHARS + 1)], "stop[0]: ", "characters"),
        (["€" * 200] * 7, "stop: ", "UTF-8 bytes"),
    ],
)
def test_stop_lists_past_their_limits_are_invalid_argument(stub, stop, field, what):
    req = generate_request([5, 6], 4, stop=stop)
    code, details = status_of(lambda: stub.Generate(req, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field) and what in details


def test_stop_token_ids_past_the_limit_are_invalid_argument(stub):
    req = generate_request([5, 6], 4, stop_token_ids=[7] * 1000)
    code, details = status_of(lambda: stub.Generate(req, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("stop_token_ids: ")


def test_requests_at_the_stop_limits_do_not_slow_a_normal_stream(stub):
    """Eight requests at every stop limit (64 strings, 4 KiB, each a near-miss of the
    others so the matcher is always mid-prefix) stream beside a normal request; the
    normal stream's gaps stay small and its tokens all arrive."""
    per = MAX_STOP_TOTAL_BYTES // MAX_STOP_STRINGS
    stops = [("a" * (per - 3)) + f"{i:03d}" for i in range(MAX_STOP_STRINGS)]
    hostile = [
        generate_request([100 + i, 7], 300, stop=stops, request_id=f"hostile-{i}") for i in range(8)
    ]
    errors = []

    def run(req):
        try:
            out, _ = stream_gaps(stub, req)
            assert out[-1].finish_reason in ("length", "stop")
        except Exception as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in hostile]
    for t in threads:
        t.start()
    normal, gaps = stream_gaps(stub, generate_request([9, 9, 9], 200, return_token_ids=True))
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sum(len(r.token_ids) for r in normal) == 200
    assert max(gaps) < MAX_GAP_S, sorted(gaps)[-5:]
    wait_idle(stub)
