"""Message types between processes, and the ZeroMQ sockets that carry them.

Every message is a small dataclass here, sent as one msgpack frame
`[type_name, {field: value}]`; numpy arrays travel as raw buffers (msgpack ext type),
not lists. No JAX here: the frontend and the detokenizer import this module.

The paths (see README.md, Architecture); each socket is bound by the process that reads it
(`IpcAddresses`), and every producer connects:
    frontend    --EngineRequest----------------->  engine (request queue)
    frontend    --AbortRequest------------------>  engine (control path)
    engine      --EngineOutputs/EngineStats/Heartbeat-->  detokenizer
    detokenizer --AbortRequest (stop string)---->  engine (control path)
    detokenizer --TextOutputs/EngineStats/Heartbeat-->  frontend
    engine      --KvEvents/KvSnapshot------------>  frontend (router; optional)
    frontend    --KvSnapshotRequest------------->  engine (control path)
    headless    --ReplicaHello / ReplicaLeft------>  frontend (its replica listen port)
    frontend    --ReplicaWelcome / ReplicaRefused / ReplicaLeft-->  headless
A replica on another host (`jaxserve engine`, `jaxserve.router.remote`) speaks the same
messages over tcp://; the frontend binds every endpoint it uses there
(`IpcAddresses.frontend_binds`), so the engine's host opens no port. `PROTOCOL_VERSION`
names this file's wire format: a peer with another is refused at the handshake.
Stats travel the same path as outputs, so the frontend sees them in step order. Aborts
have a socket of their own, which the engine drains first: never stuck behind requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from jaxserve.observability.stats import EngineCounters, EngineHistograms

_NDARRAY_EXT = 1
# The wire format of these messages; raise it with any change a peer of another version
# would misread (a field added, renamed or given another meaning). The handshake
# messages `ReplicaHello`'s `protocol` and `ReplicaRefused` never change, so that two
# versions can always tell each other apart.
# 2: `EngineCounters.process_cpu_s` / `detokenizer_cpu_s` (the processes' CPU time).
PROTOCOL_VERSION = 2


@dataclass(slots=True)
class EngineRequest:
    """A validated, tokenized request. `sampling` is SamplingParams.to_dict().

    cache_group: requests with the same group (the n samples of one prompt) share their
        prompt's KV blocks in the engine even with prefix caching off.
    deadline: seconds since the epoch after which the engine aborts the request at its
        next step (the client's gRPC deadline), or None.
    """

    request_id: str
    prompt_token_ids: np.ndarray  # [P] int32
    sampling: dict
    arrival_time: float = 0.0
    cache_group: str | None = None
    deadline: float | None = None


@dataclass(slots=True)
class AbortRequest:
    request_ids: list[str]


@dataclass(slots=True)
class TokenOutput:
    """New tokens of one request after one engine step (vLLM's EngineCoreOutput; the
    offline API's result of a whole prompt is `jaxserve.llm.RequestOutput`).

    finish_reason: None while running; "stop" (EOS / stop token / stop string),
        "length" (max_tokens or max_model_len), "abort", or "error" (then `error` says why).
        With "stop" from the engine, the last of `new_token_ids` is the EOS or stop token:
        it counts as an output token but is not detokenized (as in vLLM).
    stop_reason: the stop token id that ended it, if any.
    first: on a request's first output only, {"prompt_token_ids": ..., "sampling": ...}
        so the detokenizer learns the request in order with its tokens.
    logprobs: when the request asked for them, one entry per new token:
        [logprob of the token, [[top_token_id, logprob], ...]] (top-N, most likely first).
    prompt_logprobs: when the request asked for them, on the output that carries its first
        sampled token: one entry per prompt token, None for the first (nothing predicts
        it), then entries as in `logprobs` (vLLM's RequestOutput.prompt_logprobs).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    first: dict | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass(slots=True)
class EngineOutputs:
    """Everything one engine step produced. sent_time: the engine's time.time() when it
    sent them (0 unknown): the start of the detokenizer lag (`observability.metrics`)."""

    outputs: list[TokenOutput]
    step: int = 0
    sent_time: float = 0.0


@dataclass(slots=True)
class TextOutput:
    """A text delta for one request, ready for the client stream.

    stop_reason: the matched stop string, or the stop token id, or None.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list | None = None
    # [[prompt token id, logprob, [[top id, logprob], ...]], ...] for prompt tokens 1..
    prompt_logprobs: list | None = None


@dataclass(slots=True)
class TextOutputs:
    """The text of one `EngineOutputs`; engine_time: its `sent_time` (0 unknown)."""

    outputs: list[TextOutput]
    engine_time: float = 0.0


@dataclass(slots=True)
class EngineStats:
    """Engine facts and gauges, sent at start-up (ready=True) and after steps that change them.

    counters: the engine core's counters and last-step timings (`EngineCounters`).
    histograms: the histograms it keeps (`EngineHistograms`: queue time).
    Expert load (MoE models only; empty / 0 otherwise), from the engine's
    `eplb.recorder.ExpertLoadRecorder`:
    expert_layers: decoder-layer index of each MoE layer.
    expert_balancedness: per MoE layer (same order), mean / max of the EP ranks' token
        loads over the recorder's window, in (0, 1] (1.0: balanced, or no load yet).
    expert_routed_tokens: (token, top-k choice) pairs routed to experts since start-up,
        summed over MoE layers (cumulative).
    kv_bytes_per_token: KV-cache bytes of one token over all layers, in the model's
        layout `kv_layout` ("per-head K/V" or "MLA latent"; `models.base.KVLayout`).
    async_scheduling: whether the engine overlaps host and device work, as resolved at
        start-up (`config.resolve_async_scheduling`); None: not reported.
    """

    model: str = ""
    max_model_len: int = 0
    block_size: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    vocab_size: int = 0
    num_running: int = 0
    num_waiting: int = 0
    ready: bool = False
    counters: EngineCounters = field(default_factory=EngineCounters)
    histograms: EngineHistograms = field(default_factory=EngineHistograms)
    expert_layers: list[int] = field(default_factory=list)
    expert_balancedness: list[float] = field(default_factory=list)
    expert_routed_tokens: int = 0
    kv_bytes_per_token: int = 0
    kv_layout: str = ""
    async_scheduling: bool | None = None


@dataclass(slots=True)
class Heartbeat:
    """Sent every `engine.control.HEARTBEAT_INTERVAL_S`, idle or not, by the engine loop
    (forwarded by the sidecar) and by the sidecar: the frontend's proof of life.
    source: "engine" or "detokenizer". time: the sender's time.time()."""

    source: str
    time: float = 0.0


@dataclass(slots=True)
class ProfileRequest:
    """Frontend -> engine (control path): capture a profile for `seconds` into `out_dir`
    (`observability.profile.ProfileSession`; the engine writes the files)."""

    out_dir: str
    seconds: float


@dataclass(slots=True)
class Shutdown:
    reason: str = ""


@dataclass(slots=True)
class KvEvents:
    """Numbered prefix-cache events of one engine replica (`engine.kv_events`), on the
    engine's KV events socket to the router.

    epoch: the engine process's random id (a new one after a restart).
    events: [seq, kind, parent hash or None, [block hash, ...]] with kind "stored",
        "removed" or "cleared", seq consecutive from 0 within an epoch; hashes are the
        16-byte chained hashes of `engine.block_hash`.
    """

    epoch: int
    events: list


@dataclass(slots=True)
class KvSnapshotRequest:
    """Router -> engine (control path): send a `KvSnapshot` of the prefix cache."""

    reason: str = ""


@dataclass(slots=True)
class KvSnapshot:
    """Every full block in an engine replica's prefix cache, after the events up to `seq`.

    blocks: [parent hash or None, block hash] pairs, parents first where known.
    """

    epoch: int
    seq: int
    blocks: list


@dataclass(slots=True)
class ReplicaHello:
    """Headless engine replica -> frontend (its replica listen port): the first message.

    protocol: the sender's `PROTOCOL_VERSION`. identity: what must match the frontend's
    for the router and the frontend's tokenizer to be right (`router.identity`). name:
    who the peer is, for logs and GetServerInfo ("host pid N").
    """

    protocol: int
    identity: dict
    name: str = ""


@dataclass(slots=True)
class ReplicaWelcome:
    """Frontend -> headless replica: accepted as replica `replica`; `ports` maps the
    `IpcAddresses` fields engine_input, engine_control, kv_control, frontend_input and
    kv_events to the TCP ports the frontend bound for it, on the host the replica
    reached it at."""

    replica: int
    ports: dict


@dataclass(slots=True)
class ReplicaRefused:
    """Frontend -> headless replica: not accepted; `reason` is one line naming the field
    that differs (protocol_version, or one of the model identity's). Never changes."""

    reason: str


@dataclass(slots=True)
class ReplicaLeft:
    """Either way, on the handshake connection: the replica is out for good (its engine
    died, or the frontend dropped it); `reason` says why."""

    reason: str


_TYPES = {
    cls.__name__: cls
    for cls in (
        EngineRequest,
        AbortRequest,
        TokenOutput,
        EngineOutputs,
        TextOutput,
        TextOutputs,
        EngineStats,
        Heartbeat,
        EngineCounters,
        EngineHistograms,
        ProfileRequest,
        Shutdown,
        KvEvents,
        KvSnapshotRequest,
        KvSnapshot,
        ReplicaHello,
        ReplicaWelcome,
        ReplicaRefused,
        ReplicaLeft,
    )
}


# Field names of each message type, in declaration order (the order `dataclasses.fields`
# gives): looked up once here, not per message. `dataclasses.fields` rebuilds a tuple and
# filters pseudo-fields on every call, which made it most of `_default`'s time.
_FIELD_NAMES = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES.values()}


def _default(obj: Any):
    names = _FIELD_NAMES.get(type(obj))
    if names is not None:  # a message dataclass: the common case, checked first
        return [type(obj).__name__, {name: getattr(obj, name) for name in names}]
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        header = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(
            _NDARRAY_EXT, len(header).to_bytes(4, "little") + header + arr.tobytes()
        )
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj):
        return [type(obj).__name__, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}]
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes):
    if code != _NDARRAY_EXT:
        return msgpack.ExtType(code, data)
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgpack.unpackb(data[4 : 4 + n])
    return np.frombuffer(data[4 + n :], dtype=np.dtype(dtype)).reshape(shape)


