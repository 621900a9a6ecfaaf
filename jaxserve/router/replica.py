"""`Replica`: one engine replica as the frontend's `ReplicaSet` sees it (its addresses,
engine client, KV events state and sockets, the requests sent there). No JAX."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from jaxserve.frontend.engine_client import AsyncEngineClient
from jaxserve.ipc import EngineStats, IpcAddresses
from jaxserve.router.events import ReplicaEvents


@dataclass(slots=True)
class Replica:
    """One engine replica as the frontend sees it."""

    index: int
    addresses: IpcAddresses
    client: AsyncEngineClient
    events: ReplicaEvents | None = None
    kv_socket: zmq.asyncio.Socket | None = None
    control: zmq.Socket | None = None
    reader: asyncio.Task | None = None
    heard_since: float = 0.0  # baseline of the stall check
    decisions: int = 0
    last_stats: EngineStats | None = None
    # engine ids of the requests sent here that have not ended
    active: set[str] = field(default_factory=set)
    remote: str = ""  # a replica on another host: who it is ("host pid N"); "" local

    @property
    def address(self) -> str:
        """Where it is, for GetServerInfo: its engine's address, or the remote peer."""
        return f"remote {self.remote}" if self.remote else self.addresses.engine_input

    @property
    def name(self) -> str:
        return f"replica {self.index}"

    def named(self, reason: str) -> str:
        """`reason` naming this replica (as it is when it names it already)."""
        return reason if self.name in reason else f"{self.name}: {reason}"

    @property
    def state(self) -> str:
        c = self.client
        if c.dead_reason is not None:
            return "dead"
        if c.stalled_reason is not None:
            return "stalled"
        return "serving" if c.ready else "starting"


def no_replica_serves(replicas: list[Replica]) -> str:
    """Why none of `replicas` serves: each one's dead or stall reason, or "starting"."""
    reasons = [
        rep.named(rep.client.dead_reason or rep.client.stalled_reason or "starting")
        for rep in replicas
    ]
    return "no replica serves (" + "; ".join(reasons) + ")"
