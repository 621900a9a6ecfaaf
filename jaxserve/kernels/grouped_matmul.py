"""MoE grouped matmul on Hopper in Pallas Mosaic GPU: the entry points.

Owns `grouped_matmul` (x @ w[expert] over rows sorted by expert, the semantics of
`lax.ragged_dot`), `grouped_matmul_gate_up` (gate and up projections in one pass with
the SiLU-and-multiply epilogue) and their composition `moe_ffn`. Each checks its
operands, picks the tiling (`tile_table.py`), builds the tile list
(`grouped_matmul_plan.py`) and launches the kernel (`grouped_matmul_kernel.py`, which
says its design). The pure-jnp references with the same signatures live in
`grouped_matmul_ref.py`; the engine reaches either through `dispatch.py`, never directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from jaxserve.kernels import tile_table
from jaxserve.kernels.grouped_matmul_kernel import gmm_kernel
from jaxserve.kernels.grouped_matmul_plan import group_metadata
from jaxserve.kernels.tile_table import FUSE_GATE_UP, NUM_COMPUTE_WARPGROUPS, GmmConfig, gmm_config


def _silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up in float32; exp(-x) overflows to inf for very negative x -> 0."""
    return gate / (1.0 + jnp.exp(-gate)) * up


_OPERAND_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported_reason(k: int, n: int, dtype) -> str | None:
    """Why the kernel cannot compute x [M, k] @ w [G, k, n] in `dtype`; None if it can.

    The smallest tiles are 64 deep and 128 wide (two 64-column warpgroups), and wgmma
    takes 16-bit operands here.
    """
    if jnp.dtype(dtype) not in _OPERAND_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (the kernel takes bfloat16 or float16)"
    if k % 64:
        return f"K={k} is not a multiple of 64"
    if n % 128:
        return f"N={n} is not a multiple of 128"
    return None


def _validate(x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in _OPERAND_DTYPES:
        raise ValueError(f"x: dtype must be bfloat16 or float16, got {x.dtype}")
    names = ("w",) if len(ws) == 1 else ("w_gate", "w_up")
    for name, w in zip(names, ws, strict=True):
        if w.ndim != 3 or w.shape[1] != x.shape[1]:
            raise ValueError(f"{name}: expected [G, K={x.shape[1]}, N], got shape {w.shape}")
        if w.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {w.dtype} differs from x dtype {x.dtype}")
        if w.shape != ws[0].shape:
            raise ValueError(f"{name}: shape {w.shape} differs from w_gate {ws[0].shape}")
    if group_sizes.shape != (ws[0].shape[0],):
        raise ValueError(f"group_sizes: expected [G={ws[0].shape[0]}], got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: expected an integer dtype, got {group_sizes.dtype}")


def _run(
    x: jax.Array,
    ws: tuple[jax.Array, ...],
    group_sizes: jax.Array,
    *,
    epilogue: Callable[..., jax.Array],
    out_dtype,
    config: GmmConfig | None,
    num_sms: int | None,
) -> jax.Array:
    _validate(x, ws, group_sizes)
    m, k = x.shape
    num_groups, _, n = ws[0].shape
    if config is None:
        config = gmm_config(
            m,
            k,
            n,
            num_groups,
            fused=len(ws) > 1,
            itemsize=jnp.dtype(x.dtype).itemsize,
            out_itemsize=jnp.dtype(out_dtype).itemsize,
        )
    if k % config.tile_k:
        raise ValueError(f"x: K={k} must be a multiple of tile_k={config.tile_k}")
    if n % config.block_n:
        raise ValueError(f"w: N={n} must be a multiple of 2 * tile_n = {config.block_n}")
    # A TMA box of tile_m rows at a multiple of 8 must fit inside x. The engine's row
    # counts (tokens x top-k, bucketed) are multiples of 8 >= tile_m, so this copy only
    # happens for tiny or odd batches; padding rows are never stored.
    padded_m = max(pl.cdiv(m, 8) * 8, config.tile_m)
    x_padded = jnp.pad(x, ((0, padded_m - m), (0, 0))) if padded_m != m else x
    meta, counts = group_metadata(group_sizes, m, padded_m, config.tile_m)
    kernel = plgpu.kernel(
        functools.partial(gmm_kernel, config=config, num_weights=len(ws), epilogue=epilogue),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_sms or tile_table.num_sms(),),
        grid_names=("sm",),
        num_threads=NUM_COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(meta, counts, x_padded, *ws)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    config: GmmConfig | None = None,
    num_sms: int | None = None,
) -> jax.Array:
    """out[r] = x[r] @ w[g(r)], where rows are sorted by group; Mosaic GPU kernel.

    Same semantics as `lax.ragged_dot(x, w, group_sizes)`: group g owns rows
    [sum(group_sizes[:g]), sum(group_sizes[:g+1])); rows past sum(group_sizes) are 0.

    Args:
      x: [M, K] bf16 (or f16), rows sorted by group.
      w: [G, K, N], same dtype as x.
      group_sizes: [G] int32, rows per group; empty groups allowed. A running sum past
        M is clipped to M.
      preferred_element_type: output dtype (accumulation is always float32); x.dtype
        if None.
      config: tiling; `tile_table.gmm_config` by shape if None.
      num_sms: persistent CTAs; the device's SM count if None.

    Returns:
      [M, N] of preferred_element_type.

    Raises:
      ValueError: shapes or dtypes disagree, K is not a multiple of tile_k, or N of
        2 * tile_n.
    """
    out_dtype = preferred_element_type or x.dtype
    return _run(
        x,
        (w,),
        group_sizes,
        epilogue=lambda acc: acc,
        out_dtype=out_dtype,
        config=config,
        num_sms=num_sms,
    )


