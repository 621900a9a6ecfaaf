"""What a step produced, on the host: the sampled tokens (`StepSamples`) and the
`ipc.TokenOutput`s built from them (token ids, finish state, log-probs, the prompt's
log-probs, the first output's header). Plain data: no JAX, no scheduling decisions
(`step_samples` takes the device-to-host copy as a function).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.engine.request import Request
from jaxserve.ipc import TokenOutput

if TYPE_CHECKING:
    from jaxserve.engine.step_fn import StepOutput
    from jaxserve.engine.step_inputs import StepInputs


@dataclass(slots=True)
class StepSamples:
    """Host copies of what the sampler produced for each row of a step.

    token_ids: [S, R] int32, S = decode steps of the call (a [R] array means S = 1);
    logprobs: [S, R] float32 or None; top_token_ids / top_logprobs: [S, R, K] or None.
    prompt_logprobs: row -> (first prompt position, entries) for rows that computed
        prompt log-probs (entries in ipc.TokenOutput.logprobs format).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt_logprobs: dict[int, tuple[int, list]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if np.ndim(self.token_ids) == 1:
            self.token_ids = np.asarray(self.token_ids)[None]
            if self.logprobs is not None:
                self.logprobs = np.asarray(self.logprobs)[None]
                self.top_token_ids = np.asarray(self.top_token_ids)[None]
                self.top_logprobs = np.asarray(self.top_logprobs)[None]


def request_output(
    seq: Request, new_token_ids: list[int], logprobs: list | None = None
) -> TokenOutput:
    """The TokenOutput of `seq` after it got `new_token_ids` (or finished): carries the
    `first` header on seq's first output and the prompt log-probs with its first tokens."""
    first = prompt_logprobs = None
    if (
        seq.prompt_logprobs is not None
        and new_token_ids
        and seq.num_output_tokens == len(new_token_ids)
    ):
        # With the first sampled tokens: the prompt's log-probs are complete by then.
        prompt_logprobs = [None, *seq.prompt_logprobs]
    if not seq.first_output_sent:
        seq.first_output_sent = True
        first = {
            "prompt_token_ids": seq.prompt_token_ids,
            "sampling": seq.params.to_dict(),
        }
    return TokenOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        finish_reason=seq.finish_reason if seq.is_finished else None,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        error=seq.error,
        first=first,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def row_logprobs(seq: Request, samples: StepSamples, row: int, num_tokens: int) -> list | None:
    """The ipc.TokenOutput.logprobs entries of a row's first `num_tokens` new tokens:
    [[logprob, [[top_token_id, top_logprob], ...]], ...] with the top-N the request asked for."""
    k = seq.params.logprobs
    if k is None or samples.logprobs is None:
        return None
    entries = []
    for step in range(num_tokens):
        top: list = []
        if k > 0 and samples.top_token_ids is not None:
            ids = samples.top_token_ids[step, row, :k].tolist()
            lps = samples.top_logprobs[step, row, :k].tolist()
            top = [[i, lp] for i, lp in zip(ids, lps, strict=True)]
        entries.append([float(samples.logprobs[step, row]), top])
    return entries


def add_prompt_logprobs(seq: Request, computed: tuple[int, list] | None) -> None:
    """Append a step's prompt log-prob entries (first position, entries) to seq, skipping
    positions it already has (a recompute after preemption)."""
    if computed is None or seq.prompt_logprobs is None:
        return
    first, entries = computed
    have = len(seq.prompt_logprobs)
    if first <= have < first + len(entries):
        seq.prompt_logprobs.extend(entries[have - first :])


def step_samples(out: StepOutput, x: StepInputs, get) -> tuple[StepSamples, np.ndarray]:
    """(StepSamples, expert counts [M, S]) of a step's `step_fn.StepOutput` (device arrays
    with get=`distributed.arrays.replicated_to_host`, host arrays with get=identity).

    One transfer: the tokens, the expert counts, and the log-probs and prompt log-probs
    only when a row of x wants them. Row r of the samples is the step's row r (all dp
    ranks: column x.sample_rows[r] of the outputs).
    """
    logprobs = (out.logprobs, out.top_token_ids, out.top_logprobs) if x.logprob_rows else ()
    prompt = (
        (out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs) if x.prompt_spans else ()
    )
    host = get((out.token_ids, out.expert_counts, logprobs, prompt))
    token_ids, counts, logprobs, prompt = host
    cols = x.sample_rows
    samples = StepSamples(np.asarray(token_ids)[:, cols])
    if logprobs:
        lps, top_ids, top_lps = logprobs
        samples.logprobs, samples.top_token_ids = lps[:, cols], top_ids[:, cols]
        samples.top_logprobs = top_lps[:, cols]
    if prompt:
        samples.prompt_logprobs = _prompt_entries(x, *prompt)
    return samples, np.asarray(counts)


def _prompt_entries(
    x: StepInputs, logprobs: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray
) -> dict[int, tuple[int, list]]:
    """Per row (first prompt position, [[logprob, [[id, logprob], ...top k]], ...]);
    the arrays are the step's [dp * T] prompt outputs."""
    entries = {}
    for span in x.prompt_spans:
        rows = []
        for t in range(span.flat_start, span.flat_start + span.count):
            ids, lps = top_ids[t, : span.k].tolist(), top_lps[t, : span.k].tolist()
            rows.append([float(logprobs[t]), [[i, lp] for i, lp in zip(ids, lps, strict=True)]])
        entries[span.row] = (span.first_position, rows)
    return entries
