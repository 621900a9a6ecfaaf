"""The engine's executor across processes: process 0 leads, the others follow.

Every process builds the same engine (same mesh, same executables in the same order,
same KV cache layout: `engine.builder.build_engine` of the same `EngineConfig`).
Process 0's `EngineCore` schedules; its `LeaderExecutor` publishes each step's packed
host buffers on the step channel before dispatching the step itself, and the other
processes `follow`: they dispatch the same executable on the same buffers, so the
collectives inside the step meet. Their outputs are not read: the leader's replicated
copy is the result.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
from jaxserve.distributed.step_message import PLACEMENT, STOP
from jaxserve.engine.executor import Executor
from jaxserve.engine.model_runner import InFlightStep, ModelRunner
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.step_inputs import StepInputs
from jaxserve.engine.step_shapes import StepShape


class LeaderExecutor(Executor):
    """Process 0's executor: publish each step on `publisher`, then dispatch it.

    Args:
        runner: this process's compiled runner.
        publisher: the step channel to the followers (closed by `close`, which stops them).

    Its time per step (publishing) is the `coordination_time_s` counter; the followers'
    reported transit, `step_agreement_s`; the bytes published, `coordination_bytes`.
    """

    def __init__(self, runner: ModelRunner, publisher: StepPublisher) -> None:
        super().__init__(runner)
        self._publisher: StepPublisher | None = publisher
        self._steps = 0

    def publish_placement(self, physical_to_logical: np.ndarray) -> None:
        """Send the followers a new EPLB placement ([M, S] int32), to apply before the
        next step as this process does (the move's collectives span every process)."""
        if self._publisher is not None:
            table = np.ascontiguousarray(physical_to_logical, np.int32)
            self._publisher.publish([table], meta={"steps": self._steps}, kind=PLACEMENT)

    def dispatch(self, x: StepInputs, sched: SchedulerOutput) -> InFlightStep:
        if self._publisher is not None:
            self._publisher.publish(x.buffers, meta={"shape": list(x.shape)})
            self.last_coordination_s = self._publisher.stats.last_s
            self.coordination_time_s += self.last_coordination_s
            self.step_agreement_s = self._publisher.agreement_s
            self.coordination_bytes = self._publisher.bytes_sent
            self._steps += 1
        return super().dispatch(x, sched)

    def close(self) -> None:
        """Stop the followers (idempotent)."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


def follow(
    runner: ModelRunner,
    subscriber: StepSubscriber,
    timeout_s: float | None = None,
    on_placement: Callable[[np.ndarray], None] | None = None,
) -> int:
    """Run the leader's steps on `runner` until it sends STOP (processes 1..N-1 of a run).

    on_placement: applies a new EPLB placement ([M, S] int32 physical_to_logical; e.g.
        `EplbController.apply_table`), after this process's previous step finished and
        before its next, where the leader applies it.

    Returns:
        The number of steps run.

    Raises:
        TimeoutError: no message from the leader within timeout_s.
        RuntimeError: a placement arrived with no `on_placement` (EPLB is on in the
            leader only), or after another number of steps than the leader had run.
    """
    steps = 0
    pending = None
    while (msg := subscriber.receive(timeout_s)).kind != STOP:
        if msg.kind == PLACEMENT:
            if on_placement is None:
                raise RuntimeError(
                    "EPLB: the leader re-placed experts but this process has no EPLB "
                    "controller (start every process with the same --enable-eplb)"
                )
            if msg.meta["steps"] != steps:
                raise RuntimeError(
                    f"EPLB: placement after {msg.meta['steps']} leader steps arrived after "
                    f"{steps} steps here; the processes no longer run the same steps"
                )
            if pending is not None:
                jax.block_until_ready(pending)  # the move donates the weights it reads
                pending = None
            on_placement(msg.arrays[0])
            continue
        out = runner.run_buffers(StepShape(*msg.meta["shape"]), msg.arrays)
        steps += 1
        # Bound the device queue (and the host buffers it holds) to one step.
        if pending is not None:
            jax.block_until_ready(pending)
        pending = out.token_ids
    return steps
