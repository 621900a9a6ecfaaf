"""The /metrics endpoint of a mock-engine server: what the client saw, counted once."""

from __future__ import annotations

import time

import pytest
from server_harness import free_port

from frontend_tests.helpers import (
    RPC_TIMEOUT_S,
    MockServer,
    _wait_idle,
)
from jaxserve.frontend.client import JaxserveClient

# ---------------------------------------------------------------- metrics


def _scrape(port: int) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value} (comments skipped)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


@pytest.fixture(scope="module")
def metrics_server(model_dir):
    """A server with --metrics-port, shared by the metrics tests (each compares the
    samples after its requests with those before)."""
    port = free_port()
    srv = MockServer(model_dir, extra_args=("--metrics-port", str(port))).wait_ready()
    srv.metrics_port = port
    yield srv
    srv.terminate(15)


def _increase(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_endpoint_counts_what_the_client_saw(metrics_server, model_dir):
    port = metrics_server.metrics_port
    with JaxserveClient(metrics_server.target) as client:
        before = _scrape(port)
        deltas = list(client.generate("metrics please", max_tokens=12, timeout=RPC_TIMEOUT_S))
    samples = _scrape(port)
    model = f'model="{model_dir.name}"'

    def increase(key):
        return _increase(before, samples, key)

    assert deltas[-1].completion_tokens == 12
    assert increase(f"jaxserve_generation_tokens_total{{{model}}}") == 12
    assert increase(f"jaxserve_prompt_tokens_total{{{model}}}") == deltas[-1].prompt_tokens
    assert increase(f"jaxserve_time_to_first_token_seconds_count{{{model}}}") == 1
    assert increase(f"jaxserve_time_per_output_token_seconds_count{{{model}}}") == 1
    # 12 tokens: the first is TTFT, the other 11 each get an inter-token latency.
    assert increase(f"jaxserve_inter_token_latency_seconds_count{{{model}}}") == 11
    assert increase(f'jaxserve_request_success_total{{finish_reason="length",{model}}}') == 1
    assert 0 < samples[f"jaxserve_kv_blocks_free{{{model}}}"] <= 256
    assert samples[f"jaxserve_kv_blocks_total{{{model}}}"] == 256  # --num-blocks of the mock
    # disable_created_metrics in the serving process: no `_created` series.
    assert not [key for key in samples if "_created{" in key]


@pytest.mark.parametrize("n", [1, 3])
def test_metrics_count_a_cancelled_requests_samples_once_as_aborts(metrics_server, model_dir, n):
    port = metrics_server.metrics_port
    model = f'model="{model_dir.name}"'
    abort_key = f'jaxserve_request_success_total{{finish_reason="abort",{model}}}'
    prompt = [47] * 6
    with JaxserveClient(metrics_server.target) as client:
        _wait_idle(client)
        before = _scrape(port)
        stream = client.generate(
            prompt, n=n, max_tokens=1000, return_token_ids=True, timeout=RPC_TIMEOUT_S
        )
        received = 0
        while received < 5 * n:
            received += len(next(stream).token_ids)
        stream.close()  # cancels the call
        _wait_idle(client, timeout=3.0)  # the engine's finals (aborts) have arrived
    # The engine's finals came after the streams were detached: give a double count the
    # time to happen before reading.
    time.sleep(0.3)
    after = _scrape(port)

    def increase(key):
        return _increase(before, after, key)

    assert increase(abort_key) == n
    # Counted as samples, as request_success counts them (it was 1 for any n).
    assert increase(f'jaxserve_requests_abandoned_total{{{model},reason="cancelled"}}') == n
    assert increase(f'jaxserve_request_success_total{{finish_reason="length",{model}}}') == 0
    assert increase(f"jaxserve_e2e_request_latency_seconds_count{{{model}}}") == n
    assert increase(f"jaxserve_prompt_tokens_total{{{model}}}") == n * len(prompt)
    # The tokens the server delivered: at least what this client read before leaving.
    generated = increase(f"jaxserve_generation_tokens_total{{{model}}}")
    assert received <= generated < n * 1000


def test_each_serving_process_cpu_time_grows_under_a_request(metrics_server, model_dir):
    """`jaxserve_process_cpu_seconds_total`: the frontend's, the sidecar's and the
    engine's CPU seconds each grow while a request streams (each process works for it),
    and the host's usable cores are this machine's affinity mask (the server runs here);
    the host's busy CPU seconds grow too, where the kernel says them (/proc/stat)."""
    import os

    port = metrics_server.metrics_port
    model = f'model="{model_dir.name}"'
    with JaxserveClient(metrics_server.target) as client:
        _wait_idle(client)
        before = _scrape(port)
        list(client.generate("cpu please", max_tokens=24, timeout=RPC_TIMEOUT_S))
        _wait_idle(client)  # the engine's stats after the request have arrived
    after = _scrape(port)
    for process in ("frontend", "detokenizer", "engine"):
        key = f'jaxserve_process_cpu_seconds_total{{{model},process="{process}"}}'
        assert _increase(before, after, key) > 0, process
    assert after[f"jaxserve_host_usable_cores{{{model}}}"] == len(os.sched_getaffinity(0))
    host_busy = f"jaxserve_host_busy_cpu_seconds_total{{{model}}}"
    assert (host_busy in after) == os.path.exists("/proc/stat")
    if host_busy in after:
        assert _increase(before, after, host_busy) > 0
