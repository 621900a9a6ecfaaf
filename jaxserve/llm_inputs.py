"""The offline `LLM.generate`'s inputs, made what its engine requests are built from:
each prompt as (its text or None, its token ids) and one `SamplingParams` per prompt,
checked with the servers' rules where they apply offline (`encode_prompt`,
`check_prompt_text`, `SamplingParams.validate`, `check_lengths`). Every error is a
ValueError naming the input (`prompts[i]`, `prompts[i][j]`, `sampling_params`). No engine
here: llm.py runs what this returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from numbers import Integral

from tokenizers import Tokenizer

from jaxserve.frontend.tokenizer import encode_prompt
from jaxserve.sampling_params import SamplingParams, check_lengths, check_prompt_text


def prepare_inputs(
    prompts,
    sampling_params: SamplingParams | SequenceOf[SamplingParams] | None,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
) -> tuple[list[tuple[str | None, list[int]]], list[SamplingParams]]:
    """`LLM.generate`'s prompts and sampling_params (their forms are its docstring's) ->
    ([(text or None, token ids)] per prompt, [SamplingParams] per prompt), in order.

    Raises ValueError naming the bad input: a prompt of another type, an empty prompt,
    text that is no valid Unicode, a token id that is no int, a count of sampling_params
    that is not the prompts', a parameter out of its range, or prompt + max_tokens past
    max_model_len (the servers' length rule).
    """
    if isinstance(prompts, str | Mapping):
        prompts = [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts: expected a string or a list of prompts, got {type(prompts).__name__}"
        )
    prompts = [_unwrap_prompt(i, p) for i, p in enumerate(prompts)]
    params_list = _broadcast_params(sampling_params, len(prompts))
    encoded: list[tuple[str | None, list[int]]] = []
    for i, p in enumerate(prompts):
        text = p if isinstance(p, str) else None
        if text == "":  # as the server: even where the tokenizer would add a BOS token
            raise ValueError(f"prompts[{i}]: the prompt text must not be empty")
        if text is not None:
            check_prompt_text(f"prompts[{i}]", text, noun="Unicode")
        ids = encode_prompt(tokenizer, p) if text is not None else _token_ids(i, p)
        if not ids:
            raise ValueError(f"prompts[{i}]: the prompt is empty")
        encoded.append((text, ids))
    # Once per distinct object (one SamplingParams given for all prompts is one check);
    # in list order, so the first bad one in the list is the one named.
    for params in {id(p): p for p in params_list}.values():
        params.validate(vocab_size)
    # The server's length rules: prompt + max_tokens within max_model_len.
    for i, ((_, ids), params) in enumerate(zip(encoded, params_list, strict=True)):
        try:
            check_lengths(len(ids), max_model_len, params.max_tokens)
        except ValueError as e:
            raise ValueError(f"{e} (prompts[{i}])") from None
    return encoded, params_list


def _unwrap_prompt(i: int, prompt):
    """Prompt `i` as text or ids: vLLM's prompt dicts ({"prompt": str} or
    {"prompt_token_ids": [...]}) unwrapped, anything else as given. ValueError naming the
    prompt for a dict with neither key, both, or another key."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = set(prompt)
    if keys not in ({"prompt"}, {"prompt_token_ids"}):
        raise ValueError(
            f"prompts[{i}]: a prompt dict has exactly one key, 'prompt' (a string) or "
            f"'prompt_token_ids' (a list of ints), got {sorted(map(str, keys))}"
        )
    if "prompt" in keys:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(
                f"prompts[{i}].prompt: expected a string, got {type(prompt['prompt']).__name__}"
            )
        return prompt["prompt"]
    return _token_ids(i, prompt["prompt_token_ids"])


def _token_ids(i: int, prompt) -> list[int]:
    """Prompt `i` given as token ids; ValueError naming it ("prompts[i]") when it is no
    list of ints (None, a number, a dict) or an element is no int (bool and float too:
    int() would turn 1.5 or True into an id silently)."""
    if isinstance(prompt, bytes | Mapping) or not isinstance(prompt, Iterable):
        raise ValueError(
            f"prompts[{i}]: expected a string or a list of token ids, got {type(prompt).__name__}"
        )
    ids = list(prompt)
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise ValueError(f"prompts[{i}][{j}]: a token id must be an integer, got {t!r}")
    return [int(t) for t in ids]


def _broadcast_params(
    sampling_params: SamplingParams | SequenceOf[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: the defaults, the one given, or the list given
    (ValueError naming sampling_params when its length is not the prompts' `n`)."""
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return params
