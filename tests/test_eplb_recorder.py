"""EPLB's expert-load recording: the counts the model's step returns, and the host-side
`ExpertLoadRecorder` window.

Oracles: HF transformers' gate logits (its `router_logits`) on the same checkpoint and
tokens (top-k, bincount) for the counts, real tokens only; the single-device model for
the counts on a (dp, tp) mesh; brute-force loops for the recorder's window, rank loads
and balancedness.
"""

from __future__ import annotations

import random
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_DECODE_STEPS, swap_scheduler
from engine_helpers import greedy, random_prompts, run_engine
from flax import nnx
from model_utils import StepRequest, build_step, write_hf_checkpoint
from server_harness import ep_test_threshold
from sharding_utils import mesh_qwen3_moe_config

from jaxserve.eplb.recorder import ExpertLoadRecorder
from jaxserve.ipc import decode, encode
from jaxserve.models.base import AttentionMetadata, allocate_kv_cache
from jaxserve.models.loader import load_model
from jaxserve.sharding.load import load_sharded_model
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.rules import batch_sharding, kv_cache_sharding, replicated

METADATA_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "token_req")


def hf_expert_counts(hf_model, sequences: list[list[int]]) -> np.ndarray:
    """[MoE layers, E] int64: top-k of HF's gate logits of every token of every
    sequence (each run alone, unpadded), counted per expert."""
    import torch

    cfg = hf_model.config
    counts = None
    with torch.no_grad():
        for seq in sequences:
            out = hf_model(torch.tensor([seq]), output_router_logits=True)
            ids = [
                torch.topk(r, cfg.num_experts_per_tok, dim=-1).indices for r in out.router_logits
            ]
            per_layer = np.stack(
                [np.bincount(i.flatten().numpy(), minlength=cfg.num_experts) for i in ids]
            )
            counts = per_layer if counts is None else counts + per_layer
    return counts


# ----- the engine's step (one device) -------------------------------------------------------


def _engine_run(engine, requests, **swap) -> tuple[np.ndarray, int, dict]:
    """Run requests to completion; (counts recorded meanwhile [M, S], steps, results)."""
    recorder = engine.runner.expert_load
    before, steps_before = recorder.total_slot_load(), recorder.num_steps
    with swap_scheduler(engine, enable_prefix_caching=False, **swap):
        results = run_engine(engine, requests)
    return recorder.total_slot_load() - before, recorder.num_steps - steps_before, results


