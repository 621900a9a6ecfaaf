"""The one kernel backend switch (jaxserve.kernels.dispatch): JAXSERVE_KERNELS, the same
answers through the interpreted kernels and the references, and the fallback to the
reference for inputs the kernels do not take."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest_gpu import skip_without_gpu  # noqa: F401 -- fixture used via pytestmark
from kernel_oracles import assert_close, attention_oracle, bf16, f64, gmm_oracle, make_batch

from jaxserve.kernels import dispatch

pytestmark = pytest.mark.usefixtures("skip_without_gpu")


@pytest.fixture
def env_backend(monkeypatch):
    """Set JAXSERVE_KERNELS for one test and re-read it."""

    def set_value(value):
        monkeypatch.setenv(dispatch.ENV_VAR, value)
        dispatch._backend_from_environment.cache_clear()

    yield set_value
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch._backend_from_environment.cache_clear()


def test_backend_defaults_to_reference_on_cpu(env_backend):
    env_backend("")
    assert dispatch.get_backend() == (
        dispatch.PALLAS_MGPU if dispatch.has_nvidia_gpu() else dispatch.REFERENCE
    )
    env_backend("interpret")
    assert dispatch.get_backend() == dispatch.INTERPRET


def test_backend_env_rejects_unknown_and_missing_gpu(env_backend):
    env_backend("triton")
    with pytest.raises(ValueError, match="JAXSERVE_KERNELS='triton'"):
        dispatch.get_backend()
    if not dispatch.has_nvidia_gpu():
        env_backend("pallas")
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            dispatch.get_backend()


def test_dispatch_routes_to_interpreted_kernels_and_reference():
    """The same calls give the same answers through both backends."""
    rng = np.random.default_rng(6)
    x, w = bf16(rng, (64, 128)), bf16(rng, (4, 128, 128), 0.1)
    group_sizes = jnp.asarray([20, 0, 43, 1], jnp.int32)
    positions, metadata = make_batch(
        rng, [(1, 9), (2, 70)], num_tokens=4, block_size=8, num_blocks=12, max_blocks=9
    )
    q = bf16(rng, (4, 16, 64))
    k_cache, v_cache = bf16(rng, (12, 8, 2, 64)), bf16(rng, (12, 8, 2, 64))
    outs = {}
    for backend in (dispatch.REFERENCE, dispatch.INTERPRET):
        with dispatch.backend_override(backend):
            assert dispatch.get_backend() == backend
            outs[backend] = (
                dispatch.grouped_matmul(x, w, group_sizes),
                dispatch.paged_attention(q, k_cache, v_cache, positions, metadata, 0.125),
            )
    for kernel, reference in zip(outs[dispatch.INTERPRET], outs[dispatch.REFERENCE], strict=True):
        assert_close(kernel, f64(reference))


def test_dispatch_falls_back_to_reference_for_unsupported_inputs(caplog):
    """A float32 model (or head_dim 32) runs the reference on a kernel backend, with a
    warning that names the cause."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.float32)
    group_sizes = jnp.asarray([10, 6], jnp.int32)
    positions, metadata = make_batch(
        rng, [(1, 5)], num_tokens=2, block_size=8, num_blocks=4, max_blocks=2
    )
    q, cache = bf16(rng, (2, 4, 32)), bf16(rng, (4, 8, 2, 32))
    with caplog.at_level("WARNING"), dispatch.backend_override(dispatch.INTERPRET):
        out = dispatch.grouped_matmul(x, w, group_sizes, preferred_element_type=jnp.float32)
        attn = dispatch.paged_attention(q, cache, cache, positions, metadata, 0.1)
    assert_close(out, gmm_oracle(x, w, group_sizes), rtol=1e-5)
    assert_close(attn, attention_oracle(q, cache, cache, positions, metadata, 0.1))
    assert "dtype float32" in caplog.text and "head_dim=32" in caplog.text
