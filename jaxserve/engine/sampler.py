"""On-device sampler: logits in, next tokens with their log-probs out, one row per request.

Owns two halves of one noun:
- host side, `prepare_sampling_metadata`: packs each row's `SamplingParams`, seed and
  token history into padded NumPy arrays whose shapes depend only on the batch bucket;
- device side, `sample`: a jittable function of (logits, SamplingMetadata). Every
  parameter is data and every per-row choice is a `jnp.where`, so one compiled function
  serves every mix of greedy and sampled rows, filters and penalties in a batch.

Work nobody asked for is skipped at run time, not by compiling more shapes: `lax.cond`s
on flags the device reads off the metadata (any logit_bias or penalty; any sampled row;
with `skip_unwanted_logprobs`, any row that asked for log-probs) skip the penalties, the
filters' threshold searches and the Gumbel noise, and the log-prob pass. An all-greedy
step without penalties or log-probs costs an argmax, and gives the tokens the full path
gives. `JAXSERVE_SAMPLER=full` (read at trace time) compiles the full path alone, for
A/B benchmarks.

Order of operations, as in vLLM's sampler (vllm/v1/sample/sampler.py and the v0
vllm/model_executor/layers/sampler.py): log-probs of the raw logits (vLLM's default
`raw_logprobs`); logit_bias; repetition, frequency and presence penalties; greedy rows
take the argmax; sampled rows divide by the temperature, then top-k, top-p, min-p, and
draw with a per-row key `fold_in(key(seed), num_output_tokens)`, so a row's token depends
on its own seed, parameters and logits only, never on the other rows of the batch.

This module must not import the engine or a model: it sees logits and metadata only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import FLOAT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

# The request limits live in sampling_params (SamplingParams.validate checks them at the
# door); they size the arrays here.
K_MAX = MAX_LOGPROBS  # top log-probs computed per row
# Temperatures below this are greedy, as in vLLM (_SAMPLING_EPS): dividing by them would
# overflow the logits to inf.
GREEDY_TEMPERATURE_EPS = 1e-5

Array = jax.Array | np.ndarray

SAMPLER_ENV_VAR = "JAXSERVE_SAMPLER"  # "full": no run-time skipping (A/B benchmarks)


@dataclass(slots=True)
class SamplingRow:
    """Host-side description of one request row of a step.

    params: the request's sampling parameters (already validated).
    prompt_token_ids: [P] int32, the prompt.
    output_token_ids: tokens generated so far.
    seed: the RNG seed, already resolved (the engine draws one when `params.seed` is None);
        any Python int, taken modulo 2**64.
    """

    params: SamplingParams
    prompt_token_ids: np.ndarray
    output_token_ids: list[int]
    seed: int


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    """Per-row sampling parameters, padded to R rows (NumPy on the host, jax.Array in jit).

    Padded rows are greedy with every filter and penalty off; their outputs are ignored.
    V is the vocabulary size and L the history length (`max_len`) of the bucket.
    """

    temperature: Array  # [R] float32; 0 marks a greedy row
    top_k: Array  # [R] int32 in [1, V]; V disables
    top_p: Array  # [R] float32 in (0, 1]; 1 disables
    min_p: Array  # [R] float32 in [0, 1]; 0 disables
    repetition_penalty: Array  # [R] float32 > 0; 1 disables
    presence_penalty: Array  # [R] float32; 0 disables
    frequency_penalty: Array  # [R] float32; 0 disables
    logit_bias_ids: Array  # [R, MAX_LOGIT_BIAS] int32, -1 pads
    logit_bias_values: Array  # [R, MAX_LOGIT_BIAS] float32, 0 pads
    token_history: Array  # [R, L] int32: prompt then output ids, -1 pads
    num_prompt_tokens: Array  # [R] int32: how many leading history entries are prompt
    seeds: Array  # [R, 2] uint32: (high, low) 32-bit halves of the 64-bit seed
    num_output_tokens: Array  # [R] int32: tokens generated so far (the RNG step)
    wants_logprobs: Array  # [R] int32: 1 if the row asked for sampled-token log-probs


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    """What `sample` returns for R rows and K = num_top_logprobs.

    Log-probs are under the model's distribution: log_softmax of the raw logits, before
    logit_bias, penalties, temperature and filters (vLLM's default `raw_logprobs`).
    """

    token_ids: jax.Array  # [R] int32: the chosen tokens
    logprobs: jax.Array  # [R] float32: log-prob of each chosen token
    ranks: jax.Array  # [R] int32: 1 + number of tokens more likely than the chosen one
    top_logprobs: jax.Array  # [R, K] float32, descending
    top_token_ids: jax.Array  # [R, K] int32


# ----------------------------------------------------------------------------- host side


def uses_penalties(params: SamplingParams) -> bool:
    """Whether a request needs its token history on device (any penalty on)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def history_len_needed(rows: list[SamplingRow]) -> int:
    """The smallest `max_len` that holds the history of every row that uses penalties.

    0 when no row uses a penalty: the engine may then pick its smallest history bucket
    and `sample` skips the [R, V] token counts entirely.
    """
    return max(
        (
            len(r.prompt_token_ids) + len(r.output_token_ids)
            for r in rows
            if uses_penalties(r.params)
        ),
        default=0,
    )


def prepare_sampling_metadata(
    rows: list[SamplingRow],
    num_rows: int,
    vocab_size: int,
    max_len: int,
    row_errors: dict[int, str] | None = None,
    into: SamplingMetadata | None = None,
) -> SamplingMetadata:
    """Pack rows into padded NumPy arrays for `sample`.

    Args:
      rows: the step's rows, in batch order (len(rows) <= num_rows).
      num_rows: R, the padded row count (the batch bucket).
      vocab_size: V, the logits' last dimension.
      max_len: L, the length of the token-history arrays. Only rows that use a penalty
        fill their history (others stay -1), so L must be >= `history_len_needed(rows)`.
      row_errors: when given, a row that cannot be packed does not raise: it is left as
        padding and row_errors[i] gets the error message (the engine then ends that one
        request with an error instead of failing the whole step).
      into: metadata of num_rows padding rows and history max_len to fill in place (the
        step's packed buffers) and return, instead of new arrays.

    Returns:
      SamplingMetadata whose shapes depend only on (num_rows, max_len).

    Raises:
      ValueError naming `num_rows` if there are more rows than that; without
      `row_errors`, also for a row that cannot be packed: `logit_bias` if a request has
      more than MAX_LOGIT_BIAS entries or an id outside [0, V), `max_len` if a penalized
      row's prompt plus output does not fit (rows are expected to be validated by
      `SamplingParams.validate` already).
    """
    if len(rows) > num_rows:
        raise ValueError(f"num_rows: {len(rows)} rows do not fit in {num_rows}")
    md = _padding(num_rows, vocab_size, max_len) if into is None else into
    for i, row in enumerate(rows):
        if row_errors is None:
            _fill_row(md, i, row, vocab_size)
            continue
        try:
            _fill_row(md, i, row, vocab_size)
        except Exception as e:  # noqa: BLE001 - one request must not fail the whole step
            _pad_row(md, i, vocab_size)
            row_errors[i] = str(e)
    return md


def _padding(num_rows: int, vocab_size: int, max_len: int) -> SamplingMetadata:
    """Metadata of num_rows padding rows: greedy, every filter and penalty off."""
    return SamplingMetadata(
        temperature=np.zeros(num_rows, np.float32),
        top_k=np.full(num_rows, vocab_size, np.int32),
        top_p=np.ones(num_rows, np.float32),
        min_p=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
        presence_penalty=np.zeros(num_rows, np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        logit_bias_ids=np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32),
        logit_bias_values=np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32),
        token_history=np.full((num_rows, max_len), -1, np.int32),
        num_prompt_tokens=np.zeros(num_rows, np.int32),
        seeds=np.zeros((num_rows, 2), np.uint32),
        num_output_tokens=np.zeros(num_rows, np.int32),
        wants_logprobs=np.zeros(num_rows, np.int32),
    )


