"""DeepSeek-V3 (MLA, latent cache replicated over tp, grouped gate, shared experts) on
meshes of 8 emulated CPU devices: greedy tokens through EngineCore on 1x8, 2x4 and 8x1
(dp x tp) equal the single-device engine's, which equal HF transformers'; with EPLB
re-placing the routed experts (the shared experts stay put), the output is unchanged.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from engine_helpers import greedy, hf_greedy, random_prompts, run_engine
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from server_harness import ep_test_threshold

from jaxserve.config import CacheConfig, EngineConfig, EplbConfig, MeshConfig, SchedulerConfig
from jaxserve.engine.core import EngineCore
from tests.deepseek_utils import YARN, tiny_deepseek_v3_config, write_deepseek_checkpoint

pytestmark = pytest.mark.slow

MAX_LEN = 24
BLOCK_SIZE = 4
MAX_NUM_SEQS = 4
NUM_NEW = 5
NUM_EXPERTS = 16
REDUNDANT = 8


@pytest.fixture(scope="module")
def ds_mesh_dir(tmp_path_factory):
    """8 query heads (1 per device at tp 8), 16 experts in 4 groups (2 per device); a
    dense layer, then an MoE one."""
    path = tmp_path_factory.mktemp("ds_mesh")
    config = tiny_deepseek_v3_config(
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=NUM_EXPERTS,
        max_position_embeddings=MAX_LEN,
        rope_parameters={**YARN, "original_max_position_embeddings": 16},
    )
    hf = write_deepseek_checkpoint(config, path, seed=2)
    hf.generation_config.eos_token_id = None
    return path, hf


def _config(model_dir, dp: int, tp: int, eplb: EplbConfig | None = None) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + MAX_NUM_SEQS * MAX_LEN // 4),
        scheduler=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=16, num_decode_steps=1
        ),
        mesh=MeshConfig(dp, tp, ep_replicated_max_tokens=ep_test_threshold(dp, 16)),
        eplb=eplb or EplbConfig(),
    )


def _requests():
    prompts = random_prompts(random.Random(0), 8, 2, 16, 256)
    return [(f"r{i}", p, greedy(NUM_NEW)) for i, p in enumerate(prompts)]


def _tokens(engine) -> dict[str, list[int]]:
    return {rid: r.tokens for rid, r in run_engine(engine, _requests()).items()}


@pytest.fixture(scope="module")
def reference(ds_mesh_dir):
    """Greedy tokens of the single-device engine, checked against HF first."""
    path, hf = ds_mesh_dir
    tokens = _tokens(EngineCore(_config(path, 1, 1)))
    for rid, prompt, _ in _requests():
        assert tokens[rid] == hf_greedy(hf, prompt, NUM_NEW), rid
    return tokens


@pytest.mark.parametrize(("dp", "tp"), [(1, 8), (2, 4), (8, 1)])
def test_mesh_greedy_equals_single_device(ds_mesh_dir, reference, dp, tp):
    engine = EngineCore(_config(ds_mesh_dir[0], dp, tp))
    k, v = engine.runner.kv_cache[0]
    # The latent cache: blocks over dp, the one latent "head" replicated over tp. (Compared
    # as placements: the cache is a step's output by now, the warm-up's first runs, whose
    # spec XLA may spell otherwise, e.g. () for ("dp", ...) when dp is 1.)
    want = NamedSharding(engine.runner.mesh, P("dp", *[None] * (k.ndim - 1)))
    assert k.sharding.is_equivalent_to(want, k.ndim)
    assert _tokens(engine) == reference
    assert engine.num_compilations == 0


def test_eplb_with_shared_experts_keeps_outputs(ds_mesh_dir, reference):
    eplb = EplbConfig(
        enabled=True,
        num_redundant_experts=REDUNDANT,
        window_size=4,
        step_interval=2,
        min_improvement=0.0,
    )
    engine = EngineCore(_config(ds_mesh_dir[0], 2, 4, eplb))
    initial = engine.runner.physical_to_logical()
    assert initial.shape == (len(engine.runner.moe_layers), NUM_EXPERTS + REDUNDANT)
    assert _tokens(engine) == reference
    assert engine.eplb.num_rebalances >= 2, engine.eplb.num_rebalances
    assert not np.array_equal(engine.runner.physical_to_logical(), initial)
    assert engine.num_compilations == 0
