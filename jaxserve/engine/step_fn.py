"""The jitted step function: (flat params, KV cache, packed inputs) -> (StepOutput, KV cache).

One step runs the model over the flat batch (unpacked from the two buffers
`step_inputs.PackedLayout` packs), the LM head on the last token of each request row,
and the sampler, so only [S, R] token ids (and log-probs) leave the device; the full
variant also computes prompt log-probs, the multi-step variant runs several decode
steps in a `lax.scan`. Every MoE layer's expert load (tokens per expert slot, padding
excluded) comes back beside the tokens.

Pure JAX: no host state, no compilation (`model_runner.ModelRunner` lowers and compiles
it once per `StepShape`, then dispatches and fetches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.engine import sampler as sampler_lib
from jaxserve.engine.packed_layout import DeviceInputs, PackedLayout
from jaxserve.models.base import PAD_SLOT, KVCache


@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    """What one call returns, S = decode steps, R rows, P prompt positions, K = K_MAX.

    token_ids / logprobs: [S, R]; top_token_ids / top_logprobs: [S, R, K];
    prompt_logprobs: [P]; prompt_top_ids / prompt_top_logprobs: [P, K] (P = 0 unless
    the step is a full variant); expert_counts: [M, E_slots] int32, tokens routed to each
    expert slot of each MoE layer, summed over the S decode steps, real tokens only
    ([0, 0] without MoE layers; see `DecoderOnlyLM.forward_with_expert_counts`).
    """

    token_ids: jax.Array
    logprobs: jax.Array
    top_token_ids: jax.Array
    top_logprobs: jax.Array
    prompt_logprobs: jax.Array
    prompt_top_ids: jax.Array
    prompt_top_logprobs: jax.Array
    expert_counts: jax.Array


def step(
    params: list[jax.Array],
    kv_cache: KVCache,
    ints: jax.Array,
    floats: jax.Array,
    *,
    graphdef,
    params_def,
    layout: PackedLayout,
    block_size: int,
    num_steps: int,
    dp: int,
    output_sharding: jax.sharding.Sharding,
):
    """The jitted step: (flat params, KV cache, packed inputs) -> (StepOutput, KV cache).

    ints / floats: the dp ranks' packed inputs concatenated (DP attention; one device is
    dp = 1). output_sharding: where the StepOutput goes (replicated over the mesh, so
    every process can read every row).
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, params))
    x = layout.unpack(ints, floats, dp)
    out, kv_cache = _forward(model, kv_cache, x, block_size, num_steps)
    out = jax.lax.with_sharding_constraint(out, output_sharding)
    return out, kv_cache


def _forward(model, kv_cache: KVCache, x: DeviceInputs, block_size: int, num_steps: int):
    if num_steps > 1:
        return _decode_steps(model, kv_cache, x, block_size, num_steps)
    hidden, kv_cache, counts = model.forward_with_expert_counts(
        x.tokens, x.positions, kv_cache, x.metadata
    )
    out = sampler_lib.sample(
        model.compute_logits(hidden[x.logits_indices]),
        x.sampling,
        sampler_lib.K_MAX,
        skip_unwanted_logprobs=True,
    )
    if x.prompt_next_ids.shape[0]:  # static: only the full variant (P == T)
        prompt = sampler_lib.compute_prompt_logprobs(
            model.compute_logits(hidden), x.prompt_next_ids, sampler_lib.K_MAX
        )
    else:
        prompt = _no_prompt_logprobs()
    return _step_output(out, prompt, counts, add_step_axis=True), kv_cache


def _decode_steps(model, kv_cache, x: DeviceInputs, block_size: int, num_steps: int):
    """`num_steps` decode steps in one call (T == R: token r is row r's only token).

    Each step feeds the tokens the previous one sampled at the next position; the slot
    of position p is block_tables[r, p // block_size] * block_size + p % block_size (the
    scheduler allocated the blocks up front). Padded rows (seq_len 0) write nowhere.
    Stop conditions are the host's: it discards tokens sampled past a stop.
    """
    md0 = x.metadata
    real = md0.seq_lens > 0
    rows = jnp.arange(md0.block_tables.shape[0])

    def body(carry, step):
        kv, tokens, positions, seq_lens, counts = carry
        slots = md0.block_tables[rows, positions // block_size] * block_size
        slots = jnp.where(real, slots + positions % block_size, PAD_SLOT)
        md = dataclasses.replace(md0, slot_mapping=slots, seq_lens=seq_lens)
        hidden, kv, step_counts = model.forward_with_expert_counts(tokens, positions, kv, md)
        sampling = dataclasses.replace(
            x.sampling, num_output_tokens=x.sampling.num_output_tokens + step
        )
        out = sampler_lib.sample(
            model.compute_logits(hidden), sampling, sampler_lib.K_MAX, skip_unwanted_logprobs=True
        )
        next_seq_lens = jnp.where(real, seq_lens + 1, 0)
        carry = (kv, out.token_ids, positions + 1, next_seq_lens, counts + step_counts)
        return carry, out

    # The expert counts are summed in the carry: one [M, S] array, not one per step.
    moe = model.moe_layers()
    counts = jnp.zeros((len(moe), model.num_expert_slots) if moe else (0, 0), jnp.int32)
    carry = (kv_cache, x.tokens, x.positions, md0.seq_lens, counts)
    (kv_cache, *_, counts), outs = jax.lax.scan(body, carry, jnp.arange(num_steps, dtype=jnp.int32))
    return _step_output(outs, _no_prompt_logprobs(), counts, add_step_axis=False), kv_cache


def _no_prompt_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
    k = sampler_lib.K_MAX
    return jnp.zeros(0), jnp.zeros((0, k)), jnp.zeros((0, k), jnp.int32)


def _step_output(
    out: sampler_lib.SamplerOutput, prompt, expert_counts: jax.Array, add_step_axis: bool
) -> StepOutput:
    lead = (lambda a: a[None]) if add_step_axis else (lambda a: a)
    prompt_logprobs, prompt_top_logprobs, prompt_top_ids = prompt
    return StepOutput(
        token_ids=lead(out.token_ids),
        logprobs=lead(out.logprobs),
        top_token_ids=lead(out.top_token_ids),
        top_logprobs=lead(out.top_logprobs),
        prompt_logprobs=prompt_logprobs,
        prompt_top_ids=prompt_top_ids,
        prompt_top_logprobs=prompt_top_logprobs,
        expert_counts=expert_counts,
    )