def _revive(obj: Any):
    """Turn [type_name, fields] pairs back into dataclasses (recursively), in place: lists
    are searched, nothing else (a dict that is not a pair's fields is left as it is)."""
    if not isinstance(obj, list):
        return obj
    # In place and only into lists (msgpack's output is this call's alone): a call, a new
    # list or dict per field value (ints, strings) was most of the decoding time of a
    # message of many outputs, and gave those values back as they were.
    if len(obj) == 2:
        name, fields = obj
        if type(name) is str and type(fields) is dict:
            cls = _TYPES.get(name)
            if cls is not None:
                for key, value in fields.items():
                    if type(value) is list:
                        fields[key] = _revive(value)  # same keys: iterating stays valid
                return cls(**fields)
    for i, value in enumerate(obj):
        if type(value) is list:
            obj[i] = _revive(value)
    return obj


def encode(msg: Any) -> bytes:
    """One msgpack frame for a message dataclass."""
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(frame: bytes) -> Any:
    """Inverse of `encode`. Raises ValueError on a frame that is not a known message."""
    obj = _revive(msgpack.unpackb(frame, ext_hook=_ext_hook, raw=False, strict_map_key=False))
    if type(obj).__name__ not in _TYPES:
        raise ValueError(f"not a jaxserve message: {type(obj).__name__}")
    return obj


