"""`RouterOptions`: how many engine replicas `jaxserve serve` runs and how it routes
(`--replicas`, `--devices-per-replica`, `--router-policy`, `--router-weight`,
`--router-temperature`, `--router-balance-abs`, `--router-balance-rel`,
`--router-decode-weight`, `--router-share-limit`), and whether replicas on other hosts
may join (`--replica-listen`, `--allow-remote`)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from jaxserve.frontend.auth import is_loopback
from jaxserve.router.policy import POLICIES

# The kv policy's defaults, measured on the multi-turn chat of
# `scripts/bench_router.py --workload` (README.md, "Replicas and KV-aware routing").
BALANCE_ABS = 4.0
BALANCE_REL = 1.5
DECODE_WEIGHT = 0.0
SHARE_LIMIT = 1.1


def refuse_ipv6(flag: str, host: str) -> None:
    """Raises ValueError naming `flag` when `host` is an IPv6 literal ("::1", brackets
    already stripped): the ZeroMQ sockets between a frontend and its remote replicas
    (`router.remote`, `router.headless`) set no zmq.IPV6 and write tcp://HOST:PORT
    unbracketed, so such an address is never bound or connected. A host name passes,
    whatever it resolves to. Both ends of that connection check with this: serve's
    --replica-listen and engine's --frontend."""
    if ":" in host:
        raise ValueError(
            f"{flag}: IPv6 addresses ({host}) are not supported yet; give an IPv4 address "
            "or a host name"
        )


def refuse_unresolved(flag: str, host: str) -> None:
    """Raises ValueError naming `flag` when `host` (an IPv4 address or a host name) has
    no IPv4 address: --replica-listen binds it on this host, so a name that does not
    resolve now never will (the ZeroMQ sockets are IPv4 only, `refuse_ipv6`); without
    this, serve asked for --allow-remote. Asks the system's resolver (DNS, /etc/hosts):
    a flag check at start-up, not in RouterOptions. (engine --frontend names a peer,
    whose name may resolve later: `server_address.wait_until_resolves`.)"""
    try:
        socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(
            f"{flag}: host {host} does not resolve ({e.strerror}); give an IPv4 address or "
            "a host name that resolves to one"
        ) from None


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """replicas: engine replicas on this host (>= 1; 0 with replica_listen: a frontend
    whose replicas all join from other hosts). devices_per_replica: GPUs given to
    each (a disjoint set, through CUDA_VISIBLE_DEVICES), None: the mesh's size (dp * tp);
    on the CPU every replica has its own emulated devices anyway. policy: one of
    `policy.POLICIES` (None: "kv" with several replicas). weight / temperature: the kv
    policy's (`policy.KvPolicy`), as are balance_abs / balance_rel (the balance gate, in
    active requests; inf or None: off), decode_weight and share_limit (the bounded
    load; inf or None: off). replica_listen: (host, port) where headless engine
    replicas join (`router.remote`; port 0: the OS picks), None: none. allow_remote: lets
    replica_listen be an address other than loopback."""

    replicas: int = 1
    devices_per_replica: int | None = None
    policy: str | None = None
    weight: float = 1.0
    temperature: float = 0.0
    balance_abs: float | None = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    decode_weight: float = DECODE_WEIGHT
    share_limit: float | None = SHARE_LIMIT
    restart_dead_replicas: bool = False
    replica_listen: tuple[str, int] | None = None
    allow_remote: bool = False

    def __post_init__(self) -> None:
        if self.replicas < (0 if self.replica_listen is not None else 1):
            raise ValueError(
                f"replicas: must be >= 1 (0 only with --replica-listen: every replica then "
                f"joins from another host), got {self.replicas}"
            )
        if self.devices_per_replica is not None and self.devices_per_replica < 1:
            raise ValueError(f"devices-per-replica: must be >= 1, got {self.devices_per_replica}")
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(
                f"router-policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"router-weight: must be finite and >= 0, got {self.weight}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"router-temperature: must be finite and >= 0, got {self.temperature}")

        if self.balance_abs is not None and not self.balance_abs >= 0:  # inf: off
            raise ValueError(f"router-balance-abs: must be >= 0 (inf: off), got {self.balance_abs}")
        if not (math.isfinite(self.balance_rel) and self.balance_rel >= 1):
            raise ValueError(f"router-balance-rel: must be finite and >= 1, got {self.balance_rel}")
        if not (math.isfinite(self.decode_weight) and self.decode_weight >= 0):
            raise ValueError(
                f"router-decode-weight: must be finite and >= 0, got {self.decode_weight}"
            )
        if self.share_limit is not None and not self.share_limit >= 1:  # inf: off
            raise ValueError(f"router-share-limit: must be >= 1 (inf: off), got {self.share_limit}")
        if self.replica_listen is not None:
            host, port = self.replica_listen
            if not 0 <= port < 65536:
                raise ValueError(f"replica-listen: port must be in [0, 65535], got {port}")
            refuse_ipv6("replica-listen", host)
            if not is_loopback(host) and not self.allow_remote:
                raise ValueError(
                    f"replica-listen: {host} is not a loopback address, so engines on other "
                    "hosts (and anyone who reaches it: the port has no authentication) could "
                    "join; give --allow-remote to bind it"
                )

    def check_mesh(self, mesh_devices: int) -> None:
        """Each replica runs the mesh on exactly its own devices: raises ValueError naming
        devices-per-replica when it is set to another count than the mesh's dp * tp."""
        per = self.devices_per_replica
        if per is not None and per != mesh_devices:
            raise ValueError(
                f"devices-per-replica: {per} does not match the mesh's dp x tp = "
                f"{mesh_devices} (each replica runs --mesh on its own {mesh_devices} devices; "
                "leave the flag out to use that)"
            )

    def kv_options(self) -> dict:
        """The kv policy's keyword-only arguments (`policy.KvPolicy`)."""

        def off(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else x

        return {
            "balance_abs": off(self.balance_abs),
            "balance_rel": self.balance_rel,
            "decode_weight": self.decode_weight,
            "share_limit": off(self.share_limit),
        }

    @property
    def policy_name(self) -> str:
        return self.policy or "kv"

    def device_env(self, replica: int, mesh_devices: int) -> dict[str, str]:
        """The environment that gives `replica` its own devices: CUDA_VISIBLE_DEVICES
        picks its disjoint slice of the GPUs (of an existing CUDA_VISIBLE_DEVICES list,
        if set). Empty for one replica."""
        if self.replicas == 1:
            return {}
        per = self.devices_per_replica or mesh_devices
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(per * self.replicas)]
        if len(ids) < per * self.replicas:
            raise ValueError(
                f"devices-per-replica: {self.replicas} replicas x {per} devices need "
                f"{per * self.replicas}, CUDA_VISIBLE_DEVICES lists {len(ids)}"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[replica * per : (replica + 1) * per])}
