"""One process of a multi-process engine run with EPLB (started by
tests/test_eplb_multiprocess.py).

    python multihost_eplb_worker.py MODEL_DIR DP TP OUT_JSON

As tests/multihost_engine_worker.py, with EPLB re-planning every few steps: process 0
plans, publishes each new placement on the step channel and applies it; the others apply
it between the same two steps (`distributed.follow(on_placement=...)`). Every process
writes {"physical_to_logical": [M][S], "rebalances": n} to OUT_JSON.<process id>, and
process 0 also the tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxserve import distributed  # noqa: E402


def eplb_engine_config(model_dir: str, dp: int, tp: int):
    """The engine config of multihost_engine_worker with EPLB on: 8 redundant slots,
    a re-plan every 3 steps, any improvement accepted."""
    from multihost_engine_worker import engine_config  # noqa: PLC0415

    from jaxserve.config import EplbConfig  # noqa: PLC0415

    eplb = EplbConfig(
        enabled=True, num_redundant_experts=8, window_size=3, step_interval=3, min_improvement=0
    )
    return dataclasses.replace(engine_config(model_dir, dp, tp), eplb=eplb)


def main(model_dir: str, dp: int, tp: int, out_json: str) -> None:
    config = distributed.resolve()
    distributed.initialize(config)

    from engine_helpers import run_engine  # noqa: PLC0415 -- after jax.distributed
    from multihost_engine_worker import requests  # noqa: PLC0415

    from jaxserve.distributed.executor import LeaderExecutor, follow  # noqa: PLC0415
    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber  # noqa: PLC0415
    from jaxserve.engine.builder import build_engine  # noqa: PLC0415
    from jaxserve.engine.core import EngineCore  # noqa: PLC0415

    port = config.coordinator_port + distributed.STEP_CHANNEL_PORT_OFFSET
    result = {}
    if config.is_leader:

        def lead(runner):
            publisher = StepPublisher(config.coordinator_host, port, config.num_processes - 1)
            return LeaderExecutor(runner, publisher)

        engine = EngineCore(eplb_engine_config(model_dir, dp, tp), executor=lead)
        try:
            results = run_engine(engine, requests())
        finally:
            engine.close()
        result["tokens"] = {rid: r.tokens for rid, r in results.items()}
        runner, eplb = engine.runner, engine.eplb
    else:
        parts = build_engine(eplb_engine_config(model_dir, dp, tp))
        runner, eplb = parts.runner, parts.eplb
        channel = StepSubscriber(config.coordinator_host, port, config.process_id)
        follow(runner, channel, timeout_s=300, on_placement=eplb.apply_table)
        channel.close()
    result["physical_to_logical"] = runner.physical_to_logical().tolist()
    result["rebalances"] = eplb.num_rebalances
    with open(f"{out_json}.{config.process_id}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