@dataclass(frozen=True, slots=True)
class IpcAddresses:
    """The ZeroMQ endpoints of one server, each bound by the process that reads it."""

    engine_input: str  # EngineRequest in; bound by the engine
    detokenizer_input: str  # EngineOutputs/EngineStats/Heartbeat in; bound by the sidecar
    frontend_input: str  # TextOutputs/EngineStats/Heartbeat in; bound by the frontend
    engine_control: str = ""  # AbortRequest in; bound by the engine ("" none)
    kv_events: str = ""  # KvEvents/KvSnapshot in; bound by the frontend ("" none)
    # KvSnapshotRequest out, when not engine_control (a remote replica's: a second port)
    kv_control: str = ""
    # A remote replica's: the frontend binds engine_input and engine_control too (PUSH),
    # and the engine connects to them; ports may be "*" (the OS picks: `bound_endpoint`).
    frontend_binds: bool = False

    @classmethod
    def in_dir(cls, directory: str | Path) -> IpcAddresses:
        """ipc:// endpoints under a private directory (keep its path short: unix socket
        paths are limited to ~107 bytes)."""
        d = Path(directory)
        return cls(
            engine_input=f"ipc://{d / 'engine'}",
            detokenizer_input=f"ipc://{d / 'detokenizer'}",
            frontend_input=f"ipc://{d / 'frontend'}",
            engine_control=f"ipc://{d / 'control'}",
        )


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket was last bound to, with the port the OS chose for "*"."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


_MONITOR_IDS = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """`sock.get_monitor_socket(events)` on an inproc endpoint of its own. pyzmq's default
    endpoint is named after the socket's file descriptor, which the OS hands to the next
    socket once one is closed, while the closed socket's monitor may still hold the name:
    the new monitor then fails with "Address already in use" (measured, pyzmq 27 /
    libzmq 4.3.5). A frontend's remote replica slot, reused with a new KV socket, lost
    its disconnect watch so and stayed "stalled" after its host process died."""
    addr = f"inproc://jaxserve-monitor-{os.getpid()}-{next(_MONITOR_IDS)}"
    return sock.get_monitor_socket(events, addr=addr)


def make_socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    """A socket with linger 0 (so a dying peer never blocks shutdown), bound or connected."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock
