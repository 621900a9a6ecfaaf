"""Several processes (multi-host): everything that exists only because a run spans processes.

- `settings`: where a process's place in the run comes from (flags, JAX, SLURM,
  Kubernetes) and `jax.distributed.initialize` (re-exported here; no JAX import);
- `step_channel`: process 0 publishes each step's packed inputs, the others receive them;
  its parts: `step_message` (the message and its bytes), `step_sockets` (the TCP
  connections and the join), `step_transport` (ring or TCP, agreed at join), `shm_ring`
  (the shared-memory ring of the followers on the leader's host, woken by `futex`),
  `membership` (liveness of the peers, the followers' transit reports);
- `executor`: the engine's executor for process 0 (publish, then dispatch) and the
  followers' step loop;
- `processes`: process 0's executor factory, the followers' main (`run_follower`), and
  how every process of the run exits when one is gone;
- `arrays`: host buffers onto a mesh whose devices span processes, and replicated
  outputs back to the host.

The engine core knows none of this: it talks to an `engine.executor.Executor`.
"""

from jaxserve.distributed.settings import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HEARTBEAT_TIMEOUT_ENV,
    STEP_CHANNEL_PORT_OFFSET,
    DistributedConfig,
    add_arguments,
    check_coordinator_host,
    first_slurm_host,
    from_arguments,
    init_timeout_s,
    initialize,
    resolve,
    wait_for_coordinator,
)

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "HEARTBEAT_TIMEOUT_ENV",
    "STEP_CHANNEL_PORT_OFFSET",
    "DistributedConfig",
    "add_arguments",
    "check_coordinator_host",
    "first_slurm_host",
    "from_arguments",
    "init_timeout_s",
    "initialize",
    "resolve",
    "wait_for_coordinator",
]
