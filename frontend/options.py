"""What `jaxserve serve` configures in the frontend beyond host and ports: admission
limits, the stall timeout, TLS and the API key (the flags of issue 12; see
`frontend.admission`, `frontend.liveness`, `frontend.auth`), and the bound on the output
each stream holds for its client (`frontend.request_stream`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.frontend.admission import AdmissionLimits
from jaxserve.frontend.auth import TlsFiles
from jaxserve.frontend.liveness import DEFAULT_STALL_TIMEOUT_S
from jaxserve.frontend.request_stream import DEFAULT_MAX_STREAM_BUFFER_BYTES


@dataclass(frozen=True, slots=True)
class FrontendOptions:
    """admission: the limits past which requests get RESOURCE_EXHAUSTED.
    stall_timeout_s: heartbeat silence (seconds) after which the server is stalled.
    tls: certificate files for the gRPC and metrics ports, or None (plaintext).
    api_key: the key every RPC but health must carry, or None (no authentication).
    max_stream_buffer_bytes: estimated bytes of output a stream may hold unread by its
    client; past it the request is aborted (`frontend.requests`)."""

    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    tls: TlsFiles | None = None
    api_key: str | None = None
    max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES
