"""Meshes, the sharding rules, expert-parallel MoE and DP attention on 8 emulated CPU devices.

Oracles: the single-device model (itself checked against HF transformers in
test_models_hf.py) and the dense single-device MoE (`moe_experts_dense`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from model_utils import tiny_mixtral_config, write_hf_checkpoint
from server_harness import REPO_DIR
from sharding_utils import GreedyDriver, mesh_qwen3_moe_config

from jaxserve.models.loader import load_config, load_model
from jaxserve.models.moe import route
from jaxserve.models.moe_experts import moe_experts_dense
from jaxserve.sharding import moe_ep
from jaxserve.sharding.ep_calibration import measure_replicated_max_tokens, replicated_threshold
from jaxserve.sharding.load import load_sharded_model
from jaxserve.sharding.mesh import MeshError, as_auto_mesh, build_mesh, check_model_fits
from jaxserve.sharding.parallel import MeshParallelism
from jaxserve.sharding.placement import (
    ExpertPlacement,
    identity_placement,
    placement_from_slots,
)
from jaxserve.sharding.rules import (
    LOGICAL_AXIS_RULES,
    batch_sharding,
    logical_to_spec,
    named_sharding,
    replicated,
)

MESHES = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)]
EP_MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
PATHS = [moe_ep.ALL_TO_ALL, moe_ep.REPLICATED]

# ----- compilation counting ---------------------------------------------------------------

_COMPILES = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def test_eight_emulated_devices():
    assert jax.device_count() == 8, "tests/conftest.py must set 8 emulated CPU devices"


# ----- mesh and rules ---------------------------------------------------------------------


def test_build_mesh_auto_axes_and_device_order():
    mesh = build_mesh(4, 2)
    assert mesh.axis_names == ("dp", "tp")
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]


def test_build_mesh_errors():
    with pytest.raises(MeshError, match="needs 16 devices, but only 8 are visible"):
        build_mesh(4, 4)
    with pytest.raises(MeshError, match=r"needs 2 devices, but only 1 is visible \(cpu;"):
        build_mesh(2, 1, devices=jax.devices()[:1])  # it said "only 1 are visible"
    with pytest.raises(MeshError, match="dp and tp must be >= 1"):
        build_mesh(0, 2)


def test_explicit_mesh_rebuilt_as_auto():
    explicit = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    mesh = as_auto_mesh(explicit)
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert (mesh.devices == explicit.devices).all()
    with pytest.raises(MeshError, match="expected axes"):
        as_auto_mesh(jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,)))


def test_logical_to_spec():
    assert logical_to_spec(("experts", "embed", "expert_mlp")) == jax.P(("dp", "tp"), None, None)
    assert logical_to_spec(("embed", "q_heads", "head_dim")) == jax.P(None, "tp", None)
    assert logical_to_spec(("embed", None)) == jax.P(None, None)
    with pytest.raises(ValueError, match="'heads' has no sharding rule"):
        logical_to_spec(("embed", "heads"))
    with pytest.raises(ValueError, match="onto one mesh axis"):
        logical_to_spec(("q_heads", "mlp"))


# ----- expert-parallel MoE against the dense single-device MoE ----------------------------

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 16, 8, 8, 2


@pytest.fixture(scope="module")
def moe_weights():
    rng = np.random.default_rng(0)
    return {
        "gate": rng.standard_normal((HIDDEN, NUM_EXPERTS)).astype(np.float32),
        "w_gate": (rng.standard_normal((NUM_EXPERTS, HIDDEN, INTER)) * 0.3).astype(np.float32),
        "w_up": (rng.standard_normal((NUM_EXPERTS, HIDDEN, INTER)) * 0.3).astype(np.float32),
        "w_down": (rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN)) * 0.3).astype(np.float32),
    }


def _routing(weights, num_tokens: int, skewed: bool, seed: int = 1):
    x = np.random.default_rng(seed).standard_normal((num_tokens, HIDDEN)).astype(np.float32)
    topk_w, topk_ids = route(jnp.asarray(x), jnp.asarray(weights["gate"]), TOP_K, True)
    if skewed:  # every token picks experts 5 and 2: all rows go to one or two devices
        topk_ids = jnp.tile(jnp.asarray([[5, 2]], jnp.int32), (num_tokens, 1))
    return x, topk_w, topk_ids


def _dense(weights, x, topk_w, topk_ids):
    return np.asarray(
        moe_experts_dense(
            jnp.asarray(x), topk_w, topk_ids, weights["w_gate"], weights["w_up"], weights["w_down"]
        )
    )


@functools.cache
def _ep_fn(mesh, path):
    """One jitted EP MoE per (mesh, path), shared by the tests (same shapes, one compile)."""
    return jax.jit(lambda *a: moe_ep.expert_parallel_moe(*a, mesh=mesh, path=path))


def _physical(weights, mesh, placement: ExpertPlacement):
    """The slot-indexed expert weights for `placement`, sharded over ep."""
    p2l = np.asarray(placement.physical_to_logical)
    sharding = named_sharding(mesh, ("experts", None, None))
    return [jax.device_put(weights[n][p2l], sharding) for n in ("w_gate", "w_up", "w_down")]


def _run_ep(weights, mesh, path, placement, x, topk_w, topk_ids, fn=None):
    fn = fn or _ep_fn(mesh, path)
    tokens = batch_sharding(mesh, 2)
    args = [jax.device_put(a, tokens) for a in (x, topk_w, topk_ids)]
    tables = jax.device_put(placement, replicated(mesh))
    return np.asarray(fn(*args, *_physical(weights, mesh, placement), tables))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dp,tp", EP_MESHES)
@pytest.mark.parametrize("skewed", [False, True], ids=["random", "skewed"])
def test_ep_moe_matches_dense(moe_weights, dp, tp, path, skewed):
    # 2 * dp * 5 tokens: dp ranks of 10 tokens, not a multiple of tp = 4 or 8 (padding).
    mesh = build_mesh(dp, tp)
    x, topk_w, topk_ids = _routing(moe_weights, 10 * dp, skewed)
    out = _run_ep(moe_weights, mesh, path, identity_placement(NUM_EXPERTS), x, topk_w, topk_ids)
    np.testing.assert_allclose(out, _dense(moe_weights, x, topk_w, topk_ids), atol=1e-5, rtol=0)


def _local_ffn_oracle(x, ids, w_gate, w_up, w_down):
    """NumPy SwiGLU of each row with its expert (float32, the [M, I] intermediate rounded
    to the input dtype as the kernels store it); rows with id L give 0."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float32) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    for r, e in enumerate(np.asarray(ids)):
        if e < w_gate.shape[0]:
            gate, up = x[r] @ w_gate[e], x[r] @ w_up[e]
            hidden = gate / (1 + np.exp(-gate)) * up
            out[r] = np.asarray(jnp.asarray(hidden, jnp.bfloat16), np.float32) @ w_down[e]
    return out


