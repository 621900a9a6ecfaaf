"""`ReplicaSet`: N engine replicas behind one frontend, with the interface of one
`AsyncEngineClient` (what `frontend.requests.RequestPath`, the gRPC and HTTP services use).

Each replica is its own pipeline (engine process -> its detokenizer sidecar -> this
frontend), reached through its own `AsyncEngineClient` and `IpcAddresses`, plus its KV
event channel (router/kv_channel.py). A request's n samples go to one replica, chosen
by the `Router` among the replicas that serve now (ready, not stalled, not dead).
Replicas on other hosts join while it runs (`add_remote`, called by `router.remote`),
with their sockets bound here on TCP ports; a dead remote replica's slot goes to the
next one that joins.

Health of a replica:
- dead (`replica_died`, called by the launcher's child watcher when its engine or its
  sidecar exits): out of rotation at once; its open streams end with EngineDeadError
  naming the replica (UNAVAILABLE to the client); its index entries and load are
  dropped. The set serves while one replica lives (`dead_reason` is set only when all
  are dead).
- stalled: no heartbeat from its engine or sidecar for `stall_timeout_s`
  (`frontend.liveness.stalled_process`, checked here per replica every
  `CHECK_INTERVAL_S`): treated as dead until heartbeats come back (its streams end with
  UNAVAILABLE naming it; aborts wait for it), then it serves again with its index
  resynced.

No JAX. The router's own logic is in `router.Router`; this module is the wiring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from jaxserve.frontend.engine_client import SHUTTING_DOWN, AsyncEngineClient
from jaxserve.frontend.liveness import CHECK_INTERVAL_S, stalled_process
from jaxserve.frontend.request_stream import EngineDeadError, RequestStream
from jaxserve.ipc import (
    EngineRequest,
    EngineStats,
    IpcAddresses,
    ProfileRequest,
    TextOutput,
    TextOutputs,
    bound_endpoint,
)
from jaxserve.router.kv_channel import open_kv_channel
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.profiles import profile_replicas
from jaxserve.router.replica import Replica, no_replica_serves
from jaxserve.router.replica_stats import aggregate_stats, refusal, replica_info, update_gauges
from jaxserve.router.router import Decision, Router

logger = logging.getLogger("jaxserve.router")


class ReplicaSet:
    """Routes each request to one of several replicas; looks like one engine client.

    Args:
        addresses: one `IpcAddresses` per local replica (kv_events and engine_control
            set); none when every replica joins from another host (`add_remote`).
        router: the `Router` (policy, index, load) over replica ids 0..N-1.
        metrics: where decisions and replica gauges go (None: not exported).
        stall_timeout_s: heartbeat silence after which a replica counts as stalled.
    """

    def __init__(
        self,
        addresses: list[IpcAddresses],
        router: Router,
        metrics: RouterMetrics | None = None,
        stall_timeout_s: float = 30.0,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.stall_timeout_s = stall_timeout_s
        self.replicas = [Replica(i, a, AsyncEngineClient(a)) for i, a in enumerate(addresses)]
        self._by_stream: dict[int, Replica] = {}  # id(stream) -> its replica
        self._ctx: zmq.asyncio.Context | None = None
        self._sync_ctx: zmq.Context | None = None
        self._ready = asyncio.Event()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self._outputs_listeners: list[Callable[[TextOutputs], None]] = []
        self._serving_listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._watch: asyncio.Task | None = None
        self._retired: list[EngineStats] = []  # last stats of replaced engines (counters)
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self.stalled_reason: str | None = None  # set only when every live replica is stalled
        self.last_heartbeat: dict[str, float] = {}  # per replica instead (liveness is here)
        self._profiles: set[asyncio.Task] = set()  # captures over the replicas, running

    # ----- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        for rep in self.replicas:
            await self._start_replica(rep)
        self._watch = asyncio.create_task(self._watch_replicas(), name="replica-watch")

    async def _start_replica(self, rep: Replica) -> None:
        await rep.client.start()
        rep.client.add_stats_listener(lambda s, rep=rep: self._on_stats(rep, s))
        self._listen(rep)
        if rep.addresses.kv_events:
            open_kv_channel(rep, self._ctx, self._sync_ctx, self.router.index, self.metrics)

    async def add_remote(self, addresses: IpcAddresses, name: str) -> Replica:
        """A replica on another host joined (`router.remote`): a new replica, or the slot
        of a dead remote one, with empty entries; its sockets are bound here
        (`addresses.frontend_binds`), and `rep.addresses` holds their bound ports."""
        rep = next((r for r in self.replicas if r.remote and r.state == "dead"), None)
        if rep is None:
            rep = Replica(len(self.replicas), addresses, AsyncEngineClient(addresses))
            self.replicas.append(rep)
        else:
            await self._close_replica(rep)
            if rep.last_stats is not None:  # its counters stay in the server's totals
                self._retired.append(rep.last_stats)
            rep.addresses, rep.client = addresses, AsyncEngineClient(addresses)
            rep.last_stats, rep.decisions = None, 0
        rep.remote = name
        self.router.remove_replica(rep.index)
        rep.active.clear()
        await self._start_replica(rep)
        rep.addresses = dataclasses.replace(
            rep.client.addresses,
            kv_events=bound_endpoint(rep.kv_socket),
            kv_control=bound_endpoint(rep.control),
        )
        rep.heard_since = time.monotonic()
        self.dead_reason = None
        return rep

    async def _close_replica(self, rep: Replica) -> None:
        if rep.reader is not None:
            rep.reader.cancel()
            await asyncio.gather(rep.reader, return_exceptions=True)
        await rep.client.close()
        for sock in (rep.kv_socket, rep.control):
            if sock is not None:
                sock.close()
        rep.reader = rep.kv_socket = rep.control = None

    async def close(self) -> None:
        tasks = [t for t in [self._watch] + [r.reader for r in self.replicas] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rep in self.replicas:
            await self._close_replica(rep)
        for ctx in (self._ctx, self._sync_ctx):
            if ctx is not None:
                ctx.term()

    # ----- the engine client interface ----------------------------------------------------

    @property
    def ready(self) -> bool:
        """At least one replica serves."""
        return any(rep.client.ready for rep in self.replicas)

    async def wait_ready(self) -> EngineStats:
        """Wait until the first replica is ready; returns the server's stats."""
        await self._ready.wait()
        assert self.stats is not None
        return self.stats

    def add_stats_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """Listeners get the server-wide stats (`replica_stats.aggregate_stats`)."""
        self._stats_listeners.append(listener)

    def add_outputs_listener(self, listener: Callable[[TextOutputs], None]) -> None:
        """Called with each TextOutputs of any replica, before its streams get it."""
        self._outputs_listeners.append(listener)
        for rep in self.replicas:
            rep.client.add_outputs_listener(listener)

    def _listen(self, rep: Replica) -> None:
        rep.client.add_outputs_listener(lambda m, rep=rep: self._on_outputs(rep, m.outputs))
        for listener in self._outputs_listeners:
            rep.client.add_outputs_listener(listener)

    def send_control(self, msg) -> None:
        """Send a control message to the replicas that serve: a `ProfileRequest` to every
        one, each into its own folder, with the combined manifest written when they are
        done (`profiles.profile_replicas`); another message to the first. Raises
        EngineDeadError when none serves."""
        live = [rep for rep in self.replicas if rep.client.ready]
        if not live:
            raise EngineDeadError(no_replica_serves(self.replicas))
        if isinstance(msg, ProfileRequest) and len(self.replicas) > 1:
            from jaxserve.observability.profile_rpc import MANIFEST_GRACE_S  # noqa: PLC0415

            task = asyncio.create_task(profile_replicas(live, msg, MANIFEST_GRACE_S))
            self._profiles.add(task)
            task.add_done_callback(self._profiles.discard)
            return
        live[0].client.send_control(msg)

    def add_serving_listener(self, listener: Callable[[bool], Awaitable[None]]) -> None:
        """Awaited with `ready` whenever a replica's health changes (health service)."""
        self._serving_listeners.append(listener)

    def is_running(self, request_id: str) -> bool:
        return any(rep.client.is_running(request_id) for rep in self.replicas)

    async def wait_released(self, request_id: str, timeout: float) -> None:
        for rep in self.replicas:
            if rep.client.is_running(request_id):
                await rep.client.wait_released(request_id, timeout)

    def add_request(self, request_id: str, samples: list[EngineRequest]) -> RequestStream:
        """Route the request and send its samples to the chosen replica.

        Raises EngineDeadError when no replica serves (naming why), ValueError as
        `AsyncEngineClient.add_request` (request_id running on any replica).
        """
        if self.is_running(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")
        live = [rep.index for rep in self.replicas if rep.client.ready]
        if not live:
            raise EngineDeadError(no_replica_serves(self.replicas))
        prompt = samples[0].prompt_token_ids if samples else []
        decision = self.router.decide(prompt, live)
        rep = self.replicas[decision.replica]
        stream = rep.client.add_request(request_id, samples)
        self._by_stream[id(stream)] = rep
        # The samples' group: named by the first engine id (unique for this process).
        group = self._key(rep, stream.engine_ids[0]) if len(samples) > 1 else None
        for engine_id in stream.engine_ids:
            key = self._key(rep, engine_id)
            rep.active.add(key)
            self.router.dispatch(key, decision, len(prompt), group)
        rep.decisions += 1
        self._count(decision)
        return stream

    def _count(self, d: Decision) -> None:
        if self.metrics is not None:
            self.metrics.decision(d.policy, d.replica, d.num_blocks, d.matched_blocks)

    def abort(self, request_id: str) -> bool:
        return any(rep.client.abort(request_id) for rep in self.replicas)

    def release(self, stream: RequestStream) -> None:
        rep = self._by_stream.pop(id(stream), None)
        if rep is None:
            return
        rep.client.release(stream)
        for engine_id in stream.engine_ids:
            key = self._key(rep, engine_id)
            rep.active.discard(key)
            self.router.finish(key)

    def mark_dead(self, reason: str) -> None:
        """The whole server stops serving (every replica)."""
        for rep in self.replicas:
            self._replica_down(rep, reason, dead=True)
        self.dead_reason = reason

    def shut_down(self) -> None:
        """The server stops: every replica's open streams end (`AsyncEngineClient.shut_down`)."""
        for rep in self.replicas:
            rep.client.shut_down()
        self.dead_reason = SHUTTING_DOWN

    def mark_stalled(self, reason: str | None) -> None:
        """Stalls are tracked per replica (`_watch_replicas`); nothing to do here."""

    # ----- replica health -----------------------------------------------------------------

    async def rejoin(self, index: int) -> None:
        """The replica's processes were started again: a fresh engine client on its
        addresses; its entries are empty until its new engine's events (a new epoch,
        from event 0) or a snapshot fill them."""
        rep = self.replicas[index]
        await rep.client.close()
        rep.client = AsyncEngineClient(rep.addresses)
        await rep.client.start()
        rep.client.add_stats_listener(lambda s, rep=rep: self._on_stats(rep, s))
        self._listen(rep)
        self.router.remove_replica(rep.index)
        rep.active.clear()
        if rep.last_stats is not None:  # its counters stay in the server's totals
            self._retired.append(rep.last_stats)
        rep.last_stats = None
        if rep.events is not None:
            rep.events.reset()
        self.dead_reason = None

    def replica_died(self, index: int, reason: str) -> None:
        """The replica's engine or sidecar exited: out of rotation, streams end naming it."""
        rep = self.replicas[index]
        self._replica_down(rep, rep.named(reason), dead=True)
        if all(r.client.dead_reason is not None for r in self.replicas):
            self.dead_reason = f"every replica died (last: {rep.name}: {reason})"
        self._publish_stats()

    def _replica_down(self, rep: Replica, reason: str, dead: bool) -> None:
        if dead:
            rep.client.mark_dead(reason)
        else:
            rep.client.mark_stalled(reason)
        self.router.remove_replica(rep.index)
        rep.active.clear()
        if rep.events is not None:
            rep.events.reset()
        for s, r in list(self._by_stream.items()):
            if r is rep and dead:
                del self._by_stream[s]

    async def _watch_replicas(self) -> None:
        since = time.monotonic()
        for rep in self.replicas:
            rep.heard_since = since
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            now = time.monotonic()
            changed = False
            for rep in self.replicas:
                client = rep.client
                if client.dead_reason is not None or client.stats is None:
                    continue
                reason = stalled_process(
                    client.last_heartbeat, rep.heard_since, now, self.stall_timeout_s
                )
                if reason != client.stalled_reason:
                    changed = True
                    if reason is None:
                        client.mark_stalled(None)
                        if rep.events is not None:
                            rep.events.resync("back from a stall")
                    else:
                        self._replica_down(rep, rep.named(reason), dead=False)
                if rep.events is not None:
                    rep.events.poll(now)
            self.stalled_reason = (
                None
                if self.ready
                else (no_replica_serves(self.replicas) if self.dead_reason is None else None)
            )
            self._update_gauges()
            if changed:
                self._publish_stats()
                for listener in self._serving_listeners:
                    await listener(self.ready)

    # ----- outputs and stats --------------------------------------------------------------

    @staticmethod
    def _key(rep: Replica, engine_id: str) -> str:
        return f"{rep.index}/{engine_id}"

    def _on_outputs(self, rep: Replica, outputs: list[TextOutput]) -> None:
        for out in outputs:
            key = self._key(rep, out.request_id)
            if key not in rep.active:
                continue
            finished = out.finish_reason is not None
            self.router.on_output(key, len(out.token_ids), finished)
            if finished:
                rep.active.discard(key)

    def _on_stats(self, rep: Replica, stats: EngineStats) -> None:
        first = next((r.last_stats for r in self.replicas if r.last_stats is not None), stats)
        refused = refusal(stats, first, self.router.block_size)
        if refused is not None:
            self.replica_died(rep.index, refused)
            return
        joined = stats.ready and (rep.last_stats is None or not rep.last_stats.ready)
        if joined:
            rep.heard_since = time.monotonic()  # heartbeats start with its loop
        rep.last_stats = stats
        self._publish_stats()
        if joined:
            logger.info(
                "%s ready%s: %d usable KV blocks of %d tokens, max_model_len %d (%d blocks "
                "over the replicas serving now)", rep.name,
                f" (remote {rep.remote})" if rep.remote else "", stats.num_blocks_total,
                stats.block_size, stats.max_model_len, self.stats.num_blocks_total,
            )  # fmt: skip
        if stats.ready and not self._ready.is_set():
            self._ready.set()

    def _publish_stats(self) -> None:
        seen = [r.last_stats for r in self.replicas if r.last_stats is not None] + self._retired
        if not seen:
            return
        live = [r.last_stats for r in self.replicas if r.last_stats is not None and r.client.ready]
        self.stats = aggregate_stats(live, seen)
        for listener in self._stats_listeners:
            listener(self.stats)

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            update_gauges(self.metrics, self.replicas, self.router)

    def replica_info(self) -> list[dict]:
        """Per replica, the fields of GetServerInfo's `ReplicaInfo`."""
        return replica_info(self.replicas, self.router)
