"""`EplbController`: when and how the engine re-places its MoE experts.

Ties the three EPLB parts to a model runner: the load window it records
(eplb/recorder.py), the planner (eplb/planner.py) and the weight mover
(eplb/executor.py). The engine counts its steps and, every `step_interval` of them,
asks `plan()` for a new placement; when one is returned it drains its in-flight steps
(the move donates the old weights) and calls `apply()`, which moves the weights, swaps
them and the new placement tables into the arrays the compiled steps read (same shapes,
dtypes and shardings: no recompile), and empties the load window (its counts are by
slot, so they belong to the old placement).

Follows vLLM's EPLB (`vllm/distributed/eplb/eplb_state.py`, `EplbState.step`: count the
steps, rearrange every `step_interval` steps from the `window_size`-step load window,
log the balancedness); the plan is DeepSeek's EPLB (github.com/deepseek-ai/EPLB).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from jax.sharding import Mesh

from jaxserve.eplb.executor import PlacementExecutor
from jaxserve.eplb.planner import (
    REPLAN_TOLERANCE,
    device_load,
    minimize_movement,
    plan_placement,
)
from jaxserve.eplb.recorder import balancedness
from jaxserve.models.moe import PLACEMENT_FIELDS

if TYPE_CHECKING:
    from jaxserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedPlacement:
    """A re-placement `plan()` decided on, not yet applied.

    physical_to_logical: [M, S] int32, the new logical expert of every slot.
    layers_changed: MoE layers (rows) whose placement changes.
    slots_changed: slots, summed over layers, whose expert changes.
    balancedness_before / balancedness_after: mean over MoE layers of the window's
        balancedness (mean / max device load) under the current placement, and the
        one the plan expects for the same load.
    """

    physical_to_logical: np.ndarray
    layers_changed: int
    slots_changed: int
    balancedness_before: float
    balancedness_after: float


class EplbController:
    """Plans and applies expert re-placements for one `ModelRunner` on a mesh.

    Builds (and compiles, once) the `PlacementExecutor` for the runner's expert weights:
    construct it before the engine counts its start-up compilations.

    Args:
        runner: the model runner; its model must have placement tables (built on a
            mesh) and its `expert_load` recorder.
        mesh: the mesh the model is sharded on (ep = its size).
        num_experts: E, logical experts per MoE layer.
        max_replicas: width of the model's logical_to_physical tables (R + 1).
        step_interval: engine steps between two plans.
        min_improvement: `plan_placement`'s threshold, in [0, 1).

    Raises:
        ValueError: a runner without MoE layers or placement tables; the executor's
            errors (weights not sharded over the mesh).
    """

    def __init__(
        self,
        runner: ModelRunner,
        mesh: Mesh,
        num_experts: int,
        max_replicas: int,
        *,
        step_interval: int,
        min_improvement: float,
    ):
        if runner.expert_load is None:
            raise ValueError("EPLB: the model has no MoE layers")
        self.runner = runner
        self.ep = mesh.size
        self.num_experts = num_experts
        self.step_interval = step_interval
        self.min_improvement = min_improvement
        self.executor = PlacementExecutor(mesh, runner.expert_weights(), num_experts, max_replicas)
        self.steps_since_plan = 0
        self.num_rebalances = 0
        self.rebalance_time_s = 0.0

    def step_done(self) -> bool:
        """Count one engine step; True when a plan is due (every `step_interval`)."""
        self.steps_since_plan += 1
        return self.steps_since_plan >= self.step_interval

    def plan(self) -> PlannedPlacement | None:
        """Plan from the load window (restarts the step count). None when the window is
        empty or no layer's plan beats its current placement by `min_improvement`."""
        self.steps_since_plan = 0
        recorder = self.runner.expert_load
        if recorder.num_window_steps == 0:
            return None
        current = self.runner.physical_to_logical()
        load = recorder.expert_load(current, self.num_experts)
        if load.sum() == 0:
            return None
        planned = plan_placement(
            load,
            current.shape[1],
            self.ep,
            current=current,
            min_improvement=self.min_improvement,
            tolerance=REPLAN_TOLERANCE,
        ).physical_to_logical
        rows = [minimize_movement(c, p, self.ep) for c, p in zip(current, planned, strict=True)]
        new = np.stack([row for row, _ in rows])
        changed = (new != current).any(axis=1)
        if not changed.any():
            return None
        return PlannedPlacement(
            physical_to_logical=new,
            layers_changed=int(changed.sum()),
            slots_changed=sum(moved for _, moved in rows),
            balancedness_before=float(np.mean(balancedness(device_load(load, current, self.ep)))),
            balancedness_after=float(np.mean(balancedness(device_load(load, new, self.ep)))),
        )

    def apply(self, plan: PlannedPlacement) -> None:
        """Move the weights to `plan`, swap them and the new tables into the runner, and
        empty the load window. No step may be in flight (the old weights are donated).
        Logs one line; counts `num_rebalances` and `rebalance_time_s`.

        With several processes every process must apply the same placement between the
        same two steps (the leader publishes it first: `LeaderExecutor.publish_placement`;
        a follower calls `apply_table`)."""
        stats = self.apply_table(plan.physical_to_logical)
        logger.info(
            "EPLB: re-placed %d MoE layer(s): %d slot(s) changed (%d copied on-device, %d "
            "moved across devices, %.1f MiB, %.1f MiB on the wire) in %.3f s; "
            "balancedness %.3f -> %.3f expected",
            plan.layers_changed,
            plan.slots_changed,
            stats.slots_copied_local,
            stats.slots_moved_remote,
            stats.bytes_moved / 2**20,
            stats.bytes_on_wire / 2**20,
            stats.seconds,
            plan.balancedness_before,
            plan.balancedness_after,
        )

    def apply_table(self, physical_to_logical: np.ndarray):
        """`apply` from the new [M, S] physical_to_logical alone (a follower process's
        side of a re-placement); returns the executor's `ReplacementStats`."""
        current = self.runner.physical_to_logical()
        weights, tables, stats = self.executor.apply(
            self.runner.expert_weights(), current, physical_to_logical
        )
        # Not `dataclasses.asdict`: it deep-copies, and copying a device array runs (and
        # compiles) a copy program.
        self.runner.set_expert_placement(
            weights, [{name: getattr(t, name) for name in PLACEMENT_FIELDS} for t in tables]
        )
        self.runner.expert_load.reset()
        self.num_rebalances += 1
        self.rebalance_time_s += stats.seconds
        return stats
