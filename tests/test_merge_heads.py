"""The attention output projection (`layers.merge_heads`): the same values as the einsum
it replaces, and, on the CPU, a dot that reads the weight where it lies (no per-call
transposed copy of it in the compiled HLO)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.layers import merge_heads

T, HEADS, D, EMBED = 8, 8, 64, 512


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, HEADS, D), np.float32))
    w = jnp.asarray(rng.standard_normal((HEADS, D, EMBED), np.float32))
    return x, w


def test_merge_heads_equals_the_einsum():
    x, w = _inputs()
    want = np.einsum("thd,hde->te", np.asarray(x, np.float64), np.asarray(w, np.float64))
    got = merge_heads(x, w)
    assert got.shape == (T, EMBED) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


def _weight_copies(fn) -> list[str]:
    """Lines of fn(x, w)'s compiled HLO (the tests run on the CPU) that transpose or copy
    the weight: XLA names the argument an op reads from in its metadata (op_name="w")."""
    x, w = _inputs()
    hlo = jax.jit(fn).lower(x, w).compile().as_text()
    op = re.compile(r" (copy|transpose)\(")
    return [line.strip() for line in hlo.splitlines() if op.search(line) and 'op_name="w"' in line]


def test_merge_heads_does_not_copy_the_weight():
    # The einsum form is the control: it does copy, so the pattern below can match.
    assert _weight_copies(lambda x, w: jnp.einsum("thd,hde->te", x, w))
    assert _weight_copies(merge_heads) == []
