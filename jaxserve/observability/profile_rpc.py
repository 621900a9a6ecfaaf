"""The `jaxserve profile` RPC: `jaxserve.v1.Profiler/Capture` on the server's gRPC port.

A generic gRPC method (JSON request and response, no proto change), registered by the
frontend next to the Jaxserve service, behind the same API key. The request is
{"out_dir": DIR, "seconds": N}; the frontend sends the engine an `ipc.ProfileRequest`
(observability/profile.py) and waits for the manifest the engine writes when the capture
ends (DIR/profile.json: so DIR must be a path the engine's host and the frontend share,
the server's own host for `jaxserve serve`), then answers it. Errors: INVALID_ARGUMENT
naming `seconds` or `out_dir`, UNAVAILABLE when the engine is not running,
DEADLINE_EXCEEDED when no manifest came within seconds + `MANIFEST_GRACE_S`. No JAX.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from pathlib import Path

import grpc

from jaxserve.frontend.client import answered_http1, http1_hint
from jaxserve.frontend.client_auth import ClientAuth
from jaxserve.ipc import ProfileRequest
from jaxserve.observability.profile import MANIFEST, MAX_SECONDS

SERVICE = "jaxserve.v1.Profiler"
METHOD = f"/{SERVICE}/Capture"
MANIFEST_GRACE_S = 60.0  # stopping a JAX trace and writing it takes a while
MAX_REQUEST_BYTES = 8192  # out_dir is a path: 4096 bytes at most on Linux


def _loads(data: bytes):
    if len(data) > MAX_REQUEST_BYTES:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()


def validate(req) -> tuple[str, float]:
    """(out_dir, seconds) of a Capture request. Raises ValueError naming the field."""
    if not isinstance(req, dict):
        raise ValueError("request: expected a JSON object {out_dir, seconds}")
    seconds, out_dir = req.get("seconds"), req.get("out_dir")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"seconds: expected a number, got {seconds!r}")
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds: must be in (0, {MAX_SECONDS:g}], got {seconds}")
    if not isinstance(out_dir, str) or not out_dir or "\0" in out_dir or len(out_dir) > 4096:
        raise ValueError("out_dir: expected a non-empty path of at most 4096 characters")
    if not os.path.isabs(out_dir):
        raise ValueError(f"out_dir: must be an absolute path, got {out_dir!r}")
    return out_dir, float(seconds)


def handler(engine) -> grpc.GenericRpcHandler:
    """The Profiler service of a frontend whose engine client is `engine`."""
    busy = asyncio.Lock()

    async def capture(req, context: grpc.aio.ServicerContext) -> dict:
        try:
            out_dir, seconds = validate(req)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if busy.locked():
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "a capture is running; retry when it ends"
            )
        async with busy:
            manifest = Path(out_dir) / MANIFEST
            try:  # here first, so that an unwritable folder is the caller's error at once
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                manifest.unlink(missing_ok=True)
            except FileExistsError:  # mkdir's words for a file there: "File exists"
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"out_dir: {out_dir} is a file, not a folder"
                )
            except OSError as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"out_dir: cannot write {out_dir} ({e.strerror or e})",
                )
            try:
                engine.send_control(ProfileRequest(out_dir, seconds))
            except Exception as e:  # EngineDeadError: starting, dead, stalled
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine: {e}")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds + MANIFEST_GRACE_S
            while not manifest.exists():
                if loop.time() > deadline:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"profile: no {manifest} within {seconds + MANIFEST_GRACE_S:g} s "
                        "(is out_dir on the engine's host?)",
                    )
                await asyncio.sleep(0.1)
            return json.loads(manifest.read_text())

    method = grpc.unary_unary_rpc_method_handler(
        capture, request_deserializer=_loads, response_serializer=_dumps
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Capture": method})


def request_profile(server: str, seconds: float, out_dir: str, auth: ClientAuth | None = None):
    """Ask the server at `server` (HOST:PORT, gRPC; `auth`: its TLS and API key) for a
    capture; returns its manifest.

    Raises ValueError naming `seconds` or `out_dir` (checked here first, and the
    server's INVALID_ARGUMENT: a folder it cannot write) or a TLS file that cannot be
    read, RuntimeError ("CODE: details") when the server refuses or fails (with what to
    do when an HTTP/1 server answered: the metrics or HTTP API port)."""
    if out_dir.strip():  # an empty --out is refused, not taken for the current folder
        out_dir = os.path.abspath(out_dir)
    validate({"out_dir": out_dir, "seconds": seconds})
    auth = auth or ClientAuth()
    with auth.channel(server) as channel:
        call = channel.unary_unary(
            METHOD, request_serializer=_dumps, response_deserializer=json.loads
        )
        try:
            timeout = seconds + MANIFEST_GRACE_S + 30
            request = {"out_dir": out_dir, "seconds": seconds}
            return call(request, timeout=timeout, metadata=auth.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # its details name the field
                raise ValueError(e.details()) from None
            details = e.details() or ""
            if answered_http1(e):
                details += "; " + http1_hint(server, "profile")
            raise RuntimeError(f"{e.code().name}: {details}") from None


def describe(manifest: dict) -> str:
    """What was written and where to open it (the command's output)."""
    lines = [f"profile of {manifest['seconds']:g} s ({manifest['steps']} engine steps) in "
             f"{manifest['out_dir']}"]  # fmt: skip
    if manifest.get("error"):
        lines.append(f"  JAX trace failed: {manifest['error']}")
    for path in manifest.get("trace_json", []):
        lines.append(f"  XLA trace: {path}  -> open in https://ui.perfetto.dev")
    if manifest.get("xplane"):
        lines.append(
            f"  XLA trace (TensorBoard / XProf): {Path(manifest['xplane'][0]).parent}  -> "
            f"tensorboard --logdir {shlex.quote(manifest['out_dir'])} (Profile tab), or xprof"
        )
    # Replicas (router.profiles): a timeline each; the top level names replica 0's only.
    replicas = manifest.get("replicas") or {}
    timelines = [(f" (replica {k})", m["host_timeline"]) for k, m in replicas.items() if m]
    for which, path in timelines or [("", manifest["host_timeline"])]:
        lines.append(
            f"  engine loop timeline{which}: {path}  -> open in "
            "https://ui.perfetto.dev or chrome://tracing"
        )
    return "\n".join(lines)
