"""`jaxserve bench`: its statistics against numpy on hand-made timings, each dataset
loader, the request driver against a fake backend (arrival process, concurrency cap,
chained turns), and end to end against a live `jaxserve serve` on the demo model (the
table, the JSON and the PNG).
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from server_harness import DEMO_ENGINE, REPO_DIR, ServerProcess, serve_flags

from jaxserve.benchmark import client, datasets, report
from jaxserve.benchmark.backends import RequestResult, Sampling
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.tokenizer import encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL_DIR)


def _out(start, chunk_times, output_len, prompt_len=10, chunk_tokens=None, success=True):
    return RequestResult(
        success=success, start=start, ttft=chunk_times[0] if chunk_times else 0.0,
        latency=chunk_times[-1] if chunk_times else 0.0, chunk_times=list(chunk_times),
        chunk_tokens=chunk_tokens, prompt_len=prompt_len, output_len=output_len,
        error="" if success else "UNAVAILABLE: gone",
    )  # fmt: skip


# Hand-made timings (seconds from each request's send): chunk arrival times and tokens.
TIMINGS = [
    (0.00, [0.100, 0.150, 0.210, 0.300], 4),
    (0.05, [0.250, 0.260], 2),
    (0.10, [0.080], 1),  # one token: no TPOT, no ITL
    (0.20, [0.500, 0.520, 0.700, 0.710, 0.900], 6),  # 6 tokens in 5 chunks
]


def test_metrics_equal_numpy_on_hand_made_timings():
    outs = [_out(s, c, n, prompt_len=10 + i) for i, (s, c, n) in enumerate(TIMINGS)]
    outs.append(_out(0.3, [], 0, success=False))
    duration = 1.2
    pct = (50.0, 90.0, 99.0)
    m = report.compute_metrics(outs, duration, percentiles=pct)
    ttft = np.array([c[0] for _, c, _ in TIMINGS]) * 1000
    e2e = np.array([c[-1] for _, c, _ in TIMINGS]) * 1000
    tpot = np.array([(c[-1] - c[0]) / (n - 1) for _, c, n in TIMINGS if n > 1]) * 1000
    itl = np.concatenate([np.diff(c) for _, c, _ in TIMINGS]) * 1000
    assert itl.size == 3 + 1 + 0 + 4
    for key, want in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2e)):
        got = m[key]
        assert got["mean"] == pytest.approx(want.mean()), key
        assert got["std"] == pytest.approx(want.std()), key
        assert got["median"] == pytest.approx(np.median(want)), key
        for p in pct:
            assert got[f"p{p:g}"] == pytest.approx(np.percentile(want, p)), (key, p)
    assert m["completed"] == 4 and m["failed"] == 1
    n_out, n_in = 4 + 2 + 1 + 6, 10 + 11 + 12 + 13
    assert m["total_output_tokens"] == n_out and m["total_input_tokens"] == n_in
    assert m["request_throughput"] == pytest.approx(4 / duration)
    assert m["output_throughput"] == pytest.approx(n_out / duration)
    assert m["total_token_throughput"] == pytest.approx((n_in + n_out) / duration)
    # In flight: [0, .3], [.05, .3], [.1, .18], [.2, 1.1]: request 2 ends at 0.18, before
    # request 3 starts at 0.2, so the peak is 3.
    assert m["max_concurrency_observed"] == 3


def test_goodput_counts_requests_within_every_slo():
    outs = [_out(s, c, n) for s, c, n in TIMINGS]
    # TTFT ms: 100, 250, 80, 500; TPOT ms: 66.7, 10, (0), 80; E2E ms: 300, 260, 80, 900.
    cases = [
        ({"ttft": 200}, 2),  # 100, 80
        ({"ttft": 250}, 3),  # <= is within
        ({"tpot": 70}, 3),  # 66.7, 10, one-token request counts as 0
        ({"ttft": 300, "tpot": 50}, 2),  # request 1 (250, 10) and 2 (80, 0)
        ({"e2el": 280}, 2),
    ]
    for slo, want in cases:
        m = report.compute_metrics(outs, 2.0, slo=slo)
        assert m["good_requests"] == want, slo
        assert m["request_goodput"] == pytest.approx(want / 2.0), slo


def test_parse_slo_and_percentiles_name_the_bad_entry():
    assert report.parse_slo("ttft=200, tpot=50.5") == {"ttft": 200.0, "tpot": 50.5}
    for bad in ("ttft", "foo=1", "ttft=x", "ttft=-1", "ttft=1,ttft=2", "", "tpot=inf"):
        with pytest.raises(ValueError, match="slo"):
            report.parse_slo(bad)
    assert report.parse_percentiles("50,99.9") == (50.0, 99.9)
    for bad in ("0", "101", "a", ""):
        with pytest.raises(ValueError, match="percentiles"):
            report.parse_percentiles(bad)


def test_timeline_counts_every_token_once():
    outs = [_out(s, c, n) for s, c, n in TIMINGS]
    outs[3].chunk_tokens = [1, 2, 1, 1, 1]  # gRPC-style exact counts on one request
    tl = report.timeline(outs, t0=0.0, duration=1.2)
    assert sum(tl["output_tok_s"]) * tl["bin_s"] == pytest.approx(4 + 2 + 1 + 6)
    # The second chunk of request 3 arrives at 0.2 + 0.52 = 0.72 s and carries 2 tokens.
    k = int(0.72 / tl["bin_s"])
    assert tl["output_tok_s"][k] * tl["bin_s"] >= 2
    # Requests in flight, time-weighted per bin: the bins add up to the request-seconds,
    # and no bin's mean exceeds the peak of 3 at once.
    assert sum(tl["requests_in_flight"]) * tl["bin_s"] == pytest.approx(
        sum(c[-1] for _, c, _ in TIMINGS)
    )
    assert max(tl["requests_in_flight"]) <= 3 + 1e-9


def test_table_has_every_latency_row():
    m = report.compute_metrics([_out(s, c, n) for s, c, n in TIMINGS], 1.0, slo={"ttft": 200})
    table = report.format_table(m, (50.0, 90.0, 99.0), "demo")
    for label in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "Output token throughput"):
        assert label in table
    row = next(ln for ln in table.splitlines() if ln.startswith("TTFT"))
    assert [float(x) for x in row.split()[1:]] == pytest.approx(
        [m["ttft_ms"][k] for k in ("mean", "median", "p90", "p99")], abs=0.01
    )


# --- datasets ---------------------------------------------------------------------


def test_random_dataset_lengths_range_and_seed(tokenizer):
    a = datasets.random_dataset(tokenizer, 50, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    b = datasets.random_dataset(tokenizer, 50, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert [s.turns[0].prompt for s in a] == [s.turns[0].prompt for s in b]
    reqs = [s.turns[0] for s in a]
    assert all(20 <= r.prompt_len <= 60 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(5 <= r.output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5  # lengths vary with a range ratio
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    vocab = tokenizer.get_vocab_size()
    assert all(0 <= t < vocab and t not in special for r in reqs for t in r.prompt)
    fixed = datasets.random_dataset(tokenizer, 5, input_len=7, output_len=3)
    assert {(s.turns[0].prompt_len, s.turns[0].output_len) for s in fixed} == {(7, 3)}
    with pytest.raises(ValueError, match="input_len"):
        datasets.random_dataset(tokenizer, 5, input_len=0, output_len=3)
    with pytest.raises(ValueError, match="range_ratio"):
        datasets.random_dataset(tokenizer, 5, input_len=4, output_len=3, range_ratio=1.0)


def test_shared_prefix_dataset_shares_prefixes(tokenizer):
    sessions = datasets.shared_prefix_dataset(
        tokenizer, 12, prefix_len=16, suffix_len=4, output_len=5, num_prefixes=3, seed=1
    )
    prompts = [s.turns[0].prompt for s in sessions]
    assert all(len(p) == 20 for p in prompts)
    groups: dict[tuple, int] = {}
    for p in prompts:
        groups[tuple(p[:16])] = groups.get(tuple(p[:16]), 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    assert len({tuple(p[16:]) for p in prompts}) == 12  # each suffix its own


def _sharegpt_file(tmp_path, tokenizer):
    long = "word " * 1200
    data = [
        {"conversations": [
            {"from": "human", "value": "Write a Python function that adds two numbers."},
            {"from": "gpt", "value": "def add(a, b):\n    return a + b\n"},
            {"from": "human", "value": "Now make it add three numbers, please."},
            {"from": "gpt", "value": "def add(a, b, c):\n    return a + b + c"},
        ]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [
            {"from": "human", "value": long}, {"from": "gpt", "value": "ok ok ok ok"},
        ]},
        {"conversations": [
            {"from": "human", "value": "Explain what a KV cache stores in a transformer."},
            {"from": "gpt", "value": "It keeps the keys and values of earlier tokens."},
        ]},
        {"conversations": [{"from": "human", "value": "only a question with no answer"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path, data


def test_sharegpt_dataset_filters_like_vllm(tmp_path, tokenizer):
    path, data = _sharegpt_file(tmp_path, tokenizer)
    sessions = datasets.sharegpt_dataset(tokenizer, path, 10, seed=0)
    got = {s.turns[0].prompt: s.turns[0] for s in sessions}
    # Kept: conversations 0 and 3; dropped: "hi" (< 4 tokens), the 1200-word prompt
    # (> 1024 tokens) and the one with no answer.
    assert set(got) == {data[0]["conversations"][0]["value"], data[3]["conversations"][0]["value"]}
    for conv in (data[0], data[3]):
        q, a = conv["conversations"][0]["value"], conv["conversations"][1]["value"]
        r = got[q]
        assert r.prompt_len == len(encode_prompt(tokenizer, q))
        assert r.output_len == len(tokenizer.encode(a, add_special_tokens=False).ids)
    assert len(datasets.sharegpt_dataset(tokenizer, path, 1)) == 1
    fixed = datasets.sharegpt_dataset(tokenizer, path, 10, output_len=7)
    assert {s.turns[0].output_len for s in fixed} == {7}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"value": "x"}]}]))
    with pytest.raises(ValueError, match="dataset_path.*'from'"):
        datasets.sharegpt_dataset(tokenizer, bad, 3)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="dataset_path.*not JSON"):
        datasets.sharegpt_dataset(tokenizer, bad, 3)


def test_multi_turn_dataset_synthetic_and_from_sharegpt(tmp_path, tokenizer):
    sessions = datasets.multi_turn_dataset(
        tokenizer, 3, num_turns=4, input_len=12, output_len=5, seed=2
    )
    assert len(sessions) == 3 and all(s.chained and len(s.turns) == 4 for s in sessions)
    for t in (t for s in sessions for t in s.turns):
        assert isinstance(t.prompt, str) and t.output_len == 5
        assert t.prompt_len == len(encode_prompt(tokenizer, t.prompt))
    path, data = _sharegpt_file(tmp_path, tokenizer)
    convs = datasets.multi_turn_dataset(
        tokenizer, 10, num_turns=2, input_len=1, output_len=6, path=path
    )
    by_first = {s.turns[0].prompt: [t.prompt for t in s.turns] for s in convs}
    first = data[0]["conversations"]
    assert by_first[first[0]["value"]] == [first[0]["value"], first[2]["value"]]
    assert len(convs) == 5  # every conversation has a human turn
    with pytest.raises(ValueError, match="num_turns"):
        datasets.multi_turn_dataset(
            tokenizer, 1, num_turns=datasets.MAX_TURNS + 1, input_len=1, output_len=1
        )


def test_text_file_dataset(tmp_path, tokenizer):
    path = tmp_path / "prompts.txt"
    path.write_text("import \n\n   \ndef f(x):\\n    return\nclass A:\n")
    sessions = datasets.text_file_dataset(tokenizer, path, 5, output_len=9)
    prompts = [s.turns[0].prompt for s in sessions]
    assert prompts == [
        "import ",
        "def f(x):\n    return",
        "class A:",
        "import ",
        "def f(x):\n    return",
    ]
    assert all(s.turns[0].output_len == 9 for s in sessions)
    path.write_text("\n \n")
    with pytest.raises(ValueError, match="dataset_path"):
        datasets.text_file_dataset(tokenizer, path, 5, output_len=9)


# --- driver -----------------------------------------------------------------------


def test_arrival_gaps_are_gamma_with_mean_one_over_rate():
    gaps = client.arrival_gaps(40_000, rate=8.0, burstiness=1.0, seed=0)
    assert gaps[0] == 0
    assert gaps[1:].mean() == pytest.approx(1 / 8, rel=0.03)
    assert gaps[1:].std() == pytest.approx(1 / 8, rel=0.03)  # exponential: std == mean
    bursty = client.arrival_gaps(40_000, rate=8.0, burstiness=0.25, seed=0)[1:]
    assert bursty.mean() == pytest.approx(1 / 8, rel=0.05)
    assert bursty.std() == pytest.approx(1 / 8 / math.sqrt(0.25), rel=0.05)  # mean/sqrt(k)
    assert not client.arrival_gaps(5, math.inf, 1.0, 0).any()
    with pytest.raises(ValueError, match="request_rate"):
        client.arrival_gaps(5, 0.0, 1.0, 0)


class FakeBackend:
    """Answers after `delay` seconds with output "<n>"; records prompts and the peak of
    requests in flight."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay, self.prompts, self.in_flight, self.peak = delay, [], 0, 0

    async def send(self, prompt, max_tokens, sp):
        self.prompts.append(prompt)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        out = RequestResult(start=time.perf_counter(), chunk_tokens=[1])
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        out.chunk_times, out.ttft, out.latency = [self.delay], self.delay, self.delay
        out.success, out.output_len, out.text = True, 1, f"<{len(self.prompts)}>"
        return out


