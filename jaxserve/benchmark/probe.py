"""The question `jaxserve bench` asks a server before its run: which model it serves and,
over gRPC, how many step shapes it still compiles, in one GetServerInfo call.

The model names the tokenizer that builds the prompts (cli._tokenizer_dir); the step
shapes start the wait for the server's warm-up (server_warmup.wait_for_warmup). No answer
ends the run before any request with one line naming --server and the cause (nothing
listens there, the engine is starting or dead, a wrong key, not this API), where the run
would otherwise send every request to fail and print a table of zeros.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jaxserve.frontend.client_auth import ClientAuth

# Seconds to wait for the server's answer to the first question (its model).
PROBE_TIMEOUT_S = 10.0


class ServerUnreachableError(RuntimeError):
    """The server did not answer the first question; one line naming --server."""


@dataclass(frozen=True, slots=True)
class ServerAnswer:
    """What the server said: its model's name, and its step shapes still compiling in the
    background (GetServerInfo's warmup_pending_shapes; None over HTTP, which cannot say)."""

    model: str
    warmup_pending_shapes: int | None = None


def ask_server(server: str, backend: str, auth: ClientAuth) -> ServerAnswer:
    """What the server at `server` (HOST:PORT; http: also a URL) reports over `backend`
    ("grpc": one GetServerInfo, the model and the step shapes still compiling; "http":
    GET /v1/models, the first model's id), within PROBE_TIMEOUT_S.

    Raises ServerUnreachableError ("--server ADDR: ...") when nothing answers there,
    the server is not serving (engine starting or dead: UNAVAILABLE / 503), refuses the
    key, or answers something that is not this API."""
    where = f"--server {server}"
    if backend == "grpc":
        import grpc

        from jaxserve.frontend.client import JaxserveClient

        try:
            with JaxserveClient(server, **auth.client_kwargs()) as c:
                info = c.server_info(timeout=PROBE_TIMEOUT_S)
            return ServerAnswer(info.model, info.warmup_pending_shapes)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE and details.startswith("engine unavailable"):
                raise ServerUnreachableError(
                    f"{where}: the server is not serving ({details})"
                ) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"no answer within {PROBE_TIMEOUT_S:g} s"
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ServerUnreachableError(
                    f"{where}: no jaxserve gRPC server answers there ({code.name}: {details})"
                ) from None
            raise ServerUnreachableError(
                f"{where}: GetServerInfo failed ({code.name}: {details})"
            ) from None
    import http.client
    import urllib.error
    import urllib.request

    url = auth.url(server).rstrip("/") + "/v1/models"
    req = urllib.request.Request(url)
    for k, v in auth.headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(
            req, timeout=PROBE_TIMEOUT_S, context=auth.ssl_context()
        ) as resp:
            return ServerAnswer(json.loads(resp.read())["data"][0]["id"])
    except urllib.error.HTTPError as e:
        text = e.read(300).decode(errors="replace").replace("\n", " ")
        raise ServerUnreachableError(
            f"{where}: GET {url} answered HTTP {e.code} ({text})"
        ) from None
    except (urllib.error.URLError, OSError) as e:  # refused, timed out, unresolvable
        reason = getattr(e, "reason", e)
        raise ServerUnreachableError(
            f"{where}: no HTTP server answers at {url} ({reason}; waited at most "
            f"{PROBE_TIMEOUT_S:g} s)"
        ) from None
    except http.client.HTTPException as e:  # not HTTP at all: a gRPC port, say
        raise ServerUnreachableError(
            f"{where}: GET {url} got no HTTP answer ({type(e).__name__}); is it the gRPC "
            "port? --backend http takes serve's --http-port"
        ) from None
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ServerUnreachableError(
            f"{where}: GET {url} did not answer an OpenAI model list ({type(e).__name__}: {e})"
        ) from None