def grouped_matmul_gate_up(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    group_sizes: jax.Array,
    *,
    config: GmmConfig | None = None,
    num_sms: int | None = None,
) -> jax.Array:
    """SiLU(x @ w_gate[g]) * (x @ w_up[g]) per group, in one kernel (float32 epilogue).

    The SwiGLU expert MLP's first half (Shazeer 2020, "GLU Variants Improve
    Transformer"), as in HF Qwen3MoeMLP: act_fn(gate_proj(x)) * up_proj(x).

    Args:
      x: [M, H] bf16, rows sorted by expert.
      w_gate, w_up: [G, H, I], same dtype as x.
      group_sizes: [G] int32 rows per expert (as in `grouped_matmul`).
      config, num_sms: as in `grouped_matmul`.

    Returns:
      [M, I] in x.dtype; rows past sum(group_sizes) are 0.

    Raises:
      ValueError: as in `grouped_matmul`.
    """
    return _run(
        x,
        (w_gate, w_up),
        group_sizes,
        epilogue=_silu_mul,
        out_dtype=x.dtype,
        config=config,
        num_sms=num_sms,
    )


def moe_ffn(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    fuse_gate_up: bool | None = None,
    num_sms: int | None = None,
) -> jax.Array:
    """The SwiGLU expert MLP over rows sorted by expert, on the grouped matmul kernels.

    Args:
      x_sorted: [M, H] bf16, rows sorted by expert.
      group_sizes: [E] int32 rows per expert; rows past their sum give 0.
      w_gate, w_up: [E, H, I]; w_down: [E, I, H]; same dtype as x_sorted.
      fuse_gate_up: one kernel for gate+up with the SiLU-and-multiply epilogue, or two
        kernels and an XLA elementwise op; `tile_table.FUSE_GATE_UP` if None.
      num_sms: as in `grouped_matmul`.

    Returns:
      [M, H] in x_sorted.dtype; same contract as `grouped_matmul_ref.moe_ffn_ref`.

    Raises:
      ValueError: shapes or dtypes disagree, or H, I are not multiples of the tiles.
    """
    if w_down.shape != (w_gate.shape[0], w_gate.shape[2], w_gate.shape[1]):
        raise ValueError(f"w_down: expected [E, I, H] = {w_gate.shape[::2]}..., got {w_down.shape}")
    if fuse_gate_up is None:
        fuse_gate_up = FUSE_GATE_UP
    if fuse_gate_up:
        hidden = grouped_matmul_gate_up(x_sorted, w_gate, w_up, group_sizes, num_sms=num_sms)
    else:
        gate = grouped_matmul(x_sorted, w_gate, group_sizes, num_sms=num_sms)
        up = grouped_matmul(x_sorted, w_up, group_sizes, num_sms=num_sms)
        hidden = _silu_mul(gate.astype(jnp.float32), up.astype(jnp.float32))
        hidden = hidden.astype(x_sorted.dtype)
    return grouped_matmul(hidden, w_down, group_sizes, num_sms=num_sms)