def _pad_row(md: SamplingMetadata, i: int, vocab_size: int) -> None:
    """Reset row i to padding (after a partial fill that failed)."""
    pad = _padding(1, vocab_size, md.token_history.shape[1])
    for dst, src in zip(jax.tree.leaves(md), jax.tree.leaves(pad), strict=True):
        dst[i] = src[0]


def _fill_row(md: SamplingMetadata, i: int, row: SamplingRow, vocab_size: int) -> None:
    p = row.params
    if p.temperature >= GREEDY_TEMPERATURE_EPS:
        md.temperature[i] = p.temperature
    md.top_k[i] = vocab_size if p.top_k < 0 else min(p.top_k, vocab_size)
    md.top_p[i] = p.top_p
    md.min_p[i] = p.min_p
    md.repetition_penalty[i] = p.repetition_penalty
    md.presence_penalty[i] = p.presence_penalty
    md.frequency_penalty[i] = p.frequency_penalty
    _fill_logit_bias(md, i, p.logit_bias, vocab_size)
    if uses_penalties(p):
        _fill_history(md, i, row)
    seed = int(row.seed) % 2**64  # int(): a NumPy integer seed would overflow here
    md.seeds[i] = (seed >> 32, seed & 0xFFFFFFFF)
    md.num_output_tokens[i] = len(row.output_token_ids)
    md.wants_logprobs[i] = p.logprobs is not None


def _fill_logit_bias(
    md: SamplingMetadata, i: int, logit_bias: dict[int, float], vocab_size: int
) -> None:
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"logit_bias: at most {MAX_LOGIT_BIAS} entries are supported, got {len(logit_bias)}"
        )
    for j, (token_id, bias) in enumerate(logit_bias.items()):
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(f"logit_bias: token id {token_id} outside [0, {vocab_size})")
        md.logit_bias_ids[i, j] = int(token_id)
        md.logit_bias_values[i, j] = bias


def _fill_history(md: SamplingMetadata, i: int, row: SamplingRow) -> None:
    num_prompt = len(row.prompt_token_ids)
    num_output = len(row.output_token_ids)
    max_len = md.token_history.shape[1]
    if num_prompt + num_output > max_len:
        raise ValueError(
            f"max_len: a row with penalties has {num_prompt} prompt + {num_output} output "
            f"tokens, more than max_len={max_len}"
        )
    md.token_history[i, :num_prompt] = row.prompt_token_ids
    md.token_history[i, num_prompt : num_prompt + num_output] = row.output_token_ids
    md.num_prompt_tokens[i] = num_prompt


# --------------------------------------------------------------------------- device side


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """logit_bias, then repetition, frequency and presence penalties.

    Args:
      logits: [R, V] float32 raw logits.
      md: the batch's metadata.

    Returns:
      [R, V] float32. Repetition penalty (HF/vLLM, from CTRL, Keskar et al. 2019): a
      token seen in the prompt or output has a positive logit divided by the penalty and
      a negative one multiplied. Frequency and presence penalties (OpenAI API semantics,
      over output tokens only): logit -= frequency * count + presence * (count > 0).
    """
    logits = _add_logit_bias(logits.astype(jnp.float32), md)
    if md.token_history.shape[1] == 0:  # static: no row in this bucket has penalties
        return logits
    seen, output_counts = _token_counts(md, logits.shape[1])
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0)


def _add_logit_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    num_rows, vocab_size = logits.shape
    # Padding ids (-1) become V, out of range, and mode="drop" skips them (a plain -1
    # would wrap around to the last token).
    ids = jnp.where(md.logit_bias_ids >= 0, md.logit_bias_ids, vocab_size)
    rows = jnp.arange(num_rows)[:, None]
    return logits.at[rows, ids].add(md.logit_bias_values, mode="drop")


