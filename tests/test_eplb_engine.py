"""EPLB in the engine: expert re-placement while serving, on 8 emulated CPU devices.

A 2x4-mesh (async scheduling, multi-step decode) and an 8x1-mesh (sync) engine with
EPLB on, 8 redundant expert slots and a short step interval each run a greedy workload
during which the placement changes at least twice. Checked against independent values:
the tokens equal the single-device engine's (no mesh or EPLB code runs there), every
slot's weights equal the checkpoint weights of the expert the placement says it holds
(read from the single-device model), no compilation after start-up (the executor
compiled once), and the placement differs from the initial one.
Also: the config, LLM keyword and `serve` flag validation, and the start-up errors.
"""

from __future__ import annotations

import dataclasses
import random
import shutil

import jax
import numpy as np
import pytest
from engine_helpers import greedy, random_prompts, run_engine
from model_utils import write_hf_checkpoint
from prometheus_client import generate_latest
from server_harness import ep_test_threshold
from sharding_utils import mesh_qwen3_moe_config

from jaxserve.config import CacheConfig, EngineConfig, EplbConfig, MeshConfig, SchedulerConfig
from jaxserve.engine import builder
from jaxserve.engine.core import EngineCore
from jaxserve.observability.metrics import Metrics

MAX_LEN = 40
BLOCK_SIZE = 4
MAX_NUM_SEQS = 4
NUM_NEW = 20  # enough engine steps for two re-plans with the CPU's 8-step calls of few rows
NUM_EXPERTS = 16  # mesh_qwen3_moe_config
REDUNDANT = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_moe_dir):
    path = tmp_path_factory.mktemp("eplb_qwen3_moe")
    write_hf_checkpoint(mesh_qwen3_moe_config(MAX_LEN, vocab_size=256), path, seed=1)
    shutil.copy(tiny_moe_dir / "tokenizer.json", path / "tokenizer.json")
    return path


def _config(
    model_dir, dp: int, tp: int, eplb: EplbConfig, async_scheduling: bool = True
) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + MAX_NUM_SEQS * MAX_LEN // 4),
        scheduler=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=16,
            num_decode_steps=4,
            async_scheduling=async_scheduling,
        ),
        mesh=MeshConfig(dp, tp, ep_replicated_max_tokens=ep_test_threshold(dp, 16)),
        eplb=eplb,
    )


def _eplb_on() -> EplbConfig:
    # Re-plan every 2 steps from a 4-step window, taking any improvement.
    return EplbConfig(
        enabled=True,
        num_redundant_experts=REDUNDANT,
        window_size=4,
        step_interval=2,
        min_improvement=0.0,
    )


def _requests():
    prompts = random_prompts(random.Random(3), 10, 2, 20, 256)
    return [(f"r{i}", p, greedy(NUM_NEW)) for i, p in enumerate(prompts)]


def _tokens(engine) -> dict[str, list[int]]:
    return {rid: r.tokens for rid, r in run_engine(engine, _requests()).items()}


@pytest.fixture(scope="module")
def reference_engine(model_dir):
    """The single-device engine. EPLB is asked for and must turn itself off (ep = 1)."""
    return EngineCore(_config(model_dir, 1, 1, _eplb_on()))


@pytest.fixture(scope="module")
def reference(reference_engine):
    """Greedy tokens of the single-device engine."""
    return _tokens(reference_engine)


def test_eplb_off_on_one_device(reference_engine):
    assert reference_engine.eplb is None
    assert not reference_engine.eplb_config.enabled
    assert reference_engine.eplb_config.num_redundant_experts == 0
    (w_gate, _, _) = reference_engine.runner.expert_weights()[0]
    assert w_gate.shape[0] == NUM_EXPERTS


