"""One-device MoE experts held as one array per expert, so the CPU reads them in place.

XLA's CPU backend copies any slice of an array before a dot reads it (a `dot` does not
fuse a `slice` / `dynamic-slice` operand), so `moe_loop.expert_loop_ffn`, which slices
expert e out of the stacked [E, H, I] weights, copies the expert's three matrices (1.5
MB at Qwen3-MoE-like shapes, H 512, I 256) before using them once: at decode sizes (a row
or two per expert) the copy costs more than the matmuls. Held as E separate arrays, each
expert's weights are whole operands: the loop over the experts holding rows picks the
expert's dots with a `lax.switch` over E branches, and each dot reads its weights where
they lie. Measured (`scripts/bench_moe.py --configs qwen3-moe-like --slices`, `slices` vs
`loop@auto`): see the closing note of issue 17 for the table.

Each branch is compiled code in every step executable, so the engine holds experts this
way only up to `MAX_EXPERT_BRANCHES` experts over all MoE layers.

`ExpertSlices` is the held form: `split_expert_params` turns the engine's flat parameter
list into it once, at start-up, on one device off the NVIDIA kernels when
`JAXSERVE_MOE_EXPERTS=sliced` (`dispatch.moe_reference_experts`; opt-in: measured faster
at batch 8 but not at 1 or 128 in the engine, see the note of issue 17; the
expert-parallel path keeps the stacked, sharded arrays). The model reads `w_gate[...]`
as before and gets the `ExpertSlices`; `moe_experts.moe_experts_local` routes it here, or
stacks it back (`stacked`, a copy) for a path that wants [E, H, I].
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.models.base import replace_params
from jaxserve.models.moe_loop import SortedRows, loop_levels_for, run_expert_rows
from jaxserve.models.moe_sparse import block_size_for, check_expert_shapes, combine_copies

# Smallest chunk of rows: XLA rewrites a one-row dot into a fused multiply-reduce, which
# its CPU backend compiles with LLVM, once per branch (E per switch): 9 s against 2.6 s
# to compile the Qwen3-MoE-like test layer x 8 in a 4-step scan (`scripts/bench_moe.py`).
MIN_CHUNK = 2
# Most experts over all MoE layers held per expert: each is a `lax.switch` branch in
# every compiled step, and compile time grows with them (layer x 8 of 32 experts in a
# 4-step scan: 0.8-1.6 s stacked, 2.8-6.2 s per expert). Larger models (Qwen3-30B-A3B:
# 48 x 128) keep the stacked weights.
MAX_EXPERT_BRANCHES = 1024


@jax.tree_util.register_pytree_node_class
class ExpertSlices:
    """A stacked expert weight [E, A, B] held as E separate arrays [A, B].

    A pytree (its leaves are the E arrays), so it passes through `jit` and the NNX state
    like the array it replaces; `[...]` returns itself (what `nnx.Param[...]` asks of a
    value), and `shape` / `dtype` are the stacked array's.
    """

    def __init__(self, arrays: Sequence[jax.Array]):
        self.arrays = tuple(arrays)

    @classmethod
    def split(cls, stacked: jax.Array) -> ExpertSlices:
        """E fresh arrays from `stacked` [E, ...] (copies; the caller drops `stacked`)."""
        return cls([jnp.array(stacked[e]) for e in range(stacked.shape[0])])

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.arrays), *self.arrays[0].shape)

    @property
    def dtype(self):
        return self.arrays[0].dtype

    @property
    def ndim(self) -> int:
        return 1 + self.arrays[0].ndim

    def __getitem__(self, index):
        if index is Ellipsis:
            return self
        raise TypeError(f"ExpertSlices supports [...] only, got [{index!r}]")

    def stacked(self) -> jax.Array:
        """The [E, A, B] array (a copy: for paths that need the stacked layout)."""
        return jnp.stack(self.arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, aux, children) -> ExpertSlices:
        del aux
        return cls(children)


def sliced_expert_ffn(
    x: jax.Array,
    ids: jax.Array,
    w_gate: ExpertSlices,
    w_up: ExpertSlices,
    w_down: ExpertSlices,
) -> jax.Array:
    """`moe_sparse.sparse_expert_ffn`'s contract with per-expert weights: the copies
    sorted by expert, a loop over the experts holding rows and over each one's rows in
    chunks (`moe_loop.run_expert_rows`; chunk sizes from `block_size_for` and
    `loop_levels_for`, at least `MIN_CHUNK`), each chunk's matmuls a `lax.switch` on the
    expert over E branches that hold nothing but the dots (gate and up in one switch,
    down in another; SiLU and the product outside, shared).

    x: [T, H]; ids: [T, k] int32 in [0, E] (E: an empty copy, output 0); w_gate, w_up:
    E x [H, I]; w_down: E x [I, H]. Returns [T, k, H] in x.dtype, with the stacked
    path's rounding points (float32 products, the [rows, I] intermediate in x.dtype).

    Raises ValueError if the shapes disagree.
    """
    check_expert_shapes("sliced_expert_ffn", x, ids, w_gate, w_up, w_down)
    num_experts, hidden, _ = w_gate.shape
    n = ids.shape[0] * ids.shape[1]
    if n == 0:
        return jnp.zeros((*ids.shape, hidden), x.dtype)
    chunk = max(MIN_CHUNK, block_size_for(n, num_experts))
    rows = SortedRows.of(x, ids, num_experts, chunk)
    sizes_desc = rows.chunk_sizes(chunk, loop_levels_for(n, num_experts, chunk))
    gate_up = [_gate_up_branch(w_gate.arrays[e], w_up.arrays[e]) for e in range(num_experts)]
    down = [_down_branch(w_down.arrays[e]) for e in range(num_experts)]

    def one_expert(j, y):
        e = rows.used[j]

        def swiglu(r: jax.Array) -> jax.Array:
            gate, up = lax.switch(e, gate_up, r)
            hidden_rows = (jax.nn.silu(gate) * up).astype(x.dtype)
            return lax.switch(e, down, hidden_rows).astype(x.dtype)

        return run_expert_rows(y, rows.x_sorted, swiglu, rows.starts[e], rows.sizes[e], sizes_desc)

    y = lax.fori_loop(0, rows.num_used, one_expert, jnp.zeros_like(rows.x_sorted))
    return rows.unsort(y)


def _gate_up_branch(w_gate: jax.Array, w_up: jax.Array):
    def branch(r: jax.Array) -> tuple[jax.Array, jax.Array]:
        f32 = jnp.float32
        return (
            jnp.dot(r, w_gate, preferred_element_type=f32),
            jnp.dot(r, w_up, preferred_element_type=f32),
        )

    return branch


def _down_branch(w_down: jax.Array):
    def branch(h: jax.Array) -> jax.Array:
        return jnp.dot(h, w_down, preferred_element_type=jnp.float32)

    return branch


def moe_experts_sliced(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w_gate: ExpertSlices,
    w_up: ExpertSlices,
    w_down: ExpertSlices,
) -> jax.Array:
    """`moe_sparse.moe_experts_sparse` with per-expert weights: x [T, H], topk_weights
    [T, k], topk_ids [T, k] int32 in [0, E) -> [T, H] in x.dtype."""
    y = sliced_expert_ffn(x, topk_ids, w_gate, w_up, w_down)
    return combine_copies(topk_weights, y, x.dtype)


def split_expert_params(
    params: list, param_index: dict[tuple, int], paths: Sequence[tuple]
) -> list:
    """The engine's flat parameter list with the arrays at `paths` (stacked expert
    weights [E, ...]) replaced by their `ExpertSlices`; the others unchanged.

    params: `jax.tree.flatten` leaves of the model state; param_index: state path ->
    index in params. Raises KeyError naming a path that is not a parameter.
    """

    def split(w):  # held already where the model was built from a runner's state
        return w if isinstance(w, ExpertSlices) else ExpertSlices.split(w)

    return replace_params(params, param_index, ((p, split) for p in paths), "split_expert_params")
