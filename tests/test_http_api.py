"""The OpenAI-compatible HTTP API, with the official `openai` client as the client.

Most tests talk to one live `jaxserve serve --http-port 0` on the bundled demo model (a
ChatML chat template given with --chat-template) and check it against the gRPC API of the
same server and against the offline `LLM.generate` on the same engine settings; the chat
prompt is rendered independently by transformers' apply_chat_template. What needs another
server (no chat template, an engine still starting, a dead engine) runs on the mock
engine (tests/mock_engine.py), which starts in a second.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import grpc
import openai
import pytest
from server_harness import DEMO_ENGINE, ServerProcess, free_port, serve_flags

from jaxserve import SamplingParams
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.client import JaxserveClient

pytestmark = pytest.mark.slow

TIMEOUT_S = 120
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPTS = ["import ", "def ", "class Foo(", "for i in range("]
CHAT = [
    {"role": "system", "content": "You complete Python."},
    {"role": "user", "content": "def add(a, b):"},
]
LONG = dict(prompt="class ", max_tokens=160, temperature=0, extra_body={"ignore_eos": True})


class _Reply:
    """A plain HTTP answer (the stdlib client: raw requests need no other package)."""

    def __init__(self, status: int, data: bytes) -> None:
        self.status_code = status
        self.text = data.decode()

    def json(self):
        return json.loads(self.text)


def _http(method: str, url: str, data: bytes | None = None, json_body=None) -> _Reply:
    if json_body is not None:
        data = json.dumps(json_body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return _Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        return _Reply(e.code, e.read())


@contextmanager
def _sse_lines(url: str, body: dict):
    """The non-empty lines of a streamed answer, as they come."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        assert r.status == 200
        yield (line.decode().rstrip("\n") for line in r if line.strip())


@pytest.fixture(scope="module")
def llm(demo_llm):
    """The offline reference; built first so that the server starts on a warm cache."""
    return demo_llm


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(CHATML)
    return path


@pytest.fixture(scope="module")
def server(llm, template_file):
    metrics_port = free_port()
    flags = serve_flags(DEMO_ENGINE)
    flags += ("--http-port", "0", "--chat-template", str(template_file))
    flags += ("--metrics-port", str(metrics_port))
    srv = ServerProcess(DEMO_MODEL_DIR, extra_args=flags, start_timeout_s=600).wait_ready()
    srv.metrics_port = metrics_port
    yield srv
    srv.terminate(15) if srv.proc.poll() is None else None


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
    ) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with JaxserveClient(server.target) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client):
    (model,) = client.models.list().data
    return model.id


