"""MoE grouped matmul on Hopper in Pallas Mosaic GPU (wgmma + TMA, warp specialised).

Owns the kernels `grouped_matmul` (x @ w[expert] over rows sorted by expert, the
semantics of `lax.ragged_dot`), `grouped_matmul_gate_up` (gate and up projections in one
pass with the SiLU-and-multiply epilogue) and their composition `moe_ffn`. The pure-jnp
references with the same signatures live in `grouped_matmul_ref.py`; the engine reaches
either through `dispatch.py`, never directly.

Design (after JAX's `ops/gpu/ragged_dot_mgpu.py` and `hopper_matmul_mgpu.py`, and the
group-metadata idea of megablox, `jax.experimental.pallas.ops.tpu.megablox`):

- A tile is up to `tile_m` consecutive rows *of one expert*, times `2 * tile_n` output
  columns. An expert's tiles start at its first row rounded down to a multiple of 8 (a
  TMA box into swizzled SMEM must start on the 8-row tiling), not at a global multiple
  of tile_m, so an expert with one token costs one weight stream, never two: that is
  what decides the memory-bound decode regime. The tile list is computed outside the
  kernel by a few tiny XLA ops (`grouped_matmul_plan.py`), so the kernel does no search.
- The kernel is persistent: one CTA per SM walks the tile list, column tiles of a row
  tile next to each other (they share x rows and the expert's weights in L2). Each CTA
  runs three warpgroups: one issues TMA loads into a `max_concurrent_steps`-deep ring,
  two issue wgmma on their halves of the columns
  (`plgpu.emit_pipeline_warp_specialized`). A CTA's tiles run as one pipeline of
  pipelines (`chain_tiles`), so the next tile's loads overlap this tile's epilogue.
- A tile loads x rows [min(start, M_pad - tile_m), + tile_m), so no TMA box reads past
  the array; the rows that belong to the tile sit at an offset inside it.
- Tiles are stored with a ladder of power-of-two-row TMA stores from an unswizzled
  staging buffer (the trick of `ragged_dot_mgpu`), so no row of another expert is
  overwritten. Rows past sum(group_sizes) are written with zeros by a second loop, so
  every output element is written exactly once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxserve.kernels import tile_table
from jaxserve.kernels.grouped_matmul_plan import group_metadata
from jaxserve.kernels.tile_table import FUSE_GATE_UP, NUM_COMPUTE_WARPGROUPS, GmmConfig, gmm_config

# Registers kept by the TMA warpgroup; the compute warpgroups get the rest (as in JAX's
# hopper_matmul_mgpu example).
_MEMORY_REGISTERS = 40
_META_FIELDS = 4  # group, first row loaded, offset of the tile's rows in the load, rows


def _store_rows(staging, wg, out, cols, src_row, dst_row, rows, tile_m):
    """TMA-store rows [src_row, src_row + rows) of staging[wg] to out[dst_row:, cols].

    `rows` (0..tile_m) is traced but a TMA box has a static shape, so the store is a
    ladder of power-of-two boxes: bit b of `rows` decides whether a 2**b-row box is
    stored (after ragged_dot_mgpu).
    """

    def store(size, src, dst):
        plgpu.copy_smem_to_gmem(staging.at[wg, pl.ds(src, size)], out.at[pl.ds(dst, size), cols])

    size = tile_m
    while size:
        take = rows & size
        pl.when(take != 0)(functools.partial(store, size, src_row, dst_row))
        src_row = src_row + take
        dst_row = dst_row + take
        size //= 2


def _silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up in float32; exp(-x) overflows to inf for very negative x -> 0."""
    return gate / (1.0 + jnp.exp(-gate)) * up


