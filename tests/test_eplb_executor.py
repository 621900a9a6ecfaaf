"""EPLB placement executor (eplb/executor.py) on 8 emulated CPU devices.

The oracles are independent of the executor: the weights a slot should hold are the
logical expert's weights indexed on the host (`logical[new_p2l]`); the tables come from
`placement_from_slots`; the MoE output of the re-placed weights goes through the
expert-parallel MoE the model uses (`moe_ep.expert_parallel_moe`) and is compared with
the dense one-device MoE on the logical weights (`moe_experts_dense`); compilations are
counted from JAX's backend-compile events.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.eplb.executor import PlacementExecutor
from jaxserve.eplb.planner import minimize_movement, plan_placement
from jaxserve.eplb.transfer_plan import source_slots
from jaxserve.models.moe import route
from jaxserve.models.moe_experts import moe_experts_dense
from jaxserve.sharding import moe_ep
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.placement import placement_from_slots
from jaxserve.sharding.rules import batch_sharding, named_sharding, param_sharding_fn

NUM_EXPERTS, NUM_SLOTS, HIDDEN, INTER, NUM_LAYERS, TOP_K = 16, 24, 64, 32, 2, 2
MAX_REPLICAS = NUM_SLOTS - NUM_EXPERTS + 1  # any placement fits the table width

_COMPILES = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


# ----- source_slots ------------------------------------------------------------------------


def _random_pair(rng, num_slots: int, num_experts: int):
    """A current placement (every expert at least once) and a new one whose experts
    the current one all holds."""
    cur = rng.permutation(
        np.concatenate(
            [np.arange(num_experts), rng.integers(0, num_experts, num_slots - num_experts)]
        )
    )
    new = rng.permutation(
        np.concatenate(
            [np.arange(num_experts), rng.integers(0, num_experts, num_slots - num_experts)]
        )
    )
    # Keep some slots as they are, as a movement-minimised plan does.
    keep = rng.random(num_slots) < 0.3
    return cur, np.where(keep, cur, new)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_source_slots_prefers_kept_then_same_device(ep):
    rng = np.random.default_rng(ep)
    per_device = NUM_SLOTS // ep
    for _ in range(50):
        cur, new = _random_pair(rng, NUM_SLOTS, NUM_EXPERTS)
        src = source_slots(cur, new, ep)
        assert src.dtype == np.int32 and src.shape == (NUM_SLOTS,)
        np.testing.assert_array_equal(cur[src], new)  # the right expert's weights
        for s in range(NUM_SLOTS):
            device = s // per_device
            if cur[s] == new[s]:
                assert src[s] == s
            elif (cur[device * per_device : (device + 1) * per_device] == new[s]).any():
                assert src[s] // per_device == device, (s, src[s])


def test_source_slots_takes_local_replica_over_lower_remote_slot():
    # ep = 2: device 0 holds slots 0-3, device 1 slots 4-7. Expert 0 sits in slot 0
    # (device 0) and slot 7 (device 1); new slot 5 on device 1 must copy from slot 7.
    cur = np.array([0, 1, 2, 3, 4, 5, 6, 0])
    new = np.array([0, 1, 2, 3, 4, 0, 6, 0])
    src = source_slots(cur, new, ep=2)
    assert src[5] == 7 and src[7] == 7
    # Without a local replica the remote slot is used.
    src = source_slots(cur, np.array([0, 1, 2, 3, 4, 1, 6, 0]), ep=2)
    assert src[5] == 1


def test_source_slots_errors_name_the_argument():
    cur = np.array([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"new_p2l: experts \[7\] are held by no slot"):
        source_slots(cur, np.array([0, 1, 7, 3]), ep=2)
    with pytest.raises(ValueError, match="new_p2l: expected the shape of current_p2l"):
        source_slots(cur, np.array([0, 1, 2]), ep=2)
    with pytest.raises(ValueError, match=r"current_p2l: expected int \[S\]"):
        source_slots(cur.reshape(2, 2), cur.reshape(2, 2), ep=2)
    with pytest.raises(ValueError, match=r"new_p2l: expected int \[S\]"):
        source_slots(cur, cur.astype(np.float32), ep=2)
    with pytest.raises(ValueError, match="ep: 3 must be >= 1 and divide S=4"):
        source_slots(cur, cur, ep=3)


# ----- the executor on a mesh --------------------------------------------------------------


@functools.cache
def _logical_weights():
    """[L] layers of (w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H]) and gates."""
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(NUM_LAYERS):
        layers.append(
            tuple(
                (rng.standard_normal(shape) * 0.3).astype(np.float32)
                for shape in (
                    (NUM_EXPERTS, HIDDEN, INTER),
                    (NUM_EXPERTS, HIDDEN, INTER),
                    (NUM_EXPERTS, INTER, HIDDEN),
                )
            )
        )
    gates = rng.standard_normal((NUM_LAYERS, HIDDEN, NUM_EXPERTS)).astype(np.float32)
    return layers, gates


def _skewed_load(seed: int) -> np.ndarray:
    """[L, E] Zipf-like expert load (exponent 1.2), a random hot order per layer."""
    rng = np.random.default_rng(seed)
    base = 1000.0 * (np.arange(1, NUM_EXPERTS + 1) ** -1.2)
    return np.stack([rng.permutation(base) for _ in range(NUM_LAYERS)])


@functools.cache
def _ep_moe(mesh):
    return jax.jit(lambda *a: moe_ep.expert_parallel_moe(*a, mesh=mesh))


def _check_moe_output(mesh, weights, tables, seed: int) -> None:
    """The EP MoE of each layer's slot weights and tables == the dense MoE on the
    logical weights."""
    logical, gates = _logical_weights()
    dp = mesh.shape["dp"]
    x = np.random.default_rng(seed).standard_normal((6 * dp, HIDDEN)).astype(np.float32)
    for layer in range(NUM_LAYERS):
        topk_w, topk_ids = route(jnp.asarray(x), jnp.asarray(gates[layer]), TOP_K, True)
        want = moe_experts_dense(jnp.asarray(x), topk_w, topk_ids, *logical[layer])
        args = [jax.device_put(a, batch_sharding(mesh, 2)) for a in (x, topk_w, topk_ids)]
        got = _ep_moe(mesh)(*args, *weights[layer], tables[layer])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def _expected_remote(cur: np.ndarray, new: np.ndarray, ep: int) -> int:
    """Slots that changed expert with no slot of their device holding the new one."""
    per_device = cur.shape[-1] // ep
    count = 0
    for c, n in zip(cur, new, strict=True):
        for s in np.flatnonzero(c != n):
            device = c[(s // per_device) * per_device :][:per_device]
            count += int(not (device == n[s]).any())
    return count


@pytest.fixture(scope="module", params=[(8, 1), (2, 4)], ids=["dp8tp1", "dp2tp4"])
def placed(request):
    """A mesh, an executor, and the layers' weights laid out by an initial placement."""
    dp, tp = request.param
    mesh = build_mesh(dp, tp)
    logical, _ = _logical_weights()
    rng = np.random.default_rng(dp)
    extra = rng.integers(0, NUM_EXPERTS, (NUM_LAYERS, NUM_SLOTS - NUM_EXPERTS))
    initial = np.stack(
        [rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), e])) for e in extra]
    )
    sharding = named_sharding(mesh, ("experts", "embed", "expert_mlp"))
    weights = [
        tuple(jax.device_put(w[initial[layer]], sharding) for w in logical[layer])
        for layer in range(NUM_LAYERS)
    ]
    executor = PlacementExecutor(mesh, weights, NUM_EXPERTS, MAX_REPLICAS)
    return mesh, executor, weights, initial


