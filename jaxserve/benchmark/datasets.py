"""The prompts of a serving benchmark: what `jaxserve bench` sends, built before it sends.

Each loader returns a list of `Session`s. A session of one turn is one request; a
multi-turn session is a conversation whose turn k+1 is sent after turn k ends, its prompt
the whole history (every earlier prompt and the text the server returned) plus the new
user message, as a chat client resends it. The loaders follow vLLM's benchmark datasets
(vllm/benchmarks/datasets.py): `random` (token ids drawn uniformly from the vocabulary,
lengths drawn uniformly in [len*(1-r), len*(1+r)]), `shared-prefix` (vLLM's
prefix_repetition: a few random prefixes, each shared by many requests, plus a random
suffix), `sharegpt` (the first human turn of each conversation of a ShareGPT JSON file as
the prompt, the first model turn's token count as max_tokens; vLLM's filter drops pairs
under 4 tokens, prompts over 1024 and pairs over 2048), `multi-turn` (conversations,
synthetic or the human turns of a ShareGPT file) and `text` (a plain file, one prompt a
line). All draws come from one `numpy.random.Generator(seed)`, so a seed gives the same
prompts.

Nothing here talks to a server; token counts come from the model's tokenizer
(`frontend.tokenizer`), and the server's own count (prompt_tokens) is what the report uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from jaxserve.frontend.tokenizer import encode_prompt

DATASETS = ("random", "shared-prefix", "sharegpt", "multi-turn", "text")
# vLLM's ShareGPT filter (datasets.py is_valid_sequence).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
MAX_TURNS = 64  # turns per conversation: a bound on one session's history


@dataclass(slots=True)
class BenchRequest:
    """One request of a session.

    prompt: text, or token ids (sent as ids, no tokenization on the server). In a chained
        session a turn's prompt is the new user message only; the driver prepends history.
    prompt_len: tokens of `prompt` by the model's tokenizer (for the report of what was
        planned; the measured input count is the server's prompt_tokens).
    output_len: max_tokens of the request (>= 1).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class Session:
    """Requests sent one after another. chained: each turn's prompt is the history (the
    earlier prompts and outputs) plus its own; else the turns are independent."""

    turns: list[BenchRequest]
    chained: bool = False


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """n integer lengths uniform in [mean*(1-ratio), mean*(1+ratio)], each >= 1."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {ratio}")
    low = max(1, int(np.floor(mean * (1 - ratio))))
    high = max(low, int(np.ceil(mean * (1 + ratio))))
    return rng.integers(low, high + 1, size=n)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")


def _token_pool(tokenizer: Tokenizer) -> np.ndarray:
    """The ids random prompts draw from: the whole vocabulary minus special tokens (a
    random EOS or chat marker in a prompt would change what is being measured)."""
    special = {t for t, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    pool = np.array([i for i in range(tokenizer.get_vocab_size()) if i not in special])
    if pool.size == 0:
        raise ValueError("tokenizer: no non-special tokens to draw prompts from")
    return pool


def random_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[Session]:
    """`num_prompts` requests of random token ids; lengths as in the module docstring.

    Raises ValueError naming a length < 1 or a range_ratio outside [0, 1)."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    ins = _lengths(rng, input_len, range_ratio, num_prompts)
    outs = _lengths(rng, output_len, range_ratio, num_prompts)
    return [
        Session([BenchRequest(rng.choice(pool, int(n)).tolist(), int(n), int(m))])
        for n, m in zip(ins, outs, strict=True)
    ]


def shared_prefix_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    *,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int = 1,
    seed: int = 0,
) -> list[Session]:
    """`num_prompts` requests, each one of `num_prefixes` random prefixes of `prefix_len`
    tokens (request i takes prefix i % num_prefixes) plus its own random suffix of
    `suffix_len` tokens; the order is shuffled. Measures prefix caching.

    Raises ValueError naming a length or count < 1."""
    _check_positive(
        num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len,
        output_len=output_len, num_prefixes=num_prefixes,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    prefixes = [rng.choice(pool, prefix_len).tolist() for _ in range(num_prefixes)]
    sessions = [
        Session([
            BenchRequest(
                prefixes[i % num_prefixes] + rng.choice(pool, suffix_len).tolist(),
                prefix_len + suffix_len, output_len,
            )
        ])
        for i in range(num_prompts)
    ]  # fmt: skip
    return [sessions[i] for i in rng.permutation(num_prompts)]


def _sharegpt_conversations(path: str | Path) -> list[list[tuple[str, str]]]:
    """[(role, text), ...] per conversation of a ShareGPT JSON file: a list of objects
    with "conversations": [{"from": "human"|"gpt"|..., "value": text}, ...].

    Raises FileNotFoundError, or ValueError naming the file and what is malformed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset_path: {path} is not JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"dataset_path: {path}: want a JSON list of conversations")
    out = []
    for k, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"dataset_path: {path}: entry {k} has no 'conversations' list")
        try:
            out.append([(str(t["from"]), str(t["value"])) for t in turns])
        except (KeyError, TypeError):
            raise ValueError(
                f"dataset_path: {path}: entry {k}: each turn needs 'from' and 'value'"
            ) from None
    return out


def sharegpt_dataset(
    tokenizer: Tokenizer,
    path: str | Path,
    num_prompts: int,
    *,
    output_len: int | None = None,
    seed: int = 0,
) -> list[Session]:
    """Up to `num_prompts` requests from a ShareGPT file (module docstring), in an order
    shuffled by `seed`. output_len overrides the model turn's length as max_tokens.

    Raises ValueError if no conversation passes the filter, or as
    `_sharegpt_conversations`."""
    _check_positive(num_prompts=num_prompts)
    rng = np.random.default_rng(seed)
    convs = _sharegpt_conversations(path)
    sessions = []
    for i in rng.permutation(len(convs)):
        conv = convs[i]
        if len(conv) < 2:
            continue
        prompt, completion = conv[0][1], conv[1][1]
        n_in = len(encode_prompt(tokenizer, prompt))
        n_out = output_len or len(tokenizer.encode(completion, add_special_tokens=False).ids)
        if n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN:
            continue
        if n_in > SHAREGPT_MAX_PROMPT_LEN or n_in + n_out > SHAREGPT_MAX_TOTAL_LEN:
            continue
        sessions.append(Session([BenchRequest(prompt, n_in, n_out)]))
        if len(sessions) == num_prompts:
            break
    if not sessions:
        raise ValueError(f"dataset_path: no conversation of {path} passes the length filter")
    return sessions


def _random_text(tokenizer: Tokenizer, pool: np.ndarray, rng: np.random.Generator, n: int):
    return tokenizer.decode(rng.choice(pool, n).tolist())


def multi_turn_dataset(
    tokenizer: Tokenizer,
    num_conversations: int,
    *,
    num_turns: int,
    input_len: int,
    output_len: int,
    path: str | Path | None = None,
    seed: int = 0,
) -> list[Session]:
    """`num_conversations` chained sessions of `num_turns` turns each. Without `path` each
    user message is the text of `input_len` random tokens; with a ShareGPT `path` the
    messages are a conversation's human turns (its first `num_turns`; conversations with
    none are skipped) and max_tokens is `output_len` for every turn.

    Raises ValueError naming a count < 1 or over MAX_TURNS, or as `sharegpt_dataset`."""
    _check_positive(
        num_conversations=num_conversations, num_turns=num_turns,
        input_len=input_len, output_len=output_len,
    )  # fmt: skip
    if num_turns > MAX_TURNS:
        raise ValueError(f"num_turns: at most {MAX_TURNS}, got {num_turns}")
    rng = np.random.default_rng(seed)
    sessions = []
    if path is None:
        pool = _token_pool(tokenizer)
        for _ in range(num_conversations):
            turns = []
            for _ in range(num_turns):
                text = _random_text(tokenizer, pool, rng, input_len)
                turns.append(BenchRequest(text, len(encode_prompt(tokenizer, text)), output_len))
            sessions.append(Session(turns, chained=True))
        return sessions
    convs = _sharegpt_conversations(path)
    for i in rng.permutation(len(convs)):
        human = [text for role, text in convs[i] if role in ("human", "user") and text]
        if not human:
            continue
        turns = [
            BenchRequest(t, len(encode_prompt(tokenizer, t)), output_len) for t in human[:num_turns]
        ]
        sessions.append(Session(turns, chained=True))
        if len(sessions) == num_conversations:
            break
    if not sessions:
        raise ValueError(f"dataset_path: no conversation of {path} has a human turn")
    return sessions


def text_file_dataset(
    tokenizer: Tokenizer, path: str | Path, num_prompts: int, *, output_len: int
) -> list[Session]:
    """One request per non-blank line of a UTF-8 text file (a literal "\\n" in a line is
    a newline), the lines cycled up to `num_prompts` in file order.

    Raises FileNotFoundError, or ValueError if the file has no non-blank line."""
    _check_positive(num_prompts=num_prompts, output_len=output_len)
    lines = [ln.replace("\\n", "\n") for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"dataset_path: {path} has no prompt (no non-blank line)")
    out = []
    for i in range(num_prompts):
        text = lines[i % len(lines)]
        out.append(Session([BenchRequest(text, len(encode_prompt(tokenizer, text)), output_len)]))
    return out
