"""A NumPy reference sampler, written from the definitions, for tests of the sampler.

Float64, one row at a time, sort-based filters: deliberately the obvious way, sharing no
code with jaxserve.engine.sampler. Only tests import it.
"""

from __future__ import annotations

import numpy as np

from jaxserve.sampling_params import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, float64."""
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def penalized_logits(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """One row [V]: logit_bias, then repetition (prompt + output), frequency and presence
    (output only) penalties, as vLLM and the OpenAI API define them."""
    x = np.asarray(logits, np.float64).copy()
    for token_id, bias in params.logit_bias.items():
        x[token_id] += bias
    for token_id in set(prompt) | set(output):
        if x[token_id] > 0:
            x[token_id] /= params.repetition_penalty
        else:
            x[token_id] *= params.repetition_penalty
    for token_id in set(output):
        count = output.count(token_id)
        x[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return x


def allowed_tokens(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row [V] of penalized logits -> bool [V], the tokens a sampled row may draw.

    top-k, then top-p on the renormalized top-k distribution (keep a token while the mass
    strictly before it in descending order is below top_p), then min-p.
    """
    x = np.asarray(logits, np.float64) / params.temperature
    order = np.argsort(-x, kind="stable")
    allowed = np.ones(x.shape, bool)
    if params.top_k != -1:
        allowed[order[params.top_k :]] = False
    probs = np.where(allowed, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if params.top_p < 1.0:  # 1 disables: no rounding at the tail can drop a token
        mass_before = np.cumsum(probs[order]) - probs[order]
        allowed[order[mass_before >= params.top_p]] = False
    allowed &= np.exp(x - x.max()) >= params.min_p
    return allowed


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row [V] of penalized logits -> the distribution a sampled row draws from."""
    x = np.asarray(logits, np.float64) / params.temperature
    allowed = allowed_tokens(logits, params)
    probs = np.where(allowed, np.exp(x - x[allowed].max()), 0.0)
    return probs / probs.sum()
