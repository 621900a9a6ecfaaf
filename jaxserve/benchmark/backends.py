"""One streamed request of a benchmark, timed: over gRPC (`Generate`) or over HTTP (the
OpenAI API's streamed POST /v1/completions, server-sent events).

Each backend returns a `RequestResult` with the times vLLM's benchmark_serving records:
the time to the first chunk that carries output (TTFT), the time of every later chunk (for
the inter-token latencies, one per chunk) and the whole latency, all from
`time.perf_counter()` around the call, plus the server's token counts. A failed request
(an RPC error, an HTTP status other than 200, a timeout) is a RequestResult with
success=False and the error's words; the backends raise nothing per request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc

from jaxserve.frontend.client import build_generate_request
from jaxserve.frontend.client_auth import ClientAuth
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

BACKENDS = ("grpc", "http")


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds: start is perf_counter() when the
    request was sent; ttft, latency and chunk_times are from start. chunk_times[0] is the
    first chunk with output (== ttft); chunk_tokens[i] the tokens chunk i carried (None
    where the backend does not say: HTTP). prompt_len and output_len are the server's
    counts (prompt_tokens, completion_tokens)."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] | None = None
    prompt_len: int = 0
    output_len: int = 0
    text: str = ""


@dataclass(slots=True)
class Sampling:
    """The sampling fields every benchmark request carries."""

    temperature: float = 0.0
    ignore_eos: bool = False


class GrpcBackend:
    """Requests over one grpc.aio channel (HTTP/2 multiplexes every stream on it)."""

    name = "grpc"

    def __init__(self, target: str, timeout_s: float, auth: ClientAuth | None = None) -> None:
        self.target, self.timeout_s = target, timeout_s
        self._auth = auth or ClientAuth()
        self._metadata = self._auth.metadata
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> GrpcBackend:
        self._channel = self._auth.aio_channel(self.target)
        self._stub = pb_grpc.JaxserveStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()

    async def send(self, prompt: str | list[int], max_tokens: int, sp: Sampling) -> RequestResult:
        req = build_generate_request(
            prompt, max_tokens=max_tokens, temperature=sp.temperature,
            ignore_eos=sp.ignore_eos, return_token_ids=True,
        )  # fmt: skip
        out = RequestResult(chunk_tokens=[])
        text = []
        out.start = time.perf_counter()
        try:
            async for resp in self._stub.Generate(
                req, timeout=self.timeout_s, metadata=self._metadata
            ):
                now = time.perf_counter() - out.start
                # Each field read of a protobuf message builds a new Python object (a
                # repeated field's container, a str): read each once.
                token_ids, delta = resp.token_ids, resp.text
                if token_ids or delta:
                    out.chunk_times.append(now)
                    out.chunk_tokens.append(len(token_ids))
                    text.append(delta)
                if resp.finish_reason:
                    out.prompt_len, out.output_len = resp.prompt_tokens, resp.completion_tokens
        except grpc.aio.AioRpcError as e:
            out.error = f"{e.code().name}: {e.details()}"
            return out
        out.latency = time.perf_counter() - out.start
        return _finish(out, "".join(text))


class HttpBackend:
    """Requests over aiohttp (a C HTTP parser, so the client takes little CPU from a
    server on the same machine), one kept-alive connection per request in flight."""

    name = "http"

    def __init__(self, base_url: str, timeout_s: float, auth: ClientAuth | None = None) -> None:
        self._auth = auth or ClientAuth()
        self.base_url, self.timeout_s = self._auth.url(base_url).rstrip("/"), timeout_s
        self._headers = self._auth.headers

    async def __aenter__(self) -> HttpBackend:
        try:
            import aiohttp
        except ImportError:
            raise RuntimeError(
                "backend: http needs aiohttp (pip install 'jaxserve[bench]')"
            ) from None
        self._aiohttp = aiohttp
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=self._auth.ssl_context() or True),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers=self._headers,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def send(self, prompt: str | list[int], max_tokens: int, sp: Sampling) -> RequestResult:
        body = {
            "prompt": prompt, "max_tokens": max_tokens, "temperature": sp.temperature,
            "ignore_eos": sp.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        out = RequestResult()
        text = []
        out.start = time.perf_counter()
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=body) as r:
                if r.status != 200:
                    out.error = f"HTTP {r.status}: {(await r.text())[:500]}"
                    return out
                async for line in r.content:  # one SSE line at a time
                    if not line.startswith(b"data: {"):
                        continue  # blank separators, comments and "data: [DONE]"
                    now = time.perf_counter() - out.start
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        out.chunk_times.append(now)
                        text.append(chunk["choices"][0]["text"])
                    if usage := chunk.get("usage"):
                        out.prompt_len = usage.get("prompt_tokens", 0)
                        out.output_len = usage.get("completion_tokens", 0)
        except (self._aiohttp.ClientError, TimeoutError) as e:
            out.error = f"{type(e).__name__}: {e}"
            return out
        out.latency = time.perf_counter() - out.start
        return _finish(out, "".join(text))


def _finish(out: RequestResult, text: str) -> RequestResult:
    out.text = text
    if not out.chunk_times:
        out.error = "the stream ended without output"
        return out
    out.ttft = out.chunk_times[0]
    out.success = True
    return out


def make_backend(name: str, server: str, timeout_s: float, auth: ClientAuth | None = None):
    """The backend called `name` ("grpc" or "http") for `server` (HOST:PORT; for http
    also a URL); `auth`: the server's TLS and API key. Raises ValueError naming backend
    for another name."""
    if name == "grpc":
        return GrpcBackend(server, timeout_s, auth)
    if name == "http":
        return HttpBackend(server, timeout_s, auth)
    raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {name!r}")
