"""The sampler's inputs: each row's `SamplingParams`, seed and token history packed on the
host into padded NumPy arrays (`SamplingMetadata`) whose shapes depend only on the batch
bucket, for `sampler.sample` on the device.

Host side only (NumPy); the record is a registered pytree so the same object crosses
into jit. The request limits live in `sampling_params` (`SamplingParams.validate` checks
them at the door); they size the arrays here.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams, token_id_error

# Temperatures below this are greedy, as in vLLM (_SAMPLING_EPS): dividing by them would
# overflow the logits to inf.
GREEDY_TEMPERATURE_EPS = 1e-5

Array = jax.Array | np.ndarray


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
            raise ValueError(token_id_error("logit_bias", token_id, vocab_size))
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
