"""`jaxserve diagnose` against real running servers (issue 11 part 6): each branch of the
tree is reached by a constructed scenario, not by fabricated metric values.

One server (the demo model, --max-num-seqs 2, a KV pool of 9 usable blocks of 16 tokens)
serves three scenarios in turn, each diagnosed over its own window while its load runs:
  healthy: one short request at a time -> no layer;
  queueing: bursts of 32 requests of 24 tokens (16x --max-num-seqs; each fits the KV
      pool) -> scheduling (queue). The burst is sized so the mean queue time stays well
      above diagnose's 0.1 s floor on a fast machine too (12 x 16 tokens gave 0.098 s on CI);

  memory: pairs of long requests (140 tokens each, two need 18 of the 9 blocks) ->
      memory (KV cache).
A second server, on the first one's engine settings (so it starts on the executables the
first compiled into the session's compilation cache), runs with the detokenizer test hook
(`JAXSERVE_TEST_DETOKENIZER_DELAY_S`, frontend/detokenizer_process.py) -> application;
a third on an emulated 4-device expert-parallel mesh with EPLB off, fed prompts of one
repeated token (every token picks the same top-k experts) -> parallelism (expert load).
Diagnose runs as the user runs it: `python -m jaxserve.cli diagnose --server ... --json`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from scenario_load import Background, burst
from server_harness import REPO_DIR, ServerProcess, cpu_xla_flags, ep_test_threshold, free_port

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.detokenizer_process import DELAY_ENV
from jaxserve.observability.diagnose import scrape

pytestmark = pytest.mark.slow

WINDOW_S = 6.0
# The small server's engine: 2 running requests, a KV pool of 9 usable blocks of 16, one
# token bucket (16: the fewest step shapes to compile before the scenarios start; longer
# prompts are chunked).
_SMALL = (
    "--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--num-blocks", "10",
    "--block-size", "16", "--max-model-len", "144",
)  # fmt: skip


def _serve(*flags: str, env: dict | None = None) -> tuple[ServerProcess, str]:
    port = free_port()
    srv = ServerProcess(
        DEMO_MODEL_DIR, extra_args=(*flags, "--metrics-port", str(port)),
        env=env, start_timeout_s=900,
    ).wait_ready()  # fmt: skip
    metrics = f"127.0.0.1:{port}"
    try:
        _wait_warmed_up(metrics)
    except BaseException:
        srv.kill()  # a failed start-up leaves no server compiling beside the next tests
        raise
    return srv, metrics


def _wait_warmed_up(metrics: str, timeout_s: float = 900.0) -> None:
    """Wait until serve's background compilation is over: while it runs, diagnose rightly
    names start-up, and the scenarios here are about the steady state."""
    deadline = time.monotonic() + timeout_s
    url = f"http://{metrics}/metrics"
    while True:
        try:
            if not scrape(url).get("jaxserve_engine_warmup_pending_shapes", 1):
                return
        except OSError:  # a scrape timed out: the compile threads hold both cores; retry
            pass
        assert time.monotonic() < deadline, "background compilation did not end"
        time.sleep(1.0)


def _diagnose(metrics: str, load) -> dict:
    """Run `load` in a loop while `jaxserve diagnose --json` samples the server."""
    bg = Background(load)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "jaxserve.cli", "diagnose", "--server", metrics,
             "--seconds", str(WINDOW_S), "--json"],
            cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        bg.stop()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    print(json.dumps(result, indent=1))  # the report's diagnose outputs (pytest -s)
    return result


@pytest.fixture(scope="module")
def small_server():
    srv, metrics = _serve(*_SMALL)
    yield srv, metrics
    srv.kill()


def test_healthy_server_names_no_layer(small_server):
    srv, metrics = small_server
    result = _diagnose(metrics, lambda: burst(srv.target, ["def "], max_tokens=16))
    assert result["layer"] is None, result
    assert result["findings"] == []
    assert result["summary"]["requests_finished"] > 0


def test_burst_beyond_max_num_seqs_is_queueing(small_server):
    srv, metrics = small_server
    result = _diagnose(metrics, lambda: burst(srv.target, ["def "] * 32, max_tokens=24))
    assert result["layer"] == "scheduling (queue)", result
    numbers = result["findings"][0]["numbers"]
    assert numbers["queue_share_of_ttft"] >= 0.5 and numbers["waiting_peak"] > 0


def test_tiny_kv_pool_under_a_burst_is_memory(small_server):
    srv, metrics = small_server
    long_prompt = "import os\nimport sys\n" * 6  # ~60 tokens
    result = _diagnose(metrics, lambda: burst(srv.target, [long_prompt] * 2, max_tokens=80))
    assert result["layer"] == "memory (KV cache)", result
    numbers = result["findings"][0]["numbers"]
    assert numbers["preemptions"] > 0 or numbers["kv_used_peak_share"] >= 0.9


def test_from_bench_json_of_a_burst_sees_the_queue(small_server, tmp_path):
    """`jaxserve bench` (24 requests at once on 2 slots) then `diagnose --from` its JSON:
    the TTFT of the requests that waited points at the queue. Long enough that the median
    request waits about 6 requests' decode, 36 chunk gaps with the CPU's 8-step calls of
    2 rows (a streamed chunk carries a call's tokens), well past the rule's WAIT_STEPS."""
    srv, _ = small_server
    out = tmp_path / "b.json"
    bench = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "bench", "--server", srv.target,
         "--num-prompts", "24", "--input-len", "8", "--output-len", "48", "--ignore-eos",
         "--no-progress", "--out", str(out)],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "diagnose", "--from", str(out), "--json"],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    print(json.dumps(result, indent=1))
    assert result["layer"] == "scheduling (queue)", result
    assert "client-side" in result["note"]


def test_diagnose_errors_name_their_cause(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"not": "a bench"}')
    cmd = [sys.executable, "-m", "jaxserve.cli", "diagnose"]
    proc = subprocess.run([*cmd, "--from", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "error: --from: not a jaxserve bench" in proc.stderr
    # A missing or non-JSON --from file is a usage error too (the first was exit 1), each
    # one line naming the flag as typed (both said "from:").
    proc = subprocess.run([*cmd, "--from", str(tmp_path / "missing.json")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc
    assert proc.stderr.splitlines() == [
        f"jaxserve diagnose: error: --from: cannot read {tmp_path / 'missing.json'} "
        "(No such file or directory)"
    ]
    bad.write_text("not json")
    proc = subprocess.run([*cmd, "--from", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc
    assert proc.stderr.startswith(f"jaxserve diagnose: error: --from: {bad} is not JSON (")
    bad.write_bytes(b"\x89PNG\r\n")  # not UTF-8 text: it named no flag
    proc = subprocess.run([*cmd, "--from", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc
    assert proc.stderr.startswith(f"jaxserve diagnose: error: --from: {bad} is not JSON (")
    port = free_port()  # nothing listens there
    proc = subprocess.run([*cmd, "--server", f"127.0.0.1:{port}", "--seconds", "1"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and f"127.0.0.1:{port}/metrics" in proc.stderr
    proc = subprocess.run([*cmd, "--server", "127.0.0.1:1", "--seconds", "-5"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "error: --seconds: must be in" in proc.stderr


def test_diagnose_given_a_non_http_port_says_so_in_one_line():
    """A gRPC port answers an HTTP/1 request with bytes that are no status line."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "diagnose", "--server", f"127.0.0.1:{port}",
         "--seconds", "1", "--interval", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    listener.close()
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "not an HTTP metrics endpoint" in proc.stderr and "--metrics-port" in proc.stderr


def test_slow_detokenizer_is_the_application_layer():
    # Two requests on the 2 slots (no queue), 4 of the 9 KV blocks (no memory pressure).
    srv, metrics = _serve(*_SMALL, env={DELAY_ENV: "0.05"})
    try:
        result = _diagnose(metrics, lambda: burst(srv.target, ["def "] * 2, max_tokens=24))
    finally:
        srv.kill()
    assert result["layer"] == "application (frontend / detokenizer)", result
    numbers = result["findings"][0]["numbers"]
    assert numbers["detokenizer_lag_mean_s"] >= 0.05


def test_skewed_expert_load_on_an_ep_mesh_is_parallelism():
    """4 emulated devices (dp=2, tp=2), one EP rank each (2 of the 8 experts per rank),
    EPLB off; prompts of one repeated token id send every prefill token to the same top-2 experts,
    so at most 2 of the 4 ranks get load: balancedness <= 0.5. Two slots for the two
    requests and a 16-token step budget (each prefill step is 16 tokens of that one id):
    one token bucket, the fewest step shapes to compile; the MoE path threshold given (no
    start-up timing of the paths)."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(4)}
    flags = ("--mesh", "dp=2,tp=2", "--max-num-seqs", "2", "--max-num-batched-tokens", "16")
    flags += ("--ep-replicated-max-tokens", str(ep_test_threshold(2, 16)))
    srv, metrics = _serve(*flags, env=env)
    try:
        prompt = [7] * 48  # token ids
        result = _diagnose(metrics, lambda: burst(srv.target, [prompt] * 2, max_tokens=2))
    finally:
        srv.kill()
    assert result["layer"] == "parallelism (expert load)", result
    numbers = result["findings"][0]["numbers"]
    assert numbers["expert_balancedness_mean"] < 0.8 and numbers["eplb_rebalances"] == 0
