"""`RemoteReplicaListener`: the frontend's side of replicas on other hosts
(`jaxserve serve --replica-listen HOST:PORT`; the replica's side is `router.headless`).

Why this direction (the engine joins the frontend, as vLLM's headless data-parallel
engines do, not the frontend dialling `--engine-address` endpoints): the frontend is
the one long-lived, known address; engines come and go (scaled, restarted, moved) and
need nothing but that address, open no port on their host, and a joined one takes the
same path as a local replica (`ReplicaSet.add_remote`): no list of engine addresses to
keep in sync, no reconnect loop on the frontend.

The protocol, on a ROUTER socket bound at HOST:PORT (frames of `ipc`):
1. The replica sends `ReplicaHello` (protocol version, model identity, name).
2. A protocol version or model identity (`router.identity`) other than the frontend's is
   answered with `ReplicaRefused`, one line naming the field, also logged here. Else the
   frontend binds the replica's five sockets on HOST (ports the OS picks: engine
   requests, aborts and KV snapshot requests out, text outputs and KV events in; the
   same ZeroMQ/msgpack messages as a local replica's ipc:// ones) and answers
   `ReplicaWelcome` with its replica index and the ports. It then serves like a local
   replica once its engine's ready stats arrive, with empty entries in the router
   (resynced by snapshot).
3. Its end: `ReplicaLeft` from the replica (its engine or sidecar died, or it was
   stopped), or the engine's KV events connection closing (the whole host process
   gone), takes it out of rotation at once (`ReplicaSet.replica_died`: its streams end
   with UNAVAILABLE naming it). A replica that goes silent (SIGSTOP, a host or network
   gone without a TCP reset) is stalled after the stall timeout, as a local one is. A
   replica the frontend drops (a refused model once ready) is sent `ReplicaLeft`. A dead
   remote replica's slot is given to the next one that joins.

Security: the ports carry no authentication or encryption (as vLLM's data-parallel
ports): bind a private network's address only, which needs --allow-remote beyond
loopback (`options.RouterOptions`). No JAX.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from jaxserve.frontend.liveness import CHECK_INTERVAL_S
from jaxserve.frontend.server_address import join_host_port
from jaxserve.ipc import (
    PROTOCOL_VERSION,
    IpcAddresses,
    ReplicaLeft,
    ReplicaRefused,
    ReplicaWelcome,
    encode,
    monitor_socket,
)
from jaxserve.router.identity import first_difference, protocol_difference

logger = logging.getLogger("jaxserve.router")

MAX_REPLICAS = 64  # local and remote together: a joiner past it is refused
MAX_HELLO_BYTES = 64 * 1024  # a larger handshake frame drops the connection (ZMQ)
MAX_NAME_CHARS = 200
# After a replica's engine connection closes: how long its `jaxserve engine` process has
# to say why (`ReplicaLeft`) before the replica is out for "its connection closed".
DISCONNECT_GRACE_S = 0.5
# The sockets bound per remote replica: the IpcAddresses fields, in ReplicaWelcome.ports.
PORT_FIELDS = ("engine_input", "engine_control", "kv_control", "frontend_input", "kv_events")


def parse_hello(frame: bytes, identity: dict) -> tuple[str | None, str]:
    """Check a handshake frame against this frontend's identity.

    Returns (refusal, name): refusal is None when the peer is accepted, else one line
    naming what differs (the protocol version is read first, before any other field,
    so a peer of another version is told so whatever else it sent). Never raises.
    """
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        kind, fields = obj
        if kind != "ReplicaHello" or not isinstance(fields, dict):
            raise TypeError
    except Exception:
        return "handshake: not a jaxserve ReplicaHello message", ""
    name = str(fields.get("name", ""))[:MAX_NAME_CHARS]
    if (why := protocol_difference(PROTOCOL_VERSION, fields.get("protocol"))) is not None:
        return why, name
    theirs = fields.get("identity")
    if not isinstance(theirs, dict):
        return "identity: missing from the handshake", name
    return first_difference(identity, theirs), name


class RemoteReplicaListener:
    """Accepts headless engine replicas into a `ReplicaSet`.

    Args:
        host / port: the address to bind (port 0: the OS picks; see `port` after start).
        replicas: the frontend's `ReplicaSet` (already started).
        identity: this frontend's `router.identity.model_identity`.
    """

    def __init__(self, host: str, port: int, replicas, identity: dict) -> None:
        self.host, self.port = host, port
        self.replicas = replicas
        self.identity = identity
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._monitors: dict[int, asyncio.Task] = {}  # replica -> its disconnect watch
        self._peers: dict[bytes, int] = {}  # ROUTER identity -> replica index
        self._told: set[bytes] = set()  # peers sent ReplicaLeft

    async def start(self) -> None:
        """Bind the listen address. Raises zmq.ZMQError when it cannot be bound."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_HELLO_BYTES)
        if self.port:
            sock.bind(f"tcp://{self.host}:{self.port}")
        else:
            self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._serve(), name="replica-listener"),
            asyncio.create_task(self._tell_dropped(), name="replica-dropped"),
        ]
        logger.info(
            "accepting remote engine replicas on tcp://%s", join_host_port(self.host, self.port)
        )

    async def close(self) -> None:
        tasks = self._tasks + list(self._monitors.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()

    async def _serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            peer, frame = frames
            try:
                await self._on_message(peer, frame)
            except Exception:
                logger.exception("remote replica handshake failed")

    async def _on_message(self, peer: bytes, frame: bytes) -> None:
        if peer in self._peers:  # a joined replica speaks only to leave
            try:
                obj = msgpack.unpackb(frame, raw=False)
                reason = str(obj[1]["reason"]) if obj[0] == "ReplicaLeft" else None
            except Exception:
                reason = None
            if reason is not None:
                self._left(self._peers[peer], reason)
            return
        refusal, name = parse_hello(frame, self.identity)
        if (
            refusal is None
            and len(self.replicas.replicas) >= MAX_REPLICAS
            and not any(r.remote and r.state == "dead" for r in self.replicas.replicas)
        ):
            refusal = f"replicas: this frontend has {MAX_REPLICAS} already"
        who = name or "a peer"
        if refusal is not None:
            logger.error("refused the remote replica %s: %s", who, refusal)
            await self._sock.send_multipart([peer, encode(ReplicaRefused(refusal))])
            return
        h = f"tcp://{self.host}:*"
        template = IpcAddresses(
            engine_input=h, detokenizer_input="", frontend_input=h, engine_control=h,
            kv_events=h, kv_control=h, frontend_binds=True,
        )  # fmt: skip
        rep = await self.replicas.add_remote(template, who)
        old = self._monitors.pop(rep.index, None)
        if old is not None:
            old.cancel()
        self._peers = {p: k for p, k in self._peers.items() if k != rep.index}
        self._peers[peer] = rep.index
        ports = {f: int(getattr(rep.addresses, f).rsplit(":", 1)[1]) for f in PORT_FIELDS}
        await self._sock.send_multipart([peer, encode(ReplicaWelcome(rep.index, ports))])
        self._monitors[rep.index] = asyncio.create_task(self._watch(rep))
        logger.info("replica %d: the remote replica %s joined", rep.index, who)

    def _left(self, index: int, reason: str) -> None:
        rep = self.replicas.replicas[index]
        if rep.state != "dead":
            logger.error("replica %d (remote %s) left: %s", index, rep.remote, reason)
            self.replicas.replica_died(index, f"the remote replica {rep.remote}: {reason}")

    async def _watch(self, rep) -> None:
        """The engine's KV events connection closing = the replica's host process is gone."""
        sock = rep.kv_socket
        mon = monitor_socket(sock, zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED)
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                if event["event"] == zmq.EVENT_MONITOR_STOPPED or rep.kv_socket is not sock:
                    return
                # Its `jaxserve engine` process names the cause (a dead engine's exit)
                # a moment later, unless it is gone too.
                await asyncio.sleep(DISCONNECT_GRACE_S)
                if rep.kv_socket is sock:
                    self._left(rep.index, "its engine's connection closed")
        finally:
            mon.close()

    async def _tell_dropped(self) -> None:
        """Tell a joined replica that the frontend took it out for good (it then exits)."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            for peer, index in list(self._peers.items()):
                rep = self.replicas.replicas[index]
                if rep.client.dead_reason is not None and peer not in self._told:
                    self._told.add(peer)
                    msg = ReplicaLeft(rep.client.dead_reason)
                    await self._sock.send_multipart([peer, encode(msg)])