def _wait_idle(grpc_client, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        info = grpc_client.server_info(timeout=TIMEOUT_S)
        if (
            info.num_running == info.num_waiting == 0
            and info.kv_blocks_free == info.kv_blocks_total
        ):
            return info
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {info}"
        time.sleep(0.05)


# ---------------------------------------------------------------- small endpoints


def test_models_health_version(server, client, model_name):
    assert model_name == DEMO_MODEL_DIR.name
    card = client.models.list().data[0]
    assert card.owned_by == "jaxserve" and card.model_extra["max_model_len"] == 512
    assert _http("GET", server.http_url + "/health").status_code == 200
    from importlib.metadata import version

    assert _http("GET", server.http_url + "/version").json() == {"version": version("jaxserve")}


# ---------------------------------------------------------------- same text, three paths


def test_greedy_completions_equal_grpc_and_offline(client, grpc_client, llm, model_name):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    offline = llm.generate(PROMPTS, params)
    # One request with four prompts (choice i is prompt i), and one streamed per prompt.
    batch = client.completions.create(
        model=model_name, prompt=PROMPTS, temperature=0, max_tokens=24,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    prompt_ids = [len(o.prompt_token_ids) for o in offline]
    assert batch.usage.prompt_tokens == sum(prompt_ids)
    assert batch.usage.completion_tokens == 24 * len(PROMPTS)
    assert batch.usage.total_tokens == sum(prompt_ids) + 24 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        want = offline[i]
        assert batch.choices[i].text == want.text, prompt
        assert batch.choices[i].finish_reason == "length"
        grpc_text = "".join(
            d.text
            for d in grpc_client.generate(
                prompt, max_tokens=24, temperature=0, ignore_eos=True, timeout=TIMEOUT_S
            )
        )
        assert grpc_text == want.text, prompt
        chunks = list(
            client.completions.create(
                model=model_name, prompt=prompt, temperature=0, max_tokens=24, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, prompt
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1]
        assert usage.choices == [] and usage.usage.completion_tokens == 24
        assert usage.usage.prompt_tokens == prompt_ids[i]
        assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_equals_text_prompt(client, llm, model_name):
    ids = llm.get_tokenizer().encode("def ").ids
    by_ids = client.completions.create(model=model_name, prompt=ids, temperature=0, max_tokens=8)
    by_text = client.completions.create(
        model=model_name, prompt="def ", temperature=0, max_tokens=8
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_equals_offline_on_transformers_rendering(client, llm, model_name):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ids = list(
        hf.apply_chat_template(
            CHAT, chat_template=CHATML, add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
    )  # fmt: skip
    (want,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    got = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_completion_tokens=20,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=CHAT, temperature=0, max_tokens=20, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_default_max_tokens_is_the_room_left(client, model_name):
    # Unset max_tokens: up to max_model_len (512) - prompt; ignore_eos runs to it.
    got = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens + got.usage.completion_tokens == 512


# ---------------------------------------------------------------- sampling fields


def test_n_samples_equal_offline(client, llm, model_name):
    params = SamplingParams(n=3, temperature=0.9, top_k=40, seed=4321, max_tokens=16)
    (want,) = llm.generate(["def "], params)
    got = client.completions.create(
        model=model_name, prompt="def ", n=3, temperature=0.9, seed=4321, max_tokens=16,
        extra_body={"top_k": 40},
    )  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert len({c.text for c in got.choices}) > 1
    # Streamed, with two prompts: choice i * n + j is sample j of prompt i.
    chunks = list(
        client.completions.create(
            model=model_name, prompt=["def ", "def "], n=3, temperature=0.9, seed=4321,
            max_tokens=16, stream=True, extra_body={"top_k": 40},
        )
    )  # fmt: skip
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == list(range(6))
    assert [texts[i] for i in range(6)] == [o.text for o in want.outputs] * 2


def test_stop_string_and_stop_token(client, llm, model_name):
    params = SamplingParams(temperature=0, max_tokens=60, stop=["):"])
    (want,) = llm.generate(["def "], params)
    got = client.completions.create(
        model=model_name, prompt="def ", temperature=0, max_tokens=60, stop="):"
    )
    choice = got.choices[0]
    assert choice.text == want.text and "):" not in choice.text
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "):"
    # A stop token id (vLLM's extra): the first token greedy decoding makes.
    first = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    got = client.completions.create(
        model=model_name, prompt="def ", temperature=0, max_tokens=10,
        extra_body={"stop_token_ids": [first]},
    )  # fmt: skip
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == first
    assert got.choices[0].text == ""


def test_logprobs_equal_offline(client, llm, model_name):
    (want,) = llm.generate(["import "], SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    tok = llm.get_tokenizer()
    got = client.completions.create(
        model=model_name, prompt="import ", temperature=0, max_tokens=6, logprobs=3
    ).choices[0]
    lp = got.logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([e[0] for e in want.outputs[0].logprobs], abs=1e-5)
    for top, ref in zip(lp.top_logprobs, want.outputs[0].logprobs, strict=True):
        assert len(top) == len({tok.decode([t], skip_special_tokens=False) for t, _ in ref[1]})
        assert max(top.values()) == pytest.approx(ref[1][0][1], abs=1e-5)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == got.text
    # Chat: logprobs + top_logprobs, each entry with its bytes.
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_tokens=4, logprobs=True,
        top_logprobs=2,
    ).choices[0]  # fmt: skip
    content = chat.logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == chat.message.content
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy
        assert bytes(e.bytes) == e.token.encode()


def test_completion_top_logprobs_hold_the_sampled_token():
    # OpenAI's legacy completions and vLLM: a sampled token outside the N most likely is
    # added to its position's top_logprobs (N + 1 entries); chat keeps exactly N.
    from jaxserve.frontend.http.outputs import chat_logprobs, completion_logprobs
    from jaxserve.ipc import TextOutput

    texts = {1: "a", 2: "b", 3: "c"}.__getitem__
    out = TextOutput(
        "r", "ca", [3, 1], logprobs=[[-2.0, [[1, -0.5], [2, -1.0]]], [-0.5, [[1, -0.5], [2, -1.0]]]]
    )
    lp = completion_logprobs([out], texts, 0)
    assert lp["top_logprobs"] == [{"a": -0.5, "b": -1.0, "c": -2.0}, {"a": -0.5, "b": -1.0}]
    assert list(lp["top_logprobs"][0]) == ["a", "b", "c"]  # most likely first
    content = chat_logprobs([out], texts)["content"]
    assert [len(e["top_logprobs"]) for e in content] == [2, 2]


# ---------------------------------------------------------------- cancellation


def _aborted(server) -> float:
    """Samples counted as finished with reason "abort" (the server's metrics)."""
    text = _http("GET", f"http://127.0.0.1:{server.metrics_port}/metrics").text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("jaxserve_request_success_total{") and 'finish_reason="abort"' in line
    )


def _wait_running(grpc_client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while grpc_client.server_info(timeout=TIMEOUT_S).num_running == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)


def test_disconnect_mid_stream_returns_kv_blocks(server, client, grpc_client, model_name):
    idle = _wait_idle(grpc_client)
    aborted = _aborted(server)
    stream = client.completions.create(
        model=model_name, prompt="import ", temperature=0, max_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for n, _ in enumerate(stream):
        if n == 3:
            break
    assert grpc_client.server_info(timeout=TIMEOUT_S).num_running == 1
    stream.close()  # closes the connection
    assert _wait_idle(grpc_client).kv_blocks_free == idle.kv_blocks_free
    assert _aborted(server) == aborted + 1  # cancelled, not run to its end
    # A client that leaves while waiting for a whole (non-streamed) answer cancels it too:
    # every one of its n samples.
    body = json.dumps(
        {"messages": CHAT, "max_tokens": 450, "n": 4, "ignore_eos": True, "temperature": 0}
    ).encode()
    host, port = server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        _wait_running(grpc_client)
    assert _wait_idle(grpc_client).kv_blocks_free == idle.kv_blocks_free
    assert _aborted(server) == aborted + 1 + 4


# ---------------------------------------------------------------- errors


def _grpc_details(grpc_client, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate(timeout=TIMEOUT_S, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details()


# (field, completions kwargs, the same request over gRPC or None)
BAD = [
    ("prompt", dict(prompt=""), dict(prompt="")),
    ("prompt", dict(prompt="import os\n" * 400), dict(prompt="import os\n" * 400)),
    ("max_tokens", dict(max_tokens=0), dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=600), dict(max_tokens=600)),
    ("temperature", dict(temperature=-1.0), dict(temperature=-1.0)),
    ("top_p", dict(top_p=1.5), dict(top_p=1.5)),
    ("top_k", dict(extra_body={"top_k": -2}), dict(top_k=-2)),
    ("min_p", dict(extra_body={"min_p": 2.0}), dict(min_p=2.0)),
    ("presence_penalty", dict(presence_penalty=3.0), dict(presence_penalty=3.0)),
    ("frequency_penalty", dict(frequency_penalty=-3.0), dict(frequency_penalty=-3.0)),
    ("repetition_penalty", dict(extra_body={"repetition_penalty": 0.0}), None),
    ("n", dict(n=0), dict(n=0)),
    ("n", dict(n=129), dict(n=129)),
    ("logprobs", dict(logprobs=21), dict(logprobs=21)),
    ("stop[0]", dict(stop=[""]), dict(stop=[""])),
    ("logit_bias", dict(logit_bias={"100000": 1.0}), None),
    ("logit_bias", dict(logit_bias={"abc": 1.0}), None),
    ("stop_token_ids", dict(extra_body={"stop_token_ids": [10**6]}), None),
    # Named by its JSON path in the body (gRPC says "prompt.token_ids").
    ("prompt[2]", dict(prompt=[1, 2, 10**6]), None),
    ("temperature", dict(extra_body={"temperature": "hot"}), None),
    ("echo", dict(echo=True), None),
    ("seed", dict(seed=2**70), None),
]


@pytest.mark.parametrize(
    "field,kwargs,grpc_kwargs", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_field_is_400_beside_a_running_stream(
    client, grpc_client, llm, model_name, field, kwargs, grpc_kwargs
):
    (want,) = llm.generate(
        [LONG["prompt"]], SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    )
    running = threading.Event()
    result = {}

    def run():
        text = ""
        for chunk in client.completions.create(model=model_name, stream=True, **LONG):
            text += chunk.choices[0].text
            running.set()
        result["text"] = text

    t = threading.Thread(target=run)
    t.start()
    assert running.wait(TIMEOUT_S)
    request = {"prompt": "def ", "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, **request)
    error = err.value.body
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}:"), error
    assert error["type"] == "invalid_request_error"
    if grpc_kwargs is not None:  # the same words as gRPC's INVALID_ARGUMENT
        g = {"prompt": "def ", "max_tokens": 8, **grpc_kwargs}
        assert _grpc_details(grpc_client, **g) == error["message"]
    t.join(TIMEOUT_S)
    assert result["text"] == want.text


CHAT_BAD = [
    ("messages", dict(messages=[])),
    ("messages[0].role", dict(messages=[{"content": "hi"}])),
    (
        "messages[0].content[0]",
        dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    ),
    ("top_logprobs", dict(messages=CHAT, logprobs=True, top_logprobs=21)),
    ("top_logprobs", dict(messages=CHAT, top_logprobs=2)),
    ("max_completion_tokens", dict(messages=CHAT, max_completion_tokens=0)),
    ("messages", dict(messages=[{"role": "user", "content": "import os\n" * 400}])),
    ("response_format", dict(messages=CHAT, response_format={"type": "json_object"})),
]


@pytest.mark.parametrize(
    "field,kwargs", CHAT_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(CHAT_BAD)]
)
def test_bad_chat_field_is_400(client, model_name, field, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, max_tokens=4, **kwargs)
    assert err.value.body["param"] == field, err.value.body


def test_unknown_model_is_404_unknown_fields_are_ignored(server, client, model_name):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-5", prompt="def ", max_tokens=2)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    got = client.completions.create(
        model=model_name, prompt="def ", max_tokens=2, extra_body={"no_such_field": [1, 2]}
    )
    assert got.choices[0].finish_reason is not None
    assert "Traceback" not in server.log()


# ---------------------------------------------------------------- other servers (mock engine)


def _mock_server(model, start_delay_s: float = 0.0, extra=()) -> ServerProcess:
    args = ("--engine-class", "mock_engine:MockEngineCore", "--http-port", "0", *extra)
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.005", "JAXSERVE_MOCK_START_DELAY_S": str(start_delay_s)}
    return ServerProcess(model, extra_args=args, env=env, start_timeout_s=60)


def _post(srv, path, body):
    return _http("POST", srv.http_url + path, json_body=body)


def _raw_post_head(url: str, content_length: int, first_bytes: bytes) -> tuple[int, dict]:
    """POST headers announcing `content_length` bytes and only `first_bytes` of them;
    returns the status and JSON body of the answer (sent before the rest of the body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % content_length + first_bytes
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(
            line.split(b":")[1] for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ))  # fmt: skip
        while len(body) < length:
            body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def test_body_over_limit_is_413_and_bad_json_is_400(mock_model_dir):
    srv = _mock_server(mock_model_dir).wait_ready()
    try:
        status, body = _raw_post_head(srv.http_url, 32 * 1024 * 1024 + 1, b'{"prompt": "')
        assert status == 413 and body["error"]["code"] == "request_too_large"
        r = _http("POST", srv.http_url + "/v1/completions", b'{"prompt": ')
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = _http("POST", srv.http_url + "/v1/completions", b'{"prompt": "\\ud800"}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        assert r.json()["error"]["message"].startswith("body: not valid JSON in UTF-8")
        r = _http("GET", srv.http_url + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        # JSON sent as text/plain: refused as vLLM refuses it, not read as JSON.
        req = urllib.request.Request(
            srv.http_url + "/v1/completions", data=b'{"prompt": "a"}', method="POST",
            headers={"Content-Type": "text/plain"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=TIMEOUT_S)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and error["code"] == "unsupported_media_type", error
        assert "'text/plain'" in error["message"]
        assert "Traceback" not in srv.log()
    finally:
        srv.terminate(15)


def test_no_chat_template_is_400_and_starting_engine_is_503(mock_model_dir):
    srv = _mock_server(mock_model_dir, start_delay_s=3.0)
    try:
        r = _post(srv, "/v1/completions", {"prompt": "def ", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"].startswith("engine unavailable: ")
        assert _http("GET", srv.http_url + "/health").status_code == 503
        srv.wait_ready()
        assert _http("GET", srv.http_url + "/health").status_code == 200
        r = _post(srv, "/v1/chat/completions", {"messages": CHAT})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        assert "chat template" in r.json()["error"]["message"]
    finally:
        srv.terminate(15)


def test_engine_death_ends_streams_and_answers_503(mock_model_dir):
    srv = _mock_server(mock_model_dir).wait_ready()
    try:
        body = {"prompt": "def ", "max_tokens": 3000, "stream": True, "extra": 1}
        body["ignore_eos"] = True
        events = []
        with _sse_lines(srv.http_url + "/v1/completions", body) as lines:
            for line in lines:
                events.append(line)
                if len(events) == 3:
                    srv.kill_child("jaxserve.engine.process")
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["message"].startswith("engine unavailable: ")
        r = _post(srv, "/v1/completions", {"prompt": "def "})
        assert r.status_code == 503
    finally:
        srv.kill()


def test_sigterm_with_an_open_stream_ends_it_and_stops_within_10_s(mock_model_dir):
    """A stream still open after the shutdown grace ends as one whose engine died: an
    error event saying the server is shutting down, then `data: [DONE]` (it used to be
    cut, curl rc 18, with uvicorn's 40-line CancelledError traceback in the log)."""
    import signal

    srv = _mock_server(mock_model_dir).wait_ready()
    try:
        body = {"prompt": "def ", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        lines = []
        with _sse_lines(srv.http_url + "/v1/completions", body) as stream:
            for line in stream:
                lines.append(line)
                if len(lines) == 4:
                    start = time.monotonic()
                    srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(10)
        assert time.monotonic() - start < 10
        assert srv.proc.returncode == 0
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"], error
        assert "Traceback" not in srv.log() and "Exception in ASGI" not in srv.log(), srv.log()
    finally:
        srv.kill() if srv.proc.poll() is None else None


# ---------------------------------------------------------------- the stream chunk fast path


@pytest.mark.parametrize("chat", [False, True])
def test_fast_path_chunks_equal_the_generic_ones(chat):
    from jaxserve.frontend.http.outputs import ResponseWriter
    from jaxserve.ipc import TextOutput

    writer = ResponseWriter("id-1", 'demo "model"', chat=chat, logprobs=False, texts=None)
    cases = [
        [TextOutput("e", 'he said "hi"\n', [5])],
        [TextOutput("e", "ü", [6]), TextOutput("e", "€ \u2028", [7, 8])],
        [TextOutput("e", "", [9], finish_reason="stop", stop_reason="):")],
        [TextOutput("e", "x", [9], finish_reason="stop", stop_reason=17)],
        [TextOutput("e", "", [], finish_reason="length")],
    ]
    for outputs in cases:
        for include_usage in (False, True):
            text = "".join(o.text for o in outputs)
            want = writer._chunk(3, outputs, text, first=False)
            if include_usage:
                want["usage"] = None
            event = writer.event(3, outputs, first=False, include_usage=include_usage)
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            assert json.loads(event[6:]) == want
