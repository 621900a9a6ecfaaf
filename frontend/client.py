"""A small synchronous Python client for the jaxserve gRPC API.

    from jaxserve.frontend.client import JaxserveClient

    with JaxserveClient("127.0.0.1:50051") as client:
        for delta in client.generate("def open(", max_tokens=32, temperature=0):
            print(delta.text, end="", flush=True)

With n > 1 the deltas of the n samples interleave; `delta.index` says whose, and
`client.complete(...)` gathers them into one `Completion` per sample:

        for c in client.complete("def ", n=4, temperature=0.8, seed=7, max_tokens=32):
            print(c.index, repr(c.text), c.finish_reason)

Errors are `grpc.RpcError` (`.code()`, `.details()`): INVALID_ARGUMENT names the bad
field; UNAVAILABLE means the engine is starting or gone; RESOURCE_EXHAUSTED means the
request message is over the server's 32 MiB limit (`server.MAX_RECEIVE_MESSAGE_BYTES`).
A target that answers HTTP/1 (serve's --http-port or --metrics-port, not its gRPC --port)
raises `NotGrpcServerError`, an UNAVAILABLE RpcError whose message names the target.
Leaving the `generate` loop early cancels the call, which aborts the request (every
sample) in the engine and frees its request_id for a new request at once.

A server started with `--tls-cert/--tls-key` (and `--api-key`) is reached with the
matching options (frontend/auth.py): `tls=True` (the system's root certificates) or
`tls_ca_cert="ca.pem"`, `tls_cert`/`tls_key` for mutual TLS, `api_key="..."` (sent as
`authorization: Bearer KEY`, the OpenAI convention, on every call):

    with JaxserveClient("host:50051", tls_ca_cert="ca.pem", api_key=key) as client: ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.frontend import server_address
from jaxserve.frontend.client_auth import ClientAuth
from jaxserve.frontend.generate_request import build_generate_request
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

# gRPC's words when an HTTP/1 server answered: one with a status line (uvicorn, serve's
# --http-port), or http.server's bare error page (prometheus_client, --metrics-port).
_HTTP1 = ("http1.x server", "Expected SETTINGS frame")


def http1_hint(target: str, who: str) -> str:
    """What to do when `target` answered HTTP/1: `who` ("generate") speaks gRPC."""
    return (
        f"{target} looks like an HTTP/1 server: the HTTP API or metrics port? "
        f"{who} speaks gRPC: give serve's --port"
    )


class NotGrpcServerError(grpc.RpcError):
    """`target` answered as an HTTP/1 server (serve's --http-port or --metrics-port),
    not gRPC. An RpcError (code() UNAVAILABLE, details() gRPC's own words), so that a
    caller catching RpcError still catches it; str() names the target and the fix."""

    def __init__(self, target: str, details: str) -> None:
        super().__init__(http1_hint(target, "JaxserveClient"))
        self.target = target
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def answered_http1(error: grpc.RpcError) -> bool:
    """Whether gRPC failed `error` (a call's: it has code() and details()) because an
    HTTP/1 server answered."""
    details = error.details() or ""
    return error.code() == grpc.StatusCode.UNAVAILABLE and any(w in details for w in _HTTP1)


@dataclass(slots=True)
class GenerateDelta:
    """One streamed response of one sample. finish_reason is None until the sample's last
    one ("stop", "length", "abort"); stop_reason is the matched stop string or stop token
    id; the token counts are set on the last one. index: the sample, in [0, n)."""

    request_id: str
    text: str
    token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Per new token: (token id, its logprob, [(top token id, logprob), ...]).
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # Per prompt token from the second on, in the same form (only with prompt_logprobs).
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


@dataclass(slots=True)
class Completion:
    """One sample's whole output, gathered from its deltas (vLLM's CompletionOutput).

    request_id: the request's id (the one the server assigned when the caller set none).
    token_ids are empty unless the request set return_token_ids; logprobs and
    prompt_logprobs are as in GenerateDelta (prompt_logprobs only on sample 0).
    """

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


def collect_completions(deltas: Iterable[GenerateDelta]) -> list[Completion]:
    """The deltas of one request (any number of samples, interleaved) gathered into one
    Completion per sample, ordered by index."""
    by_index: dict[int, Completion] = {}
    for d in deltas:
        c = by_index.setdefault(d.index, Completion(d.request_id, d.index))
        c.text += d.text
        c.token_ids += d.token_ids
        if d.logprobs:
            c.logprobs = (c.logprobs or []) + d.logprobs
        if d.prompt_logprobs:
            c.prompt_logprobs = (c.prompt_logprobs or []) + d.prompt_logprobs
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            c.prompt_tokens, c.completion_tokens = d.prompt_tokens, d.completion_tokens
    return [by_index[i] for i in sorted(by_index)]


@dataclass(slots=True)
class ServerInfo:
    model: str
    max_model_len: int
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_running: int
    num_waiting: int
    vocab_size: int
    kv_bytes_per_token: int = 0
    kv_layout: str = ""
    # Step shapes still compiling in the background (below steady-state speed until 0).
    warmup_pending_shapes: int = 0
    # Prompt tokens looked up in the prefix cache since start, and those found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # With `serve --replicas N`: one dict per replica, the fields of the proto's
    # `ReplicaInfo` (replica, state, reason, KV blocks, requests, router load, ...).
    replicas: list[dict] = field(default_factory=list)


def _logprobs(entries) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
    """Repeated TokenLogprob -> [(token id, logprob, [(top id, logprob), ...])], None if empty."""
    out = [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in entries]
    return out or None


def _delta(resp: pb.GenerateResponse) -> GenerateDelta:
    kind = resp.WhichOneof("matched_stop")
    return GenerateDelta(
        request_id=resp.request_id,
        text=resp.text,
        token_ids=list(resp.token_ids),
        index=resp.index,
        finish_reason=resp.finish_reason or None,
        stop_reason=getattr(resp, kind) if kind else None,
        prompt_tokens=resp.prompt_tokens,
        completion_tokens=resp.completion_tokens,
        logprobs=_logprobs(resp.logprobs),
        prompt_logprobs=_logprobs(resp.prompt_logprobs),
    )


class JaxserveClient:
    """Blocking client over one channel; thread-safe (one channel, many calls).

    Args:
        target: the server's host:port ("[::1]:50051" for IPv6).
        tls, tls_ca_cert, tls_cert, tls_key, api_key: how to reach a server with TLS
            and an API key (`client_auth.ClientAuth`, which documents each).

    Raises:
        ValueError: naming the option, for a file that cannot be read, a tls_cert
            without tls_key (or the reverse), a target port outside [1, 65535], or an
            http(s):// URL as the target (`server_address.grpc_target_error`).
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        tls: bool = False,
        tls_ca_cert: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        api_key: str | None = None,
    ) -> None:
        server_address.check("target", target)
        self._target = target
        auth = ClientAuth(tls, tls_ca_cert, tls_cert, tls_key, api_key)
        self._channel = auth.channel(target)
        self._metadata = auth.metadata
        self._stub = pb_grpc.JaxserveStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **params
    ) -> Iterator[GenerateDelta]:
        """Stream the completion of `prompt` as deltas; the last has finish_reason. With
        n > 1 the samples' deltas interleave (see `GenerateDelta.index`); each sample's
        last delta has finish_reason, and the stream ends after all n.

        params: the keyword arguments of `build_generate_request` (max_tokens,
            temperature, top_k, top_p, seed, stop, ...). timeout: seconds for the call.
        Raises grpc.RpcError on a bad request (INVALID_ARGUMENT) or a dead engine,
        NotGrpcServerError when the target is an HTTP/1 port.
        """
        call = self._stub.Generate(
            build_generate_request(prompt, **params), timeout=timeout, metadata=self._metadata
        )
        try:
            with self._naming_http1():
                for resp in call:
                    yield _delta(resp)
        finally:
            call.cancel()  # a no-op after the stream ended; aborts it if the caller left

    def complete(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **params
    ) -> list[Completion]:
        """Run `generate` to the end; returns one Completion per sample (n of them, by
        index), each carrying the request_id (the server's, if none was given). Same
        arguments and errors as `generate`."""
        return collect_completions(self.generate(prompt, timeout=timeout, **params))

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running request (every sample of it); returns False if no such request
        was running."""
        with self._naming_http1():
            return self._stub.Abort(
                pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self._metadata
            ).found

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        with self._naming_http1():
            info = self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=timeout, metadata=self._metadata
            )
        fields = {f: getattr(info, f) for f in ServerInfo.__slots__ if f != "replicas"}
        replicas = [
            {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields} for r in info.replicas
        ]
        return ServerInfo(**fields, replicas=replicas)

    def is_serving(self, *, timeout: float | None = 5.0) -> bool:
        """True if the health service says SERVING (False if unreachable). Raises
        NotGrpcServerError when the target is an HTTP/1 port: it never will be."""
        return self._health_check(timeout)[0]

    def _health_check(self, timeout: float | None) -> tuple[bool, str | None]:
        """(SERVING?, why not: gRPC's status and details, or the health status)."""
        try:
            with self._naming_http1():
                resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except NotGrpcServerError:
            raise
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return True, None
        return False, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_serving(self, timeout: float) -> None:
        """Block until the server is SERVING. Raises TimeoutError after `timeout` seconds,
        saying the last answer (e.g. "UNAVAILABLE: ... Connection refused": nothing
        listens there; "NOT_SERVING": the engine is not ready)."""
        deadline = time.monotonic() + timeout
        while True:
            serving, why = self._health_check(max(0.1, min(2.0, deadline - time.monotonic())))
            if serving:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"server not SERVING within {timeout} s (last answer: {why})")
            time.sleep(0.2)

    @contextlib.contextmanager
    def _naming_http1(self) -> Iterator[None]:
        """gRPC's UNAVAILABLE "... http1.x server" as NotGrpcServerError naming the target."""
        try:
            yield
        except grpc.RpcError as e:
            if answered_http1(e):
                raise NotGrpcServerError(self._target, e.details()) from e
            raise

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> JaxserveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