@pytest.fixture(scope="module")
def engine_requests(tiny_engine):
    rng = random.Random(5)
    prompts = random_prompts(rng, 5, 3, 13, tiny_engine.model_config.vocab_size)
    # 1 + 2 * TINY_DECODE_STEPS tokens: the multi-step run ends exactly on a multi-step call.
    return [(f"e{i}", p, greedy(1 + 2 * TINY_DECODE_STEPS)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def single_step_run(tiny_engine, engine_requests):
    return _engine_run(tiny_engine, engine_requests, async_scheduling=False, num_decode_steps=1)


def test_engine_counts_equal_hf_gate_recount(
    tiny_engine, hf_model, engine_requests, single_step_run
):
    """Over a run of prefills and decodes (padded to token buckets), the recorded counts
    are HF's top-k of the tokens the engine computed: each prompt and every generated
    token but the last. Padded rows would add to the counts."""
    counts, steps, results = single_step_run
    assert steps > 1
    computed = [p + results[rid].tokens[:-1] for rid, p, _ in engine_requests]
    np.testing.assert_array_equal(counts, hf_expert_counts(hf_model, computed))
    assert tiny_engine.runner.moe_layers == (0, 1, 2)  # every layer of the tiny model is MoE


def test_multi_step_counts_equal_single_steps(tiny_engine, engine_requests, single_step_run):
    """A multi-step decode call returns its steps' counts summed: the same requests give
    the same counts with fewer recorded steps; async scheduling changes nothing."""
    counts, steps, results = single_step_run
    before = tiny_engine.num_compilations
    for overlap in (False, True):
        multi, multi_steps, multi_results = _engine_run(
            tiny_engine, engine_requests, async_scheduling=overlap
        )
        assert {r: v.tokens for r, v in multi_results.items()} == {
            r: v.tokens for r, v in results.items()
        }
        assert multi_steps < steps  # multi-step decode calls ran
        np.testing.assert_array_equal(multi, counts)
    assert tiny_engine.num_compilations == before


def test_engine_stats_carry_balancedness(tiny_engine, single_step_run):
    stats = tiny_engine.stats()
    recorder = tiny_engine.runner.expert_load
    assert stats.expert_layers == [0, 1, 2]
    assert stats.expert_balancedness == recorder.balancedness().tolist()
    assert stats.expert_balancedness == [1.0, 1.0, 1.0]  # one device: one EP rank
    assert stats.expert_routed_tokens == recorder.total_slot_load().sum() > 0
    assert decode(encode(stats)) == stats  # the new fields cross the process boundary


# ----- the model's forward: padding, logits unchanged, and on a mesh ----------------------


def _forward_fn(model, out_sharding=None):
    graphdef, state = nnx.split(model)

    def forward(state, tokens, positions, kv_cache, metadata):
        m = nnx.merge(graphdef, state)
        hidden, kv_cache, counts = m.forward_with_expert_counts(
            tokens, positions, kv_cache, metadata
        )
        logits = m.compute_logits(hidden)
        if out_sharding is not None:
            logits, counts = jax.lax.with_sharding_constraint((logits, counts), out_sharding)
        return logits, counts

    def plain(state, tokens, positions, kv_cache, metadata):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, positions, kv_cache, metadata)
        return m.compute_logits(hidden)

    return state, jax.jit(forward), jax.jit(plain)


BLOCK_SIZE, MAX_BLOCKS = 4, 8


def _step_arrays(prompts: list[list[int]], dp: int, tokens_per_rank: int, rows_per_rank: int):
    """Host arrays of one prefill step in the DP layout (request r on rank r % dp, its
    blocks rank-local), each rank padded to tokens_per_rank tokens."""
    per_rank = [[] for _ in range(dp)]
    for r, p in enumerate(prompts):
        row = r // dp
        per_rank[r % dp].append(
            StepRequest(p, 0, [1 + row * MAX_BLOCKS + b for b in range(MAX_BLOCKS)])
        )
    steps = [
        build_step(reqs, BLOCK_SIZE, MAX_BLOCKS, tokens_per_rank, rows_per_rank)
        for reqs in per_rank
    ]
    arrays = [np.concatenate([np.asarray(s[i]) for s in steps]) for i in (0, 1)]
    for f in METADATA_FIELDS:
        arrays.append(np.concatenate([np.asarray(getattr(s[2], f)) for s in steps]))
    return arrays


def _run_step(model, mesh, prompts, tokens_per_rank: int, with_plain: bool = False):
    """(logits, counts, plain-call logits or None) of one padded prefill step, on the
    host."""
    dp = 1 if mesh is None else mesh.shape["dp"]
    rows = -(-len(prompts) // dp)
    arrays = _step_arrays(prompts, dp, tokens_per_rank, rows)
    c = model.config
    cache = allocate_kv_cache(
        c.num_hidden_layers,
        dp * (1 + rows * MAX_BLOCKS),
        BLOCK_SIZE,
        c.num_key_value_heads,
        c.head_dim,
        sharding=None if mesh is None else kv_cache_sharding(mesh),
    )
    if mesh is None:
        tokens, positions, *fields = [jnp.asarray(a) for a in arrays]
    else:
        tokens, positions, *fields = [
            jax.device_put(a, batch_sharding(mesh, a.ndim)) for a in arrays
        ]
    md = AttentionMetadata(**dict(zip(METADATA_FIELDS, fields, strict=True)))
    state, forward, plain = _forward_fn(model, None if mesh is None else replicated(mesh))
    logits, counts = forward(state, tokens, positions, cache, md)
    if mesh is not None:
        assert counts.sharding.is_fully_replicated
    plain_logits = np.asarray(plain(state, tokens, positions, cache, md)) if with_plain else None
    return np.asarray(logits), np.asarray(counts), plain_logits


@pytest.fixture(scope="module")
def mesh_model_dir(tmp_path_factory, tiny_moe_dir):
    path = tmp_path_factory.mktemp("eplb_mesh_qwen3_moe")
    write_hf_checkpoint(mesh_qwen3_moe_config(64, vocab_size=256), path, seed=1)
    shutil.copy(tiny_moe_dir / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def mesh_prompts():
    return random_prompts(random.Random(9), 5, 2, 9, 256)


@pytest.fixture(scope="module")
def single_device_step(mesh_model_dir, mesh_prompts):
    model, _ = load_model(mesh_model_dir)
    return _run_step(model, None, mesh_prompts, tokens_per_rank=64, with_plain=True)


def test_model_counts_exclude_padding_and_keep_logits(
    mesh_model_dir, mesh_prompts, single_device_step
):
    """One padded prefill step (64 slots, ~25 real tokens): the counts are HF's recount
    of the real tokens, and the logits are bit-identical to the plain `__call__`'s."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mesh_model_dir, dtype=torch.float32).eval()
    logits, counts, plain = single_device_step
    layers = [i for i in range(hf.config.num_hidden_layers) if i not in hf.config.mlp_only_layers]
    assert counts.shape == (len(layers), hf.config.num_experts)
    np.testing.assert_array_equal(counts, hf_expert_counts(hf, mesh_prompts))
    assert counts.sum() == sum(map(len, mesh_prompts)) * hf.config.num_experts_per_tok * len(layers)
    np.testing.assert_array_equal(logits, plain)


@pytest.mark.parametrize(
    ("dp", "tp", "replicated_max_tokens"), [(2, 4, 0), (8, 1, 0), (2, 4, 1024)]
)
def test_mesh_counts_equal_single_device(
    mesh_model_dir, mesh_prompts, single_device_step, dp, tp, replicated_max_tokens
):
    """Under expert parallelism (all_to_all and replicated-token paths) the counts are
    global (every dp rank's real tokens), replicated, and equal the one-device counts;
    the identity placement makes slot s expert s."""
    mesh = build_mesh(dp, tp)
    model, _ = load_sharded_model(mesh_model_dir, mesh, replicated_max_tokens=replicated_max_tokens)
    tokens_per_rank = max(sum(map(len, mesh_prompts[k::dp])) for k in range(dp)) + 3
    _, counts, _ = _run_step(model, mesh, mesh_prompts, tokens_per_rank)
    np.testing.assert_array_equal(counts, single_device_step[1])


def _mesh_engine(model_dir, dp: int, tp: int):
    from jaxserve.config import CacheConfig, EngineConfig, MeshConfig, SchedulerConfig
    from jaxserve.engine.core import EngineCore

    # One token bucket, one step per call: two executables.
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + 4 * 64 // BLOCK_SIZE),
            scheduler=SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=16, num_decode_steps=1
            ),
            mesh=MeshConfig(dp, tp, ep_replicated_max_tokens=ep_test_threshold(dp, 16)),
        )
    )


def test_mesh_engine_records_the_single_device_counts(mesh_model_dir, mesh_prompts):
    """The engine on a 2x4 mesh (DP attention, wide EP over 8 ranks) records the counts
    of the one-device engine for the same greedy requests, and its balancedness is that
    of the 8 EP ranks' loads (slot s on rank s // (S / 8))."""
    requests = [(f"m{i}", p, greedy(3)) for i, p in enumerate(mesh_prompts)]
    runs = {}
    for dp, tp in ((1, 1), (2, 4)):
        engine = _mesh_engine(mesh_model_dir, dp, tp)
        results = run_engine(engine, requests)
        runs[dp, tp] = engine, {rid: r.tokens for rid, r in results.items()}
    (one, one_tokens), (mesh, mesh_tokens) = runs[1, 1], runs[2, 4]
    assert mesh_tokens == one_tokens
    assert mesh.num_compilations == 0
    counts = mesh.runner.expert_load.total_slot_load()
    np.testing.assert_array_equal(counts, one.runner.expert_load.total_slot_load())
    assert counts.sum() > 0
    ranks = counts.reshape(counts.shape[0], 8, -1).sum(axis=2)  # all steps are in the window
    np.testing.assert_allclose(
        mesh.stats().expert_balancedness, ranks.mean(axis=1) / ranks.max(axis=1), rtol=1e-12
    )
    assert one.stats().expert_balancedness == [1.0] * counts.shape[0]


# ----- the recorder ----------------------------------------------------------------------


def _random_placement(rng: np.random.Generator, num_experts: int, num_slots: int) -> np.ndarray:
    """physical_to_logical [S]: every expert in one slot at least, the rest replicas."""
    p2l = np.concatenate(
        [np.arange(num_experts), rng.integers(0, num_experts, num_slots - num_experts)]
    )
    return rng.permutation(p2l)


@pytest.mark.parametrize(("window", "ep"), [(1, 1), (5, 4), (7, 2), (50, 8)])
def test_recorder_window_ranks_balancedness_brute_force(window, ep):
    rng = np.random.default_rng(window * 10 + ep)
    layers, experts, slots = 3, 12, 16
    rec = ExpertLoadRecorder(layers, slots, ep=ep, window=window)
    history = []
    p2l = np.stack([_random_placement(rng, experts, slots) for _ in range(layers)])
    for step in range(23):
        # Some steps idle (all zero), some skewed to a few slots.
        counts = rng.integers(0, 50, (layers, slots)) * (rng.random((layers, slots)) < 0.6)
        if step % 5 == 4:
            counts[:] = 0
        rec.record(counts.astype(np.int32))
        history.append(counts)
        win = history[-window:]
        load = np.zeros((layers, slots), np.int64)
        for c in win:
            load += c
        np.testing.assert_array_equal(rec.slot_load(), load)
        assert rec.num_window_steps == len(win)
        per_rank = slots // ep
        ranks = np.zeros((layers, ep), np.int64)
        for m in range(layers):
            for s in range(slots):
                ranks[m, s // per_rank] += load[m, s]
        np.testing.assert_array_equal(rec.rank_load(), ranks)
        expected = [
            1.0 if ranks[m].max() == 0 else ranks[m].mean() / ranks[m].max() for m in range(layers)
        ]
        np.testing.assert_allclose(rec.balancedness(), expected, rtol=1e-12)
        logical = np.zeros((layers, experts), np.int64)
        for m in range(layers):
            for s in range(slots):
                logical[m, p2l[m, s]] += load[m, s]  # a replica's load is its slot's
        np.testing.assert_array_equal(rec.expert_load(p2l, experts), logical)
    np.testing.assert_array_equal(rec.total_slot_load(), np.sum(history, axis=0))
    assert rec.total_routed_tokens() == int(np.sum(history))
    assert rec.num_steps == 23


def test_recorder_shared_placement_reset_and_zero_load():
    rec = ExpertLoadRecorder(2, 4, ep=2, window=3)
    np.testing.assert_array_equal(rec.balancedness(), [1.0, 1.0])  # no load yet
    rec.record(np.array([[4, 0, 0, 0], [1, 1, 1, 1]]))
    np.testing.assert_array_equal(rec.balancedness(), [0.5, 1.0])  # one rank did it all
    np.testing.assert_array_equal(
        rec.expert_load(np.array([0, 1, 0, 2]), 3), [[4, 0, 0], [2, 1, 1]]
    )
    rec.reset()
    assert rec.num_window_steps == 0 and not rec.slot_load().any()
    assert rec.total_routed_tokens() == 8  # totals survive a re-placement


def test_recorder_errors_name_the_field():
    with pytest.raises(ValueError, match="ep"):
        ExpertLoadRecorder(2, 6, ep=4)
    with pytest.raises(ValueError, match="window"):
        ExpertLoadRecorder(2, 4, window=0)
    with pytest.raises(ValueError, match="num_layers"):
        ExpertLoadRecorder(0, 4)
    rec = ExpertLoadRecorder(2, 4)
    with pytest.raises(ValueError, match="counts"):
        rec.record(np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="counts"):
        rec.record(-np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="physical_to_logical"):
        rec.expert_load(np.array([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="physical_to_logical"):
        rec.expert_load(np.zeros((3, 4), np.int64), 3)


@pytest.mark.parametrize("tokens, top_k, slots", [(8, 2, 8), (1, 4, 32), (300, 8, 64)])
def test_count_expert_tokens_is_a_masked_bincount(tokens, top_k, slots):
    """Both ways `count_expert_tokens` counts (compare-and-sum at decode sizes, the
    scatter-add past `SMALL_COUNT_ELEMENTS`) give NumPy's bincount of the real tokens'
    slots, a negative slot counted from the end and one out of range dropped, as a JAX
    scatter-add indexes."""
    from jaxserve.models.moe import SMALL_COUNT_ELEMENTS, count_expert_tokens

    rng = np.random.default_rng(tokens)
    ids = rng.integers(-slots - 2, slots + 2, (tokens, top_k)).astype(np.int32)
    mask = rng.random(tokens) > 0.3
    for token_mask in (mask, None):
        real = ids if token_mask is None else ids[token_mask]
        wrapped = np.where(real < 0, real + slots, real).ravel()
        expected = np.bincount(wrapped[(wrapped >= 0) & (wrapped < slots)], minlength=slots)
        got = jax.jit(count_expert_tokens, static_argnums=2)(
            jnp.asarray(ids), None if token_mask is None else jnp.asarray(token_mask), slots
        )
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), expected)
    assert (ids.size * slots <= SMALL_COUNT_ELEMENTS) == (tokens < 300)  # both paths run
