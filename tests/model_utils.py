"""Test helpers for the model families: tiny random HF checkpoints, hand-built paged-cache
metadata for prefill/decode steps, and a jitted model step.

The metadata builder is a deliberately simple oracle of the layout in
`jaxserve.models.base` (slot = block_table[p // block_size] * block_size + p % block_size),
written independently of the engine's scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.base import PAD_SLOT, AttentionMetadata, allocate_kv_cache


def tiny_qwen3_moe_config(**overrides):
    """A small random-init HF Qwen3-MoE config (float32). Weights use std 0.2 so routing
    and logits are far from ties."""
    from transformers import Qwen3MoeConfig

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(overrides)
    return Qwen3MoeConfig(**base)


def tiny_mixtral_config(**overrides):
    """A small random-init HF Mixtral config (float32), std 0.2 weights."""
    from transformers import MixtralConfig

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(overrides)
    return MixtralConfig(**base)


def write_hf_checkpoint(hf_config, path: Path, seed: int = 0, max_shard_size: str | None = None):
    """Instantiate the HF torch model for `hf_config` in float32 with a fixed seed, save it
    to `path` with `save_pretrained`, and return the (eval-mode) torch model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def hf_logits(hf_model, tokens: list[int]) -> np.ndarray:
    """HF logits [len(tokens), vocab] float32 for one unpadded sequence."""
    import torch

    with torch.no_grad():
        out = hf_model(torch.tensor([tokens], dtype=torch.long)).logits[0]
    return out.float().numpy()


@dataclass
class StepRequest:
    """One request's part of a step: `tokens` at positions start..start+len-1, its KV
    blocks in `block_table`."""

    tokens: list[int]
    start: int
    block_table: list[int]


def build_step(
    requests: list[StepRequest],
    block_size: int,
    max_blocks: int,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
) -> tuple[jax.Array, jax.Array, AttentionMetadata]:
    """Flat (tokens, positions, metadata) for a step, padded to `num_tokens` tokens and
    `num_reqs` request rows (padded tokens: token 0, position 0, PAD_SLOT, a padded row)."""
    total = sum(len(r.tokens) for r in requests)
    num_tokens = num_tokens or total
    num_reqs = num_reqs or len(requests)
    pad_row = len(requests) if num_reqs > len(requests) else len(requests) - 1
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    token_req = np.full(num_tokens, pad_row, np.int32)
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    seq_lens = np.zeros(num_reqs, np.int32)
    query_start = np.full(num_reqs + 1, total, np.int32)
    t = 0
    for r, req in enumerate(requests):
        query_start[r] = t
        block_tables[r, : len(req.block_table)] = req.block_table
        seq_lens[r] = req.start + len(req.tokens)
        for i, tok in enumerate(req.tokens):
            pos = req.start + i
            tokens[t], positions[t], token_req[t] = tok, pos, r
            slots[t] = req.block_table[pos // block_size] * block_size + pos % block_size
            t += 1
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(block_tables),
        seq_lens=jnp.asarray(seq_lens),
        query_start_loc=jnp.asarray(query_start),
        token_req=jnp.asarray(token_req),
    )
    return jnp.asarray(tokens), jnp.asarray(positions), metadata


class ModelStepper:
    """Jitted paged and cache-less forwards of one model (compiled once per shape)."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        graphdef, state = nnx.split(model)

        @jax.jit
        def paged(state, tokens, positions, kv_cache, metadata):
            m = nnx.merge(graphdef, state)
            hidden, kv_cache = m(tokens, positions, kv_cache, metadata)
            return m.compute_logits(hidden), kv_cache

        @jax.jit
        def cacheless(state, tokens, positions):
            m = nnx.merge(graphdef, state)
            hidden, _ = m(tokens, positions, None, None)
            return m.compute_logits(hidden)

        self._state, self._paged, self._cacheless = state, paged, cacheless

    def new_cache(self, num_blocks: int, block_size: int):
        c = self.config
        return allocate_kv_cache(
            c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim
        )

    def paged(self, tokens, positions, kv_cache, metadata):
        """-> (logits [T, vocab] float32, updated cache)."""
        return self._paged(self._state, tokens, positions, kv_cache, metadata)

    def cacheless(self, tokens: list[int]) -> np.ndarray:
        """Logits [T, vocab] of one sequence without a cache."""
        toks = jnp.asarray(tokens, jnp.int32)
        return np.asarray(self._cacheless(self._state, toks, jnp.arange(len(tokens))))


# ----- HF parity of one model family (tests/test_models_hf.py, tests/test_dense_models.py)


def load_family(hf_config, path: Path) -> tuple:
    """Save `hf_config` as a random checkpoint (seed 0) in `path`, load it with the
    jaxserve loader; returns (HF torch model, `ModelStepper`). Asserts that the loader
    picked the HF architecture."""
    from jaxserve.models.loader import load_model

    hf_model = write_hf_checkpoint(hf_config, path, seed=0)
    model, config = load_model(path)
    assert config.architecture == type(hf_model).__name__
    return hf_model, ModelStepper(model)


def shuffled_blocks(seed: int, count: int, num_blocks: int) -> list[int]:
    """`count` distinct KV block ids from 1..num_blocks-1 in a scrambled order (block 0
    is the null block)."""
    order = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))
    return [int(b) for b in order[:count]]


def paged_greedy(
    stepper: ModelStepper,
    prompt: list[int],
    new_tokens: int,
    *,
    block_size: int,
    max_blocks: int,
    num_blocks: int,
    seed: int = 1,
) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` through the paged cache: one prefill
    step padded to 8 tokens / 2 request rows, then one decode step per token, on a
    shuffled block table (`shuffled_blocks(seed, ...)`)."""
    blocks = shuffled_blocks(seed, -(-(len(prompt) + new_tokens) // block_size), num_blocks)
    kv_cache = stepper.new_cache(num_blocks, block_size)
    tokens, positions, metadata = build_step(
        [StepRequest(prompt, 0, blocks)], block_size, max_blocks, num_tokens=8, num_reqs=2
    )
    logits, kv_cache = stepper.paged(tokens, positions, kv_cache, metadata)
    generated = [int(np.argmax(np.asarray(logits)[len(prompt) - 1]))]
    for _ in range(new_tokens - 1):
        pos = len(prompt) + len(generated) - 1
        tokens, positions, metadata = build_step(
            [StepRequest([generated[-1]], pos, blocks)], block_size, max_blocks, num_reqs=2
        )
        step_logits, kv_cache = stepper.paged(tokens, positions, kv_cache, metadata)
        generated.append(int(np.argmax(np.asarray(step_logits)[0])))
    return generated


def hf_generate_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """HF `generate(do_sample=False)`: the `new_tokens` tokens after `prompt`."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()
