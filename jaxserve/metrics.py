"""Moved to `jaxserve.observability.metrics` and `.engine_metrics`; kept importable for
existing importers."""

from jaxserve.observability.engine_metrics import ENGINE_COUNTERS, ENGINE_GAUGES  # noqa: F401
from jaxserve.observability.metrics import (  # noqa: F401
    EXPERT_BALANCEDNESS,
    EXPERT_BALANCEDNESS_MEAN,
    EXPERT_ROUTED_TOKENS,
    Metrics,
)
