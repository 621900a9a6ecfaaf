"""One process of a multi-process greedy run (started by tests/test_multihost.py).

    python multihost_worker.py MODEL_DIR DP TP OUT_JSON

The run's place comes from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID: `jaxserve.distributed.resolve`). Process 0 builds every step's inputs
and publishes them on the step channel before running the step; the others receive each
step and run it with the same inputs. Process 0 writes {"tokens": ..., "channel_us": ...}
to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxserve import distributed  # noqa: E402

# Same prompts and lengths as tests/test_sharding.py's model tests.
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 19)), [7, 7, 7], list(range(30, 42)), [5, 6]]
NUM_NEW = 5
MAX_LEN = 32


def main(model_dir: str, dp: int, tp: int, out_json: str) -> None:
    config = distributed.resolve()
    distributed.initialize(config)

    from sharding_utils import GreedyDriver  # noqa: PLC0415

    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber  # noqa: PLC0415
    from jaxserve.distributed.step_message import STOP  # noqa: PLC0415
    from jaxserve.sharding.load import load_sharded_model  # noqa: PLC0415 -- after init
    from jaxserve.sharding.mesh import build_mesh  # noqa: PLC0415

    mesh = build_mesh(dp, tp)
    model, _ = load_sharded_model(model_dir, mesh)
    driver = GreedyDriver(model, mesh, len(PROMPTS), MAX_LEN)
    port = config.coordinator_port + distributed.STEP_CHANNEL_PORT_OFFSET
    if config.is_leader:
        channel = StepPublisher(config.coordinator_host, port, config.num_processes - 1)
        driver.publish = channel.publish
        tokens, _ = driver.generate(PROMPTS, NUM_NEW)
        channel.close()
        result = {"tokens": tokens, "channel_us": channel.stats.mean_us}
        with open(out_json, "w") as f:
            json.dump(result, f)
    else:
        channel = StepSubscriber(config.coordinator_host, port, config.process_id)
        while (message := channel.receive(timeout_s=300)).kind != STOP:
            driver.run(message.arrays)
        channel.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
