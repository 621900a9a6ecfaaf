"""The MoE experts' test oracle: each token copy through its own expert, in NumPy float64."""

from __future__ import annotations

import numpy as np


def expert_rows_oracle(x, ids, w_gate, w_up, w_down) -> np.ndarray:
    """x [T, H], ids [T, k] in [0, E] (E: an empty copy), weights [E, H, I] / [E, I, H]
    -> [T, k, H] float64: copy (t, j) through expert ids[t, j]'s SwiGLU FFN; 0 for id E."""
    x, ids = np.asarray(x, np.float64), np.asarray(ids)
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in (w_gate, w_up, w_down))
    out = np.zeros((*ids.shape, x.shape[1]))
    for t, j in np.ndindex(ids.shape):
        e = ids[t, j]
        if e < w_gate.shape[0]:
            gate, up = x[t] @ w_gate[e], x[t] @ w_up[e]
            out[t, j] = (gate / (1 + np.exp(-gate)) * up) @ w_down[e]
    return out


def random_experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> tuple:
    """(w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H]) float32 jax arrays, N(0, 0.3^2)."""
    import jax.numpy as jnp  # noqa: PLC0415 -- the oracle itself needs only NumPy

    rng = np.random.default_rng(seed)
    shapes = [
        (num_experts, hidden, inter),
        (num_experts, hidden, inter),
        (num_experts, inter, hidden),
    ]
    return tuple(jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in shapes)
