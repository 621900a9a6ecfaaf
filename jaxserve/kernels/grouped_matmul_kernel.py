"""The body of the MoE grouped matmul kernel on Hopper, in Pallas Mosaic GPU (wgmma +
TMA, warp specialised): `gmm_kernel`, which `grouped_matmul.py` launches (after checking
the operands and choosing the tiling) over the tile list of `grouped_matmul_plan.py`.

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

from jaxserve.kernels.tile_table import NUM_COMPUTE_WARPGROUPS, GmmConfig

# Registers kept by the TMA warpgroup; the compute warpgroups get the rest (as in JAX's
# hopper_matmul_mgpu example).
_MEMORY_REGISTERS = 40


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


def gmm_kernel(
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
