"""The session's persistent compilation cache (tests/conftest.py) serves this process, and
a compilation it serves still counts in `CompileCounter`: the tests that assert "no
compilation after warm-up" (tests/test_engine.py and others) keep their meaning."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.compile_counter import CompileCounter


def test_engines_default_to_the_session_cache(compile_cache):
    assert EngineConfig().compilation_cache_dir == compile_cache
    assert os.environ["JAXSERVE_CACHE_ROOT"] in compile_cache  # inherited by subprocesses


def test_a_persistent_cache_hit_counts_as_a_compilation():
    CompileCounter.install()
    hits = []

    def on_event(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(on_event)
    x = jnp.arange(12.0).reshape(3, 4)

    def fresh():
        # A new function object each time: JAX's in-memory caches miss, the disk one hits.
        return jax.jit(lambda a: jnp.tanh(a @ a.T + 0.125).sum(axis=0))

    try:
        before = CompileCounter.count
        first = fresh()(x)
        assert CompileCounter.count == before + 1
        seen = len(hits)
        second = fresh()(x)
        assert len(hits) == seen + 1, "the second compilation was not served by the disk cache"
        assert CompileCounter.count == before + 2
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    np.testing.assert_allclose(np.asarray(second), np.asarray(first))
