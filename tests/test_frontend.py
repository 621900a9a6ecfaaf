"""The gRPC frontend, the detokenizer sidecar and the process model, on the mock engine.

Most tests talk to one real `jaxserve serve` (three processes, loopback, a free port) whose
engine is tests/mock_engine.py; the expected tokens come from the mock's token function and
the expected text from `tokenizer.decode`. Shutdown and engine death get their own server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from mock_engine import mock_logprobs, mock_tokens, write_mock_model_dir
from server_harness import ServerProcess, alive

from jaxserve import ipc
from jaxserve.frontend.client import JaxserveClient, build_generate_request, collect_completions
from jaxserve.frontend.detokenizer_process import OutputProcessor
from jaxserve.frontend.engine_client import (
    AsyncEngineClient,
    EngineDeadError,
    engine_request_id,
)
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.frontend.server import MAX_RECEIVE_MESSAGE_BYTES
from jaxserve.frontend.tokenizer import load_tokenizer
from jaxserve.frontend.validation import (
    DEFAULT_MAX_TOKENS,
    MAX_N,
    ModelLimits,
    RequestValidationError,
    build_engine_request,
    check_request_id,
    sampling_params_from_proto,
    split_samples,
)
from jaxserve.ipc import AbortRequest, EngineRequest, IpcAddresses, RequestOutput, TextOutput
from jaxserve.sampling_params import MAX_LOGIT_BIAS

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
STEP_DELAY_S = 0.005  # mock engine step time: a 1000-token stream lasts >= 5 s
START_TIMEOUT_S = 60
RPC_TIMEOUT_S = 30
FFFD = "\ufffd"


# ---------------------------------------------------------------- server harness


def MockServer(model_dir: Path, *, start_delay_s: float = 0.0, extra_args=()) -> ServerProcess:
    """The real three-process server with the mock engine in the engine process."""
    args = ("--num-blocks", "256", "--block-size", "16")
    args += ("--engine-class", "mock_engine:MockEngineCore", *extra_args)
    env = {
        "JAXSERVE_MOCK_STEP_DELAY_S": str(STEP_DELAY_S),
        "JAXSERVE_MOCK_START_DELAY_S": str(start_delay_s),
    }
    return ServerProcess(model_dir, extra_args=args, env=env, start_timeout_s=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_mock_model_dir(tmp_path_factory.mktemp("mock_model"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def vocab(model_dir):
    meta = json.loads((model_dir / "config.json").read_text())
    return meta["vocab_size"], meta["first_text_token_id"]


@pytest.fixture(scope="module")
def server(model_dir):
    srv = MockServer(model_dir).wait_ready()
    yield srv
    srv.terminate(15)


@pytest.fixture(scope="module")
def client(server):
    with JaxserveClient(server.target) as c:
        yield c


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


# ---------------------------------------------------------------- streaming


def test_stream_matches_mock_tokens_and_decode(client, tok, vocab):
    prompt = "hello 你好 🤖"
    expected = _expected_ids(tok, vocab, prompt, 40)
    deltas = list(
        client.generate(prompt, max_tokens=40, return_token_ids=True, timeout=RPC_TIMEOUT_S)
    )
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert last.prompt_tokens == len(tok.encode(prompt).ids)
    assert last.completion_tokens == 40
    assert [t for d in deltas for t in d.token_ids] == expected
    full = tok.decode(expected)
    assert "".join(d.text for d in deltas) == full
    if FFFD not in full:
        assert not any(FFFD in d.text for d in deltas)
    assert len({d.request_id for d in deltas}) == 1


def test_token_id_prompt_with_seed_and_no_token_ids(client, tok, vocab):
    prompt_ids = [10, 20, 30, 40]
    expected = _expected_ids(tok, vocab, prompt_ids, 12, seed=1234)
    deltas = list(client.generate(prompt_ids, max_tokens=12, seed=1234, timeout=RPC_TIMEOUT_S))
    assert "".join(d.text for d in deltas) == tok.decode(expected)
    assert all(d.token_ids == [] for d in deltas)  # return_token_ids not set
    assert deltas[-1].prompt_tokens == 4 and deltas[-1].completion_tokens == 12


def test_unset_max_tokens_defaults_to_16(client):
    deltas = list(client.generate([1, 2, 3], return_token_ids=True, timeout=RPC_TIMEOUT_S))
    assert deltas[-1].completion_tokens == DEFAULT_MAX_TOKENS
    assert sum(len(d.token_ids) for d in deltas) == DEFAULT_MAX_TOKENS


def test_stop_string_cuts_text_and_aborts_engine(client, tok, vocab):
    prompt_ids = [7, 8, 9]
    ids = _expected_ids(tok, vocab, prompt_ids, 200)
    full = tok.decode(ids)
    # A stop string from a clean stretch of the output, a little way in.
    start = next(i for i in range(30, len(full) - 3) if FFFD not in full[i : i + 3])
    stop = full[start : start + 3]
    cut = full.find(stop)
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]).rstrip(FFFD))

    deltas = list(
        client.generate(
            prompt_ids, max_tokens=2000, stop=[stop], return_token_ids=True, timeout=RPC_TIMEOUT_S
        )
    )
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert "".join(d.text for d in deltas) == full[:cut]
    assert [t for d in deltas for t in d.token_ids] == ids[:k]
    assert last.completion_tokens == k
    # The sidecar told the engine to abort: it is idle long before 2000 steps (10 s).
    _wait_idle(client, timeout=3.0)


def test_stop_token_id(client, tok, vocab):
    prompt_ids = [11, 12]
    ids = _expected_ids(tok, vocab, prompt_ids, 50)
    stop_token = ids[6]
    j = ids.index(stop_token)
    deltas = list(
        client.generate(
            prompt_ids,
            max_tokens=50,
            stop_token_ids=[stop_token],
            return_token_ids=True,
            timeout=RPC_TIMEOUT_S,
        )
    )
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop_token)
    assert "".join(d.text for d in deltas) == tok.decode(ids[:j])  # stop token not in text
    assert [t for d in deltas for t in d.token_ids] == ids[: j + 1]
    assert last.completion_tokens == j + 1


def test_logprobs_follow_their_tokens(client, tok, vocab):
    prompt_ids = [21, 22, 23]
    ids = _expected_ids(tok, vocab, prompt_ids, 10)
    deltas = list(
        client.generate(
            prompt_ids, max_tokens=10, logprobs=2, return_token_ids=True, timeout=RPC_TIMEOUT_S
        )
    )
    got = [entry for d in deltas for entry in d.logprobs or ()]
    expected = []
    for t in ids:
        logprob, top = mock_logprobs(t, 2, vocab[0])
        expected.append((t, logprob, [(i, lp) for i, lp in top]))
    assert got == expected


# ---------------------------------------------------------------- n samples


def test_n_samples_share_one_stream_each_index_finishing_once(client, tok, vocab):
    prompt_ids, n, seed, max_tokens = [31, 32, 33], 3, 77, 20
    deltas = list(
        client.generate(
            prompt_ids,
            request_id="three-samples",
            n=n,
            seed=seed,
            max_tokens=max_tokens,
            return_token_ids=True,
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert {d.request_id for d in deltas} == {"three-samples"}
    assert {d.index for d in deltas} == set(range(n))
    finals = [d.index for d in deltas if d.finish_reason is not None]
    assert sorted(finals) == list(range(n))  # each sample ends exactly once
    for i in range(n):
        mine = [d for d in deltas if d.index == i]
        assert mine[-1].finish_reason == "length"  # nothing of a sample after its final
        # Sample i is seeded seed + i, as jaxserve.LLM does.
        expected = _expected_ids(tok, vocab, prompt_ids, max_tokens, seed=seed + i)
        assert [t for d in mine for t in d.token_ids] == expected
        assert "".join(d.text for d in mine) == tok.decode(expected)
        assert mine[-1].completion_tokens == max_tokens
    samples = collect_completions(deltas)
    assert [c.index for c in samples] == list(range(n))
    assert [c.request_id for c in samples] == ["three-samples"] * n
    assert [c.token_ids for c in samples] == [
        [t for d in deltas if d.index == i for t in d.token_ids] for i in range(n)
    ]
    _wait_idle(client)


def _wait_num_running(client, num_running, timeout=5.0):
    deadline = time.monotonic() + timeout
    while (info := client.server_info(timeout=RPC_TIMEOUT_S)).num_running != num_running:
        assert time.monotonic() < deadline, f"never {num_running} running: {info}"
        time.sleep(0.01)
    return info


def test_abort_of_the_request_id_aborts_every_sample(server, client):
    stub = pb_grpc.JaxserveStub(grpc.insecure_channel(server.target))
    _wait_idle(client)
    group = client.generate([44] * 5, request_id="grp", n=3, max_tokens=1000, timeout=30)
    solo = client.generate([45] * 5, request_id="solo-1", max_tokens=500, timeout=30)
    first = [next(group), next(solo)]
    assert all(d.finish_reason is None for d in first)
    _wait_num_running(client, 4)
    # A running request's id is taken, whatever the n of the newcomer.
    for request_id, n in (("grp", 1), ("grp", 2), ("solo-1", 1), ("solo-1", 3)):
        req = build_generate_request("hi", request_id=request_id)
        req.sampling.n = n
        _assert_invalid(stub, req, "request_id", f"{request_id} n={n}")

    assert client.abort("grp", timeout=RPC_TIMEOUT_S)
    rest = [first[0], *group]
    finals = {d.index: d for d in rest if d.finish_reason is not None}
    assert sorted(finals) == [0, 1, 2]
    assert all(d.finish_reason == "abort" and d.completion_tokens < 1000 for d in finals.values())
    assert _wait_num_running(client, 1).num_waiting == 0  # the solo request runs on
    assert not client.abort("grp", timeout=RPC_TIMEOUT_S)  # finished: nothing to abort
    assert client.abort("solo-1", timeout=RPC_TIMEOUT_S)
    assert list(solo)[-1].finish_reason == "abort"
    _wait_idle(client, timeout=3.0)


def test_client_cancel_aborts_every_sample(client):
    total = _wait_idle(client).kv_blocks_total
    stream = client.generate([46] * 5, request_id="cancel-group", n=4, max_tokens=800, timeout=30)
    next(stream)
    assert _wait_num_running(client, 4).kv_blocks_free < total
    stream.close()  # cancels the call
    _wait_idle(client, timeout=3.0)  # 800 tokens would take >= 4 s
    # Every id is free again once the engine confirmed the aborts.
    again = client.complete([1], request_id="cancel-group", n=2, max_tokens=2, timeout=30)
    assert [c.finish_reason for c in again] == ["length", "length"]


def _tokens(deltas, index=0):
    return [t for d in deltas if d.index == index for t in d.token_ids]


def test_sample_ids_are_not_client_ids(server, client, tok, vocab):
    """The samples of a request with n > 1 have engine ids of their own: no client id
    clashes with them, and Abort never reaches them."""
    _wait_idle(client)
    max_tokens = 200  # >= 1 s at the mock's step time: they run through the checks below
    running = {
        "s": dict(prompt=[51] * 4, n=3, seed=5),
        "p-1": dict(prompt=[52] * 4, n=1, seed=None),
        "q": dict(prompt=[53] * 4, n=3, seed=9),
    }
    streams = {
        rid: client.generate(
            r["prompt"], request_id=rid, n=r["n"], seed=r["seed"], max_tokens=max_tokens,
            return_token_ids=True, timeout=RPC_TIMEOUT_S,
        )
        for rid, r in running.items()
    }  # fmt: skip
    firsts = {rid: next(stream) for rid, stream in streams.items()}
    assert all(d.finish_reason is None for d in firsts.values())
    _wait_num_running(client, 7)

    # "s-1" while s (n=3) runs, and "p" with n=2 while "p-1" runs: accepted and correct.
    for rid, prompt, n in (("s-1", [54, 55], 1), ("p", [56, 57], 2)):
        got = client.complete(
            prompt, request_id=rid, n=n, seed=3, max_tokens=4, return_token_ids=True,
            timeout=RPC_TIMEOUT_S,
        )  # fmt: skip
        assert [c.request_id for c in got] == [rid] * n
        for i, c in enumerate(got):
            assert c.finish_reason == "length"
            assert c.token_ids == _expected_ids(tok, vocab, prompt, 4, seed=3 + i)
    # "q-1" names no client request: not found, and q's sample 1 runs on.
    assert not client.abort("q-1", timeout=RPC_TIMEOUT_S)
    assert _wait_num_running(client, 7).num_waiting == 0

    for rid, stream in streams.items():
        r = running[rid]
        deltas = [firsts[rid], *stream]
        assert {d.request_id for d in deltas} == {rid}
        for i in range(r["n"]):
            (final,) = [d for d in deltas if d.index == i and d.finish_reason is not None]
            assert (final.finish_reason, final.completion_tokens) == ("length", max_tokens)
            seed = None if r["seed"] is None else r["seed"] + i
            assert _tokens(deltas, i) == _expected_ids(tok, vocab, r["prompt"], max_tokens, seed)
    _wait_idle(client)


def test_request_id_is_reusable_at_once_after_a_cancel(client, tok, vocab):
    """A cancelled request frees its id when its stream ends, not when the engine's final
    comes: a new request with the id is accepted at once (10 of 10), and the engine's
    late outputs of the old one never reach it."""
    _wait_idle(client)
    for attempt in range(10):
        old_n = 1 + attempt % 2  # also a request with n > 1
        old = client.generate(
            [61] * 5, request_id="r", n=old_n, max_tokens=2000, return_token_ids=True,
            timeout=RPC_TIMEOUT_S,
        )  # fmt: skip
        next(old)
        next(old)
        old.close()  # cancels the call; the engine still runs it for a few ms
        prompt = [62, attempt]
        deltas = list(
            client.generate(
                prompt, request_id="r", max_tokens=8, return_token_ids=True,
                timeout=RPC_TIMEOUT_S,
            )
        )  # fmt: skip
        assert {(d.request_id, d.index) for d in deltas} == {("r", 0)}, attempt
        assert [d.finish_reason for d in deltas].count("length") == 1, attempt
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 8
        expected = _expected_ids(tok, vocab, prompt, 8)
        assert _tokens(deltas) == expected, attempt
        assert "".join(d.text for d in deltas) == tok.decode(expected), attempt
    _wait_idle(client, timeout=3.0)  # every cancelled request was aborted in the engine


def test_complete_reports_the_assigned_request_id(client):
    got = client.complete([1, 2], n=2, max_tokens=2, timeout=RPC_TIMEOUT_S)
    (request_id,) = {c.request_id for c in got}
    assert len(request_id) == 32 and int(request_id, 16) >= 0  # the server's uuid4().hex


# ---------------------------------------------------------------- health, reflection, info


def test_health_is_serving(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "jaxserve.v1.Jaxserve"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "jaxserve.v1.Jaxserve" in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        methods = {
            m.name for m in db.FindFileContainingSymbol("jaxserve.v1.Jaxserve").service[0].method
        }
        assert methods == {"Generate", "Abort", "GetServerInfo"}


def test_server_info_reports_engine_facts(client, vocab):
    info = _wait_idle(client)
    assert info.max_model_len == 4096 and info.block_size == 16
    assert info.kv_blocks_total == 256 and info.vocab_size == vocab[0]


# ---------------------------------------------------------------- bad input


BAD_REQUESTS = [
    ("empty text", dict(prompt=""), "prompt"),
    ("empty token ids", dict(prompt=[]), "prompt.token_ids"),
    ("prompt too long", dict(prompt=[5] * 4096), "prompt"),
    ("prompt + max_tokens too long", dict(prompt=[5] * 100, max_tokens=4000), "max_tokens"),
    ("max_tokens 0", dict(prompt="hi", max_tokens=0), "max_tokens"),
    ("max_tokens negative", dict(prompt="hi", max_tokens=-3), "max_tokens"),
    ("negative temperature", dict(prompt="hi", temperature=-0.5), "temperature"),
    ("top_p 0", dict(prompt="hi", top_p=0.0), "top_p"),
    ("top_p above 1", dict(prompt="hi", top_p=1.5), "top_p"),
    ("top_k 0", dict(prompt="hi", top_k=0), "top_k"),
    ("top_k below -1", dict(prompt="hi", top_k=-2), "top_k"),
    ("token id at vocab size", dict(prompt=[1, "VOCAB"]), "prompt.token_ids"),
    ("negative token id", dict(prompt=[1, -1]), "prompt.token_ids"),
    ("stop token outside vocab", dict(prompt="hi", stop_token_ids=["VOCAB"]), "stop_token_ids"),
    ("empty stop string", dict(prompt="hi", stop=["ok", ""]), "stop"),
    ("n 0", dict(prompt="hi", n=0), "n"),
    ("n negative", dict(prompt="hi", n=-1), "n"),
    ("n above the maximum", dict(prompt="hi", n=MAX_N + 1), "n"),
    # Control characters (C0, DEL, C1), among them the engine ids' separator.
    ("request_id with a newline", dict(prompt="hi", request_id="a\nb"), "request_id"),
    ("request_id with a unit separator", dict(prompt="hi", request_id="a\x1f#0.1"), "request_id"),
    ("request_id with DEL", dict(prompt="hi", request_id="a\x7f"), "request_id"),
    ("request_id with a C1 control", dict(prompt="hi", request_id="\x85a"), "request_id"),
    # The sampler holds MAX_LOGIT_BIAS biases per request, in float32.
    (
        "logit_bias above its maximum entries",
        dict(prompt="hi", logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
        "logit_bias",
    ),
    ("logit_bias beyond float32", dict(prompt="hi", logit_bias={5: 1e308}), "logit_bias"),
    ("temperature beyond float32", dict(prompt="hi", temperature=1e308), "temperature"),
    (
        "repetition_penalty beyond float32",
        dict(prompt="hi", repetition_penalty=1e308),
        "repetition_penalty",
    ),
]


def _resolve(value, vocab_size):
    if value == "VOCAB":
        return vocab_size
    if isinstance(value, list):
        return [_resolve(v, vocab_size) for v in value]
    return value


def test_bad_inputs_rejected_beside_a_running_stream(server, client, tok, vocab):
    stub = pb_grpc.JaxserveStub(grpc.insecure_channel(server.target))
    running_id = "long-running"
    long_ids = _expected_ids(tok, vocab, [3, 1, 4], 300)
    result: dict = {}

    def run_long():
        try:
            deltas = list(
                client.generate(
                    [3, 1, 4], request_id=running_id, max_tokens=300, timeout=RPC_TIMEOUT_S
                )
            )
            result["deltas"] = deltas
        except Exception as e:  # reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=run_long)
    thread.start()
    try:
        _wait_running(client)
        for name, kwargs, field in BAD_REQUESTS:
            kwargs = {k: _resolve(v, vocab[0]) for k, v in kwargs.items()}
            n = kwargs.pop("n", None)
            req = build_generate_request(**kwargs)
            if n is not None:
                req.sampling.n = n
            _assert_invalid(stub, req, field, name)
        _assert_invalid(stub, pb.GenerateRequest(), "prompt", "no prompt")
        dup = build_generate_request("hi", request_id=running_id)
        _assert_invalid(stub, dup, "request_id", "duplicate request id")
        assert thread.is_alive(), "the long stream should still be running"
    finally:
        thread.join(RPC_TIMEOUT_S)
    assert "error" not in result, result.get("error")
    deltas = result["deltas"]
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 300
    assert "".join(d.text for d in deltas) == tok.decode(long_ids)
    _wait_idle(client)


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


# Raw request bytes that do not parse: invalid UTF-8 in each string field, and a message
# cut short. Field tags: request_id = 1 (0x0a), text = 2 (0x12), stop = 6 (0x32).
UNDECODABLE_GENERATE = [
    ("bad UTF-8 in text", b"\x12\x03\xff\xfeA"),
    ("bad UTF-8 in request_id", b"\x0a\x02\xff\xfe\x12\x02hi"),
    ("bad UTF-8 in stop", b"\x12\x02hi\x32\x02\xff\xfe"),
    ("truncated", b"\x12\x05hi"),
]


def test_undecodable_requests_are_invalid_argument_without_a_traceback(server, client):
    log_start = len(server.lines)
    with grpc.insecure_channel(server.target) as channel:
        generate = channel.unary_stream(
            "/jaxserve.v1.Jaxserve/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        abort = channel.unary_unary(
            "/jaxserve.v1.Jaxserve/Abort",
            request_serializer=lambda b: b,
            response_deserializer=pb.AbortResponse.FromString,
        )
        calls = [(name, lambda d=data: list(generate(d, timeout=RPC_TIMEOUT_S)), "GenerateRequest")
                 for name, data in UNDECODABLE_GENERATE]  # fmt: skip
        calls.append(
            ("Abort, bad UTF-8", lambda: abort(b"\x0a\x02\xff\xfe", timeout=10), "AbortRequest")
        )
        for name, call, message in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert info.value.details().startswith(f"request: not a valid {message} ("), (
                name, info.value.details()
            )  # fmt: skip
        # The same raw path with valid bytes reaches the servicer.
        ok = list(generate(build_generate_request([1, 2], max_tokens=3).SerializeToString()))
        assert ok[-1].finish_reason == "length" and ok[-1].completion_tokens == 3
    # grpc.aio logs a traceback for a deserializer that raises: none here (the log line
    # of a rejected call is written before its status is sent, so it would be in by now).
    client.server_info(timeout=RPC_TIMEOUT_S)
    time.sleep(0.2)
    new_log = "".join(server.lines[log_start:])
    assert "Traceback" not in new_log and "DecodeError" not in new_log, new_log


def test_prompt_over_4_mib_reaches_the_prompt_check(server):
    stub = pb_grpc.JaxserveStub(grpc.insecure_channel(server.target))
    # Above gRPC's default 4 MiB receive limit, below MAX_RECEIVE_MESSAGE_BYTES.
    big = build_generate_request("x" * (5 * 1024 * 1024))
    _assert_invalid(stub, big, "prompt", "5 MiB text prompt")
    huge = build_generate_request("x" * (MAX_RECEIVE_MESSAGE_BYTES + 1))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(huge, timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------- abort and cancel


def test_abort_rpc_ends_stream_and_frees_blocks(client):
    total = _wait_idle(client).kv_blocks_total
    stream = client.generate([42] * 5, request_id="abort-me", max_tokens=2000, timeout=30)
    first = next(stream)
    assert first.finish_reason is None
    info = _wait_running(client)
    assert info.num_running == 1 and info.kv_blocks_free < total
    assert client.abort("abort-me", timeout=RPC_TIMEOUT_S)
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].completion_tokens < 2000
    _wait_idle(client, timeout=3.0)
    assert not client.abort("abort-me", timeout=RPC_TIMEOUT_S)  # finished: nothing to abort


def test_client_cancel_aborts_request(client):
    total = _wait_idle(client).kv_blocks_total
    stream = client.generate([43] * 5, request_id="cancel-me", max_tokens=2000, timeout=30)
    next(stream)
    next(stream)
    assert _wait_running(client).kv_blocks_free < total
    stream.close()  # cancels the call
    _wait_idle(client, timeout=3.0)  # 2000 tokens would take >= 10 s
    # The id is free again once the engine confirmed the abort.
    again = list(client.generate([1], request_id="cancel-me", max_tokens=2, timeout=30))
    assert again[-1].finish_reason == "length"


# ---------------------------------------------------------------- CLI


def test_cli_generate_streams_text_and_a_final_newline(server, tok, vocab):
    prompt = "import "
    expected = tok.decode(_expected_ids(tok, vocab, prompt, 12))
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         "--max-tokens", "12", "--temperature", "0", "-v", prompt],
        capture_output=True, timeout=60, cwd=REPO_DIR,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # The text, then one newline (a pipe too, as `llm` does); -v's summary goes to stderr.
    assert out.stdout.decode() == expected + "\n"
    prompt_tokens = len(tok.encode(prompt).ids)
    assert out.stderr.decode().splitlines() == [
        f"[finish_reason=length stop_reason=None prompt_tokens={prompt_tokens} "
        "completion_tokens=12]"
    ]


def test_cli_generate_prints_each_of_n_samples(server, tok, vocab):
    prompt = "import "
    texts = [tok.decode(_expected_ids(tok, vocab, prompt, 8, seed=5 + i)) for i in range(2)]
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         "--max-tokens", "8", "--seed", "5", "-n", "2", "-v", prompt],
        capture_output=True, timeout=60, cwd=REPO_DIR,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == "".join(
        f"--- sample {i} (finish_reason=length) ---\n{text}\n" for i, text in enumerate(texts)
    )
    # -v: each sample's finish and token counts, as the help says.
    prompt_tokens = len(tok.encode(prompt).ids)
    assert out.stderr.decode().splitlines() == [
        f"[sample={i} finish_reason=length stop_reason=None prompt_tokens={prompt_tokens} "
        "completion_tokens=8]"
        for i in range(2)
    ]


def test_cli_generate_reports_bad_input(server):
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         "--top-p", "2", "hi"],
        capture_output=True, timeout=60, cwd=REPO_DIR, text=True,
    )  # fmt: skip
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: top_p:" in out.stderr


# ---------------------------------------------------------------- processes


def test_busy_port_is_an_error(server, model_dir):
    port = server.target.rsplit(":", 1)[1]
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
         "--port", port, "--engine-class", "mock_engine:MockEngineCore"],
        capture_output=True, text=True, timeout=60, cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    # The metrics port's style: the flag, the address and the OS's reason.
    assert f"jaxserve serve: error: port: cannot bind 127.0.0.1:{port} ([Errno " in out.stderr


def test_busy_metrics_port_is_an_error_naming_the_flag(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
             "--port", "0", "--metrics-port", str(port),
             "--engine-class", "mock_engine:MockEngineCore"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_DIR,
            env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
        )  # fmt: skip
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert f"jaxserve serve: error: metrics-port: cannot bind 127.0.0.1:{port} (" in stderr
    # No child outlived it (children carry their parent's pid on their command line).
    marker = f"--parent-pid {proc.pid}"
    leftovers = [
        pid for pid in (int(p.name) for p in Path("/proc").glob("[0-9]*"))
        if alive(pid) and marker in _cmdline(pid)
    ]  # fmt: skip
    assert not leftovers


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
    except OSError:
        return ""


def test_serve_logging_quiets_the_jax_backend_probe():
    """`configure_logging` (used by `serve`) hides xla_bridge's INFO lines at every start
    ("Unable to initialize backend 'tpu'"); at DEBUG they stay."""
    code = (
        "import sys; from jaxserve.logs import configure_logging; "
        "configure_logging(sys.argv[1], 'test'); import jax; jax.devices()"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # probe every platform
    logs = {}
    for level in ("INFO", "DEBUG"):
        out = subprocess.run(
            [sys.executable, "-c", code, level], capture_output=True, text=True, timeout=120,
            env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        logs[level] = out.stderr
    assert "Unable to initialize backend" in logs["DEBUG"]  # the probe does log it
    assert "Unable to initialize backend" not in logs["INFO"]
    assert "xla_bridge" not in logs["INFO"]


def test_frontend_process_never_imports_jax():
    code = (
        "import sys, jaxserve.cli, jaxserve.launcher, jaxserve.frontend.server, "
        "jaxserve.frontend.client, jaxserve.frontend.detokenizer_process; "
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sigterm_stops_all_processes(model_dir):
    srv = MockServer(model_dir).wait_ready()
    try:
        assert len(srv.children) == 2 and all(alive(p) for p in srv.children)
        ended = threading.Event()

        def stream():
            try:
                with JaxserveClient(srv.target) as c:
                    for _ in c.generate([9] * 3, max_tokens=3000, timeout=30):
                        pass
            except grpc.RpcError:
                pass
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        time.sleep(0.3)
        assert srv.terminate(timeout=10) < 10
        assert srv.proc.returncode == 0, srv.log()
        assert ended.wait(5), "an open stream was left hanging"
        deadline = time.monotonic() + 2
        while any(alive(p) for p in srv.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in srv.children)
    finally:
        srv.kill()


def test_not_serving_until_engine_ready(model_dir):
    srv = MockServer(model_dir, start_delay_s=3.0)
    try:
        with JaxserveClient(srv.target) as c:
            assert not srv.ready.is_set()
            assert not c.is_serving()
            with pytest.raises(grpc.RpcError) as info:
                list(c.generate("hi", timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "starting" in info.value.details()
            srv.wait_ready()
            assert c.is_serving()
            assert list(c.generate("hi", max_tokens=2, timeout=10))[-1].finish_reason == "length"
        srv.terminate(timeout=10)
    finally:
        srv.kill()


def test_children_die_with_the_frontend(model_dir):
    srv = MockServer(model_dir).wait_ready()
    try:
        srv.proc.send_signal(signal.SIGKILL)  # no chance to clean up: the children must notice
        srv.proc.wait(10)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in srv.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in srv.children)
    finally:
        srv.kill()


# ---------------------------------------------------------------- units


def test_validation_defaults_follow_the_proto():
    params = sampling_params_from_proto(pb.GenerateRequest(text="x"), 10, 100)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1
    assert params.max_tokens == DEFAULT_MAX_TOKENS and params.skip_special_tokens
    assert params.seed is None and params.logprobs is None
    # Unset max_tokens is cut to the room left; explicit values are kept (and then checked).
    assert sampling_params_from_proto(pb.GenerateRequest(text="x"), 95, 100).max_tokens == 5
    req = build_generate_request("x", max_tokens=50, temperature=0.0, skip_special_tokens=False)
    params = sampling_params_from_proto(req, 95, 100)
    assert params.max_tokens == 50 and params.temperature == 0.0
    assert not params.skip_special_tokens


def test_split_samples_follows_the_offline_llm(tok, vocab):
    limits = ModelLimits(max_model_len=100, vocab_size=vocab[0])
    req = build_generate_request([5, 6, 7], n=3, seed=10, prompt_logprobs=2, max_tokens=4)
    parent = build_engine_request(req, "r", tok, limits)
    samples = split_samples(parent)
    # The client's id on each: the engine client gives the engine ids (tested below).
    assert [s.request_id for s in samples] == ["r", "r", "r"]
    assert [s.sampling["seed"] for s in samples] == [10, 11, 12]
    assert [s.sampling["n"] for s in samples] == [1, 1, 1]
    assert [s.sampling["prompt_logprobs"] for s in samples] == [2, None, None]
    for s in samples:
        assert s.prompt_token_ids.tolist() == [5, 6, 7]
        rest = {k: v for k, v in s.sampling.items() if k not in ("seed", "n", "prompt_logprobs")}
        assert rest == {
            k: v for k, v in parent.sampling.items() if k not in ("seed", "n", "prompt_logprobs")
        }
    # Unseeded samples stay unseeded (the engine draws a different seed for each).
    unseeded = split_samples(
        build_engine_request(build_generate_request("x", n=2), "u", tok, limits)
    )
    assert [s.sampling["seed"] for s in unseeded] == [None, None]
    # n = 1: the request itself.
    (single,) = split_samples(build_engine_request(build_generate_request("x"), "s", tok, limits))
    assert single.request_id == "s" and single.cache_group is None


@pytest.mark.parametrize("request_id", ["a\nb", "\x00", "x\x1f#0.0", "\x7f", "a\x9fb"])
def test_control_characters_in_request_id_are_rejected(request_id):
    with pytest.raises(RequestValidationError, match="^request_id: control character"):
        check_request_id(request_id)
    check_request_id("req 42/a-b#0.1 é🤖")  # printable characters (and spaces) are fine


def _offline_engine_client(sent: list, fail_on_send: int | None = None) -> AsyncEngineClient:
    """An AsyncEngineClient whose sends are recorded (no sockets); the fail_on_send-th
    EngineRequest (0-based) fails as a stuck engine does."""
    engine = AsyncEngineClient(IpcAddresses.in_dir("/nonexistent"))
    engine._ready.set()

    def send(msg):
        num_requests = sum(isinstance(m, EngineRequest) for m in sent)
        if isinstance(msg, EngineRequest) and num_requests == fail_on_send:
            raise EngineDeadError("the engine is not taking requests")
        sent.append(msg)

    engine._send = send
    return engine


def _samples(request_id: str, n: int) -> list[EngineRequest]:
    prompt = np.asarray([1, 2], np.int32)
    return [EngineRequest(request_id, prompt, {"n": 1, "seed": i}) for i in range(n)]


def _drain(stream) -> list[tuple[int, str, str | None]]:
    """(sample index, engine id, finish_reason) of every output queued on the stream."""
    got = asyncio.run(stream.next_batch())
    return [(i, o.request_id, o.finish_reason) for i, o in got]


def test_engine_client_gives_each_sample_a_unique_engine_id():
    sent: list = []
    engine = _offline_engine_client(sent)
    g = engine.add_request("g", _samples("g", 2))
    g0, g1 = (engine_request_id("g", 0, i) for i in range(2))
    assert g.engine_ids == [g0, g1] and [m.request_id for m in sent] == [g0, g1]
    assert [m.sampling["seed"] for m in sent] == [0, 1]  # the samples themselves, in order
    # The samples share a cache_group of their own; a lone request has none.
    (group,) = {m.cache_group for m in sent}
    assert group is not None and ipc.decode(ipc.encode(sent[1])).cache_group == group
    engine.add_request("h", _samples("h", 2))
    engine.add_request("g-1", _samples("g-1", 1))
    assert sent[2].cache_group == sent[3].cache_group not in (group, None)
    assert sent[4].cache_group is None
    # Engine ids are unique and never equal to a client id (they hold a control character).
    ids = [m.request_id for m in sent]
    assert len(set(ids)) == len(ids) and not {"g", "h", "g-1"} & set(ids)
    assert all("\x1f" in i for i in ids)
    # Client ids are unique among running requests; abort matches client ids only.
    with pytest.raises(ValueError, match="^request_id: 'g' is already running"):
        engine.add_request("g", _samples("g", 1))
    with pytest.raises(ValueError, match="^request_id: .* control character"):
        engine.add_request("x\x1f#9.0", _samples("x", 1))
    assert not engine.abort(g1) and not engine.abort("g-0")
    del sent[:]
    assert engine.abort("g-1") and sent == [AbortRequest([engine_request_id("g-1", 2, 0)])]


def test_engine_client_routes_outputs_and_frees_the_id_on_the_last_final():
    sent: list = []
    engine = _offline_engine_client(sent)
    stream = engine.add_request("g", _samples("g", 2))
    g0, g1 = stream.engine_ids
    engine._dispatch([TextOutput(g1, "a", [5]), TextOutput(g0, "", [], "abort")])
    assert engine.is_running("g")
    assert engine.abort("g") and sent[-1] == AbortRequest([g1])  # only what still runs
    engine._dispatch([TextOutput(g1, "", [], "abort")])
    assert not engine.is_running("g") and not engine.abort("g")
    # Both samples' outputs came through the one stream, in arrival order, by index.
    assert _drain(stream) == [(1, g1, None), (0, g0, "abort"), (1, g1, "abort")]
    engine.release(stream)  # what the server does when the stream ends: nothing left
    assert sent[-1] == AbortRequest([g1])


def test_engine_client_release_frees_the_id_at_once_and_drops_late_outputs():
    sent: list = []
    engine = _offline_engine_client(sent)
    old = engine.add_request("r", _samples("r", 2))
    engine._dispatch([TextOutput(old.engine_ids[0], "x", [7], "length")])
    engine.release(old)  # the client cancelled: the unfinished sample is aborted
    assert sent[-1] == AbortRequest([old.engine_ids[1]]) and not engine.is_running("r")
    new = engine.add_request("r", _samples("r", 1))
    assert engine.is_running("r") and not set(new.engine_ids) & set(old.engine_ids)
    # The engine's late outputs of the old request are dropped; the new one's arrive.
    engine._dispatch(
        [
            TextOutput(old.engine_ids[1], "late", [8]),
            TextOutput(new.engine_ids[0], "new", [9]),
            TextOutput(old.engine_ids[1], "", [], "abort"),
        ]
    )
    assert _drain(new) == [(0, new.engine_ids[0], None)]
    assert _drain(old) == [(0, old.engine_ids[0], "length")]  # nothing after the release
    engine.release(old)  # idempotent: the new request keeps its id
    assert engine.is_running("r") and len(sent) == 4  # two samples, one abort, one sample


def test_engine_client_send_failure_aborts_what_was_sent_and_frees_the_id():
    sent: list = []
    engine = _offline_engine_client(sent, fail_on_send=2)
    with pytest.raises(EngineDeadError):
        engine.add_request("g", _samples("g", 4))
    ids = [engine_request_id("g", 0, i) for i in range(4)]
    assert [m.request_id for m in sent[:2]] == ids[:2]
    assert sent[2:] == [AbortRequest(ids[:2])]  # only the samples that were sent
    assert not engine.is_running("g")
    engine._dispatch([TextOutput(i, "", [], "abort") for i in ids[:2]])  # dropped
    # The request that failed holds nothing: its id is free for the next one.
    del sent[:]  # (the fake engine takes sends again)
    assert engine.add_request("g", _samples("g", 1)).engine_ids == [engine_request_id("g", 1, 0)]


def test_output_processor_stop_string_aborts_and_drops_the_rest(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("abc STOP def ghi").ids
    first = {"prompt_token_ids": [1, 2], "sampling": {"stop": ["STOP"]}}
    texts, aborts = proc.process([RequestOutput("r", ids, num_prompt_tokens=2, first=first)])
    assert aborts == ["r"]
    (out,) = texts
    assert (out.text, out.finish_reason, out.stop_reason) == ("abc ", "stop", "STOP")
    assert out.prompt_tokens == 2
    # Tokens still in flight, then the engine's final abort: dropped, state released.
    assert proc.process([RequestOutput("r", [5])]) == ([], [])
    assert proc.process([RequestOutput("r", [], finish_reason="abort")]) == ([], [])
    assert proc.num_requests == 0


def test_output_processor_passes_errors_and_engine_finishes(tok):
    proc = OutputProcessor(tok)
    texts, aborts = proc.process(
        [
            RequestOutput("bad", [], finish_reason="error", error="prompt: too long"),
            RequestOutput("ok", tok.encode("hi").ids, finish_reason="length", first={}),
        ]
    )
    assert aborts == []
    assert (texts[0].finish_reason, texts[0].error) == ("error", "prompt: too long")
    assert (texts[1].text, texts[1].finish_reason) == ("hi", "length")
    assert proc.num_requests == 0


# ---------------------------------------------------------------- metrics


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
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
def test_metrics_count_a_cancelled_request_once_as_abort(metrics_server, model_dir, n):
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
    assert increase(f'jaxserve_request_success_total{{finish_reason="length",{model}}}') == 0
    assert increase(f"jaxserve_e2e_request_latency_seconds_count{{{model}}}") == n
    assert increase(f"jaxserve_prompt_tokens_total{{{model}}}") == n * len(prompt)
    # The tokens the server delivered: at least what this client read before leaving.
    generated = increase(f"jaxserve_generation_tokens_total{{{model}}}")
    assert received <= generated < n * 1000
