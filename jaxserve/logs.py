"""Logging set-up shared by every jaxserve process (frontend, engine, detokenizer, follower).

No JAX here: the frontend and the detokenizer import this.
"""

from __future__ import annotations

import logging

# Loggers of libraries whose INFO lines are noise at every start, raised to WARNING:
# jax._src.xla_bridge logs "Unable to initialize backend 'tpu'" (and 'cuda' on a CPU-only
# machine) while JAX looks for its platforms.
QUIET_LOGGERS = ("jax._src.xla_bridge",)


def configure_logging(level: str, process_name: str) -> None:
    """Log to stderr at `level` ("INFO", "debug", ...), each line tagged `[process_name]`;
    the `QUIET_LOGGERS` log only warnings and errors (unless `level` is DEBUG, which keeps
    everything for debugging).

    Raises ValueError if `level` is not a logging level name.
    """
    level = level.upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s [{process_name}] %(message)s"
    )
    if logging.getLevelName(level) != logging.DEBUG:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
