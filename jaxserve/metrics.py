"""Moved to `jaxserve.observability.metrics`; kept importable for existing importers."""

from jaxserve.observability.metrics import (  # noqa: F401
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    EXPERT_BALANCEDNESS,
    EXPERT_BALANCEDNESS_MEAN,
    EXPERT_ROUTED_TOKENS,
    Metrics,
)