def _single(n):
    return [datasets.Session([datasets.BenchRequest(f"p{i}", 1, 1)]) for i in range(n)]


def test_driver_caps_concurrency_and_sends_warmups_first():
    fake = FakeBackend()
    run = asyncio.run(
        client.run(fake, _single(12), sampling=Sampling(), max_concurrency=3, num_warmups=2)
    )
    assert fake.prompts[:2] == ["p0", "p1"]  # warm-ups: the first sessions' first turns
    assert len(fake.prompts) == 14 and len(run.outputs) == 12
    assert fake.peak == 3
    # 12 requests, 3 at a time, 0.02 s each: at least 4 rounds.
    assert run.duration >= 4 * 0.02


def test_driver_rate_spreads_the_sends():
    fake = FakeBackend(delay=0.001)
    rate = 50.0
    run = asyncio.run(client.run(fake, _single(6), sampling=Sampling(), request_rate=rate))
    sent = np.array([o.start - run.t0 for o in run.outputs])
    # Each send waits for its arrival time (gaps from the same seed), in dataset order.
    assert np.all(sent >= np.cumsum(client.arrival_gaps(6, rate, 1.0, 0)) - 1e-6), sent
    assert np.all(np.diff(sent) >= 0)
    # Rate inf: every request is sent before the first one ends.
    fake = FakeBackend(delay=0.5)
    asyncio.run(client.run(fake, _single(6), sampling=Sampling()))
    assert fake.peak == 6


def test_driver_chains_turns_with_history():
    fake = FakeBackend(delay=0.001)
    turns = [datasets.BenchRequest(t, 1, 1) for t in ("first", "second", "third")]
    asyncio.run(client.run(fake, [datasets.Session(turns, chained=True)], sampling=Sampling()))
    sep = client.TURN_SEPARATOR
    assert fake.prompts == [
        "first",
        "first<1>" + sep + "second",
        "first<1>" + sep + "second<2>" + sep + "third",
    ]


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
