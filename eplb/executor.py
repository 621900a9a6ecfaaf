"""EPLB placement executor: move the expert weights of the MoE layers to a new placement.

The planner (eplb/planner.py) decides which logical expert every physical slot should
hold; this module makes it so on the devices. It owns the *move* only: given the slot
weights (sharded over the ep = dp * tp devices, device d holding slots
[d * S/ep, (d + 1) * S/ep), `sharding/placement.py`) and the current and new
physical_to_logical tables, it returns the weights of the new placement and the new
tables, as device arrays that can be swapped into the model without recompiling its
step (same shapes, dtypes and shardings).

How a re-placement runs (one compiled function per model, built once):

1-2. On the host, `eplb/transfer_plan.py` picks the source slot of every new slot and
   turns the sources into int32 index tables (a local gather per device, and per ring
   shift which slots each device sends and where the receiver puts them).
3. One jitted `shard_map` takes the weights (donated: the old buffers are reused, so a
   re-placement needs no second copy of the model's experts) and the tables (traced:
   a new placement is new data, not a new program). Per device and weight: gather the
   local sources, then ep - 1 ring rounds of one-slot `ppermute`s, as many as the
   round needs (at most `max_transfer_slots`), scattered into place. Arrays, rounds
   and transfers run one after the other, so the scratch memory is about one array's
   slots of one device plus one slot's buffers
   (`PlacementExecutor.temp_bytes_per_device`).

A ring round sends as many one-slot transfers (a `fori_loop` of `ppermute`s, its trip
count a table entry) as its busiest device needs, and a round where no slot crosses
devices sends nothing: a re-placement that changes few slots moves few (per round every
device sends that many: collective permutes are all-device). `max_transfer_slots`
bounds the slots one device may take from one other (the table width), default S / ep:
any placement. A variable-size exchange (`lax.ragged_all_to_all`) would remove the
per-round padding on a GPU but is unimplemented on the CPU.

Same idea as vLLM's EPLB `rearrange_expert_weights_inplace`
(vllm/distributed/eplb/rebalance_execute.py) and SGLang's `expert_location_updater`:
keep a slot's weights where they already are, copy from a local replica when one
exists, and point-to-point transfer the rest; here with static shapes under `jit`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.eplb.transfer_plan import source_slots, transfer_tables
from jaxserve.sharding.mesh import as_auto_mesh
from jaxserve.sharding.placement import ExpertPlacement, placement_from_slots
from jaxserve.sharding.rules import EP, replicated

# One MoE layer's slot-indexed expert weights, e.g. (w_gate, w_up, w_down).
LayerWeights = tuple[jax.Array, ...]


@dataclass(frozen=True)
class ReplacementStats:
    """What one `PlacementExecutor.apply` did, summed over the layers.

    slots_kept: slots whose expert did not change (no copy).
    slots_copied_local: slots that changed expert, copied from a slot on the same device.
    slots_moved_remote: slots copied from another device.
    bytes_moved: bytes of the remote copies (slots_moved_remote x bytes per slot, all
        weight arrays of the layer): the data that has to cross devices.
    bytes_on_wire: bytes the ppermute transfers send, all devices: each round sends
        one slot per transfer from every device, as many transfers as the busiest
        device of the round needs (`TransferTables.round_slots`), so rounds where no
        slot moves cost nothing; = bytes_moved when every device of a round moves as
        many slots.
    seconds: host wall time of the call, tables included, until the outputs are ready.
    """

    slots_kept: int
    slots_copied_local: int
    slots_moved_remote: int
    bytes_moved: int
    bytes_on_wire: int
    seconds: float


class PlacementExecutor:
    """Re-places the expert weights of a model's MoE layers with one compiled function.

    Built once per model and mesh: it compiles the move for the weights' shapes,
    dtypes and shardings (ahead of time, so a later call with other shapes fails
    instead of compiling again). Every `apply` then runs that executable with new index
    tables: `num_compilations` stays 1.

    Args:
        mesh: the (dp, tp) mesh the weights live on (`sharding.mesh.build_mesh`).
        weights: [L] layers, each a tuple of slot-indexed weight arrays (or
            `jax.ShapeDtypeStruct`s with shardings), e.g. (w_gate [S, H, I], w_up
            [S, H, I], w_down [S, I, H]); axis 0 is the slot axis, sharded over all
            devices (`PartitionSpec(("dp", "tp"))`, the "experts" rule), the other axes
            whole. Every layer has the same number of slots S.
        num_experts: E, logical experts per layer.
        max_replicas: width of the tables' logical_to_physical, the same as the model's
            `PlacementTable` state (kept fixed so swapping tables needs no recompile).
        max_transfer_slots: C, most slots one device may receive from one other device
            in one apply; default S / ep (any placement). An apply sends per ring round
            as many slots as its busiest device needs (see the module docstring).

    Raises:
        ValueError: an empty `weights`, layers with different slot counts, S not
            divisible by ep, a weight not sharded over ep on axis 0 (names it), or
            max_transfer_slots outside [1, S / ep].
    """

    def __init__(
        self,
        mesh: Mesh,
        weights: Sequence[Sequence[jax.Array | jax.ShapeDtypeStruct]],
        num_experts: int,
        max_replicas: int,
        *,
        max_transfer_slots: int | None = None,
    ):
        self.mesh = as_auto_mesh(mesh)
        self.ep = self.mesh.size
        self.num_experts = num_experts
        self.max_replicas = max_replicas
        self._structs = _check_weights(self.mesh, weights)
        self.num_layers = len(self._structs)
        self.num_slots = self._structs[0][0].shape[0]
        per_device = self.num_slots // self.ep
        capacity = per_device if max_transfer_slots is None else max_transfer_slots
        if not 1 <= capacity <= per_device:
            raise ValueError(f"max_transfer_slots: {capacity} must be in [1, S/ep = {per_device}]")
        self.max_transfer_slots = capacity
        # Bytes of one slot of each layer, summed over its weight arrays.
        self.slot_bytes = [
            sum(int(np.prod(w.shape[1:])) * np.dtype(w.dtype).itemsize for w in layer)
            for layer in self._structs
        ]
        self._table_sharding = NamedSharding(self.mesh, P(EP))
        self._placement_sharding = replicated(self.mesh)
        start = time.perf_counter()
        self._compiled = self._compile()
        self.compile_seconds = time.perf_counter() - start
        self.num_compilations = 1
        # Scratch the move needs per device beyond the (donated, aliased) weights: about
        # one array's new slots plus one round's send and receive buffers, as the arrays
        # and rounds run one at a time (None where the backend does not report it).
        memory = self._compiled.memory_analysis()
        self.temp_bytes_per_device = None if memory is None else int(memory.temp_size_in_bytes)

    def apply(
        self,
        weights: Sequence[Sequence[jax.Array]],
        current_p2l: np.ndarray,
        new_p2l: np.ndarray,
    ) -> tuple[list[LayerWeights], list[ExpertPlacement], ReplacementStats]:
        """Move every layer's weights from the current placement to the new one.

        Args:
            weights: [L] layers of slot-indexed weights, as given to the constructor
                (same shapes, dtypes, shardings). DONATED: do not use them after the
                call; use the returned arrays.
            current_p2l: [L, S] ints, the expert each slot holds now.
            new_p2l: [L, S] ints in [0, E), every expert in every row.

        Returns:
            (new_weights [L] tuples, same shapes/dtypes/shardings as `weights`;
             tables [L] `ExpertPlacement`s of int32 device arrays replicated over the
             mesh, shaped [E, max_replicas], [E], [S] like the model's `PlacementTable`
             state; stats).

        Raises:
            ValueError: table shapes (names the argument), an expert of new_p2l not held
                by any current slot, an expert without a slot or with more than
                max_replicas slots, a transfer over max_transfer_slots, or weights that
                do not match the compiled shapes/shardings.
        """
        start = time.perf_counter()
        cur = self._check_tables(current_p2l, "current_p2l")
        new = self._check_tables(new_p2l, "new_p2l")
        placements = [placement_from_slots(row, self.num_experts, self.max_replicas) for row in new]
        sources = np.stack([source_slots(c, n, self.ep) for c, n in zip(cur, new, strict=True)])
        tables = transfer_tables(sources, self.ep, self.max_transfer_slots)
        structs = _check_weights(self.mesh, weights)
        if not _same_layout(structs, self._structs):
            raise ValueError(
                "weights: shapes/dtypes/shardings differ from the ones the executor was "
                f"built for ({_describe(structs)} vs {_describe(self._structs)})"
            )
        device_tables = [
            _put(t, self._table_sharding)
            for t in (tables.local_source, tables.send_slots, tables.recv_slots, tables.round_slots)
        ]
        new_weights = self._compiled(tuple(tuple(layer) for layer in weights), *device_tables)
        device_placements = [
            jax.tree.map(lambda a: _put(a, self._placement_sharding), p) for p in placements
        ]
        jax.block_until_ready((new_weights, device_placements))
        stats = self._stats(cur, new, sources, tables, time.perf_counter() - start)
        return [tuple(layer) for layer in new_weights], device_placements, stats

    def _check_tables(self, p2l: np.ndarray, name: str) -> np.ndarray:
        table = np.asarray(p2l)
        want = (self.num_layers, self.num_slots)
        if table.shape != want or not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"{name}: expected int {list(want)}, got {table.dtype} {table.shape}")
        if (table < 0).any() or (table >= self.num_experts).any():
            raise ValueError(f"{name}: entries must be in [0, {self.num_experts})")
        return table.astype(np.int64)

    def _stats(self, cur, new, sources, tables, seconds: float) -> ReplacementStats:
        per_device = self.num_slots // self.ep
        slots = np.arange(self.num_slots)
        changed = cur != new
        remote = (sources // per_device) != (slots // per_device)[None, :]
        remote_per_layer = remote.sum(1)
        wire_slots_per_layer = self.ep * tables.round_slots[0].sum(axis=1)
        return ReplacementStats(
            slots_kept=int((~changed).sum()),
            slots_copied_local=int((changed & ~remote).sum()),
            slots_moved_remote=int(remote.sum()),
            bytes_moved=int(np.dot(remote_per_layer, self.slot_bytes)),
            bytes_on_wire=int(np.dot(wire_slots_per_layer, self.slot_bytes)),
            seconds=seconds,
        )

    def _compile(self):
        """Lower and compile the move for the constructor's weights (once)."""
        ep, capacity = self.ep, self.max_transfer_slots
        per_device = self.num_slots // ep
        rounds = ep - 1
        table = NamedSharding(self.mesh, P(EP))
        table_structs = (
            jax.ShapeDtypeStruct((ep, self.num_layers, per_device), np.int32, sharding=table),
            jax.ShapeDtypeStruct((ep, self.num_layers, rounds, capacity), np.int32, sharding=table),
            jax.ShapeDtypeStruct((ep, self.num_layers, rounds, capacity), np.int32, sharding=table),
            jax.ShapeDtypeStruct((ep, self.num_layers, rounds), np.int32, sharding=table),
        )
        weight_specs = tuple(tuple(P(EP) for _ in layer) for layer in self._structs)
        moved = jax.shard_map(
            _move_body,
            mesh=self.mesh,
            in_specs=(weight_specs, P(EP), P(EP), P(EP), P(EP)),
            out_specs=weight_specs,
        )
        out_shardings = tuple(tuple(w.sharding for w in layer) for layer in self._structs)
        jitted = jax.jit(moved, donate_argnums=(0,), out_shardings=out_shardings)
        return jitted.lower(self._structs, *table_structs).compile()


