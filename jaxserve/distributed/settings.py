"""Multi-process start-up: `jax.distributed.initialize` from flags or environment variables.

Where the three numbers (coordinator address, number of processes, this process's id)
come from, first match wins:

1. flags: `--coordinator-address HOST:PORT --num-processes N --process-id I`;
2. JAX's own variables: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`
   (scripts/launch_multihost_local.sh sets them);
3. SLURM (`srun`): `SLURM_NTASKS`, `SLURM_PROCID`, and `JAX_COORDINATOR_ADDRESS` or the
   first host of `SLURM_STEP_NODELIST` (as JAX's SlurmCluster does; scripts/launch_slurm.sh);
4. a Kubernetes indexed Job: `JOB_COMPLETION_INDEX` as the process id, with
   `JAX_NUM_PROCESSES` and `JAX_COORDINATOR_ADDRESS` set in the pod template
   (scripts/k8s_indexed_job.yaml).

None of them: a single process, and `initialize` does nothing. Process 0 hosts the
coordinator (JAX's rule) and, in jaxserve, schedules every step
(`jaxserve.distributed.step_channel`).

Failure detection. A run cannot go on without any of its processes: every step's
collectives need all of them. Two mechanisms bound how long a survivor waits:

- the step channel's membership connections (`jaxserve.distributed.membership`): a
  process that dies closes them (the kernel does, even on SIGKILL), and the others
  learn it at once;
- JAX's coordination service heartbeats, for what closes no connection (a host that
  loses power or network): a process silent for `heartbeat_timeout_s` is declared dead
  and the service makes every other process terminate (JAX's default is 100 s; jaxserve's
  is `DEFAULT_HEARTBEAT_TIMEOUT_S`, set with `--heartbeat-timeout-s` or
  `JAXSERVE_HEARTBEAT_TIMEOUT_S`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from jaxserve.distributed.step_sockets import connect
from jaxserve.frontend.server_address import wait_until_resolves
from jaxserve.logs import report_start_failure

logger = logging.getLogger(__name__)

# The step channel listens beside the coordinator: its port is the coordinator's + this.
STEP_CHANNEL_PORT_OFFSET = 1
# The highest port above the coordinator's that a run takes: the step channel's + 1 and
# + 2, the failed leader's notice on + 3 (`start_status.START_STATUS_PORT_OFFSET`).
HIGHEST_PORT_OFFSET = 3

# Seconds without a heartbeat after which JAX declares a process dead. Short enough that a
# lost host ends the run in well under a minute; long enough for a busy host's heartbeat
# thread (it runs in C++, so neither the GIL nor a long compilation delays it).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
HEARTBEAT_TIMEOUT_ENV = "JAXSERVE_HEARTBEAT_TIMEOUT_S"

# The environment variables that `resolve` reads for a run's place (the heartbeat's aside).
RUN_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
    "SLURM_PROCID", "SLURM_STEP_NODELIST", "JOB_COMPLETION_INDEX",
)  # fmt: skip

# Seconds jax.distributed.initialize waits for every process to join (JAX's default), and
# as long for the coordinator's host name to resolve and its port to accept connections
# (`init_timeout_s`: JAXSERVE_INIT_TIMEOUT_S sets it).
INIT_TIMEOUT_S = 300
INIT_TIMEOUT_ENV = "JAXSERVE_INIT_TIMEOUT_S"
# Seconds between a follower's tries to connect to the coordinator's port.
_CONNECT_RETRY_S = 0.5
# How far past jaxserve's own wait JAX's join timeout is set: when a process never joins,
# `initialize`'s watchdog ends this one with a line first; JAX would abort it with a C++
# stack trace (measured, jax 0.11.2: ~5 s after its initialization_timeout).
_JAX_JOIN_MARGIN_S = 30


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """One process's place in a multi-process run.

    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: processes in the run (>= 2).
    process_id: this process, in [0, num_processes).
    heartbeat_timeout_s: seconds of missed heartbeats after which JAX's coordination
        service declares a process dead and terminates the others (module docstring).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

    @property
    def coordinator_host(self) -> str:
        return self.coordinator_address.rpartition(":")[0].strip("[]")

    @property
    def coordinator_port(self) -> int:
        return int(self.coordinator_address.rpartition(":")[2])

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def to_arguments(self) -> list[str]:
        """The flags of `add_arguments` that give another process (e.g. the engine
        process `jaxserve serve` starts) this same place in the run."""
        return [
            "--coordinator-address", self.coordinator_address,
            "--num-processes", str(self.num_processes),
            "--process-id", str(self.process_id),
            "--heartbeat-timeout-s", str(self.heartbeat_timeout_s),
        ]  # fmt: skip


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
    heartbeat_timeout_s: int | None = None,
) -> DistributedConfig | None:
    """The run's `DistributedConfig` from flags, then the environment (module docstring);
    None for a single process.

    heartbeat_timeout_s: the flag's value; None falls back to `JAXSERVE_HEARTBEAT_TIMEOUT_S`,
        then `DEFAULT_HEARTBEAT_TIMEOUT_S`.

    Raises:
        ValueError: a partial or inconsistent setting, or a coordinator port outside
            [1, 65535 - HIGHEST_PORT_OFFSET] (names the flag or variable).
    """
    env = os.environ if env is None else env
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    count = num_processes if num_processes is not None else _int_env(env, "JAX_NUM_PROCESSES")
    index = process_id if process_id is not None else _int_env(env, "JAX_PROCESS_ID")
    if count is None and "SLURM_NTASKS" in env:
        count = _int_env(env, "SLURM_NTASKS")
        index = _int_env(env, "SLURM_PROCID") if index is None else index
        if address is None and "SLURM_STEP_NODELIST" in env:
            address = f"{first_slurm_host(env['SLURM_STEP_NODELIST'])}:{_SLURM_DEFAULT_PORT}"
    if index is None and "JOB_COMPLETION_INDEX" in env:
        index = _int_env(env, "JOB_COMPLETION_INDEX")
    if count is None or count == 1:
        if address is not None and count is None:
            raise ValueError(
                "distributed: a coordinator address is set but not the number of processes "
                "(--num-processes or JAX_NUM_PROCESSES)"
            )
        return None
    if address is None:
        raise ValueError(
            f"distributed: {count} processes but no coordinator address "
            "(--coordinator-address or JAX_COORDINATOR_ADDRESS, host:port of process 0)"
        )
    if index is None:
        raise ValueError(
            "distributed: no process id (--process-id, JAX_PROCESS_ID, SLURM_PROCID or "
            "JOB_COMPLETION_INDEX)"
        )
    if not 0 <= index < count:
        raise ValueError(f"distributed: process id {index} is not in [0, {count})")
    if not re.fullmatch(r".+:\d+", address):
        raise ValueError(f"distributed: coordinator address {address!r} is not host:port")
    port, top = int(address.rpartition(":")[2]), 65535 - HIGHEST_PORT_OFFSET
    if not 1 <= port <= top:
        # JAX takes any number and fails only after its 5-minute join wait, with an abort.
        raise ValueError(
            f"distributed: coordinator address {address!r}: port {port} is not in "
            f"[1, {top}] (--coordinator-address or JAX_COORDINATOR_ADDRESS; the run also "
            f"takes the {HIGHEST_PORT_OFFSET} ports above it)"
        )
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _int_env(env, HEARTBEAT_TIMEOUT_ENV)
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = DEFAULT_HEARTBEAT_TIMEOUT_S
    if heartbeat_timeout_s < 1:
        raise ValueError(
            f"distributed: heartbeat timeout must be >= 1 s (--heartbeat-timeout-s or "
            f"{HEARTBEAT_TIMEOUT_ENV}), got {heartbeat_timeout_s}"
        )
    return DistributedConfig(address, count, index, heartbeat_timeout_s)


