"""End to end on the bundled demo model: `jaxserve serve` (frontend, engine, detokenizer
processes) against the offline `LLM.generate` on the same engine settings.

One server serves the whole module; the last two tests kill its engine, then SIGTERM it,
so they run last (pytest keeps file order).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from server_harness import DEMO_ENGINE, ServerProcess, alive, serve_flags, wait_idle

from jaxserve import SamplingParams
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.client import JaxserveClient, collect_completions

pytestmark = pytest.mark.slow

RPC_TIMEOUT_S = 120

PROMPTS = [
    "import ", "def ", "class ", "from collections import ", "for i in range(",
    "if __name__ == ", "return ", "with open(", "    def __init__(self, ", "try:\n    ",
    "raise ValueError(", "# Copyright", "self.", "while True:\n    ", "lambda x: ", "print(",
]  # fmt: skip


# A stream that runs long enough for other requests to arrive beside it.
LONG_PROMPT = "class "
LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)


def _params(i: int) -> SamplingParams:
    """16 different parameter sets: greedy, seeded temperature/top-k/top-p/min-p, stops."""
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=24 + i)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=32)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=100 + i, max_tokens=32)
    return SamplingParams(temperature=0.0, max_tokens=40, stop=["\n", "):"])


def _client_kwargs(p: SamplingParams) -> dict:
    return dict(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        min_p=p.min_p, seed=p.seed, stop=p.stop,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(demo_llm):
    return demo_llm


@pytest.fixture(scope="module")
def offline(llm):
    """The offline results, computed first so the server starts on a warm compile cache."""
    params = [_params(i) for i in range(len(PROMPTS))] + [LONG]
    return llm.generate([*PROMPTS, LONG_PROMPT], params)


@pytest.fixture(scope="module")
def server(offline):
    flags = serve_flags(DEMO_ENGINE)
    srv = ServerProcess(DEMO_MODEL_DIR, extra_args=flags, start_timeout_s=600).wait_ready()
    yield srv
    srv.kill() if srv.proc.poll() is None else None


@pytest.fixture(scope="module")
def client(server):
    with JaxserveClient(server.target) as c:
        yield c


def test_concurrent_streams_equal_offline_generate(client, offline):
    assert len(offline) == len(PROMPTS) + 1
    results: dict[int, list] = {}

    def run(i: int) -> None:
        kwargs = _client_kwargs(_params(i))
        results[i] = list(client.generate(PROMPTS[i], timeout=RPC_TIMEOUT_S, **kwargs))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RPC_TIMEOUT_S)
    assert sorted(results) == list(range(len(PROMPTS)))
    for i, deltas in results.items():
        want = offline[i]
        text = "".join(d.text for d in deltas)
        assert text == want.text, f"prompt {i} {PROMPTS[i]!r} ({_params(i)})"
        assert deltas[-1].finish_reason == want.finish_reason, f"prompt {i}"
        assert deltas[-1].completion_tokens == len(want.token_ids), f"prompt {i}"
    # The demo model must have learned something: "import " continues with a module name.
    first_word = offline[0].text.split()[0] if offline[0].text.split() else ""
    assert first_word.split(".")[0].strip(",") in __import__("sys").stdlib_module_names, offline[
        0
    ].text


def test_prompt_logprobs_equal_offline(client, llm):
    prompt = "def __init__(self, name):"
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    want = want[0]
    deltas = list(
        client.generate(
            prompt, max_tokens=2, temperature=0, prompt_logprobs=3, timeout=RPC_TIMEOUT_S
        )
    )
    got = [entry for d in deltas for entry in d.prompt_logprobs or ()]
    assert want.prompt_logprobs[0] is None  # nothing predicts the first prompt token
    assert len(got) == len(want.prompt_token_ids) - 1
    for (token_id, logprob, top), ref, ref_id in zip(
        got, want.prompt_logprobs[1:], want.prompt_token_ids[1:], strict=True
    ):
        assert token_id == ref_id
        assert logprob == pytest.approx(ref[0], abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in ref[1]]
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in ref[1]], abs=1e-5)


def test_abort_and_client_cancel_return_kv_blocks(client):
    idle = wait_idle(client)
    # Abort RPC mid-stream.
    stream = client.generate(
        "import ",
        max_tokens=400,
        temperature=0,
        ignore_eos=True,
        request_id="abort-me",
        timeout=RPC_TIMEOUT_S,
    )
    got = []
    for delta in stream:
        got.append(delta)
        if len(got) == 3:
            assert client.abort("abort-me", timeout=RPC_TIMEOUT_S)
        if delta.finish_reason:
            break
    assert got[-1].finish_reason == "abort"
    assert wait_idle(client).kv_blocks_free == idle.kv_blocks_free
    # Client cancel: leave the stream after a few deltas.
    stream = client.generate(
        "def ", max_tokens=400, temperature=0, ignore_eos=True, timeout=RPC_TIMEOUT_S
    )
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    assert wait_idle(client).kv_blocks_free == idle.kv_blocks_free


def test_n_samples_equal_offline_generate(client, llm):
    prompt = "def "
    params = SamplingParams(n=3, temperature=0.9, top_k=40, seed=4321, max_tokens=24)
    (want,) = llm.generate([prompt], params)
    deltas = list(
        client.generate(
            prompt,
            n=3,
            temperature=0.9,
            top_k=40,
            seed=4321,
            max_tokens=24,
            return_token_ids=True,
            timeout=RPC_TIMEOUT_S,
        )
    )
    got = collect_completions(deltas)
    assert [c.index for c in got] == [w.index for w in want.outputs] == [0, 1, 2]
    for c, w in zip(got, want.outputs, strict=True):
        assert c.text == w.text, f"sample {c.index}"
        assert c.token_ids == w.token_ids, f"sample {c.index}"
        assert c.finish_reason == w.finish_reason, f"sample {c.index}"
    # Seeds seed, seed + 1, seed + 2: the samples are not copies of one another.
    assert len({tuple(c.token_ids) for c in got}) > 1


def test_abort_and_cancel_of_n_samples_return_kv_blocks(client):
    idle = wait_idle(client)
    common = dict(max_tokens=400, temperature=0, ignore_eos=True, n=4, timeout=RPC_TIMEOUT_S)
    # Abort RPC with the request's id: every sample ends with "abort".
    stream = client.generate("import ", request_id="abort-group", **common)
    finals = {}
    for n, delta in enumerate(stream):
        if n == 3:
            assert client.abort("abort-group", timeout=RPC_TIMEOUT_S)
        if delta.finish_reason:
            finals[delta.index] = delta.finish_reason
    assert finals == dict.fromkeys(range(4), "abort")
    assert wait_idle(client).kv_blocks_free == idle.kv_blocks_free
    # Client cancel: leave the stream after a few deltas.
    stream = client.generate("def ", **common)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    assert wait_idle(client).kv_blocks_free == idle.kv_blocks_free


BAD_INPUTS = [
    ("prompt", dict(prompt="")),
    ("prompt", dict(prompt="import os\n" * 400)),  # longer than max_model_len (512 tokens)
    ("prompt", dict(prompt="ab " * 1_000_000)),  # rejected before tokenizing (3 MB)
    ("max_tokens", dict(prompt="def ", max_tokens=0)),
    ("temperature", dict(prompt="def ", temperature=-1.0)),
    ("temperature", dict(prompt="def ", temperature=float("inf"))),
    ("top_p", dict(prompt="def ", top_p=0.0)),
    ("top_p", dict(prompt="def ", top_p=1.5)),
    ("top_k", dict(prompt="def ", top_k=-2)),
    ("prompt.token_ids", dict(prompt=[1, 2, 10**6])),  # outside the vocabulary
    ("stop[0]", dict(prompt="def ", stop=[""])),
]


@pytest.mark.parametrize(
    "field,kwargs", BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_invalid_argument_beside_a_running_stream(client, offline, field, kwargs):
    running = threading.Event()
    result = {}

    def run():
        deltas = []
        for d in client.generate(
            LONG_PROMPT, timeout=RPC_TIMEOUT_S, **_client_kwargs(LONG), ignore_eos=True
        ):
            deltas.append(d)
            running.set()
        result["deltas"] = deltas

    t = threading.Thread(target=run)
    t.start()
    assert running.wait(RPC_TIMEOUT_S)
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(prompt, timeout=RPC_TIMEOUT_S, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    t.join(RPC_TIMEOUT_S)
    assert result["deltas"][-1].finish_reason is not None
    assert "".join(d.text for d in result["deltas"]) == offline[-1].text


def test_server_info_counts_prefix_cache_lookups_and_hits(client):
    """A prompt sent twice: the first is looked up and misses, the second finds every
    full block of the first's but the block holding its last token (which is computed
    to sample from), as the engine's prefix-cache rule says."""
    info = wait_idle(client)
    bs = info.block_size
    prompt = [(7 * i) % 90 + 5 for i in range(3 * bs + 5)]  # token ids, 3 full blocks + 5
    before = client.server_info(timeout=RPC_TIMEOUT_S)
    list(client.generate(prompt, max_tokens=2, timeout=RPC_TIMEOUT_S))
    first = client.server_info(timeout=RPC_TIMEOUT_S)
    list(client.generate(prompt, max_tokens=2, timeout=RPC_TIMEOUT_S))
    second = client.server_info(timeout=RPC_TIMEOUT_S)
    assert first.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
    assert first.prefix_cache_hits == before.prefix_cache_hits
    assert second.prefix_cache_queries - first.prefix_cache_queries == len(prompt)
    assert second.prefix_cache_hits - first.prefix_cache_hits == (len(prompt) - 1) // bs * bs


def test_sigterm_stops_every_process_within_10_s(server):
    pids = [server.proc.pid, *server.children]
    elapsed = server.terminate(10)
    assert elapsed < 10
    deadline = time.monotonic() + 2
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]