def test_local_expert_ffn_kernel_boundary():
    """The grouped-matmul plug-in of the all_to_all path (sort by expert, kernel, unsort)
    under the Mosaic GPU interpreter, and the CPU dense path, against a NumPy oracle."""
    from jaxserve.kernels import dispatch

    rng = np.random.default_rng(5)
    rows, hidden, inter, local = 24, 128, 128, 3

    def bf16(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)

    x = bf16((rows, hidden))
    weights = bf16((local, hidden, inter), 0.1), bf16((local, hidden, inter), 0.1)
    weights += (bf16((local, inter, hidden), 0.1),)
    ids = jnp.asarray(rng.integers(0, local + 1, rows), jnp.int32)  # id 3: empty row
    want = _local_ffn_oracle(x, ids, *weights)
    dense = moe_ep.local_expert_ffn(x, ids, *weights)
    with dispatch.backend_override(dispatch.INTERPRET):
        kernel = jax.jit(moe_ep.local_expert_ffn)(x, ids, *weights)
    for got in (dense, kernel):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
        assert not np.asarray(got, np.float32)[np.asarray(ids) == local].any()


def _replica_placements(num_slots: int):
    """Two different placements of NUM_EXPERTS experts on `num_slots` slots with replicas (same
    table shapes): hot experts 5 and 2 get extra slots, the order is shuffled."""
    rng = np.random.default_rng(7)
    extra = [5, 2, 5, 2, 5, 1, 0, 3][: num_slots - NUM_EXPERTS]
    first = rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), extra]))
    second = rng.permutation(first)
    return (placement_from_slots(s, NUM_EXPERTS, max_replicas=4) for s in (first, second))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dp,tp", [(4, 2), (1, 8)])
def test_ep_moe_replicas_replaced_without_recompiling(moe_weights, dp, tp, path):
    mesh = build_mesh(dp, tp)
    first, second = _replica_placements(16)
    assert (np.asarray(first.replica_counts)[[5, 2]] > 1).all()
    assert not np.array_equal(first.physical_to_logical, second.physical_to_logical)
    fn = _ep_fn(mesh, path)
    for skewed in (False, True):
        x, topk_w, topk_ids = _routing(moe_weights, 8 * dp, skewed)
        want = _dense(moe_weights, x, topk_w, topk_ids)
        out = _run_ep(moe_weights, mesh, path, first, x, topk_w, topk_ids, fn)
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
        compiles = _COMPILES[0]
        out = _run_ep(moe_weights, mesh, path, second, x, topk_w, topk_ids, fn)
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
        assert _COMPILES[0] == compiles, "a new placement must not recompile"