def _move_body(weights, local_source, send_slots, recv_slots, round_slots):
    """Per-device body: weights [L] tuples of [S/ep, ...] local slots; tables with a
    leading device axis of 1 (see `TransferTables`). Returns the new local slots.

    The arrays are moved one after the other: `optimization_barrier` makes an array's
    input wait for the previous array's result, so XLA cannot schedule every array's
    transfer buffers at once (measured on the CPU without it: scratch of about 16x the
    weights' own size at ep = 8).
    """
    ep = lax.axis_size(EP)
    moved: list[jax.Array] = []
    for layer, arrays in enumerate(weights):
        tables = (
            local_source[0, layer],
            send_slots[0, layer],
            recv_slots[0, layer],
            round_slots[0, layer],
        )
        for w in arrays:
            if moved:
                moved[-1], w = lax.optimization_barrier((moved[-1], w))
            moved.append(_move_array(w, *tables, ep))
    it = iter(moved)
    return tuple(tuple(next(it) for _ in arrays) for arrays in weights)


def _move_array(w, local, send, recv, count, ep: int) -> jax.Array:
    """One array's new local slots: the local gather, then ep - 1 ring rounds of
    count[r] one-slot transfers each (0: the round sends nothing), each round started
    after the previous one landed (one slot's buffers live at a time)."""
    new = w[local]
    for r in range(ep - 1):
        # Ring shift r + 1: every device sends to the one r + 1 after it.
        perm = [(d, (d + r + 1) % ep) for d in range(ep)]

        def transfer(k, new, w=w, r=r, perm=perm):
            got = lax.ppermute(lax.dynamic_index_in_dim(w, send[r, k], keepdims=False), EP, perm)
            # recv = S/ep marks a padding transfer: dropped.
            return new.at[recv[r, k]].set(got, mode="drop")

        new = lax.fori_loop(0, count[r], transfer, new)
        if r < ep - 2:
            new, w = lax.optimization_barrier((new, w))
    return new


