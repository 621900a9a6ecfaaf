"""`jaxserve bench` end to end against a live `jaxserve serve` on the demo model (the
table, the JSON and the PNG), its HTTP backend against a stand-in endpoint, and its
start-up questions to the server (the model, the warm-up). Its statistics, datasets and
request driver: test_bench_report.py, test_bench_datasets.py, test_bench_driver.py.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from server_harness import DEMO_ENGINE, REPO_DIR, ServerProcess, serve_flags

from jaxserve.benchmark.backends import Sampling
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.tokenizer import encode_prompt, load_tokenizer

# --- end to end on the demo model -------------------------------------------------


@pytest.fixture(scope="module")
def server():
    # The demo-model tests' settings: their executables, compiled once per session.
    flags = (*serve_flags(DEMO_ENGINE), "--http-port", "0")
    srv = ServerProcess(DEMO_MODEL_DIR, extra_args=flags, start_timeout_s=600).wait_ready()
    yield srv
    srv.kill()


def _bench(server, *args: str, http: bool = False) -> subprocess.CompletedProcess:
    target = (
        ["--backend", "http", "--server", server.http_url] if http else ["--server", server.target]
    )
    cmd = [sys.executable, "-m", "jaxserve.cli", "bench", *target, *args]
    return subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True, timeout=300)


def _png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk (the PNG spec, section 5)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_bench_random_end_to_end_json_and_png(server, tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    r = _bench(
        server, "--dataset", "random", "--num-prompts", "6", "--input-len", "24",
        "--output-len", "8", "--ignore-eos", "--max-concurrency", "3", "--num-warmups", "1",
        "--slo", "ttft=60000,tpot=60000", "--out", str(out), "--plot", str(png),
        "--no-progress",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "TTFT" in r.stdout and "Request goodput" in r.stdout
    doc = json.loads(out.read_text())
    m, reqs = doc["metrics"], doc["requests"]
    assert m["completed"] == 6 and m["failed"] == 0 and len(reqs) == 6
    # ignore_eos: every request ran to max_tokens; the server counted the prompt ids sent.
    assert [q["output_len"] for q in reqs] == [8] * 6
    assert [q["prompt_len"] for q in reqs] == [24] * 6
    assert m["total_output_tokens"] == 48 and m["total_input_tokens"] == 144
    assert m["max_concurrency_observed"] <= 3
    assert m["good_requests"] == 6  # the SLOs are a minute: every request meets them
    # The summary is the statistics of the per-request records.
    ttft = np.array([q["ttft"] for q in reqs]) * 1000
    assert m["ttft_ms"]["mean"] == pytest.approx(ttft.mean())
    assert m["ttft_ms"]["p90"] == pytest.approx(np.percentile(ttft, 90))
    itl = np.concatenate([q["itl"] for q in reqs]) * 1000
    assert m["itl_ms"]["median"] == pytest.approx(np.median(itl))
    for q in reqs:
        assert 0 < q["ttft"] <= q["latency"] and sum(q["chunk_tokens"]) == 8
        assert q["tpot"] == pytest.approx((q["latency"] - q["ttft"]) / 7)
    assert m["output_throughput"] == pytest.approx(48 / m["duration_s"])
    assert doc["config"]["request_rate"] == "inf" and doc["config"]["max_concurrency"] == 3
    tl = doc["timeline"]
    assert sum(tl["output_tok_s"]) * tl["bin_s"] == pytest.approx(48)
    width, height = _png_size(png)
    assert (width, height) == (15 * 80, 8 * 80)  # figsize (15, 8) at dpi 80


@pytest.mark.slow
def test_bench_http_backend_end_to_end(server, tmp_path):
    """The same load over the OpenAI API (streamed /v1/completions): the server's usage
    counts reach the JSON, and the times are consistent."""
    assert server.http_url, "the server logged no HTTP port"
    out = tmp_path / "h.json"
    r = _bench(
        server, "--dataset", "text", "--dataset-path", str(_prompt_file(tmp_path)),
        "--num-prompts", "4", "--output-len", "6", "--ignore-eos", "--max-concurrency", "2",
        "--out", str(out), "--no-progress", http=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["backend"] == "http"
    m, reqs = doc["metrics"], doc["requests"]
    assert m["completed"] == 4 and m["total_output_tokens"] == 24
    tok = load_tokenizer(DEMO_MODEL_DIR)
    want = [len(encode_prompt(tok, p)) for p in ("import ", "def ", "import ", "def ")]
    assert [q["prompt_len"] for q in reqs] == want
    for q in reqs:
        assert q["chunk_tokens"] is None and 0 < q["ttft"] <= q["latency"]
        assert len(q["itl"]) == len(q["chunk_times"]) - 1
    assert m["max_concurrency_observed"] <= 2


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("import \ndef \n")
    return path


@pytest.mark.slow
def test_bench_multi_turn_poisson_end_to_end(server, tmp_path):
    out = tmp_path / "m.json"
    r = _bench(
        server, "--dataset", "multi-turn", "--num-prompts", "2", "--num-turns", "3",
        "--input-len", "8", "--output-len", "4", "--ignore-eos", "--request-rate", "20",
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    reqs = json.loads(out.read_text())["requests"]
    assert len(reqs) == 6 and all(q["success"] for q in reqs)
    # Each conversation's turns carry the history: prompts grow turn by turn.
    for conv in (reqs[0:3], reqs[3:6]):
        lens = [q["prompt_len"] for q in conv]
        assert lens[0] < lens[1] < lens[2], lens
        assert conv[0]["sent_s"] < conv[1]["sent_s"] < conv[2]["sent_s"]
        assert conv[1]["sent_s"] >= conv[0]["sent_s"] + conv[0]["latency"]


@pytest.mark.slow
def test_bench_bad_flags_name_the_flag(server, tmp_path):
    for args, flag in (
        (["--request-rate", "0"], "--request-rate"),
        (["--slo", "ttft=abc"], "--slo"),
        (["--dataset", "sharegpt"], "--dataset-path"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--input-len", "0"], "--input-len"),
    ):
        r = _bench(server, "--no-progress", "--num-prompts", "2", *args)
        assert r.returncode == 2 and flag in r.stderr, (args, r.stderr)


def test_http_backend_sends_the_key_and_reads_sse():
    """HttpBackend against a stand-in OpenAI endpoint (aiohttp.web): the Bearer key, the
    body it posts, the chunks and usage it reads from the event stream."""
    from aiohttp import web

    from jaxserve.benchmark.backends import HttpBackend
    from jaxserve.frontend.client_auth import ClientAuth

    seen = {}

    async def completions(request):
        seen["auth"] = request.headers.get("Authorization")
        seen["body"] = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("ab", "", "c"):  # an empty chunk is no output
            chunk = {"choices": [{"index": 0, "text": text}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with HttpBackend(f"127.0.0.1:{port}", 30, ClientAuth(api_key="k1")) as b:
                return await b.send([1, 2, 3], 3, Sampling(temperature=0.5, ignore_eos=True))
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert seen["auth"] == "Bearer k1"
    body = seen["body"]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3 and body["stream"] is True
    assert body["temperature"] == 0.5 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert out.success and out.text == "abc" and len(out.chunk_times) == 2
    assert (out.prompt_len, out.output_len) == (5, 3)
    assert 0 < out.ttft == out.chunk_times[0] < out.chunk_times[1] <= out.latency


def test_wait_for_warmup_polls_until_nothing_compiles():
    """server_warmup.wait_for_warmup on a scripted server: it polls until 0, gives up at
    the timeout (saying the numbers include warm-up), and asks nothing of a server that
    cannot say (None) or with a timeout of 0."""
    from jaxserve.benchmark.server_warmup import POLL_S, wait_for_warmup

    def run(answers, timeout_s):
        now, lines, asked = [0.0], [], iter(answers)

        def sleep(s):
            now[0] += s

        rec = wait_for_warmup(lambda: next(asked), timeout_s, lines.append, sleep, lambda: now[0])
        return rec, lines

    rec, lines = run([3, 2, 0], 60)
    assert rec == {"pending_at_start": 3, "waited_s": 2 * POLL_S, "pending_at_run": 0}
    assert "3 step shapes still compiling" in lines[0] and "compiled after 2.0 s" in lines[-1]
    rec, lines = run([5] * 10, 3 * POLL_S)
    assert rec["pending_at_run"] == 5 and rec["waited_s"] == 3 * POLL_S
    assert "include its warm-up" in lines[-1]
    rec, lines = run([None], 60)
    assert rec == {"pending_at_start": None, "waited_s": 0.0, "pending_at_run": None}
    assert lines == []
    rec, lines = run([4], 0)  # --warmup-timeout 0: no wait, but the record says so
    assert rec["pending_at_run"] == 4 and lines == [
        "server: 4 step shapes still compiling: the numbers below include its warm-up"
    ]


@pytest.mark.parametrize("pending", [[0], [3, 0]])
def test_bench_asks_the_server_once_at_start_up(pending, tmp_path, monkeypatch, capsys):
    """`jaxserve bench` learns the model and the step shapes still compiling from one
    GetServerInfo (it used to ask twice: once for the model, once for the warm-up); it
    asks again only to poll a warm-up in progress. A scripted gRPC server counts the
    calls: `pending` are its successive warmup_pending_shapes answers."""
    from concurrent import futures

    import grpc

    from jaxserve.benchmark import server_warmup
    from jaxserve.cli import build_parser
    from jaxserve.frontend.proto import jaxserve_pb2 as pb
    from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

    class Scripted(pb_grpc.JaxserveServicer):
        info_calls = 0

        def GetServerInfo(self, request, context):
            answer = pending[min(self.info_calls, len(pending) - 1)]
            self.info_calls += 1
            return pb.ServerInfo(
                model=DEMO_MODEL_DIR.name, max_model_len=512, warmup_pending_shapes=answer
            )

        def Generate(self, request, context):
            yield pb.GenerateResponse(
                text="x", token_ids=[5], finish_reason="length",
                prompt_tokens=len(request.token_ids.ids), completion_tokens=1,
            )  # fmt: skip

    monkeypatch.setattr(server_warmup, "POLL_S", 0.01)
    servicer = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_JaxserveServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = tmp_path / "b.json"
    try:
        args = build_parser().parse_args(
            ["bench", "--server", f"127.0.0.1:{port}", "--dataset", "random",
             "--num-prompts", "2", "--input-len", "4", "--output-len", "1", "--no-progress",
             "--out", str(out)]
        )  # fmt: skip
        assert args.func(args) == 0, capsys.readouterr().err
    finally:
        server.stop(None)
    assert servicer.info_calls == len(pending)  # one probe, then one poll per non-zero
    warmup = json.loads(out.read_text())["server_warmup"]
    assert warmup["pending_at_start"] == pending[0] and warmup["pending_at_run"] == 0