def check_coordinator_host(config: DistributedConfig, timeout_s: float = INIT_TIMEOUT_S) -> None:
    """Wait (`server_address.wait_until_resolves`, one WARNING at once) until the
    coordinator address's host resolves: every process connects to it (process 0 binds
    it too). A pod's name behind a Kubernetes headless Service resolves only once that
    pod runs, so a name is waited for, up to `timeout_s` (as long as
    jax.distributed.initialize would wait for the processes to join), not refused at
    once; a follower used to wait out initialize's timeout with no word of why.

    Raises ValueError naming the coordinator address when it still does not resolve.
    """
    try:
        wait_until_resolves("distributed", config.coordinator_host, timeout_s)
    except ValueError as e:
        raise ValueError(
            f"distributed: coordinator address {config.coordinator_address}: "
            f"{str(e).removeprefix('distributed: ')} (--coordinator-address or "
            "JAX_COORDINATOR_ADDRESS: process 0's address)"
        ) from None


def init_timeout_s(env: Mapping[str, str] | None = None) -> int:
    """Seconds a process waits at start for the coordinator (its host name, then its
    port) and for the run's processes to join: $JAXSERVE_INIT_TIMEOUT_S, else
    INIT_TIMEOUT_S. Raises ValueError naming the variable when it is not an integer >= 1."""
    value = _int_env(os.environ if env is None else env, INIT_TIMEOUT_ENV)
    if value is None:
        return INIT_TIMEOUT_S
    if value < 1:
        raise ValueError(f"{INIT_TIMEOUT_ENV} must be >= 1 (seconds), got {value}")
    return value