def _token_counts(md: SamplingMetadata, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(seen in prompt or output [R, V] bool, output counts [R, V] int32) by scatter-add."""
    history = md.token_history
    num_rows, max_len = history.shape
    valid = history >= 0
    ids = jnp.where(valid, history, vocab_size)  # out of range: dropped
    is_output = valid & (jnp.arange(max_len)[None, :] >= md.num_prompt_tokens[:, None])
    rows = jnp.arange(num_rows)[:, None]
    zeros = jnp.zeros((num_rows, vocab_size), jnp.int32)
    # Integer scatter-adds are exact in any order, so the counts are deterministic.
    occurrences = zeros.at[rows, ids].add(valid.astype(jnp.int32), mode="drop")
    output_counts = zeros.at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    return occurrences > 0, output_counts


def apply_filters(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Temperature, top-k, top-p and min-p: the logits that sampled rows draw from.

    Args:
      logits: [R, V] float32, after `apply_penalties`.
      md: the batch's metadata.

    Returns:
      [R, V] float32: for sampled rows, logits / temperature (+inf clamped to the largest
      float32) with every token outside the allowed set at -inf; greedy rows are returned
      unchanged. The allowed set is the intersection of: the top_k largest (with every
      token tied with the k-th); the smallest prefix of tokens by descending probability
      whose mass (after top-k, renormalized) reaches top_p, at least one token (ties with
      its last token kept); tokens with probability >= min_p * the largest probability.

    Cost: no sort. Each of top-k and top-p is an exact bitwise binary search for its
    threshold over the float32 bit patterns (the idea of the pivot search in FlashInfer's
    sorting-free top-k/top-p renorm kernels, include/flashinfer/sampling.cuh): 32
    compare-and-reduce passes over [R, V], O(64 V) per row in all, where the usual
    sort + cumsum filter (vLLM's apply_top_k_top_p) is O(V log V). On this project's CPU,
    [32, 151936] filters in ~0.5 s against ~1.4 s for a sort alone.
    """
    greedy = md.temperature == 0.0
    temperature = jnp.where(greedy, 1.0, md.temperature)
    # A huge (valid, finite) logit_bias, a repetition penalty < 1 on it or a small
    # temperature can overflow a logit to +inf, and exp(inf - inf) = NaN would then drop
    # exactly those tokens; the largest float32 keeps them the most likely instead.
    x = jnp.minimum(logits / temperature[:, None], FLOAT32_MAX)
    keys = _ordered_keys(x)
    keep = keys >= _kth_largest_key(keys, md.top_k)[:, None]
    top_k_logits = jnp.where(keep, x, -jnp.inf)  # top-p renormalizes over the top-k
    keep &= _top_p_mask(top_k_logits, keys, md.top_p)
    # min-p after top-k/top-p equals min-p on the full distribution: the top token
    # survives both, and p / p_max does not change under renormalization.
    keep &= jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)) >= md.min_p[:, None]
    return jnp.where(keep | greedy[:, None], x, -jnp.inf)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the float32 order of x (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    # Negative floats order reversed by magnitude: flip all bits. Non-negative ones sit
    # above every negative: set the sign bit.
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_where(keys: jax.Array, predicate) -> jax.Array:
    """Per row, the largest uint32 t with predicate(t) true, for predicate monotone
    non-increasing in t and true at t = 0. Decided bit by bit from the top: 32 passes,
    a fixed trip count so XLA needs no host round trip to run the loop.

    keys: [R, V] uint32 (only its shape is used here); predicate: [R] uint32 -> [R] bool.
    """

    def body(i, threshold):
        candidate = threshold | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(predicate(candidate), candidate, threshold)

    return jax.lax.fori_loop(0, 32, body, jnp.zeros(keys.shape[0], jnp.uint32))


def _kth_largest_key(keys: jax.Array, k: jax.Array) -> jax.Array:
    """[R] uint32: the k-th largest key of each row (k in [1, V])."""

    def at_least_k_above(t):
        return jnp.sum(keys >= t[:, None], axis=-1) >= k

    return _largest_key_where(keys, at_least_k_above)


def _top_p_mask(x: jax.Array, keys: jax.Array, top_p: jax.Array) -> jax.Array:
    """[R, V] bool: the smallest set of largest tokens whose probability reaches top_p."""
    probs = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # unnormalized, masked = 0
    target = top_p * jnp.sum(probs, axis=-1)

    def mass_reaches_target(t):
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= target

    # The same reduction of non-negative terms is monotone in the set, so the search is
    # exact for the float32 sums; the top token is always kept because the mass of the
    # keys above it is 0 < target. top_p = 1 keeps all, with no rounding at the tail.
    threshold = _largest_key_where(keys, mass_reaches_target)
    return (keys >= threshold[:, None]) | (top_p >= 1.0)[:, None]


def row_keys(md: SamplingMetadata) -> jax.Array:
    """[R] typed PRNG keys: fold_in(key(seed), num_output_tokens) per row.

    The key data of a threefry key from a 64-bit seed is its (high, low) 32-bit halves,
    so this equals `jax.random.key(seed)` for every seed < 2**32 (and for all seeds with
    jax_enable_x64), independent of JAX's default PRNG implementation setting.
    """
    base = jax.random.wrap_key_data(md.seeds, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(base, md.num_output_tokens.astype(jnp.uint32))


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    num_top_logprobs: int = K_MAX,
    *,
    skip_unwanted_logprobs: bool = False,
) -> SamplerOutput:
    """Choose one token per row. Jittable; `num_top_logprobs` and
    `skip_unwanted_logprobs` must be static.

    Args:
      logits: [R, V] float32 (other float dtypes are upcast) raw model logits.
      md: SamplingMetadata for R rows.
      num_top_logprobs: K, how many top alternatives to return per row (0 allowed; more
        than V gives V).
      skip_unwanted_logprobs: when no row has `wants_logprobs`, skip the log-prob pass
        and return zeros in logprobs, ranks, top_logprobs and top_token_ids (the engine,
        which reads them only for such rows); False always computes them.

    Returns:
      SamplerOutput. Greedy rows take the argmax of the penalized logits (first index on
      ties); sampled rows draw from softmax(apply_filters(...)) by the Gumbel-max trick
      with noise from `row_keys(md)`. The tokens do not depend on which work was skipped.
    """
    logits = logits.astype(jnp.float32)
    if os.environ.get(SAMPLER_ENV_VAR, "").strip().lower() == "full":
        token_ids = _draw(apply_penalties(logits, md), md)
        return SamplerOutput(token_ids, *_logprobs(logits, token_ids, num_top_logprobs))
    processed = jax.lax.cond(_any_penalty(md), apply_penalties, lambda x, _: x, logits, md)
    token_ids = jax.lax.cond(
        jnp.all(md.temperature == 0.0),
        lambda x, _: jnp.argmax(x, axis=-1).astype(jnp.int32),
        _draw,
        processed,
        md,
    )
    if not skip_unwanted_logprobs:
        return SamplerOutput(token_ids, *_logprobs(logits, token_ids, num_top_logprobs))
    k = min(num_top_logprobs, logits.shape[-1])

    def nothing(_logits, ids):
        rows = ids.shape[0]
        return (
            jnp.zeros(rows, jnp.float32),
            jnp.zeros(rows, jnp.int32),
            jnp.zeros((rows, k), jnp.float32),
            jnp.zeros((rows, k), jnp.int32),
        )

    wanted = jnp.any(md.wants_logprobs != 0)
    lp = jax.lax.cond(
        wanted, lambda x, ids: _logprobs(x, ids, num_top_logprobs), nothing, logits, token_ids
    )
    return SamplerOutput(token_ids, *lp)


def _any_penalty(md: SamplingMetadata) -> jax.Array:
    """[] bool: whether `apply_penalties` changes any logit (a logit_bias entry, or,
    with a token history, a penalty off its neutral value)."""
    any_bias = jnp.any(md.logit_bias_ids >= 0)
    if md.token_history.shape[1] == 0:  # static: apply_penalties adds the bias only
        return any_bias
    return (
        any_bias
        | jnp.any(md.repetition_penalty != 1.0)
        | jnp.any(md.presence_penalty != 0.0)
        | jnp.any(md.frequency_penalty != 0.0)
    )


def _draw(processed: jax.Array, md: SamplingMetadata) -> jax.Array:
    """[R] int32: greedy rows' argmax of the penalized logits, sampled rows' Gumbel-max
    draw from the filtered ones."""
    filtered = apply_filters(processed, md)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, processed.shape[1:], jnp.float32))(
        row_keys(md)
    )
    sampled = jnp.argmax(filtered + noise, axis=-1)
    greedy = jnp.argmax(processed, axis=-1)
    return jnp.where(md.temperature == 0.0, greedy, sampled).astype(jnp.int32)


def _logprobs(
    logits: jax.Array, token_ids: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """log_softmax of logits [N, V] at token_ids [N], their ranks, and the top-k."""
    logprobs_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    safe_ids = jnp.clip(token_ids, 0, logits.shape[-1] - 1)
    chosen = jnp.take_along_axis(logprobs_all, safe_ids[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logprobs_all > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs_all, min(k, logits.shape[-1]))
    return chosen, ranks, top_logprobs, top_ids.astype(jnp.int32)


def compute_prompt_logprobs(
    logits: jax.Array, next_token_ids: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt log-probs: how likely the model found each next prompt token. Jittable
    with `k` static.

    Args:
      logits: [T, V] raw logits; row t is the model's prediction after position t.
      next_token_ids: [T] int32, the prompt token at position t + 1. Padding entries may
        hold any value (e.g. -1); their outputs are meaningless and must be ignored.
      k: how many top alternatives per position (0 allowed; more than V gives V).

    Returns:
      (logprobs [T] float32, top_logprobs [T, k] float32 descending, top_ids [T, k]
      int32), all under log_softmax of the raw logits.
    """
    logprobs, _, top_logprobs, top_ids = _logprobs(logits, next_token_ids, k)
    return logprobs, top_logprobs, top_ids
