"""The gRPC frontend's streams on the mock engine: tokens and text, stops, log-probs, n
samples, abort and cancel.
"""

from __future__ import annotations

import time

import grpc
from mock_engine import mock_logprobs

from frontend_tests.helpers import (
    FFFD,
    RPC_TIMEOUT_S,
    _assert_invalid,
    _expected_ids,
    _wait_idle,
    _wait_running,
)
from jaxserve.frontend.client import build_generate_request, collect_completions
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.frontend.validation import (
    DEFAULT_MAX_TOKENS,
)

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