def _host_copy(x: jax.Array) -> np.ndarray:
    """The array on the host through its transient per-device shards: `np.asarray(x)`
    would cache a host view on `x` itself, which on the CPU keeps its buffer from being
    donated to the next apply."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.array(s.data) for s in shards])


def _check_placed(mesh, new_weights, old_shardings, tables, new_p2l):
    logical, _ = _logical_weights()
    for layer in range(NUM_LAYERS):
        for got, want, sharding in zip(
            new_weights[layer], logical[layer], old_shardings[layer], strict=True
        ):
            np.testing.assert_array_equal(_host_copy(got), want[new_p2l[layer]])
            assert got.sharding == sharding
        expected = placement_from_slots(new_p2l[layer], NUM_EXPERTS, MAX_REPLICAS)
        # The model's PlacementTable state is placed by the loader's sharding rule.
        state_sharding = param_sharding_fn(mesh)("layers.0.mlp.physical_to_logical", ())
        for field in dataclasses.fields(expected):
            got = getattr(tables[layer], field.name)
            want = getattr(expected, field.name)
            np.testing.assert_array_equal(np.asarray(got), want)
            assert got.dtype == jnp.int32 and got.shape == want.shape
            assert got.sharding.is_equivalent_to(state_sharding, got.ndim)


def test_replacement_moves_weights_and_keeps_moe_output(placed):
    mesh, executor, weights, current = placed
    ep = mesh.size
    # The initial tables placed as the loader places the model's PlacementTable state.
    state_sharding = param_sharding_fn(mesh)("layers.0.mlp.physical_to_logical", ())
    tables = [
        jax.device_put(placement_from_slots(row, NUM_EXPERTS, MAX_REPLICAS), state_sharding)
        for row in current
    ]
    _check_moe_output(mesh, weights, tables, seed=1)

    compiles = _COMPILES[0]
    for step, (seed, minimize) in enumerate([(11, True), (12, False), (13, True)]):
        load = _skewed_load(seed)
        plan = plan_placement(load, NUM_SLOTS, ep, current=current).physical_to_logical
        if minimize:
            plan = np.stack(
                [minimize_movement(c, p, ep)[0] for c, p in zip(current, plan, strict=True)]
            )
        assert (plan != current).any(), "the test needs a placement that changes"
        shardings = [tuple(w.sharding for w in layer) for layer in weights]
        new_weights, new_tables, stats = executor.apply(weights, current, plan)

        assert all(w.is_deleted() for layer in weights for w in layer)  # donated
        _check_placed(mesh, new_weights, shardings, new_tables, plan)
        remote = _expected_remote(current, plan, ep)
        assert stats.slots_moved_remote == remote
        assert stats.bytes_moved == remote * 4 * 3 * HIDDEN * INTER
        assert stats.slots_kept == int((current == plan).sum())
        assert stats.slots_kept + stats.slots_copied_local + remote == NUM_LAYERS * NUM_SLOTS
        if step < 2:  # after the first and the second re-placement
            _check_moe_output(mesh, new_weights, new_tables, seed=2 + step)
        weights, current = new_weights, plan

    # Neither the executor nor the MoE step that reads the swapped-in weights and tables.
    assert _COMPILES[0] == compiles, "a new placement must not compile anything"
    assert executor.num_compilations == 1


def test_executor_errors_name_the_field(placed):
    mesh, executor, _, current = placed
    logical, _ = _logical_weights()
    ep = mesh.size
    sharding = named_sharding(mesh, ("experts", "embed", "expert_mlp"))
    with pytest.raises(ValueError, match=r"current_p2l: expected int \[2, 24\]"):
        executor.apply([], current[0], current)
    with pytest.raises(ValueError, match=r"new_p2l: entries must be in \[0, 16\)"):
        executor.apply([], current, current + NUM_EXPERTS)
    few = current.copy()
    few[0, :] = np.arange(NUM_SLOTS) % 8  # experts 8-15 lose their slots
    with pytest.raises(ValueError, match="physical_to_logical: experts .* have no slot"):
        executor.apply([], current, few)
    small = jax.device_put(np.zeros((NUM_SLOTS, 4, 4), np.float32), sharding)
    with pytest.raises(ValueError, match="weights: shapes/dtypes/shardings differ"):
        executor.apply([(small,) * 3] * NUM_LAYERS, current, current)
    replicated_weight = jax.device_put(logical[0][1][current[0]])  # one device only
    bad = [
        (jax.device_put(logical[0][0][current[0]], sharding), replicated_weight),
    ]
    with pytest.raises(ValueError, match=r"weights\[0\]\[1\]: expected slots sharded over ep"):
        PlacementExecutor(mesh, bad, NUM_EXPERTS, MAX_REPLICAS)
    with pytest.raises(ValueError, match=r"max_transfer_slots: 0 must be in \[1, S/ep = 3\]"):
        PlacementExecutor(mesh, [bad[0][:1]], NUM_EXPERTS, MAX_REPLICAS, max_transfer_slots=0)
    # A capacity of one slot per device pair; new slots 3 and 4 (device 1) take experts 9
    # and 10, held only by slots 9 and 10, both on device 3 (3 slots per device).
    assert ep == 8
    tight = PlacementExecutor(mesh, [bad[0][:1]], NUM_EXPERTS, MAX_REPLICAS, max_transfer_slots=1)
    cur = np.concatenate([np.arange(NUM_EXPERTS), np.arange(8)])[None, :]
    new = cur.copy()
    new[0, 3:5] = [9, 10]
    with pytest.raises(
        ValueError,
        match="layer 0: device 1 needs more than max_transfer_slots=1 slots from device 3",
    ):
        tight.apply([bad[0][:1]], cur, new)


def test_move_scratch_is_a_few_arrays_not_every_round(placed):
    # Weights are donated (aliased to the outputs); the scratch the move needs on a device
    # is about one array's new slots plus one round's send and receive buffers. Without
    # the sequencing barriers XLA keeps every round's buffers of every array at once
    # (about 48 of these arrays here).
    mesh, executor, _, _ = placed
    array_bytes = NUM_SLOTS // mesh.size * HIDDEN * INTER * 4  # one array, one device
    assert executor.temp_bytes_per_device is not None
    assert executor.temp_bytes_per_device <= 4 * array_bytes