def _put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Host table onto the mesh; with several processes (each holds the same whole
    table) each places its own devices' shards."""
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _check_weights(mesh: Mesh, weights) -> tuple[tuple[jax.ShapeDtypeStruct, ...], ...]:
    """The weights as ShapeDtypeStructs with their shardings, after checking them."""
    if len(weights) == 0 or any(len(layer) == 0 for layer in weights):
        raise ValueError("weights: expected at least one MoE layer, each with >= 1 array")
    num_slots = weights[0][0].shape[0]
    if num_slots % mesh.size:
        raise ValueError(
            f"weights: {num_slots} {'slot is' if num_slots == 1 else 'slots are'} not "
            f"divisible by ep = dp*tp = {mesh.size}"
        )
    structs = []
    for layer, arrays in enumerate(weights):
        row = []
        for i, w in enumerate(arrays):
            name = f"weights[{layer}][{i}]"
            if w.ndim < 1 or w.shape[0] != num_slots:
                raise ValueError(f"{name}: expected {num_slots} slots on axis 0, got {w.shape}")
            sharding = getattr(w, "sharding", None)
            expected = NamedSharding(mesh, P(EP))
            if sharding is None or not sharding.is_equivalent_to(expected, w.ndim):
                raise ValueError(
                    f"{name}: expected slots sharded over ep on axis 0 ({expected.spec}), "
                    f"got {sharding}"
                )
            row.append(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding))
        structs.append(tuple(row))
    return tuple(structs)


def _same_layout(a, b) -> bool:
    """Same layers, shapes and dtypes, and equivalent shardings."""
    if [len(layer) for layer in a] != [len(layer) for layer in b]:
        return False
    return all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and x.sharding.is_equivalent_to(y.sharding, len(x.shape))
        for la, lb in zip(a, b, strict=True)
        for x, y in zip(la, lb, strict=True)
    )


def _describe(structs) -> str:
    return str([[(tuple(w.shape), str(w.dtype)) for w in layer] for layer in structs])


__all__ = ["PlacementExecutor", "ReplacementStats"]