def test_replicas_share_the_load(moe_weights):
    # Skewed routing over replicated experts: every replica of expert 5 gets tokens.
    from jaxserve.sharding.placement import choose_slots

    placement, _ = _replica_placements(16)
    ids = jnp.full((64, 1), 5, jnp.int32)
    slots = np.asarray(choose_slots(ids, jnp.arange(64, dtype=jnp.int32), placement))
    replicas = np.flatnonzero(np.asarray(placement.physical_to_logical) == 5)
    assert sorted(set(slots.ravel().tolist())) == sorted(replicas.tolist())


@pytest.mark.parametrize("dp,tp", [(2, 4), (8, 1)])
def test_replicated_path_equals_all_to_all(moe_weights, dp, tp):
    mesh = build_mesh(dp, tp)
    x, topk_w, topk_ids = _routing(moe_weights, 6 * dp, skewed=False, seed=3)
    identity = identity_placement(NUM_EXPERTS)
    a2a, rep = (_run_ep(moe_weights, mesh, p, identity, x, topk_w, topk_ids) for p in PATHS)
    np.testing.assert_allclose(rep, a2a, atol=1e-6, rtol=0)


def test_ep_moe_errors(moe_weights):
    mesh = build_mesh(4, 2)
    x, topk_w, topk_ids = _routing(moe_weights, 6, skewed=False)
    experts = [moe_weights[n] for n in ("w_gate", "w_up", "w_down")]
    args = (x, topk_w, topk_ids, *experts, identity_placement(NUM_EXPERTS))
    with pytest.raises(ValueError, match="6 tokens are not divisible by dp=4"):
        moe_ep.expert_parallel_moe(*args, mesh=mesh)
    one = (*_routing(moe_weights, 1, skewed=False), *args[3:])
    with pytest.raises(ValueError, match="1 token is not divisible by dp=4"):
        moe_ep.expert_parallel_moe(*one, mesh=mesh)
    with pytest.raises(ValueError, match=r"8 expert slots are not divisible by ep = dp\*tp = 6"):
        moe_ep.expert_parallel_moe(*args, mesh=build_mesh(3, 2))
    with pytest.raises(ValueError, match="path must be one of"):
        moe_ep.expert_parallel_moe(*args, mesh=mesh, path="dense")


def test_placement_from_slots_errors():
    with pytest.raises(ValueError, match=r"experts \[3\] have no slot"):
        placement_from_slots(np.array([0, 1, 2, 2]), 4)
    with pytest.raises(ValueError, match="more than max_replicas=1"):
        placement_from_slots(np.array([0, 1, 1, 2]), 3, max_replicas=1)
    with pytest.raises(ValueError, match=r"entries must be in \[0, 2\)"):
        placement_from_slots(np.array([0, 2]), 2)


_HLO_ARRAY = re.compile(r"\b(f32|s32)\[([\d,]*)\]")


def _all_to_all_buffer_bytes(hlo: str) -> int:
    """Sum of the per-device buffers of every all-to-all in compiled HLO text."""
    total = 0
    for line in hlo.splitlines():
        lhs, _, rhs = line.partition(" = ")
        if not lhs.strip().startswith("%all-to-all") or " all-to-all(" not in rhs:
            continue
        result_type = rhs.split(" all-to-all(")[0]
        for _dtype, dims in _HLO_ARRAY.findall(result_type):
            total += 4 * math.prod(int(d) for d in dims.split(",") if d)
    return total


@pytest.mark.parametrize("dp,tp", [(4, 2), (8, 1), (1, 8)])
def test_all_to_all_bytes_match_the_compiled_program(moe_weights, dp, tp):
    mesh = build_mesh(dp, tp)
    num_tokens = 8 * dp
    x, topk_w, topk_ids = _routing(moe_weights, num_tokens, skewed=False)
    experts = [moe_weights[n] for n in ("w_gate", "w_up", "w_down")]
    placement = jax.tree.map(jnp.asarray, identity_placement(NUM_EXPERTS))
    hlo = (
        _ep_fn(mesh, moe_ep.ALL_TO_ALL)
        .lower(x, topk_w, topk_ids, *experts, placement)
        .compile()
        .as_text()
    )
    ep = dp * tp
    sent = _all_to_all_buffer_bytes(hlo) * (ep - 1) // ep  # a device keeps its own chunk
    want = moe_ep.all_to_all_bytes_per_device(num_tokens, HIDDEN, TOP_K, mesh, NUM_EXPERTS, 4)
    assert sent == want > 0


