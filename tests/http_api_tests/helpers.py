"""Shared by the HTTP API tests: constants, a plain HTTP client and the mock-engine server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from contextlib import contextmanager

from server_harness import ServerProcess

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


class Reply:
    """A plain HTTP answer (the stdlib client: raw requests need no other package)."""

    def __init__(self, status: int, data: bytes) -> None:
        self.status_code = status
        self.text = data.decode()

    def json(self):
        return json.loads(self.text)


def http_request(method: str, url: str, data: bytes | None = None, json_body=None) -> Reply:
    if json_body is not None:
        data = json.dumps(json_body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


@contextmanager
def sse_lines(url: str, body: dict):
    """The non-empty lines of a streamed answer, as they come."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        assert r.status == 200
        yield (line.decode().rstrip("\n") for line in r if line.strip())


def mock_server(model, start_delay_s: float = 0.0, extra=()) -> ServerProcess:
    """A `jaxserve serve --http-port 0` whose engine is tests/mock_engine.py (starts in
    about a second; `start_delay_s` more before it is ready), not waited for."""
    args = ("--engine-class", "mock_engine:MockEngineCore", "--http-port", "0", *extra)
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.005", "JAXSERVE_MOCK_START_DELAY_S": str(start_delay_s)}
    return ServerProcess(model, extra_args=args, env=env, start_timeout_s=60)


def post(srv, path, body):
    return http_request("POST", srv.http_url + path, json_body=body)
