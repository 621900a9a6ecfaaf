"""Checking a gRPC GenerateRequest and turning it into EngineRequests (one per sample).

Everything a client can get wrong is caught here, before anything reaches the engine, and
reported as `RequestValidationError` whose message starts with the offending field's name
(the server returns it as INVALID_ARGUMENT). Defaults for unset fields follow vLLM's
SamplingParams and are documented in jaxserve.proto.
"""

from __future__ import annotations

import dataclasses
import time
import unicodedata
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.tokenizer import encode_prompt
from jaxserve.ipc import EngineRequest
from jaxserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    SamplingParams,
    check_lengths,
    logit_bias_count_error,
    token_id_error,
)

DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_LEN = 256


class RequestValidationError(ValueError):
    """A bad request; the message starts with the field name ("max_tokens: ...")."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the engine reported at start-up, against which requests are checked."""

    max_model_len: int
    vocab_size: int


def build_engine_request(
    request: pb.GenerateRequest, request_id: str, tokenizer: Tokenizer, limits: ModelLimits
) -> EngineRequest:
    """Validate `request` and return its EngineRequest (prompt as int32 ids), under the
    client's `request_id` (split it with `split_samples`; the engine client gives each
    sample its engine id).

    Raises RequestValidationError naming the field: request_id (too long, a control
    character), prompt / prompt.token_ids (missing, empty, ids outside [0, vocab_size),
    longer than max_model_len allows), max_tokens (<= 0, or prompt + max_tokens >
    max_model_len), and every sampling field that SamplingParams.validate checks
    (temperature, top_p, top_k, stop, ...).
    """
    check_request_id(request_id)
    prompt_ids = _prompt_token_ids(request, tokenizer, limits)
    # The rules the offline LLM applies too (SamplingParams.validate, check_lengths).
    try:
        check_lengths(len(prompt_ids), limits.max_model_len)
    except ValueError as e:
        raise RequestValidationError(str(e)) from e
    try:
        params = sampling_params_from_proto(request, len(prompt_ids), limits.max_model_len)
        params.validate(vocab_size=limits.vocab_size)
        check_lengths(len(prompt_ids), limits.max_model_len, params.max_tokens)
    except ValueError as e:
        raise RequestValidationError(str(e)) from e
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
        sampling=params.to_dict(),
        arrival_time=time.time(),
    )


def split_samples(request: EngineRequest) -> list[EngineRequest]:
    """The n engine requests of a request whose sampling asks for n samples.

    Follows `jaxserve.LLM.generate` (and vLLM's n): each sample has n = 1, and seed + i
    when a seed is set, so the samples differ yet each is reproducible. Only sample 0 asks
    for prompt_logprobs (they are the same for every sample, and computing them costs a
    full-logits prefill). The samples keep the client's request_id: the engine client
    (`AsyncEngineClient.add_request`) gives each its engine id and, with n > 1, their
    shared cache_group. With n = 1 the request is returned as is.
    """
    n = request.sampling.get("n", 1)
    if n == 1:
        return [request]
    seed = request.sampling.get("seed")
    out = []
    for i in range(n):
        sampling = {**request.sampling, "n": 1}
        if seed is not None:
            sampling["seed"] = seed + i
        if i > 0:
            sampling["prompt_logprobs"] = None
        out.append(dataclasses.replace(request, sampling=sampling))
    return out


def check_request_id(request_id: str) -> None:
    """Raises RequestValidationError("request_id: ...") on an id that is too long or holds
    a control character (Unicode category Cc: C0, DEL, C1). Control characters are refused
    so that ids print cleanly in logs, and because the engine client builds its engine ids
    around one (`engine_client.engine_request_id`), which no client id may then contain."""
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise RequestValidationError(
            f"request_id: at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}"
        )
    bad = next((i for i, c in enumerate(request_id) if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise RequestValidationError(
            f"request_id: control character {request_id[bad]!r} at position {bad} is not allowed"
        )


def sampling_params_from_proto(
    request: pb.GenerateRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """SamplingParams from the request, unset fields taking their documented defaults.

    An unset max_tokens is DEFAULT_MAX_TOKENS cut to the room left after the prompt.

    Raises ValueError naming a field out of range (SamplingParams validates at
    construction); token ids against the vocabulary are `.validate(vocab_size)`'s.
    """
    s = request.sampling

    def opt(msg, name, default):
        return getattr(msg, name) if msg.HasField(name) else default

    if request.HasField("max_tokens"):
        max_tokens = request.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, max_model_len - prompt_len)
    if len(s.logit_bias) > MAX_LOGIT_BIAS:  # before copying a hostile map
        raise RequestValidationError(logit_bias_count_error(len(s.logit_bias)))
    n = opt(s, "n", 1)
    if not 1 <= n <= MAX_N:
        raise RequestValidationError(f"n: must be in [1, {MAX_N}], got {n}")
    return SamplingParams(
        temperature=opt(s, "temperature", 1.0),
        top_k=opt(s, "top_k", -1),
        top_p=opt(s, "top_p", 1.0),
        min_p=opt(s, "min_p", 0.0),
        seed=opt(s, "seed", None),
        max_tokens=max_tokens,
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=opt(request, "skip_special_tokens", True),
        repetition_penalty=opt(s, "repetition_penalty", 1.0),
        presence_penalty=opt(s, "presence_penalty", 0.0),
        frequency_penalty=opt(s, "frequency_penalty", 0.0),
        logit_bias={int(k): float(v) for k, v in s.logit_bias.items()},
        n=n,
        logprobs=opt(request, "logprobs", None),
        prompt_logprobs=opt(request, "prompt_logprobs", None),
    )


def max_prompt_chars(tokenizer: Tokenizer, limits: ModelLimits) -> int:
    """The most characters a text can have and still fit in max_model_len tokens,
    whatever it encodes to: a longer one is refused before it is tokenized (seconds of
    frontend CPU for a text of megabytes)."""
    return limits.max_model_len * _max_token_chars(tokenizer)


def _max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token can cover: the longest vocabulary entry
    (byte-level BPE entries hold one character per byte, and a character is >= 1 byte)."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        _MAX_TOKEN_CHARS[key] = max(map(len, tokenizer.get_vocab()), default=1)
    return _MAX_TOKEN_CHARS[key]


_MAX_TOKEN_CHARS: dict[int, int] = {}


def _prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits):
    vocab_size = limits.vocab_size
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestValidationError("prompt: one of text or token_ids is required")
    if kind == "text":
        if not request.text:
            raise RequestValidationError("prompt: text must not be empty")
        # A text this long cannot fit in max_model_len tokens whatever it encodes to:
        # reject it before spending seconds of frontend CPU on tokenizing it.
        max_chars = max_prompt_chars(tokenizer, limits)
        if len(request.text) > max_chars:
            raise RequestValidationError(
                f"prompt: {len(request.text)} characters cannot fit in max_model_len "
                f"{limits.max_model_len} tokens"
            )
        ids = encode_prompt(tokenizer, request.text)
        if not ids:
            raise RequestValidationError("prompt: text encodes to no tokens")
        return ids
    # The length first: copying millions of ids into a list only to refuse them would
    # cost the frontend ~60 MB per request.
    if len(request.token_ids.ids) >= limits.max_model_len:
        raise RequestValidationError(
            f"prompt: {len(request.token_ids.ids)} tokens leave no room for output within "
            f"max_model_len {limits.max_model_len}"
        )
    ids = list(request.token_ids.ids)
    if not ids:
        raise RequestValidationError("prompt.token_ids: must not be empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestValidationError(token_id_error("prompt.token_ids", bad, vocab_size))
    return ids