def _gmm_kernel(
    meta_gmem,
    counts_gmem,
    x_gmem,
    *refs,
    config: GmmConfig,
    num_weights: int,
    epilogue: Callable[..., jax.Array],
):
    """Kernel body; `refs` = num_weights weight refs [G, K, N], the output, scratch."""
    w_gmems = refs[:num_weights]
    out_gmem = refs[num_weights]
    k = x_gmem.shape[1]
    m, n = out_gmem.shape
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    block_n = NUM_COMPUTE_WARPGROUPS * tile_n
    n_tiles = n // block_n
    dtype = x_gmem.dtype
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))

    in_specs = [
        plgpu.BlockSpec((tile_m, tile_k), lambda ki: (0, ki), transforms=transforms),
        *[
            plgpu.BlockSpec((tile_k, block_n), lambda ki: (ki, 0), transforms=transforms)
            for _ in range(num_weights)
        ],
    ]

    k_steps = k // tile_k
    # A pipeline of pipelines needs whole rounds of the ring per tile (JAX's rule).
    chain = config.chain_tiles and k_steps % config.max_concurrent_steps == 0

    def make_pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            pipeline_state=state,
            memory_registers=_MEMORY_REGISTERS,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=NUM_COMPUTE_WARPGROUPS,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731 -- allocations do not depend on the body
    x_abstract = x_gmem.at[pl.ds(0, tile_m), :]
    w_abstract = [w.at[0, :, pl.ds(0, block_n)] for w in w_gmems]

    @functools.partial(
        pl.run_scoped,
        allocations=make_pipeline(ignore, ignore).get_allocations(x_abstract, *w_abstract),
        staging=plgpu.SMEM((NUM_COMPUTE_WARPGROUPS, tile_m, tile_n), out_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocations, staging):
        wg = lax.axis_index("wg")
        num_tiles = counts_gmem[0]

        @plgpu.nd_loop((num_tiles * n_tiles,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
            (lin,) = loop_info.index
            # Column tiles of one row tile are adjacent in the walk: concurrent CTAs
            # share the tile's x rows and its expert's weights in L2.
            mi = lax.div(lin, n_tiles)
            ni = lax.rem(lin, n_tiles)
            group = meta_gmem[0, mi]
            load_row = pl.multiple_of(meta_gmem[1, mi], 8)
            offset = meta_gmem[2, mi]
            rows = meta_gmem[3, mi]
            wg_cols = pl.ds(ni * block_n + wg * tile_n, tile_n)

            def compute_context(eval_pipeline):
                accs = [plgpu.ACC((tile_m, tile_n), jnp.float32) for _ in range(num_weights)]

                def acc_scope(*acc_refs):
                    eval_pipeline(tuple(acc_refs))
                    result = epilogue(*(a[...] for a in acc_refs)).astype(out_gmem.dtype)
                    # The previous tile's stores must be done reading the staging buffer.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    staging[wg] = result
                    plgpu.commit_smem()
                    _store_rows(
                        staging,
                        wg,
                        out_gmem,
                        wg_cols,
                        offset,
                        load_row + offset,
                        rows,
                        tile_m,
                    )

                pl.run_scoped(acc_scope, *accs)

            def mma_body(_, x_smem, *w_and_carry):
                *w_smems, acc_refs = w_and_carry
                for acc_ref, w_smem in zip(acc_refs, w_smems, strict=True):
                    plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * tile_n, tile_n)])
                plgpu.wgmma_wait(0)
                return acc_refs

            operands = (
                x_gmem.at[pl.ds(load_row, tile_m), :],
                *[w.at[group, :, pl.ds(ni * block_n, block_n)] for w in w_gmems],
            )

            def one_pipeline(state=None):
                make_pipeline(mma_body, compute_context, state)(*operands, allocations=allocations)

            if not chain:
                one_pipeline()
                return
            # Chain the tiles of this CTA into one pipeline of pipelines: the TMA
            # warpgroup streams the next tile's stages while the compute warpgroups
            # finish (and store) the current one. A lone tile is START and STOP at
            # once, which the chained form cannot say.
            last = loop_info.num_local_steps - 1
            state = jnp.where(
                loop_info.local_index == 0,
                int(plgpu.PipelinePipeline.START),
                jnp.where(
                    loop_info.local_index == last,
                    int(plgpu.PipelinePipeline.STOP),
                    int(plgpu.PipelinePipeline.STEADY),
                ),
            )
            lax.cond(last == 0, one_pipeline, lambda: one_pipeline(state))

        # Rows past sum(group_sizes) are zero (lax.ragged_dot semantics).
        @pl.when(wg < NUM_COMPUTE_WARPGROUPS)
        def _zero_tail():
            covered = counts_gmem[1]
            tail_tiles = lax.div(m - covered + tile_m - 1, tile_m)

            @plgpu.nd_loop((tail_tiles * n_tiles,), collective_axes="sm")
            def _zero_loop(loop_info: plgpu.NDLoopInfo):
                (lin,) = loop_info.index
                ti = lax.div(lin, n_tiles)
                ni = lax.rem(lin, n_tiles)
                first = covered + ti * tile_m
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                staging[wg] = jnp.zeros((tile_m, tile_n), out_gmem.dtype)
                plgpu.commit_smem()
                _store_rows(
                    staging,
                    wg,
                    out_gmem,
                    pl.ds(ni * block_n + wg * tile_n, tile_n),
                    0,
                    first,
                    jnp.minimum(m - first, tile_m),
                    tile_m,
                )

        # The staging buffer must outlive the stores that read it.
        plgpu.wait_smem_to_gmem(0)


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
        functools.partial(_gmm_kernel, config=config, num_weights=len(ws), epilogue=epilogue),
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
