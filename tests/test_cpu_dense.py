"""The CPU dense kernel on panel-major weights (`jaxserve.kernels.cpu_dense`): equal to a
float64 numpy product within float32 rounding, the packed layout round-trips, the
engine's greedy tokens do not change with it, and without it nothing is packed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import cpu_dense

needs_kernel = pytest.mark.skipif(
    not cpu_dense.applies(), reason="no C++ compiler, or a CPU without AVX2 + FMA / AVX-512"
)


def _weights(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32)


def test_pack_round_trips_and_pads_the_last_panel_with_zeros():
    w = _weights((7, 3, 11), 0)  # K = 7, N = 33: three panels, the last holds one column
    packed = cpu_dense.PanelMajor.pack(jnp.asarray(w), k_ndim=1)
    assert packed.panels.shape == (3, 7, 16) and packed.shape == (7, 3, 11)
    flat = w.reshape(7, 33)
    np.testing.assert_array_equal(np.asarray(packed.panels[1, :, 5]), flat[:, 21])
    np.testing.assert_array_equal(np.asarray(packed.panels[2, :, 1:]), 0)
    np.testing.assert_array_equal(np.asarray(packed.unpack()), w)
    o_proj = cpu_dense.PanelMajor.pack(jnp.asarray(_weights((2, 3, 5), 1)), k_ndim=2)
    assert o_proj.panels.shape == (1, 6, 16)  # K = 2 * 3 contracted axes, N = 5


@needs_kernel
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 128, 4096), (8, 128, 4096), (2, 64, 100), (3, 17, 33), (5, 129, 16), (7, 31, 47),
     (13, 33, 31), (64, 128, 256), (1, 5, 80), (6, 1, 16), (2, 16, 150), (300, 600, 50)],
)  # fmt: skip
def test_kernel_equals_a_float64_product(m, k, n):
    """Row counts 1-300 (the one-row and two-row wide tiles, whole and masked; blocks
    of up to 6 or 8 rows; 300 rows of K 600 are 3 row chunks of at most 256 KiB of x),
    N not a multiple of 16 (a masked last panel), K odd, the pool shared or not."""
    w, x = _weights((k, n), m), _weights((m, k), m + 1)
    panels = cpu_dense.PanelMajor.pack(jnp.asarray(w)).panels
    y = jax.jit(cpu_dense.dense_panels, static_argnums=2)(jnp.asarray(x), panels, n)
    expected = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_kernel
@pytest.mark.parametrize("rows", [4, cpu_dense.MAX_ROWS + 3])
def test_project_on_panels_equals_the_plain_product(rows):
    """`project` on a PanelMajor (the kernel up to MAX_ROWS rows, XLA's dot on the panels
    past it) equals the caller's own product on the plain weight, for an o_proj-shaped
    weight ([heads, D, embed], two contracted axes) inside a jitted function."""
    w = _weights((2, 8, 20), 3)
    x = jnp.asarray(_weights((rows, 2, 8), 4))

    def merge(x, w):
        return jax.lax.dot_general(x, w, (((1, 2), (0, 1)), ((), ())))

    packed = cpu_dense.PanelMajor.pack(jnp.asarray(w), k_ndim=2)
    got = jax.jit(lambda x, p: cpu_dense.project(x, p, merge))(x, packed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(merge(x, w)), rtol=1e-5, atol=1e-5)
    traced = str(jax.make_jaxpr(lambda x, p: cpu_dense.project(x, p, merge))(x, packed))
    assert ("ffi_call" in traced) == (rows <= cpu_dense.MAX_ROWS)


@needs_kernel
def test_engine_greedy_tokens_are_unchanged_by_the_kernel(demo_greedy):
    """The demo model through the offline engine (prefill and multi-step decode, batch
    3): the same greedy tokens with the weights packed and with the kernel off, and the
    projections and LM head are held packed only when it is on (all of them: the size
    floor lowered to the demo's [128, 64] k/v projections)."""
    on, packed_on = demo_greedy("1", "1")
    off, packed_off = demo_greedy("0", "1")
    assert packed_on.get("PanelMajor") == 4 * 4 + 1  # q/k/v/o of 4 layers and the LM head
    assert "PanelMajor" not in packed_off
    assert on == off


def test_turned_off_or_unavailable_nothing_is_packed(monkeypatch):
    w = jnp.ones((4, 8), jnp.float32)
    params, index = [w], {("lm_head",): 0}
    monkeypatch.setenv(cpu_dense.ENV_VAR, "0")
    assert cpu_dense.pack_params(params, index, [(("lm_head",), 1)]) == params
    monkeypatch.setenv(cpu_dense.ENV_VAR, "1")
    monkeypatch.setattr(cpu_dense, "available", lambda: False)
    assert cpu_dense.pack_params(params, index, [(("lm_head",), 1)]) == params
    with pytest.raises(RuntimeError, match="not available"):
        cpu_dense.dense_panels(jnp.ones((1, 4)), jnp.ones((1, 4, 16)), 8)
    monkeypatch.setenv(cpu_dense.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=cpu_dense.ENV_VAR):
        cpu_dense.enabled()


@needs_kernel
def test_pack_params_skips_other_dtypes_and_small_weights_and_names_a_missing_path(monkeypatch):
    monkeypatch.setattr(cpu_dense, "MIN_WEIGHT_FLOATS", 32)
    f32, bf16 = jnp.ones((4, 8), jnp.float32), jnp.ones((4, 8), jnp.bfloat16)
    small = jnp.ones((4, 7), jnp.float32)
    index = {("a",): 0, ("b",): 1, ("c",): 2}
    out = cpu_dense.pack_params([f32, bf16, small], index, [(("a",), 1), (("b",), 1), (("c",), 1)])
    assert isinstance(out[0], cpu_dense.PanelMajor) and out[1] is bf16 and out[2] is small
    with pytest.raises(KeyError, match="lm_head"):
        cpu_dense.pack_params([f32], index, [(("lm_head",), 1)])
