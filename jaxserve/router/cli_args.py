"""The router's `jaxserve serve` flags and the `RouterOptions` they make."""

from __future__ import annotations

import argparse

from jaxserve.router import options
from jaxserve.router.options import RouterOptions, refuse_ipv6, refuse_unresolved
from jaxserve.router.policy import POLICIES

# The help group of the flags below; every one of them is the frontend's.
ROUTER_GROUP = "replicas and routing"


def add_router_arguments(s: argparse.ArgumentParser) -> None:
    """--replicas, --devices-per-replica, --router-policy, --router-weight,
    --router-temperature, --restart-dead-replicas, --replica-listen, --allow-remote (a
    "replicas and routing" group)."""
    g = s.add_argument_group(ROUTER_GROUP)
    g.add_argument(
        "--replicas", type=int, default=1, metavar="N",
        help="engine replicas on this host, each with its own devices, engine process and "
        "detokenizer, behind this frontend's request router; 0 with --replica-listen: "
        "all join from other hosts (default: 1)",
    )  # fmt: skip
    g.add_argument(
        "--devices-per-replica", type=int, metavar="D",
        help="GPUs per replica, a disjoint set each (CUDA_VISIBLE_DEVICES) (default: the "
        "mesh's size, dp x tp; on the CPU each replica has its own emulated devices)",
    )  # fmt: skip
    g.add_argument(
        "--router-policy", choices=POLICIES,
        help="how a request's replica is chosen: kv (prefix-cache aware, load "
        "balanced), round-robin, least-loaded or random (default: kv)",
    )  # fmt: skip
    g.add_argument(
        "--router-weight", type=float, default=1.0, metavar="W",
        help="kv policy: cost of one uncached prompt block against one block of a "
        "replica's active load (default: 1.0)",
    )  # fmt: skip
    g.add_argument(
        "--router-temperature", type=float, default=0.0, metavar="T",
        help="kv policy: 0 takes the lowest cost; > 0 samples among the near-best "
        "(default: 0)",
    )  # fmt: skip
    g.add_argument(
        "--router-balance-abs", type=float, default=options.BALANCE_ABS, metavar="N",
        help="kv policy: the load is imbalanced when the most active requests on a "
        "replica exceed the fewest by more than N (and by --router-balance-rel); then "
        "the request goes to the fewest, whatever the cache (SGLang's cache-aware "
        "router) (default: 4; inf: never imbalanced)",
    )  # fmt: skip
    g.add_argument(
        "--router-balance-rel", type=float, default=options.BALANCE_REL, metavar="R",
        help="kv policy: ... and only if, too, the most exceed R x the fewest "
        "(default: 1.5)",
    )  # fmt: skip
    g.add_argument(
        "--router-decode-weight", type=float, default=options.DECODE_WEIGHT, metavar="D",
        help="kv policy: weight of a replica's held blocks in its load, against its "
        "pending prefill blocks (default: 0; 1 with the two above off is NVIDIA Dynamo's cost)",
    )  # fmt: skip
    g.add_argument(
        "--router-share-limit", type=float, default=options.SHARE_LIMIT, metavar="C",
        help="kv policy: a replica that has taken more than C x the mean of the requests "
        "routed in the last minute or so takes none while another is under (bounded "
        "load) (default: 1.1; inf: no limit)",
    )  # fmt: skip
    g.add_argument(
        "--restart-dead-replicas", action="store_true",
        help="start a replica whose engine or detokenizer died again; it rejoins with "
        "empty entries in the router (default: off: it stays out of rotation)",
    )  # fmt: skip
    g.add_argument(
        "--replica-listen", metavar="HOST:PORT",
        help="accept headless engine replicas (`jaxserve engine --frontend HOST:PORT` on "
        "other hosts) here, beside the --replicas local ones; PORT in [1, 65535], the "
        "one the engines are given (default: none)",
    )  # fmt: skip
    g.add_argument(
        "--allow-remote", action="store_true",
        help="let --replica-listen bind an address other than loopback (its ports carry "
        "no authentication: a private network only) (default: loopback only)",
    )  # fmt: skip


def host_port(flag: str, text: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" ("[::1]:PORT" for IPv6), PORT within [1, 65535].
    Raises ValueError naming flag."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{flag}: expected HOST:PORT, got {text!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{flag}: port must be within [1, 65535], got {text!r}")
    return host, int(port)


def router_options(args: argparse.Namespace) -> RouterOptions:
    """RouterOptions from the flags. Raises ValueError naming the flag, --replica-listen's
    host among them when it does not resolve (`options.refuse_unresolved`)."""
    listen = args.replica_listen
    if listen is not None:
        listen = host_port("replica-listen", listen)
        refuse_ipv6("replica-listen", listen[0])  # first: its own words, not "does not resolve"
        refuse_unresolved("replica-listen", listen[0])
    return RouterOptions(
        replica_listen=listen,
        allow_remote=args.allow_remote,
        replicas=args.replicas,
        devices_per_replica=args.devices_per_replica,
        policy=args.router_policy,
        weight=args.router_weight,
        temperature=args.router_temperature,
        balance_abs=args.router_balance_abs,
        balance_rel=args.router_balance_rel,
        decode_weight=args.router_decode_weight,
        share_limit=args.router_share_limit,
        restart_dead_replicas=args.restart_dead_replicas,
    )
