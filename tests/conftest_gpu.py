"""Pytest plugin: skip tests marked `gpu` when JAX has no NVIDIA GPU.

That is the suite's one allowed skip. Enable it from tests/conftest.py with

    pytest_plugins = ["conftest_gpu"]

(tests/ is on sys.path under pytest's default import mode). Modules with gpu tests may
also use `skip_without_gpu` as an autouse fixture, so they skip correctly on their own.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_available() -> bool:
    """Whether JAX's default device is an NVIDIA GPU (cached: JAX picks it once)."""
    from jaxserve.kernels.dispatch import has_nvidia_gpu  # noqa: PLC0415 -- imports JAX

    return has_nvidia_gpu()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX has no GPU backend here)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def skip_without_gpu(request: pytest.FixtureRequest) -> None:
    """Skip the requesting test if it is marked `gpu` and there is no GPU."""
    if request.node.get_closest_marker("gpu") and not gpu_available():
        pytest.skip("needs an NVIDIA GPU (JAX has no GPU backend here)")
