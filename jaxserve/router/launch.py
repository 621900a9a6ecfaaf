"""`jaxserve serve --replicas N`: the replicas' processes and their supervision, for the
launcher (`jaxserve.launcher`, which owns the single-engine path and the frontend's run).

Each replica k has its own socket folder `<socket dir>/r{k}` (`IpcAddresses` plus its KV
events socket), an engine process with its own devices (`RouterOptions.device_env`) and
log tag `engine k`, and a detokenizer sidecar `detokenizer k`. A dead child takes its
replica out of rotation (`ReplicaSet.replica_died`) and its other child is stopped;
with --restart-dead-replicas both start again after `REPLICA_RESTART_BACKOFF_S` and
the replica rejoins (`ReplicaSet.rejoin`). No JAX.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time

import zmq

from jaxserve.config import EngineConfig
from jaxserve.frontend.server_address import join_host_port
from jaxserve.ipc import IpcAddresses
from jaxserve.launcher import CHILD_POLL_INTERVAL_S, CHILD_TERM_TIMEOUT_S, _Child, _spawn
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.replicas import ReplicaSet
from jaxserve.router.router import Router

logger = logging.getLogger("jaxserve")

REPLICA_RESTART_BACKOFF_S = 1.0  # --restart-dead-replicas: the least time down


def spawn_replicas(
    engine_config: EngineConfig, router_options, socket_dir: str, children: list[_Child],
    engine_class: str | None, log_level: str,
) -> list[IpcAddresses]:  # fmt: skip
    """Start every replica's engine and sidecar (each replica's sockets in its own
    folder, its engine given its own devices); returns their addresses."""
    mesh_devices = engine_config.mesh.dp * engine_config.mesh.tp
    result = []
    for k in range(router_options.replicas):
        folder = os.path.join(socket_dir, f"r{k}")
        os.makedirs(folder, exist_ok=True)
        addrs = IpcAddresses.in_dir(folder)
        addrs = dataclasses.replace(addrs, kv_events=f"ipc://{os.path.join(folder, 'kv')}")
        engine_args = [
            "--config-json", json.dumps(engine_config.to_dict()),
            "--engine-input", addrs.engine_input,
            "--detokenizer-input", addrs.detokenizer_input,
            "--engine-control", addrs.engine_control,
            "--kv-events", addrs.kv_events,
            "--log-level", log_level, "--log-name", f"engine {k}",
        ]  # fmt: skip
        if engine_class:
            engine_args += ["--engine-class", engine_class]
        env = router_options.device_env(k, mesh_devices)
        engine = replica_child(
            k, "engine", "jaxserve.engine.process", engine_args, folder, env
        )  # fmt: skip
        children.append(engine)
        sidecar_args = [
            "--model", engine_config.model,
            "--detokenizer-input", addrs.detokenizer_input,
            "--frontend-input", addrs.frontend_input,
            "--engine-input", addrs.engine_control,
            "--log-level", log_level, "--log-name", f"detokenizer {k}",
        ]  # fmt: skip
        sidecar = replica_child(
            k, "detokenizer", "jaxserve.frontend.detokenizer_process", sidecar_args, folder, {}
        )  # fmt: skip
        children.append(sidecar)
        result.append(addrs)
    logger.info(
        "%d engine replicas, router policy %s", router_options.replicas,
        router_options.policy_name,
    )  # fmt: skip
    return result


def replica_child(
    k: int, role: str, module: str, args: list[str], folder: str, env: dict
) -> _Child:
    def start() -> _Child:
        child = _spawn(f"replica {k} {role}", module, args, folder, env)
        child.replica, child.respawn = k, start
        return child

    return start()


def make_replica_set(addresses, engine_config, metrics, options, router_options):
    """The frontend's `ReplicaSet` over the replicas' addresses, with its router."""
    name = engine_config.served_model_name or os.path.basename(
        os.path.normpath(engine_config.model)
    )
    router = Router(
        engine_config.cache.block_size, router_options.policy_name,
        weight=router_options.weight, temperature=router_options.temperature,
        **router_options.kv_options(),
    )  # fmt: skip
    return ReplicaSet(
        addresses, router, RouterMetrics(metrics.registry, name), options.stall_timeout_s
    )


def describe(replicas, router_options) -> str:
    """The configuration block's replicas row: each replica's state and KV blocks."""
    each = ", ".join(
        f"{r.index}: {r.state}"
        + (f" {r.last_stats.num_blocks_total} blocks" if r.last_stats is not None else "")
        for r in replicas.replicas
    )
    listen = router_options.replica_listen
    remote = f"; remote ones join at {join_host_port(*listen)}" if listen is not None else ""
    return f"{len(replicas.replicas)} ({each}), router policy {router_options.policy_name}{remote}"


async def start_listener(replicas, engine_config, router_options):
    """With --replica-listen: the started `remote.RemoteReplicaListener`, else None.
    Raises RuntimeError naming replica-listen when its address cannot be bound."""
    if router_options.replica_listen is None:
        return None
    from jaxserve.router.identity import model_identity  # noqa: PLC0415
    from jaxserve.router.remote import RemoteReplicaListener  # noqa: PLC0415

    host, port = router_options.replica_listen
    listener = RemoteReplicaListener(host, port, replicas, model_identity(engine_config))
    try:
        await listener.start()
    except zmq.ZMQError as e:
        await listener.close()
        raise RuntimeError(
            f"replica-listen: cannot bind {join_host_port(host, port)} ({e})"
        ) from None
    return listener


async def watch_replica_children(children: list[_Child], replicas, restart: bool) -> str:
    """With several replicas: a dead child takes its replica out of rotation (and its
    other child is stopped: SIGTERM, SIGKILL after `CHILD_TERM_TIMEOUT_S`, and reaped,
    so that no engine outlives its dead sidecar, running or as a zombie). With
    `restart`, the replica's children are started again (at most once per
    `REPLICA_RESTART_BACKOFF_S`) and it rejoins with empty entries. Returns a
    description once every replica is dead at the same time."""
    down: dict[int, float] = {}  # replica -> when it went down
    stopping: dict[int, float] = {}  # id(child) -> when it was sent SIGTERM
    while True:
        for child in list(children):
            k = child.replica
            if k in down:
                _reap(child, stopping)
                continue
            if child.process.poll() is None:
                continue
            reason = child.describe_exit()
            down[k] = time.monotonic()
            logger.error("%s: replica %d is out of rotation", reason, k)
            replicas.replica_died(k, reason)
            for other in children:
                if other.replica == k and other.process.poll() is None:
                    other.process.terminate()
                    stopping[id(other)] = time.monotonic()
            if replicas.dead_reason is not None:  # remote ones included
                return f"every replica died (last: {reason})"
        if restart:
            for k, since in list(down.items()):
                mine = [c for c in children if c.replica == k]
                if time.monotonic() - since < REPLICA_RESTART_BACKOFF_S or any(
                    c.process.poll() is None for c in mine
                ):
                    continue  # its other child is still stopping, or too soon
                for old in mine:
                    stopping.pop(id(old), None)
                    children[children.index(old)] = old.respawn()
                logger.warning("replica %d: restarted; it rejoins with empty entries", k)
                await replicas.rejoin(k)
                del down[k]
        if down and len(down) == len(children) // 2 and replicas.dead_reason is not None:
            return replicas.dead_reason  # the local ones are down, the last remote one too
        await asyncio.sleep(CHILD_POLL_INTERVAL_S)


def _reap(child: _Child, stopping: dict[int, float]) -> None:
    """A child of a replica that is down: reap it once it has exited; SIGKILL it when it
    outlives its SIGTERM by `CHILD_TERM_TIMEOUT_S`."""
    if child.process.poll() is not None:  # poll() reaps
        stopping.pop(id(child), None)
        return
    since = stopping.setdefault(id(child), time.monotonic())
    if time.monotonic() - since > CHILD_TERM_TIMEOUT_S:
        logger.warning("the %s process did not stop; killing it", child.name)
        child.process.kill()
