"""The routing-sized expert-parallel dispatch (capacity factor + drop-free overflow rounds)
on 8 emulated CPU devices.

Oracles: the dense single-device MoE (`moe_experts_dense`, itself checked against HF
transformers through the models), brute force over the excess for the round count, and
the all-to-all buffers of the compiled HLO for the byte accounting.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.moe_experts import moe_experts_dense
from jaxserve.sharding import moe_ep
from jaxserve.sharding.dispatch_capacity import (
    DEFAULT_CAPACITY_FACTOR,
    dispatch_bytes_per_device,
    dispatch_capacity,
    ideal_bytes_per_device,
    row_bytes,
)
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.placement import identity_placement, placement_from_slots
from jaxserve.sharding.rules import batch_sharding, named_sharding, replicated

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 16, 8, 16, 2
# 0.3: a main round of ~1/3 of the mean per-peer rows, so even random routing overflows
# and skewed routing needs many rounds.
FACTORS = [DEFAULT_CAPACITY_FACTOR, 0.3]


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    shapes = {"w_gate": (HIDDEN, INTER), "w_up": (HIDDEN, INTER), "w_down": (INTER, HIDDEN)}
    return {
        n: (rng.standard_normal((NUM_EXPERTS, *s)) * 0.3).astype(np.float32)
        for n, s in shapes.items()
    }


@functools.cache
def _fn(dp: int, tp: int, factor: float | None):
    mesh = build_mesh(dp, tp)
    return mesh, jax.jit(
        lambda *a: moe_ep.expert_parallel_moe(*a, mesh=mesh, capacity_factor=factor)
    )


def _routing(num_tokens: int, kind: str, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, HIDDEN)).astype(np.float32)
    if kind == "random":
        ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in x])
    else:  # adversarial: every token picks experts 6 and 7, both on device 3 (2 slots each)
        ids = np.tile([[7, 6]], (num_tokens, 1))
    w = rng.random((num_tokens, TOP_K)).astype(np.float32)
    return x, w / w.sum(1, keepdims=True), ids.astype(np.int32)


def _run(weights, dp, tp, factor, placement, x, w, ids):
    mesh, fn = _fn(dp, tp, factor)
    tokens = batch_sharding(mesh, 2)
    p2l = np.asarray(placement.physical_to_logical)
    experts = named_sharding(mesh, ("experts", None, None))
    physical = [jax.device_put(weights[n][p2l], experts) for n in ("w_gate", "w_up", "w_down")]
    args = [jax.device_put(a, tokens) for a in (x, w, ids)]
    return np.asarray(fn(*args, *physical, jax.device_put(placement, replicated(mesh))))


def _dense(weights, x, w, ids):
    experts = [weights[n] for n in ("w_gate", "w_up", "w_down")]
    return np.asarray(moe_experts_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), *experts))


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("dp,tp", [(8, 1), (2, 4)])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_routing_sized_dispatch_matches_the_single_device_moe(weights, dp, tp, factor, kind):
    # 12 tokens per dp rank: not a multiple of tp = 4 (tp padding rows).
    x, w, ids = _routing(12 * dp, kind)
    out = _run(weights, dp, tp, factor, identity_placement(NUM_EXPERTS), x, w, ids)
    np.testing.assert_allclose(out, _dense(weights, x, w, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_routing_sized_dispatch_with_redundant_slots(weights, kind):
    # S = E + 8 slots (3 per device), the hot experts 6 and 7 replicated 5 times each.
    slots = np.concatenate([np.arange(NUM_EXPERTS), [6, 7] * 4])
    placement = placement_from_slots(slots, NUM_EXPERTS, 5)
    x, w, ids = _routing(96, kind, seed=2)
    out = _run(weights, 8, 1, 0.3, placement, x, w, ids)
    np.testing.assert_allclose(out, _dense(weights, x, w, ids), atol=1e-5, rtol=0)


def test_traced_round_count_matches_the_host_count():
    cap = dispatch_capacity(40, 4, 8, 4, 0.5)
    assert cap.overflow > 0
    excess = np.arange(-3, cap.worst - cap.main + 1)
    traced = jax.jit(moe_ep.overflow_rounds, static_argnums=1)(jnp.asarray(excess), cap.overflow)
    want = [cap.overflow_rounds(int(e)) for e in excess]
    assert np.asarray(traced).tolist() == want
    # Brute force: the fewest rounds of `overflow` rows that hold the excess.
    assert want == [next(r for r in range(99) if r * cap.overflow >= max(e, 0)) for e in excess]
    assert cap.overflow_rounds(cap.worst - cap.main) == cap.max_overflow_rounds
    with pytest.raises(ValueError, match="excess"):
        cap.overflow_rounds(cap.worst - cap.main + 1)


def test_capacity_sizes():
    # 256 tokens, top-8, ep 64, 3 slots per device: mean 32 rows per peer.
    cap = dispatch_capacity(256, 8, 64, 3, 1.25)
    assert (cap.main, cap.worst, cap.overflow) == (40, 256 * 3, 10)
    worst = dispatch_capacity(256, 8, 64, 3, None)
    assert (worst.main, worst.overflow, worst.max_overflow_rounds) == (768, 0, 0)
    tiny = dispatch_capacity(1, 8, 256, 1, 1.25)  # mean 1/32 of a row: at least one row
    assert tiny.main == 1 and tiny.worst == 1 and tiny.overflow == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        dispatch_capacity(16, 2, 8, 2, 0.0)
    with pytest.raises(ValueError, match="tokens_per_device"):
        dispatch_capacity(0, 2, 8, 2)


def test_bad_capacity_factor_names_the_field(weights):
    mesh = build_mesh(8, 1)
    x, w, ids = _routing(8, "random")
    experts = [weights[n] for n in ("w_gate", "w_up", "w_down")]
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        moe_ep.expert_parallel_moe(
            x, w, ids, *experts, identity_placement(NUM_EXPERTS), mesh=mesh, capacity_factor=-1
        )


# ----- the bytes: one function for the benchmark, checked against the compiled step -----

_ARRAY = re.compile(r"\b(f32|s32|bf16)\[([\d,]*)\]")
_ITEMSIZE = {"f32": 4, "s32": 4, "bf16": 2}
_COMPUTATION = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) ")


def _all_to_all_bytes_by_computation(hlo: str) -> tuple[dict[str, int], str, list[str]]:
    """Per-device all-to-all buffer bytes of each computation in compiled HLO text, the
    entry computation's name and the body computations of its while loops."""
    by_comp: dict[str, int] = {}
    comp = entry = ""
    bodies = []
    for line in hlo.splitlines():
        if (m := _COMPUTATION.match(line)) and line.rstrip().endswith("{"):
            comp = m.group(1)
            entry = comp if line.startswith("ENTRY") else entry
            by_comp.setdefault(comp, 0)
            continue
        lhs, _, rhs = line.partition(" = ")
        if " while(" in rhs:
            bodies.append(re.search(r"body=(%[\w.\-]+)", rhs).group(1))
        if " all-to-all(" in rhs:
            result_type = rhs.split(" all-to-all(")[0]
            for dtype, dims in _ARRAY.findall(result_type):
                size = math.prod(int(d) for d in dims.split(",") if d)
                by_comp[comp] += _ITEMSIZE[dtype] * size
    return by_comp, entry, bodies