@pytest.mark.parametrize(
    ("dp", "tp", "async_scheduling"),
    # Async scheduling drains its in-flight step before each move; sync has none.
    [(2, 4, True), (8, 1, False)],
)
def test_eplb_engine_rebalances_with_same_outputs(
    model_dir, reference_engine, reference, dp, tp, async_scheduling
):
    engine = EngineCore(_config(model_dir, dp, tp, _eplb_on(), async_scheduling))
    controller = engine.eplb
    assert controller is not None
    initial = engine.runner.physical_to_logical()  # before any step
    num_slots = NUM_EXPERTS + REDUNDANT
    assert initial.shape == (len(engine.runner.moe_layers), num_slots)
    np.testing.assert_array_equal(initial[0], np.arange(num_slots) % NUM_EXPERTS)

    tokens = _tokens(engine)

    assert tokens == reference
    assert all(len(t) == NUM_NEW for t in tokens.values())
    assert controller.num_rebalances >= 2, controller.num_rebalances
    p2l = engine.runner.physical_to_logical()
    assert not np.array_equal(p2l, initial)
    for row in p2l:  # every expert keeps a slot, none more than R + 1
        counts = np.bincount(row, minlength=NUM_EXPERTS)
        assert counts.min() >= 1 and counts.max() <= REDUNDANT + 1
    assert engine.num_compilations == 0
    assert controller.executor.num_compilations == 1
    stats = engine.stats()
    assert stats.counters.eplb_rebalances == controller.num_rebalances
    assert stats.counters.eplb_rebalance_s > 0
    metrics = Metrics(model="m")
    metrics.update_from_engine(stats)
    exposition = generate_latest(metrics.registry).decode()
    assert f'jaxserve_eplb_rebalances_total{{model="m"}} {float(controller.num_rebalances)}' in (
        exposition
    )

    # Slot s of every MoE layer holds the checkpoint weights of expert p2l[s]: compared
    # with the single-device model's expert weights (slot e = expert e there).
    checkpoint = reference_engine.runner.expert_weights()
    moved = engine.runner.expert_weights()
    for layer, (ref_arrays, arrays) in enumerate(zip(checkpoint, moved, strict=True)):
        for ref, got in zip(ref_arrays, arrays, strict=True):
            np.testing.assert_array_equal(
                np.asarray(jax.device_get(got)), np.asarray(ref)[p2l[layer]]
            )
    # The placement tables the step reads agree with p2l (logical_to_physical lists
    # exactly the slots of each expert, padded with its first slot).
    index = engine.runner._param_index
    for layer, i in enumerate(engine.runner.moe_layers):
        l2p = np.asarray(engine.runner._params[index[("layers", i, "mlp", "logical_to_physical")]])
        counts = np.asarray(engine.runner._params[index[("layers", i, "mlp", "replica_counts")]])
        assert l2p.shape == (NUM_EXPERTS, REDUNDANT + 1)
        for e in range(NUM_EXPERTS):
            np.testing.assert_array_equal(l2p[e, : counts[e]], np.flatnonzero(p2l[layer] == e))


def test_redundant_slots_must_divide_ep(model_dir):
    eplb = dataclasses.replace(_eplb_on(), num_redundant_experts=3)
    with pytest.raises(ValueError, match="num-redundant-experts"):
        EngineCore(_config(model_dir, 2, 4, eplb))


def test_eplb_accepted_with_several_processes(monkeypatch):
    # Issue 16 item 3: EPLB runs on several processes (tests/test_eplb_multiprocess.py);
    # this test used to assert the start-up refusal.
    monkeypatch.setattr(builder.jax, "process_count", lambda: 2)
    config = EngineConfig(mesh=MeshConfig(2, 4), eplb=EplbConfig(enabled=True))
    assert builder.check_eplb(config).enabled


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("num_redundant_experts", -1, "--num-redundant-experts"),
        ("window_size", 0, "--eplb-window-size"),
        ("step_interval", 0, "--eplb-step-interval"),
        ("min_improvement", 1.0, "--eplb-min-improvement"),
        ("min_improvement", -0.1, "--eplb-min-improvement"),
    ],
)
def test_eplb_config_validation(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(EplbConfig(), **{field: value}).validate()


def test_eplb_config_round_trip_and_defaults():
    assert EngineConfig().eplb == EplbConfig(enabled=False, num_redundant_experts=0)
    config = EngineConfig(eplb=EplbConfig(enabled=True, num_redundant_experts=8, step_interval=7))
    assert EngineConfig.from_dict(config.to_dict()) == config
    # A dict without the eplb section (an older sender) gets the defaults.
    old = config.to_dict()
    del old["eplb"]
    assert EngineConfig.from_dict(old).eplb == EplbConfig()


def test_llm_eplb_kwargs():
    from jaxserve.llm import build_engine_config

    config = build_engine_config(
        "m",
        mesh="dp=2,tp=4",
        enable_eplb=True,
        num_redundant_experts=8,
        eplb_window_size=10,
        eplb_step_interval=20,
        eplb_min_improvement=0.1,
    )
    assert config.eplb == EplbConfig(True, 8, 10, 20, 0.1)
    assert build_engine_config("m", eplb=EplbConfig(enabled=True)).eplb.enabled
    with pytest.raises(ValueError, match="--eplb-step-interval"):
        build_engine_config("m", eplb_step_interval=0)
    with pytest.raises(TypeError, match="eplb"):
        build_engine_config("m", eplb={"enabled": True})


def test_serve_eplb_flags(capsys):
    from jaxserve.cli import _engine_config, build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--mesh", "dp=2,tp=4", "--enable-eplb", "--num-redundant-experts", "8"]
        + ["--eplb-window-size", "50", "--eplb-step-interval", "100"]
        + ["--eplb-min-improvement", "0.2"]
    )
    assert _engine_config(args).eplb == EplbConfig(True, 8, 50, 100, 0.2)
    assert _engine_config(parser.parse_args(["serve"])).eplb == EplbConfig()
    for flag, value in [
        ("--num-redundant-experts", "-1"),
        ("--eplb-window-size", "0"),
        ("--eplb-step-interval", "x"),
        ("--eplb-min-improvement", "1.5"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, value])
        assert flag in capsys.readouterr().err
