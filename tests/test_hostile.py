"""Hostile requests cost a bounded amount per token and fail only themselves.

The stop matcher against a brute-force search; the detokenizer's decode window stays
bounded over runs of tokens that decode to "" and of invalid UTF-8 bytes, while its text
still equals `tokenizer.decode`; request limits name their field; a bad token id in the
sidecar fails only its own request.
"""

from __future__ import annotations

import random

import pytest
from mock_engine import SPECIAL_TOKENS, train_test_tokenizer
from test_detokenizer import _byte_token_ids, _gpt2_byte_chars

from jaxserve.frontend.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from jaxserve.frontend.detokenizer_process import OutputProcessor
from jaxserve.frontend.stop_matcher import StopMatcher
from jaxserve.ipc import TokenOutput
from jaxserve.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_BYTES,
    SamplingParams,
)

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return train_test_tokenizer()


# ---------------------------------------------------------------- stop matcher


def _brute_first_match(text: str, stops: list[str], chunks: list[str]):
    """Oracle: feeding chunk by chunk, the first chunk after which the text holds a stop;
    then the earliest start (ties: lowest list index). Returns (chunk index, start, index)."""
    seen = ""
    for c, chunk in enumerate(chunks):
        seen += chunk
        hits = [(seen.find(s), j) for j, s in enumerate(stops) if s in seen]
        if hits:
            start, j = min(hits)
            return c, start, j
    return None


def _brute_hold(text: str, stops: list[str]) -> int:
    return max(
        (k for s in stops for k in range(1, len(s)) if k <= len(text) and s.startswith(text[-k:])),
        default=0,
    )


@pytest.mark.parametrize("seed", range(4))
def test_stop_matcher_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(300):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 6))
        ]
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            chunks.append(text[i : i + n])
            i += n
        expected = _brute_first_match(text, stops, chunks)
        m = StopMatcher(stops)
        seen = ""
        for c, chunk in enumerate(chunks):
            seen += chunk
            got = m.feed(chunk)
            if expected is not None and c == expected[0]:
                assert got is not None and (got.start, got.index) == expected[1:], (text, stops)
                break
            assert got is None, (text, stops, c)
            assert m.hold == _brute_hold(seen, stops), (seen, stops)
        else:
            assert expected is None


def test_stop_matcher_many_stops_one_pass():
    # 1,000 stop strings that all share a long prefix with the text: the automaton still
    # reports the right match and hold (a per-string scan would do 1,000 checks per char).
    stops = [f"{'x' * 40}{i:04d}" for i in range(1000)]
    m = StopMatcher(stops)
    assert m.feed("y" + "x" * 45) is None
    assert m.hold == 40
    got = m.feed("0") or m.feed("7") or m.feed("3") or m.feed("1")
    assert got is not None and m.stop_string(got) == stops[731] and got.start == 6


def test_stop_matcher_rejects_empty_stop():
    with pytest.raises(ValueError, match="^stop:"):
        StopMatcher(["a", ""])


# ---------------------------------------------------------------- detokenizer window


class _CountingTokenizer:
    """Forwards decode to a real tokenizer and records the longest id list decoded."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tok, ids, *, skip=True, stop=(), chunk=1):
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, skip_special_tokens=skip, stop=stop)
    text = ""
    for i in range(0, len(ids), chunk):
        text += detok.update(ids[i : i + chunk], finished=i + chunk >= len(ids)).text
    return text, counting.longest


# The window is at most the context before read_offset plus the pending tokens.
_WINDOW_BOUND = 2 * MAX_PENDING_TOKENS + 2


def test_window_stays_bounded_over_invalid_utf8_runs(tok):
    chars = _gpt2_byte_chars()
    lone = [tok.token_to_id(chars[b]) for b in (0xFF, 0x80, 0xBF, 0xE4)]
    rng = random.Random(0)
    # 0xFF never starts a character; runs of lone bytes only sometimes complete one.
    ids = lone[:1] * 1500 + [rng.choice(lone) for _ in range(1500)]
    ids += _byte_token_ids(tok, "ok 你好")
    text, longest = _stream(tok, ids)
    assert text == tok.decode(ids)
    assert longest <= _WINDOW_BOUND


def test_window_stays_bounded_over_tokens_decoding_to_nothing(tok):
    ids = _byte_token_ids(tok, "a") + [1] * 3000 + _byte_token_ids(tok, "你好 b")
    text, longest = _stream(tok, ids, skip=True)
    assert text == tok.decode(ids, skip_special_tokens=True) == "a你好 b"
    assert longest <= _WINDOW_BOUND


@pytest.mark.parametrize("seed", range(3))
def test_long_random_streams_match_decode_with_bounded_window(tok, seed):
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    ids = []
    for _ in range(40):
        kind = rng.random()
        if kind < 0.3:
            ids += _byte_token_ids(tok, "机器学习 🤖 café")
        elif kind < 0.6:
            ids += [rng.randrange(len(SPECIAL_TOKENS))] * rng.randint(1, 40)
        else:
            ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    skip = seed % 2 == 0
    text, longest = _stream(tok, ids, skip=skip, chunk=rng.randint(1, 3))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert longest <= _WINDOW_BOUND


def test_stop_with_many_long_stop_strings_still_matches(tok):
    target = "机器学习 END"
    stops = [f"{'機' * 200}{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["END"]
    ids = _byte_token_ids(tok, "hello " + target + " more")
    detok = IncrementalDetokenizer(tok, stop=stops)
    text = "".join(detok.update([t]).text for t in ids)
    assert text == "hello 机器学习 "
    assert detok.stop_string == "END"


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, r"stop\[0\]"),
        ({"stop": ["€" * MAX_STOP_STRING_CHARS] * 8}, "stop"),
        ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ],
)
def test_request_lists_past_their_limit_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_request_lists_at_their_limit_are_accepted():
    per = MAX_STOP_TOTAL_BYTES // MAX_STOP_STRINGS
    SamplingParams(stop=["y" * per] * MAX_STOP_STRINGS).validate(vocab_size=100)
    SamplingParams(stop_token_ids=[5] * MAX_STOP_TOKEN_IDS).validate(vocab_size=100)


# ---------------------------------------------------------------- sidecar isolation


def test_bad_token_id_fails_only_its_request(tok):
    proc = OutputProcessor(tok)
    first = {"prompt_token_ids": [5], "sampling": {}}
    good = tok.encode("hello").ids
    texts, aborts = proc.process(
        [
            TokenOutput("bad", [-1], first=first),
            TokenOutput("good", good, first=first),
        ]
    )
    by_id = {t.request_id: t for t in texts}
    assert by_id["bad"].finish_reason == "error"
    assert "token id" in by_id["bad"].error
    assert aborts == ["bad"]
    assert by_id["good"].text == "hello" and by_id["good"].finish_reason is None
    # The engine's later outputs for the failed request are dropped; its final clears it.
    texts, _ = proc.process(
        [TokenOutput("bad", [7], finish_reason="abort"), TokenOutput("good", [], "length")]
    )
    assert [t.request_id for t in texts] == ["good"]
    assert proc.num_requests == 0