@pytest.mark.parametrize("dp,tp", [(8, 1), (2, 4)])
def test_bytes_function_matches_the_compiled_buffers(weights, dp, tp):
    factor = 0.3
    mesh, fn = _fn(dp, tp, factor)
    num_tokens = 12 * dp
    x, w, ids = _routing(num_tokens, "random")
    experts = [weights[n] for n in ("w_gate", "w_up", "w_down")]
    placement = jax.tree.map(jnp.asarray, identity_placement(NUM_EXPERTS))
    hlo = fn.lower(x, w, ids, *experts, placement).compile().as_text()
    by_comp, entry, bodies = _all_to_all_bytes_by_computation(hlo)
    loops = [b for b in bodies if by_comp.get(b)]
    assert len(loops) == 1, "one overflow loop with all-to-alls"
    ep = mesh.size
    main = by_comp[entry] * (ep - 1) // ep  # a device keeps its own chunk
    per_round = by_comp[loops[0]] * (ep - 1) // ep
    n = moe_ep.per_device_tokens(num_tokens, mesh)
    cap = dispatch_capacity(n, TOP_K, ep, NUM_EXPERTS // ep, factor)
    assert cap.max_overflow_rounds >= 2
    for rounds in range(cap.max_overflow_rounds + 1):
        want = moe_ep.all_to_all_bytes_per_device(
            num_tokens, HIDDEN, TOP_K, mesh, NUM_EXPERTS, 4, factor, rounds
        )
        assert main + rounds * per_round == want > 0
        assert want == dispatch_bytes_per_device(cap, HIDDEN, 4, rounds)


def test_worst_case_dispatch_has_no_overflow_loop(weights):
    mesh, fn = _fn(8, 1, None)
    x, w, ids = _routing(96, "random")
    experts = [weights[n] for n in ("w_gate", "w_up", "w_down")]
    placement = jax.tree.map(jnp.asarray, identity_placement(NUM_EXPERTS))
    hlo = fn.lower(x, w, ids, *experts, placement).compile().as_text()
    by_comp, entry, bodies = _all_to_all_bytes_by_computation(hlo)
    assert not [b for b in bodies if by_comp.get(b)]
    want = moe_ep.all_to_all_bytes_per_device(96, HIDDEN, TOP_K, mesh, NUM_EXPERTS, 4)
    assert by_comp[entry] * 7 // 8 == want


def test_ideal_bytes_are_the_routed_rows():
    assert ideal_bytes_per_device(10, HIDDEN, 2) == 10 * (2 * HIDDEN * 2 + 4)
    assert row_bytes(HIDDEN, 4) == 2 * HIDDEN * 4 + 4


# ----- the ragged path (GPU only), its offsets checked on the CPU with an emulation -----


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`lax.ragged_all_to_all` as its docstring defines it, from all_gathers: device i
    sends operand[input_offsets[j]:+send_sizes[j]] to device j, written there at
    output_offsets[j] (one slice per device)."""
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [ep] from each source
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    at = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    assert_sizes = jnp.all(sizes == recv_sizes)
    index = jnp.arange(output.shape[0])
    for i in range(ops.shape[0]):
        inside = (index >= at[i]) & (index < at[i] + sizes[i]) & assert_sizes
        src = jnp.clip(index - at[i] + starts[i], 0, operand.shape[0] - 1)
        mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(mask, ops[i][src], output)
    return output


@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_ragged_path_offsets_with_an_emulated_collective(weights, monkeypatch, kind):
    # Random routing fits the receive buffer (ragged exchange); adversarial routing does
    # not (every device falls back to the capacity rounds). Both equal the dense MoE.
    monkeypatch.setenv("JAXSERVE_EP_RAGGED", "on")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    mesh = build_mesh(8, 1)
    fn = jax.jit(
        lambda *a: moe_ep.expert_parallel_moe(
            *a, mesh=mesh, capacity_factor=DEFAULT_CAPACITY_FACTOR
        )
    )
    x, w, ids = _routing(96, kind, seed=2)
    # Which branch this routing takes: rows each device receives against ep * main.
    received = np.bincount(ids.reshape(-1) // 2, minlength=8)  # expert e on device e // 2
    cap = dispatch_capacity(12, TOP_K, 8, 2, DEFAULT_CAPACITY_FACTOR)
    assert (received.max() <= 8 * cap.main) == (kind == "random")
    tokens = batch_sharding(mesh, 2)
    experts = named_sharding(mesh, ("experts", None, None))
    physical = [jax.device_put(weights[n], experts) for n in ("w_gate", "w_up", "w_down")]
    args = [jax.device_put(a, tokens) for a in (x, w, ids)]
    tables = jax.device_put(identity_placement(NUM_EXPERTS), replicated(mesh))
    lowered = fn.lower(*args, *physical, tables).as_text()
    assert "all_gather" in lowered  # the emulation is in the program: the ragged branch
    out = np.asarray(fn(*args, *physical, tables))
    np.testing.assert_allclose(out, _dense(weights, x, w, ids), atol=1e-5, rtol=0)


def test_ragged_is_off_on_the_cpu(monkeypatch):
    from jaxserve.sharding.moe_ragged import ragged_supported

    monkeypatch.delenv("JAXSERVE_EP_RAGGED", raising=False)
    assert not ragged_supported()
    monkeypatch.setenv("JAXSERVE_EP_RAGGED", "maybe")
    with pytest.raises(ValueError, match="JAXSERVE_EP_RAGGED"):
        ragged_supported()


def test_ragged_path_lowers_with_the_real_collective(weights, monkeypatch):
    # The CPU cannot compile ragged_all_to_all, but the program must lower with it: rows
    # and ids out, results back (3 ops), behind the capacity fallback.
    monkeypatch.setenv("JAXSERVE_EP_RAGGED", "on")
    mesh = build_mesh(4, 2)
    fn = jax.jit(lambda *a: moe_ep.expert_parallel_moe(*a, mesh=mesh, capacity_factor=1.25))
    x, w, ids = _routing(16, "random")
    experts = [weights[n] for n in ("w_gate", "w_up", "w_down")]
    placement = jax.tree.map(jnp.asarray, identity_placement(NUM_EXPERTS))
    text = fn.lower(x, w, ids, *experts, placement).as_text()
    assert text.count("ragged_all_to_all") == 3
