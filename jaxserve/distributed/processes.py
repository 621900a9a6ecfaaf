"""The processes of a multi-process run (one engine over devices of several processes):
what process 0 adds to its engine, what processes 1..N-1 run, and how any of them ends.

- `leader_executor`: process 0's executor factory (`executor.LeaderExecutor` over a
  `step_channel.StepPublisher`);
- `run_follower`: the main of processes 1..N-1 (build the same engine, then run each step
  process 0 publishes);
- `exit_on_lost_peer` / `exit_now`: no process can go on without the others, so when one
  is gone (its step channel connection closed) or a step fails, every process exits at
  once with a non-zero code and a log line that says why, and never waits at
  jax.distributed's shutdown barrier, which a dead process never reaches (measured: the
  survivor hung there until the heartbeat timeout, then JAX aborted it).

No JAX import at module level: `jaxserve.engine.process` imports this in every engine
process, mock engines included.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from jaxserve.config import EngineConfig
from jaxserve.distributed.membership import LOST_CONNECTION
from jaxserve.distributed.settings import (
    STEP_CHANNEL_PORT_OFFSET,
    DistributedConfig,
    initialize,
)
from jaxserve.logs import report_start_failure

logger = logging.getLogger("jaxserve.engine")

# Exit codes of the engine process and of followers.
EXIT_STEP_FAILED = 1
EXIT_START_FAILED = 2
EXIT_PEER_LOST = 3  # another process of a multi-process run is gone
# After a failed step in a multi-process run: how long to let the step channel's watcher
# name a dead peer (a collective fails the moment a peer's connection drops, about when
# the watcher reads its EOF) before exiting with EXIT_STEP_FAILED.
PEER_LOSS_GRACE_S = 1.0


def run_follower(config: EngineConfig, dist: DistributedConfig) -> int:
    """Processes 1..N-1 of a multi-process run: join it, build the same engine as
    process 0 (same mesh, same executables in the same order), then run each step it
    publishes until it stops.

    Returns:
        0 once the leader stopped the run. Any failure ends the process instead, at once
        (`exit_now`): EXIT_START_FAILED, EXIT_STEP_FAILED, or EXIT_PEER_LOST when the
        leader is gone.
    """
    initialize(dist, what=f"follower {dist.process_id}")  # before any other JAX call
    from jaxserve.distributed.executor import follow  # noqa: PLC0415
    from jaxserve.distributed.step_channel import StepSubscriber  # noqa: PLC0415
    from jaxserve.engine.builder import build_engine  # noqa: PLC0415

    # jax.distributed's preemption notifier takes SIGTERM over and the process would run on
    # (measured): take it back, so that stopping a follower (e.g. deleting its pod) ends
    # it, and with it the run (the leader sees it gone).
    signal.signal(signal.SIGTERM, lambda *_: _leave_on_sigterm(dist.process_id))
    try:
        parts = build_engine(config)
        runner = parts.runner
        # EPLB: the leader's new placements, applied here between the same two steps.
        on_placement = None if parts.eplb is None else parts.eplb.apply_table
        port = dist.coordinator_port + STEP_CHANNEL_PORT_OFFSET
        channel = StepSubscriber(
            dist.coordinator_host, port, dist.process_id, on_leader_lost=exit_on_lost_peer(dist)
        )
    except Exception as e:
        report_start_failure(f"follower {dist.process_id}", e, logger)
        exit_now(EXIT_START_FAILED)
    try:
        steps = follow(runner, channel, on_placement=on_placement)
    except Exception:
        logger.exception("follower %d: a step failed; the process exits", dist.process_id)
        time.sleep(PEER_LOSS_GRACE_S)  # a dead leader: let the watcher name it
        exit_now(EXIT_STEP_FAILED)
    channel.close()
    logger.info("follower %d: the leader stopped after %d steps", dist.process_id, steps)
    # Before JAX shuts down (and so that this process reaches jax.distributed's shutdown
    # barrier, where the leader waits, within its grace): no more background compiling.
    parts.warmup.stop()
    return 0


def leader_executor(dist: DistributedConfig):
    """The executor factory of process 0: publish every step to the followers (once they
    all joined the step channel), exiting at once should one be gone."""

    def make(runner):
        from jaxserve.distributed.executor import LeaderExecutor  # noqa: PLC0415
        from jaxserve.distributed.step_channel import StepPublisher  # noqa: PLC0415

        port = dist.coordinator_port + STEP_CHANNEL_PORT_OFFSET
        publisher = StepPublisher(
            dist.coordinator_host,
            port,
            dist.num_processes - 1,
            on_follower_lost=exit_on_lost_peer(dist),
        )
        return LeaderExecutor(runner, publisher)

    return make


def _leave_on_sigterm(process_id: int) -> NoReturn:
    logger.warning(
        "follower %d: SIGTERM: leaving the run (the leader ends it: it cannot go on without "
        "this process)",
        process_id,
    )
    exit_now(0)


def exit_on_lost_peer(dist: DistributedConfig) -> Callable[[int], None]:
    """The step channel's lost-peer callback for this process: log which process is gone
    and exit with EXIT_PEER_LOST (from the channel's watcher thread, so it also ends a
    process whose main thread is blocked in a step's collectives)."""

    def lost(process_id: int) -> None:
        role = "the leader" if process_id == 0 else "a follower"
        logger.error(
            "process %d (%s) of the %d-process run is gone: %s; the run cannot go on "
            "without it: process %d exits (code %d)",
            process_id,
            role,
            dist.num_processes,
            LOST_CONNECTION,
            dist.process_id,
            EXIT_PEER_LOST,
        )
        exit_now(EXIT_PEER_LOST)

    return lost


def exit_now(code: int) -> NoReturn:
    """End the process with `code` at once, after flushing logs: skips the interpreter's
    exit hooks, among them jax.distributed's shutdown barrier, which waits for every
    process of the run (a dead one: until the heartbeat timeout, then JAX aborts)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