def test_capacity_covers_worst_case():
    # 5 tokens per device, top-2, 2 slots per device: all 10 assignments can land on
    # one device; with 1 slot per device at most one choice per token does.
    assert moe_ep.capacity(5, 2, 2) == 10
    assert moe_ep.capacity(5, 2, 1) == 5


# ----- choosing the MoE path --------------------------------------------------------------


def test_replicated_threshold_is_the_crossover():
    timings = {16: (5.0, 1.0), 32: (5.0, 2.0), 64: (5.0, 6.0), 128: (5.0, 4.0)}
    assert replicated_threshold(timings) == 32
    assert replicated_threshold({16: (1.0, 2.0)}) == 0


def test_moe_path_chosen_by_threshold_and_logged(caplog):
    import jaxserve.sharding.parallel as parallel_module

    parallel_module._logged_paths.clear()  # each choice is logged once per process
    parallel = MeshParallelism(build_mesh(2, 4), replicated_max_tokens=32)
    with caplog.at_level(logging.INFO, logger="jaxserve.sharding.parallel"):
        assert parallel.moe_path(32) == moe_ep.REPLICATED
        assert parallel.moe_path(64) == moe_ep.ALL_TO_ALL
    assert "MoE step of 32 tokens on dp=2,tp=4: replicated path" in caplog.text
    assert "MoE step of 64 tokens on dp=2,tp=4: all_to_all path" in caplog.text


def test_measured_threshold_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.sharding.ep_calibration"):
        threshold = measure_replicated_max_tokens(
            build_mesh(2, 4), [8, 16], HIDDEN, INTER, NUM_EXPERTS, TOP_K
        )
    assert threshold in (0, 8, 16)
    assert f"replicated-token path for steps of <= {threshold} tokens" in caplog.text


# ----- the model on a mesh ----------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 19)), [7, 7, 7], list(range(30, 42)), [5, 6]]
NUM_NEW = 5
MAX_LEN = 32


@pytest.fixture(scope="module")
def mesh_model_dir(tmp_path_factory):
    """A model every mesh holds (see `mesh_qwen3_moe_config`)."""
    path = tmp_path_factory.mktemp("mesh_qwen3_moe")
    write_hf_checkpoint(mesh_qwen3_moe_config(MAX_LEN), path, seed=0)
    return path


@pytest.fixture(scope="module")
def single_device_run(mesh_model_dir):
    model, _ = load_model(mesh_model_dir)
    return GreedyDriver(model, None, len(PROMPTS), MAX_LEN).generate(PROMPTS, NUM_NEW)


@pytest.mark.parametrize("dp,tp", MESHES)
def test_model_on_mesh_matches_single_device(mesh_model_dir, single_device_run, dp, tp):
    mesh = build_mesh(dp, tp)
    # (2, 4) takes the replicated-token MoE path; the others all_to_all.
    threshold = 1024 if (dp, tp) == (2, 4) else 0
    model, _ = load_sharded_model(mesh_model_dir, mesh, replicated_max_tokens=threshold)
    tokens, logits = GreedyDriver(model, mesh, len(PROMPTS), MAX_LEN).generate(PROMPTS, NUM_NEW)
    want_tokens, want_logits = single_device_run
    assert tokens == want_tokens
    for step, rows in want_logits.items():
        for r, want in rows.items():
            np.testing.assert_allclose(logits[step][r], want, atol=1e-5, rtol=0)


def test_mixtral_sliding_window_on_mesh_matches_single_device(tmp_path):
    config = tiny_mixtral_config(
        num_attention_heads=8, num_key_value_heads=8, head_dim=8, sliding_window=4
    )
    write_hf_checkpoint(config, tmp_path, seed=1)
    single, _ = load_model(tmp_path)
    want_tokens, want_logits = GreedyDriver(single, None, len(PROMPTS), MAX_LEN).generate(
        PROMPTS, NUM_NEW
    )
    mesh = build_mesh(4, 2)
    model, _ = load_sharded_model(tmp_path, mesh)
    tokens, logits = GreedyDriver(model, mesh, len(PROMPTS), MAX_LEN).generate(PROMPTS, NUM_NEW)
    assert tokens == want_tokens
    for step, rows in want_logits.items():
        for r, want in rows.items():
            np.testing.assert_allclose(logits[step][r], want, atol=1e-5, rtol=0)


