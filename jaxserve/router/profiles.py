"""`jaxserve profile` with several replicas: one capture on every serving replica.

The Profiler RPC (`observability.profile_rpc`) sends one `ipc.ProfileRequest(out_dir,
seconds)` and waits for `out_dir/profile.json`. With several replicas, `profile_replicas`
sends each serving replica k its own request for `out_dir/replica-k` (so their JAX traces
and host timelines do not overwrite each other), waits for each replica's manifest
there, and then writes the combined manifest at `out_dir/profile.json` (written whole,
through a rename): the fields of one replica's manifest (`observability.profile.
ProfileSession.finish`) over all of them (steps summed, files, xplane and trace_json
lists joined, host_timeline the first replica's, error naming each replica that failed)
plus `replicas`: {k: that replica's manifest, or None when it wrote none within
seconds + `profile_rpc.MANIFEST_GRACE_S`}. No JAX.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from jaxserve.ipc import ProfileRequest
from jaxserve.observability.profile import MANIFEST

logger = logging.getLogger("jaxserve.router")

POLL_S = 0.1


def replica_dir(out_dir: str, replica: int) -> str:
    """Where replica `replica`'s capture goes."""
    return os.path.join(out_dir, f"replica-{replica}")


async def profile_replicas(replicas: list, msg: ProfileRequest, grace_s: float) -> dict:
    """Capture on every replica in `replicas` (`Replica`s that serve now, non-empty) and
    write the combined manifest; returns it.

    Args:
        replicas: the replicas to capture on.
        msg: the request (out_dir absolute and created, seconds in range: checked by
            the RPC).
        grace_s: how long past `seconds` to wait for a replica's manifest.
    """
    paths = {}
    for rep in replicas:
        sub = Path(replica_dir(msg.out_dir, rep.index))
        sub.mkdir(parents=True, exist_ok=True)
        (sub / MANIFEST).unlink(missing_ok=True)  # an older capture's is not this one's
        paths[rep.index] = sub / MANIFEST
        rep.client.send_control(ProfileRequest(str(sub), msg.seconds))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + msg.seconds + grace_s
    while loop.time() < deadline and not all(p.exists() for p in paths.values()):
        await asyncio.sleep(POLL_S)
    each = {k: json.loads(p.read_text()) if p.exists() else None for k, p in paths.items()}
    got = [m for m in each.values() if m is not None]
    errors = [
        f"replica {k}: {m['error'] if m is not None else 'no manifest'}"
        for k, m in each.items()
        if m is None or m.get("error")
    ]
    manifest = {
        "out_dir": str(Path(msg.out_dir).resolve()),
        "seconds": msg.seconds,
        "started": min((m["started"] for m in got), default=None),
        "steps": sum(m.get("steps", 0) for m in got),
        "error": "; ".join(errors) or None,
        "files": [f for m in got for f in m.get("files", [])],
        "host_timeline": got[0]["host_timeline"] if got else "",
        "xplane": [f for m in got for f in m.get("xplane", [])],
        "trace_json": [f for m in got for f in m.get("trace_json", [])],
        "replicas": {str(k): m for k, m in each.items()},
    }
    target = Path(msg.out_dir) / MANIFEST
    tmp = target.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, target)
    logger.info("profile of %d replicas written to %s", len(replicas), msg.out_dir)
    return manifest
