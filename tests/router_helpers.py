"""Helpers of the router tests: the per-replica part of GetServerInfo, and finding one
replica's engine process under a `jaxserve serve --replicas N` server."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from server_harness import ServerProcess, child_pids

from jaxserve.frontend.proto import jaxserve_pb2 as pb


def replica_infos(client) -> list:
    """GetServerInfo's `replicas` (pb.ReplicaInfo messages), by replica index."""
    info = client._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return sorted(info.replicas, key=lambda r: r.replica)


def wait_replicas(client, predicate, timeout: float, poll_s: float = 0.05) -> float:
    """Poll until predicate(replica_infos) holds; returns the seconds it took. Raises
    AssertionError with the last infos after `timeout`."""
    start = time.monotonic()
    infos = None
    while True:
        try:
            infos = replica_infos(client)
        except grpc.RpcError as e:  # no replica serves (yet): GetServerInfo is UNAVAILABLE
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        if infos is not None and predicate(infos):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {infos}")
        time.sleep(poll_s)


def replica_pid(server: ServerProcess, replica: int, module: str) -> int:
    """The pid of replica `replica`'s child running `python -m module`."""
    for pid in child_pids(server.proc.pid):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
        if module in cmd and f"/r{replica}/" in cmd:
            return pid
    raise AssertionError(f"no child of replica {replica} runs {module}")


def leading_blocks(blocks: set[bytes], hashes: list[bytes]) -> int:
    """Brute force: how many of `hashes` (a prompt's chained block hashes) lead in `blocks`."""
    n = 0
    while n < len(hashes) and hashes[n] in blocks:
        n += 1
    return n