def test_weights_placed_by_the_rules(mesh_model_dir):
    mesh = build_mesh(2, 4)
    model, _ = load_sharded_model(mesh_model_dir, mesh)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    checked = set()
    for path, var in params.items():
        axes = var.get_metadata()["out_sharding"]
        assert var.get_value().sharding.spec == logical_to_spec(axes), path
        checked.update(a for a in axes if a)
    assert {"experts", "q_heads", "kv_heads", "mlp"} <= checked
    w_gate = params[("layers", 0, "mlp", "w_gate")].get_value()
    # 16 experts over 8 devices: each device holds 2 whole experts.
    assert {s.data.shape for s in w_gate.addressable_shards} == {(2, 64, 32)}
    assert LOGICAL_AXIS_RULES["experts"] == ("dp", "tp")


def test_mesh_that_cannot_hold_the_model(tiny_moe_dir, mesh_model_dir):
    tiny = load_config(tiny_moe_dir)  # 4 query heads, 2 KV heads, 8 experts
    with pytest.raises(MeshError, match=r"num_key_value_heads=2 is not divisible by tp=4"):
        check_model_fits(tiny, build_mesh(2, 4))
    with pytest.raises(MeshError, match=r"num_attention_heads=4 is not divisible by tp=8"):
        load_sharded_model(tiny_moe_dir, build_mesh(1, 8))
    config = load_config(mesh_model_dir)
    with pytest.raises(MeshError, match=r"num_experts=16 is not divisible by ep = dp\*tp = 6"):
        check_model_fits(config, build_mesh(3, 2))
    odd = dataclasses.replace(config, num_attention_heads=3, num_key_value_heads=3, num_experts=3)
    with pytest.raises(MeshError, match=r"intermediate_size=64 is not divisible by tp=3"):
        check_model_fits(odd, build_mesh(1, 3))


# ----- Orbax checkpoints (`jaxserve convert`) ---------------------------------------------


def test_convert_to_orbax_and_restore_onto_another_mesh(mesh_model_dir, tmp_path, monkeypatch):
    from jaxserve.cli import build_parser
    from jaxserve.models import checkpoint

    # Restore in many small batches (bounded host memory), not one.
    monkeypatch.setattr(checkpoint, "RESTORE_BATCH_BYTES", 64 * 1024)
    out = tmp_path / "converted"
    argv = ["convert", "--model", str(mesh_model_dir), "--out", str(out), "--mesh", "dp=2,tp=4"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    assert (out / "config.json").is_file() and not list(out.glob("*.safetensors"))

    reference, _ = load_model(mesh_model_dir)
    want = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
    restored, _ = load_sharded_model(out, build_mesh(4, 2))
    single, _ = load_model(out)
    for model in (restored, single):
        got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        assert got.keys() == want.keys()
        for path, var in got.items():
            np.testing.assert_array_equal(var.get_value(), want[path].get_value(), str(path))
    for path, var in dict(nnx.to_flat_state(nnx.state(restored, nnx.Param))).items():
        axes = var.get_metadata()["out_sharding"]
        assert var.get_value().sharding.spec == logical_to_spec(axes), path
    assert args.func(args) == 2  # a second conversion into the same folder: a usage error
    # Restoring it, a process logging as serve's engine does logs none of Orbax's INFO
    # lines (its version, handlers, read throughput: a dozen in serve's start-up log);
    # at DEBUG they are kept.
    info = _orbax_lines(out, "INFO")
    assert info == [], info
    debug = _orbax_lines(out, "DEBUG")
    assert any("throughput" in line for line in debug), debug


# A process that logs as `jaxserve serve`'s engine does (`configure_logging`) and loads a
# model folder; argv: the log level, the folder.
_LOAD_LOGGING = (
    "import sys; from jaxserve.logs import configure_logging; "
    "configure_logging(sys.argv[1], 'engine'); "
    "from jaxserve.models.loader import load_model; load_model(sys.argv[2])"
)


def _orbax_lines(model_dir, level: str) -> list[str]:
    """The log lines below WARNING of Orbax (logging through absl) while `model_dir` loads."""
    r = subprocess.run(
        [sys.executable, "-c", _LOAD_LOGGING, level, str(model_dir)],
        capture_output=True, text=True, timeout=120, cwd=REPO_DIR,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if re.search(r" (INFO|DEBUG) \[engine\]", line)]
    orbax = ("orbax", "checkpoint", "throughput", "Read ratio", "[process=0]")
    return [line for line in lines if any(word in line for word in orbax)]