def wait_for_coordinator(
    config: DistributedConfig, timeout_s: float, deadline: float | None = None
) -> None:
    """A follower (process_id > 0): return once the coordinator's port accepts a TCP
    connection, trying every _CONNECT_RETRY_S seconds for up to `timeout_s`.

    deadline: `time.monotonic()` time to give up at when part of the wait was spent
        before this call (default: now + `timeout_s`); the message still names
        `timeout_s`, the wait the user set, not what was left of it.

    jax.distributed.initialize, when the coordinator never answers, waits out its
    timeout and then aborts the process in C++ with a stack trace (measured, jax 0.11.2);
    so a follower waits here first: for a leader that starts later (Kubernetes peers start
    minutes apart) it is the same wait, and for one that never comes it ends in one line.
    The first refused try logs one INFO line (waiting is normal for a follower).

    Raises ValueError naming --coordinator-address and the wait when nothing accepted a
    connection within `timeout_s` seconds.
    """

    def waiting(error: OSError) -> None:
        logger.info(
            "process %d: waiting up to %g s for process 0's coordinator at %s (%s)",
            config.process_id, timeout_s, config.coordinator_address, _reason(error),
        )  # fmt: skip

    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    try:
        conn = connect(
            config.coordinator_host, config.coordinator_port, deadline, timeout_s,
            retry_s=_CONNECT_RETRY_S, on_first_refusal=waiting,
        )  # fmt: skip
    except TimeoutError as e:
        raise ValueError(
            f"distributed: coordinator address {config.coordinator_address}: nothing "
            f"accepted a connection ({_reason(e.__cause__)}) within {round(timeout_s, 1):g} s: "
            "process 0 did not start there (--coordinator-address or JAX_COORDINATOR_ADDRESS: "
            f"process 0's address; {INIT_TIMEOUT_ENV} sets the wait)"
        ) from None
    conn.close()


def _reason(error: BaseException | None) -> str:
    """The words of a failed connect: its strerror, else its type's name."""
    return getattr(error, "strerror", None) or type(error).__name__


