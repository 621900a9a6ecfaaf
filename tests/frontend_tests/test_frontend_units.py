"""Frontend units without a server: request validation, the engine client's id and
output routing, the detokenizer's output processor.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxserve import ipc
from jaxserve.frontend.client import build_generate_request
from jaxserve.frontend.detokenizer_process import OutputProcessor
from jaxserve.frontend.engine_client import AsyncEngineClient, engine_request_id
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.request_stream import EngineDeadError
from jaxserve.frontend.validation import (
    DEFAULT_MAX_TOKENS,
    ModelLimits,
    RequestValidationError,
    build_engine_request,
    check_request_id,
    sampling_params_from_proto,
    split_samples,
)
from jaxserve.ipc import AbortRequest, EngineRequest, IpcAddresses, TextOutput, TokenOutput

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
    texts, aborts = proc.process([TokenOutput("r", ids, num_prompt_tokens=2, first=first)])
    assert aborts == ["r"]
    (out,) = texts
    assert (out.text, out.finish_reason, out.stop_reason) == ("abc ", "stop", "STOP")
    assert out.prompt_tokens == 2
    # Tokens still in flight, then the engine's final abort: dropped, state released.
    assert proc.process([TokenOutput("r", [5])]) == ([], [])
    assert proc.process([TokenOutput("r", [], finish_reason="abort")]) == ([], [])
    assert proc.num_requests == 0


def test_output_processor_passes_errors_and_engine_finishes(tok):
    proc = OutputProcessor(tok)
    texts, aborts = proc.process(
        [
            TokenOutput("bad", [], finish_reason="error", error="prompt: too long"),
            TokenOutput("ok", tok.encode("hi").ids, finish_reason="length", first={}),
        ]
    )
    assert aborts == []
    assert (texts[0].finish_reason, texts[0].error) == ("error", "prompt: too long")
    assert (texts[1].text, texts[1].finish_reason) == ("hi", "length")
    assert proc.num_requests == 0


def test_a_prompt_that_is_not_utf8_is_named_not_a_traceback(capsys):
    """Invalid bytes on stdin reach Python as surrogate escapes: the request builder names
    the prompt, and `jaxserve generate` prints one line and exits 2 (before any RPC: no
    server is listening here)."""
    bad = b"\xff\xfe bad".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match="prompt: not valid UTF-8"):
        build_generate_request(bad)
    from jaxserve import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "--server", "127.0.0.1:9", bad])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompt: not valid UTF-8" in err[0], err
