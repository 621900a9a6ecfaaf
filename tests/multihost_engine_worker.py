"""One process of a multi-process engine run (started by tests/test_multihost.py).

    python multihost_engine_worker.py MODEL_DIR DP TP OUT_JSON

The run's place comes from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID). Every process builds the same engine on the dp x tp mesh that spans
all of them. Process 0 leads: it schedules REQUESTS and publishes each step on the step
channel before dispatching it, then writes {"tokens": {id: [...]}, "counters": {...}} to
OUT_JSON. The others follow its steps until it stops them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxserve import distributed  # noqa: E402


def engine_config(model_dir: str, dp: int, tp: int):
    """The EngineConfig every process (and the in-process reference, the session's
    `mesh_engine`) uses: `sharding_utils.mesh_engine_config`."""
    from sharding_utils import mesh_engine_config  # noqa: PLC0415 -- imports jax

    return mesh_engine_config(model_dir, dp, tp)


def requests() -> list[tuple[str, list[int], dict]]:
    """Mixed-length greedy requests (vocab 256)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(7)]
    return [(f"r{i}", p, dict(temperature=0.0, max_tokens=6)) for i, p in enumerate(prompts)]


def main(model_dir: str, dp: int, tp: int, out_json: str) -> None:
    config = distributed.resolve()
    distributed.initialize(config)

    from engine_helpers import run_engine  # noqa: PLC0415 -- after jax.distributed

    from jaxserve.distributed.executor import LeaderExecutor, follow  # noqa: PLC0415
    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber  # noqa: PLC0415
    from jaxserve.engine.builder import build_engine  # noqa: PLC0415
    from jaxserve.engine.core import EngineCore  # noqa: PLC0415

    port = config.coordinator_port + distributed.STEP_CHANNEL_PORT_OFFSET
    if config.is_leader:

        def lead(runner):
            publisher = StepPublisher(config.coordinator_host, port, config.num_processes - 1)
            return LeaderExecutor(runner, publisher)

        engine = EngineCore(engine_config(model_dir, dp, tp), executor=lead)
        try:
            results = run_engine(engine, requests())
        finally:
            engine.close()
        tokens = {rid: r.tokens for rid, r in results.items()}
        with open(out_json, "w") as f:
            counters = dataclasses.asdict(engine.counters())
            json.dump({"tokens": tokens, "counters": counters}, f)
    else:
        runner = build_engine(engine_config(model_dir, dp, tp)).runner
        channel = StepSubscriber(config.coordinator_host, port, config.process_id)
        follow(runner, channel, timeout_s=300)
        channel.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
