"""Test helpers for sharded models: a DP-layout step builder and a greedy prefill/decode
driver over the paged KV cache, the same for one device and for a (dp, tp) mesh.

The DP layout (see `jaxserve.sharding.parallel.MeshParallelism.paged_attention`): the
flat batch is the dp ranks' batches concatenated, each padded to the same number of
tokens and rows and built with rank-local block ids by `model_utils.build_step` (the
independent oracle of the single-device layout). Request r runs on dp rank r % dp.

Used in-process by tests/test_sharding.py and in subprocesses by tests/multihost_worker.py.
Also the engine settings of the mesh-engine tests (`mesh_engine_config`), one set for
tests/test_engine_mesh.py, test_multihost.py and test_eplb_multiprocess.py, so that the
session's `mesh_engine(dp, tp)` (tests/conftest.py) serves all of them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from model_utils import StepRequest, build_step, tiny_qwen3_moe_config
from server_harness import ep_test_threshold

from jaxserve.models.base import AttentionMetadata, allocate_kv_cache
from jaxserve.sharding.rules import batch_sharding, kv_cache_sharding, replicated

METADATA_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "token_req")


def mesh_qwen3_moe_config(max_position_embeddings: int, **overrides):
    """A tiny Qwen3-MoE every 8-device mesh holds: heads and KV heads divisible by 8, 16
    experts (2 per device on 8), a dense layer between MoE layers (a tp-sharded MLP)."""
    return tiny_qwen3_moe_config(
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        num_experts=16,
        intermediate_size=64,
        mlp_only_layers=[1],
        max_position_embeddings=max_position_embeddings,
        **overrides,
    )


# The mesh-engine tests' model length and KV pool: MESH_MAX_NUM_SEQS sequences of
# MESH_MAX_LEN tokens in blocks of MESH_BLOCK_SIZE, plus the null block.
MESH_MAX_LEN = 32
MESH_BLOCK_SIZE = 4
MESH_MAX_NUM_SEQS = 4
# One token bucket (T = 16; prompts longer than that are chunked): the step shapes are
# the plain and full T = 16 steps and the decode calls of 1 and 4 rows, 4 executables
# (a 32-token budget added T = 32's two, and a third MoE size for the EP calibration:
# the 8x1 engine built in 8.8 s instead of 16.3 s).
MESH_MAX_BATCHED_TOKENS = 16


def mesh_engine_config(model_dir, dp: int, tp: int):
    """The EngineConfig of the mesh-engine tests on a (dp, tp) mesh (1, 1: one device):
    multi-step decode (4 steps), MESH_MAX_BATCHED_TOKENS budget, async scheduling (on: the default
    of an accelerator; the CPU's default is off), the replicated-token MoE path for every
    step, given (`server_harness.ep_test_threshold`), not measured."""
    from jaxserve.config import CacheConfig, EngineConfig, MeshConfig, SchedulerConfig

    return EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(
            block_size=MESH_BLOCK_SIZE,
            num_blocks=1 + MESH_MAX_NUM_SEQS * MESH_MAX_LEN // MESH_BLOCK_SIZE,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=MESH_MAX_NUM_SEQS,
            max_num_batched_tokens=MESH_MAX_BATCHED_TOKENS,
            num_decode_steps=4,
            async_scheduling=True,
        ),
        mesh=MeshConfig(
            dp, tp, ep_replicated_max_tokens=ep_test_threshold(dp, MESH_MAX_BATCHED_TOKENS)
        ),
    )


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated (or single-device) array as NumPy, also across processes."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


class GreedyDriver:
    """Prefill then greedy decode of several prompts through the paged cache.

    Args:
        model: the model (its `parallel` decides the mesh; None = one device).
        mesh: the model's mesh, or None on one device.
        num_prompts: most requests (sets the KV pool of each rank).
        max_len: most tokens of one request.
        block_size: tokens per KV block.
    """

    def __init__(self, model, mesh, num_prompts: int, max_len: int, block_size: int = 4):
        c = model.config
        self.mesh = mesh
        self.dp = 1 if mesh is None else mesh.shape["dp"]
        self.block_size = block_size
        self.max_blocks = math.ceil(max_len / block_size)
        self.rows_per_rank = math.ceil(num_prompts / self.dp)
        # Block 0 of each rank is its null block; row j of a rank owns a fixed range.
        blocks_per_rank = 1 + self.rows_per_rank * self.max_blocks
        cache_sharding = None if mesh is None else kv_cache_sharding(mesh)
        self.kv_cache = allocate_kv_cache(
            c.num_hidden_layers,
            self.dp * blocks_per_rank,
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            sharding=cache_sharding,
        )
        graphdef, state = nnx.split(model)
        out_sharding = None if mesh is None else replicated(mesh)

        def forward(state, tokens, positions, kv_cache, metadata):
            m = nnx.merge(graphdef, state)
            hidden, kv_cache = m(tokens, positions, kv_cache, metadata)
            logits = m.compute_logits(hidden)
            if out_sharding is not None:
                logits = jax.lax.with_sharding_constraint(logits, out_sharding)
            return logits, kv_cache

        self._state = state
        self._forward = jax.jit(forward, donate_argnums=(3,))
        # Called with each step's host arrays before it runs (multi-process leader).
        self.publish = None

    def _block_table(self, row: int) -> list[int]:
        return [1 + row * self.max_blocks + b for b in range(self.max_blocks)]

    def _host_inputs(self, per_rank: list[list[StepRequest]], tokens_per_rank: int):
        """[tokens, positions, *metadata fields] as NumPy, in the DP layout."""
        steps = [
            build_step(reqs, self.block_size, self.max_blocks, tokens_per_rank, self.rows_per_rank)
            for reqs in per_rank
        ]
        arrays = [np.concatenate([np.asarray(s[i]) for s in steps]) for i in (0, 1)]
        for f in METADATA_FIELDS:
            arrays.append(np.concatenate([np.asarray(getattr(s[2], f)) for s in steps]))
        return arrays

    def run(self, host_arrays: list[np.ndarray]) -> np.ndarray:
        """One forward of `_host_inputs`' arrays; logits [T, vocab] on the host. Every
        process of a multi-process run calls it with the same arrays."""
        if self.mesh is None:
            tokens, positions, *fields = [jnp.asarray(a) for a in host_arrays]
        else:
            tokens, positions, *fields = [
                jax.device_put(a, batch_sharding(self.mesh, a.ndim)) for a in host_arrays
            ]
        metadata = AttentionMetadata(**dict(zip(METADATA_FIELDS, fields, strict=True)))
        logits, self.kv_cache = self._forward(
            self._state, tokens, positions, self.kv_cache, metadata
        )
        return to_host(logits)

    def step(self, chunks: dict[int, tuple[list[int], int]], tokens_per_rank: int):
        """Run one step: request r feeds chunks[r] = (tokens, start position). The host
        inputs go to `self.publish` first, if set (the multi-process leader).

        Returns {r: logits [len(tokens), vocab] float32 NumPy}.
        """
        per_rank: list[list[StepRequest]] = [[] for _ in range(self.dp)]
        where: dict[int, tuple[int, int]] = {}
        for r, (toks, start) in sorted(chunks.items()):
            rank, row = r % self.dp, r // self.dp
            offset = sum(len(q.tokens) for q in per_rank[rank])
            if row != len(per_rank[rank]):
                raise ValueError("requests of a rank must be scheduled in row order")
            per_rank[rank].append(StepRequest(list(toks), start, self._block_table(row)))
            where[r] = (rank * tokens_per_rank + offset, len(toks))
        arrays = self._host_inputs(per_rank, tokens_per_rank)
        if self.publish is not None:
            self.publish(arrays)
        logits = self.run(arrays)
        return {r: logits[a : a + n] for r, (a, n) in where.items()}

    def generate(self, prompts: list[list[int]], num_new: int):
        """Prefill every prompt in one step, then `num_new - 1` greedy decode steps, all
        padded to one shape (one compilation).

        Returns (tokens [num_prompts][num_new], logits {step: {r: [n, vocab]}}).
        """
        tokens_per_rank = max(
            sum(len(p) for p in prompts[rank :: self.dp]) for rank in range(self.dp)
        )
        out = self.step({r: (p, 0) for r, p in enumerate(prompts)}, tokens_per_rank)
        history = {0: out}
        generated = [[int(out[r][-1].argmax())] for r in range(len(prompts))]
        for i in range(1, num_new):
            chunks = {r: ([g[-1]], len(prompts[r]) + i - 1) for r, g in enumerate(generated)}
            out = self.step(chunks, tokens_per_rank)
            history[i] = out
            for r, g in enumerate(generated):
                g.append(int(out[r][-1].argmax()))
        return generated, history