# JAX's SlurmCluster default coordinator port.
_SLURM_DEFAULT_PORT = 61234


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "node[003-005,9],gpu1" -> "node003"."""
    head = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist.strip())
    if head is None:
        raise ValueError(f"SLURM_STEP_NODELIST: cannot parse {nodelist!r}")
    prefix, ranges = head.group(1), head.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def initialize(
    config: DistributedConfig | None, timeout_s: int | None = None, what: str = "engine"
) -> None:
    """`jax.distributed.initialize` for `config` (nothing for None). Call it before any
    other JAX call; every process of the run must call it.

    timeout_s: how long (seconds) to wait for every process to join; None:
        `init_timeout_s()`. Past it the process reports one start-up failure line
        (`what` failed to start: ..., `jaxserve.logs.report_start_failure`) and exits
        with code 2 (`_exit_unless_joined`).

    Process 0's coordinator binds the coordinator address as given (JAX's default binds
    every interface, "[::]:port", with no authentication): give the address the other
    hosts reach this one by, and only that interface listens.
    """
    if config is None:
        return
    import jax  # noqa: PLC0415 -- the CLI imports this module without JAX

    logger.info(
        "jax.distributed.initialize: process %d of %d, coordinator %s, heartbeat timeout %d s",
        config.process_id,
        config.num_processes,
        config.coordinator_address,
        config.heartbeat_timeout_s,
    )
    timeout_s = init_timeout_s() if timeout_s is None else timeout_s
    joined = threading.Event()
    threading.Thread(
        target=_exit_unless_joined, args=(config, timeout_s, joined, what),
        name="jaxserve-join-watchdog", daemon=True,
    ).start()  # fmt: skip
    jax.distributed.initialize(
        config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=timeout_s + _JAX_JOIN_MARGIN_S,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        coordinator_bind_address=config.coordinator_address,
    )
    joined.set()


def _exit_unless_joined(
    config: DistributedConfig, timeout_s: float, joined: threading.Event, what: str
) -> None:
    """`initialize`'s watchdog thread: unless the run's processes all joined within
    `timeout_s` seconds, one line (which processes to start, the variable that sets the
    wait) and exit code 2, from this thread: the main one is blocked in JAX's C++ join."""
    if joined.wait(timeout_s):
        return
    from jaxserve.distributed.processes import EXIT_START_FAILED, exit_now  # noqa: PLC0415

    error = ValueError(
        f"distributed: the run's {config.num_processes} processes did not all join within "
        f"{timeout_s:g} s at the coordinator {config.coordinator_address} (process "
        f"{config.process_id} waited): start every process with --num-processes "
        f"{config.num_processes} and the same --coordinator-address ({INIT_TIMEOUT_ENV} "
        "sets the wait)"
    )
    report_start_failure(what, error, logger)
    exit_now(EXIT_START_FAILED)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --coordinator-address, --num-processes and --process-id to a CLI parser."""
    group = parser.add_argument_group("multi-process (jax.distributed)")
    group.add_argument(
        "--coordinator-address",
        help="host:port of process 0's coordinator (default: "
        "$JAX_COORDINATOR_ADDRESS, SLURM or Kubernetes variables, else one process)",
    )
    group.add_argument(
        "--num-processes", type=int, help="processes in the run (default: $JAX_NUM_PROCESSES or 1)"
    )
    group.add_argument(
        "--process-id",
        type=int,
        help="this process, 0 = the scheduler (default: $JAX_PROCESS_ID or 0)",
    )
    group.add_argument(
        "--heartbeat-timeout-s",
        type=int,
        help=f"seconds of missed heartbeats after which a process counts as dead and the "
        f"run ends (default: ${HEARTBEAT_TIMEOUT_ENV} or {DEFAULT_HEARTBEAT_TIMEOUT_S})",
    )


def from_arguments(args: argparse.Namespace, env: Mapping[str, str] | None = None):
    """`resolve` from the flags of `add_arguments` and the environment."""
    return resolve(
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        env,
        heartbeat_timeout_s=getattr(args, "heartbeat_timeout_s", None),
    )
