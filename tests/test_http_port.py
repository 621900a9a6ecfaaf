"""What a vLLM user expects of the HTTP (OpenAI API) port, on one mock-engine server
(tests/mock_engine.py, started in about a second) with an API key and a chat template:

- `GET /metrics` on the API port is the --metrics-port exposition (the same registry:
  the same families, and the same counts once idle), and needs no API key (as vLLM's);
- every 400 names the exact field in `param` and at the start of its message, list
  indices included (`prompt[0]`, `prompt[1][1]`, `stream_options`, `top_logprobs`);
- a chat template sent with the request is refused (400 naming `chat_template`), as
  vLLM refuses it without --trust-request-chat-template, never silently ignored.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from email.message import Message

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, free_port

KEY = "test-key-1"
TIMEOUT_S = 60
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server(mock_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    template.write_text(CHATML)
    metrics_port = free_port()
    args = (
        "--engine-class", "mock_engine:MockEngineCore", "--http-port", "0",
        "--metrics-port", str(metrics_port), "--chat-template", str(template),
        "--api-key", KEY,
    )  # fmt: skip
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.002"}
    srv = ServerProcess(mock_model_dir, extra_args=args, env=env, start_timeout_s=TIMEOUT_S)
    srv.wait_ready()
    srv.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield srv
    srv.terminate(15) if srv.proc.poll() is None else srv.kill()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.http_url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S
    ) as c:
        yield c


def _get(url: str, key: str | None = None) -> tuple[int, Message, str]:
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def _post(server, path: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.http_url + path, data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _finished(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "jaxserve_request_success_total")


# ---------------------------------------------------------------- /metrics


def test_metrics_on_the_api_port_are_the_metrics_ports(server, client):
    status, headers, before = _get(server.http_url + "/metrics")  # no key: open, as vLLM's
    assert status == 200, before
    assert headers["Content-Type"].startswith("text/plain; version=")
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt="def ", max_tokens=5)
    assert got.choices[0].finish_reason == "length"
    # The frontend counts a finished request as its last output goes out: poll briefly.
    deadline = time.monotonic() + 10
    want = _finished(_samples(before)) + 1
    while _finished(_samples(_get(server.http_url + "/metrics")[2])) < want:
        assert time.monotonic() < deadline, "the request was not counted"
        time.sleep(0.05)
    api = _samples(_get(server.http_url + "/metrics")[2])
    port = _samples(_get(server.metrics_url)[2])
    assert {name for name, _ in api} == {name for name, _ in port}
    for key in api:  # counts of requests and tokens: one registry, so equal
        if key[0].startswith(("jaxserve_request_", "jaxserve_prompt_", "jaxserve_generation_")):
            assert api[key] == port[key], key
    assert _finished(api) == want


def test_the_api_key_still_guards_the_api(server):
    assert _get(server.http_url + "/v1/models")[0] == 401
    assert _get(server.http_url + "/v1/models", KEY)[0] == 200


# ---------------------------------------------------------------- field names in 400s

# (path, body, the field, words the message must hold)
BAD = [
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": "yes"},
     "stream_options", "JSON object"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}},
     "stream_options", "stream is true"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "boolean"),
    ("/v1/completions", {"prompt": [[]]}, "prompt[0]", "must not be empty"),
    ("/v1/completions", {"prompt": [1e30]}, "prompt[0]", "1e+30"),
    ("/v1/completions", {"prompt": [5, 2.5]}, "prompt[1]", "token id"),
    ("/v1/completions", {"prompt": [[5], [6, 1e30]]}, "prompt[1][1]", "1e+30"),
    ("/v1/completions", {"prompt": ["def ", 7]}, "prompt[1]", "string"),
    ("/v1/completions", {"prompt": {"text": "a"}}, "prompt", "an object"),
    ("/v1/completions", {"prompt": []}, "prompt", "must not be empty"),
    # A token id outside the vocabulary: its JSON path, not gRPC's "prompt.token_ids".
    ("/v1/completions", {"prompt": [[5, 6], [5, 10**6]]}, "prompt[1][1]", "outside the vocab"),
    ("/v1/completions", {"prompt": [1, 2, 99999999]}, "prompt[2]", "outside the vocab"),
    ("/v1/completions", {"prompt": [-1]}, "prompt[0]", "outside the vocab"),
    ("/v1/completions", {"prompt": ["def ", ""]}, "prompt[1]", "must not be empty"),
    # Both limits with different values: a 400 naming both, on either endpoint.
    ("/v1/completions", {"prompt": "a", "max_completion_tokens": 8}, "max_tokens",
     "differs from max_completion_tokens: 8"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 8},
     "max_completion_tokens", "differs from max_tokens: 4"),
    # Given alone, the limit's errors name it (the shared rule's words, its name).
    ("/v1/completions", {"prompt": "a", "max_tokens": None, "max_completion_tokens": 0},
     "max_completion_tokens", "must be >= 1, got 0"),
    # An integral float past 2**53 gets the count's range, not "must be an integer, got
    # a number (1e+16)" (test_a_huge_max_tokens_names_the_limit for max_tokens).
    ("/v1/completions", {"prompt": "a", "n": 1e16}, "n",
     "n: must be in [1, 128], got 10000000000000000"),
    # A huge one is abbreviated (1e300 echoed its 301 digits: session 25's trial).
    ("/v1/completions", {"prompt": "a", "n": 1e300}, "n",
     f"n: must be in [1, 128], got {str(int(1e300))[:12]}... (301 digits)"),
    # past int32: the message gives the upper end (it said ">= 1, got 2147483648").
    ("/v1/completions", {"prompt": "a", "top_k": 2**31}, "top_k",
     "top_k: must be -1 or 0 (disabled) or >= 1, at most 2147483647, got 2147483648"),
    ("/v1/completions", {"prompt": "a", "top_k": -1e300}, "top_k",
     f"got -{str(int(1e300))[:11]}... (301 digits)"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1e300}, "max_tokens",
     f"got {str(int(1e300))[:12]}... (301 digits)"),
    # ... throughout the message, not only at its start (it said "+ max_tokens (1000000)").
    ("/v1/completions", {"prompt": "a", "max_tokens": None, "max_completion_tokens": 10**6},
     "max_completion_tokens", "+ max_completion_tokens (1000000) exceeds max_model_len"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": None,
     "max_completion_tokens": 10**6}, "max_completion_tokens",
     "+ max_completion_tokens (1000000) exceeds max_model_len"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "21"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": []}, "stream_options",
     "JSON object"),
    ("/v1/chat/completions", {"messages": [CHAT[0], 5]}, "messages[1]", "JSON object"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}"},
     "chat_template", "--trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}},
     "chat_template_kwargs.chat_template", "--trust-request-chat-template"),
    # A value named by its key or index, as a type error names it (these were "logit_bias"
    # and "stop", the message saying which one).
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias.1",
     "must be in [-100, 100], got 101"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 5, "7": -1e39}}, "logit_bias.7",
     "float32"),
    ("/v1/completions", {"prompt": "a", "stop": ["x" * 257]}, "stop[0]", "257 characters"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["ok", ""]}, "stop[1]", "non-empty"),
    # Token ids too, whatever is wrong with them (a range error said "stop_token_ids" and
    # "logit_bias" where a type error named the index or key: session 18's trial).
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [3, -5]}, "stop_token_ids[1]",
     "-5"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [99999]}, "stop_token_ids[0]",
     "99999"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"999999": 1}}, "logit_bias.999999",
     "999999"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias.x",
     "not a token id"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body,field,words", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_field_names_the_exact_field(server, path, body, field, words):
    status, answer = _post(server, path, {"max_tokens": 4, **body})
    error = answer["error"]
    assert status == 400, answer
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}: "), error
    assert words in error["message"], error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_huge_max_tokens_names_the_limit(server, path, field):
    """max_tokens: 1e16 (an integer, written as a float past 2**53) was "must be an
    integer, got a number (1e+16)" (fresh-user trial); now the range and the model length
    it comes from, as for 10**16 written out."""
    status, _, models = _get(server.http_url + "/v1/models", KEY)
    max_model_len = json.loads(models)["data"][0]["max_model_len"]
    first = {"prompt": "a"} if path == "/v1/completions" else {"messages": CHAT}
    for written in (1e16, 10**16):
        status, answer = _post(server, path, {**first, "max_tokens": None, field: written})
        assert status == 400, answer
        assert answer["error"]["param"] == field
        assert answer["error"]["message"] == (
            f"{field}: must be within [1, {max_model_len - 1}] (prompt + {field} <= "
            f"max_model_len {max_model_len}), got 10000000000000000"
        )


def test_a_bodys_bytes_are_read_as_vllm_reads_them(server):
    """UTF-16 is read (json.loads(bytes) takes it, as vLLM's FastAPI does); a Latin-1
    body is a 400 that names the charset its Content-Type gave, which is not read."""
    text = '{"prompt": "caf\u00e9", "max_tokens": 2}'
    answers = []
    for body, charset in ((text.encode("utf-16"), "utf-16"), (text.encode("latin-1"), "latin-1")):
        req = urllib.request.Request(server.http_url + "/v1/completions", data=body, method="POST")
        req.add_header("Content-Type", f"application/json; charset={charset}")
        req.add_header("Authorization", f"Bearer {KEY}")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                answers.append((r.status, json.loads(r.read())))
        except urllib.error.HTTPError as e:
            answers.append((e.code, json.loads(e.read())))
    (status, utf16), (latin1_status, latin1) = answers
    assert status == 200 and utf16["usage"]["completion_tokens"] == 2, utf16
    assert latin1_status == 400 and latin1["error"]["param"] == "body", latin1
    assert "charset=latin-1 is not read: JSON is UTF-8" in latin1["error"]["message"]


def test_max_tokens_and_max_completion_tokens_of_one_value_are_taken(client):
    model = client.models.list().data[0].id
    both = {"max_tokens": 3, "max_completion_tokens": 3}
    got = client.completions.create(model=model, prompt="a", extra_body=both)
    assert got.usage.completion_tokens == 3
    got = client.chat.completions.create(model=model, messages=CHAT, extra_body=both)
    assert got.usage.completion_tokens == 3


def test_max_completion_tokens_alone_binds_on_both_endpoints(client):
    """OpenAI's newer name is honoured by /v1/completions too (vLLM's completions ignore
    it and generate their default 16): a client that sends it gets that many tokens."""
    model = client.models.list().data[0].id
    for limit in (3, 5):  # neither is the default
        alone = {"max_completion_tokens": limit}
        got = client.completions.create(model=model, prompt="a", extra_body=alone)
        assert got.usage.completion_tokens == limit
        got = client.chat.completions.create(model=model, messages=CHAT, extra_body=alone)
        assert got.usage.completion_tokens == limit


def test_a_long_request_template_is_refused_and_the_servers_is_used(server, client):
    # Whatever its length (up to the body limit), never compiled: refused before rendering.
    status, answer = _post(
        server, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ x }}" * 100_000}
    )
    assert status == 400 and answer["error"]["param"] == "chat_template", answer
    model = client.models.list().data[0].id
    got = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3)
    assert got.choices[0].finish_reason == "length"
    assert "Traceback" not in server.log()


# ---------------------------------------------------------------- vLLM / OpenAI compatibility


def test_top_k_0_means_all_tokens_as_in_vllm(server, client):
    # A 400 ("must be -1 (disabled) or >= 1") before; vLLM takes 0 or -1 for "disabled".
    model = client.models.list().data[0].id
    for top_k in (0, -1):
        got = client.completions.create(
            model=model, prompt="a", max_tokens=2, extra_body={"top_k": top_k}
        )
        assert got.usage.completion_tokens == 2
    status, answer = _post(server, "/v1/completions", {"prompt": "a", "top_k": -2})
    assert status == 400 and answer["error"]["param"] == "top_k", answer
    assert "-1 or 0 (disabled) or >= 1" in answer["error"]["message"]


def test_retrieve_model_and_its_created_time(server, client):
    started = time.time()
    (listed,) = client.models.list().data
    got = client.models.retrieve(listed.id)  # was a 404: /v1/models/{id} was not served
    assert got.id == listed.id and got.object == "model" and got.owned_by == "jaxserve"
    # `created` was 0: now the server's start, a unix time before this test began.
    assert got.created == listed.created and 0 < started - got.created < 3600
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("not-" + listed.id)
    error = e.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert error["message"] == (
        f"model: the model 'not-{listed.id}' does not exist (this server serves '{listed.id}')"
    )
    assert _get(server.http_url + f"/v1/models/{listed.id}")[0] == 401  # the key guards it
