"""The executor seam: how the engine core reaches "the devices".

`EngineCore` dispatches every step and fetches its results through an `Executor`; it
never knows how many processes run the step. `Executor` is the one-process
implementation (the runner's own dispatch and fetch). Several processes:
`jaxserve.distributed.executor.LeaderExecutor` publishes each step's buffers to the
other processes before dispatching it, and `jaxserve.distributed.executor.follow` runs
them there.
"""

from __future__ import annotations

from jaxserve.engine.model_runner import InFlightStep, ModelRunner
from jaxserve.engine.outputs import StepSamples
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.step_inputs import StepInputs


class Executor:
    """Runs packed steps on this process's devices (one process: all of them).

    Args:
        runner: the compiled `ModelRunner` the steps run on.

    Attributes:
        coordination_time_s / last_coordination_s: seconds spent agreeing on steps with
            other processes, since start-up / in the last step (0 in one process).
        step_agreement_s: the followers' step agreement latency (slowest follower's
            median transit, `StepPublisher.agreement_s`; 0 in one process).
        coordination_bytes: bytes published to the followers since start-up.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.coordination_time_s = 0.0
        self.last_coordination_s = 0.0
        self.step_agreement_s = 0.0
        self.coordination_bytes = 0

    def publish_placement(self, physical_to_logical) -> None:
        """Tell the other processes of a new EPLB placement, before applying it here
        ([M, S] int32; nothing to do in one process)."""

    def dispatch(self, x: StepInputs, sched: SchedulerOutput) -> InFlightStep:
        """Queue one step and return at once (see `ModelRunner.dispatch`)."""
        return self.runner.dispatch(x, sched)

    def fetch(self, step: InFlightStep) -> StepSamples:
        """Wait for a dispatched step's samples (see `ModelRunner.fetch`)."""
        return self.runner.fetch(step)

    def close(self) -> None:
        """Release what the executor holds besides the runner (idempotent)."""
