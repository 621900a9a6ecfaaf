"""Engine requests checked at the door (`EngineCore.add_request`): a bad request becomes
an error output on the next step instead of an exception, so that it never stops the
engine or other requests.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from jaxserve.ipc import EngineRequest, TokenOutput
from jaxserve.sampling_params import SamplingParams, token_id_error


def validate_request(
    req: EngineRequest, vocab_size: int, running: Container[str]
) -> tuple[SamplingParams, list[int]]:
    """The sampling parameters and prompt token ids of `req`.

    running: ids of the requests the engine holds now.

    Raises:
        ValueError: a field out of range or of the wrong type (named in the message), or
            a request id already running.
    """
    if req.request_id in running:
        raise ValueError(f"request_id: {req.request_id!r} is already running")
    try:
        params = SamplingParams.from_dict(req.sampling)  # validated without a vocabulary
    except TypeError as e:
        raise ValueError(f"sampling: {e}") from None
    params.check_token_ids(vocab_size)  # the rest of validate(vocab_size)
    if params.n != 1:
        raise ValueError(
            f"n: the engine runs one sample per request (fan out n > 1 before it), got {params.n}"
        )
    prompt = np.asarray(req.prompt_token_ids).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt_token_ids: the prompt is empty")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_token_ids: expected integers, got {prompt.dtype}")
    bad = prompt[(prompt < 0) | (prompt >= vocab_size)]
    if bad.size:
        raise ValueError(token_id_error("prompt_token_ids", int(bad[0]), vocab_size))
    return params, prompt.astype(np.int64).tolist()


def error_output(req: EngineRequest, error: str) -> TokenOutput:
    """The final output of a request rejected at the door with `error`."""
    try:
        prompt = np.asarray(req.prompt_token_ids, np.int64).reshape(-1)
    except (TypeError, ValueError):
        prompt = np.zeros(0, np.int64)
    return TokenOutput(
        request_id=req.request_id,
        new_token_ids=[],
        finish_reason="error",
        num_prompt_tokens=int(prompt.size),
        error=error,
        first={"prompt_token_ids": prompt, "sampling": req.sampling},
    )
