"""IncrementalDetokenizer against full `tokenizer.decode`, property-style, with a byte-level
BPE tokenizer trained in the test on text with multi-byte UTF-8 (CJK, emoji, accents)."""

from __future__ import annotations

import random

import pytest
from mock_engine import SPECIAL_TOKENS, train_test_tokenizer

from jaxserve.frontend.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"

_TEXTS = [
    "你好，世界！🤖 robots",
    "café 😀😃 naïve résumé",
    "import os\nprint('こんにちは')",
    "🦊🐶🚀🌍 ❤️ 机器学习",
    "plain ascii text with spaces",
]


@pytest.fixture(scope="module")
def tok():
    return train_test_tokenizer()


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_token_ids(tok, text: str) -> list[int]:
    chars = _gpt2_byte_chars()
    return [tok.token_to_id(chars[b]) for b in text.encode("utf-8")]


def _stable_text(tok, ids, skip_special_tokens) -> str:
    """Oracle: what may be shown after `ids`: full decode minus an incomplete UTF-8 tail."""
    return tok.decode(ids, skip_special_tokens=skip_special_tokens).rstrip(FFFD)


def _hold(text: str, stops: list[str]) -> int:
    """Oracle: longest suffix of `text` that is a proper prefix of a stop string."""
    return max(
        (k for s in stops for k in range(1, len(s)) if k <= len(text) and s.startswith(text[-k:])),
        default=0,
    )


def _random_ids(rng: random.Random, tok) -> list[int]:
    vocab = tok.get_vocab_size()
    kind = rng.random()
    if kind < 0.4:  # valid text, encoded: the decode has no U+FFFD
        text = "".join(rng.choice(_TEXTS) for _ in range(rng.randint(1, 3)))
        ids = tok.encode(text).ids
    elif kind < 0.7:  # valid text as single-byte tokens: every multi-byte char is split
        ids = _byte_token_ids(tok, rng.choice(_TEXTS))
    else:  # arbitrary ids: invalid UTF-8 and stray continuation bytes
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    # Sprinkle special tokens (skipped or shown depending on skip_special_tokens).
    for _ in range(rng.randint(0, 2)):
        ids.insert(rng.randint(0, len(ids)), rng.randrange(len(SPECIAL_TOKENS)))
    return ids


def _random_stops(rng: random.Random, text: str) -> list[str]:
    stops = []
    clean = text.replace(FFFD, "")
    for _ in range(rng.randint(0, 3)):
        if clean and rng.random() < 0.8:
            i = rng.randrange(len(clean))
            stops.append(clean[i : i + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(["zz9", "\n\n", "🤖x", "QQ"]))
    return [s for s in stops if s and FFFD not in s]


def _chunks(rng: random.Random, ids: list[int]):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        yield ids[i : i + n]
        i += n


@pytest.mark.parametrize("seed", range(6))
def test_matches_full_decode_with_stop_strings(tok, seed):
    rng = random.Random(seed)
    for _ in range(60):
        ids = _random_ids(rng, tok)
        skip = rng.random() < 0.5
        full = tok.decode(ids, skip_special_tokens=skip)
        stops = _random_stops(rng, full)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stops)

        # Oracle for the stop: the first k whose stable text holds a stop string.
        stop_k, cut, stop_str = None, None, None
        for k in range(1, len(ids) + 1):
            t = _stable_text(tok, ids[:k], skip)
            hits = [(t.find(s), j) for j, s in enumerate(stops) if s in t]
            if hits:
                cut, j = min(hits)
                stop_k, stop_str = k, stops[j]
                break

        shown, consumed, fed = "", [], 0
        chunks = list(_chunks(rng, ids))
        for n, chunk in enumerate(chunks):
            delta = detok.update(chunk, finished=n == len(chunks) - 1)
            shown += delta.text
            consumed += delta.token_ids
            fed += len(chunk)
            if FFFD in delta.text:
                assert FFFD in full, (ids, delta.text)
            if delta.stop_string is not None:
                break
            if n < len(chunks) - 1:
                t = _stable_text(tok, ids[:fed], skip)
                assert shown == t[: len(t) - _hold(t, stops)], (ids, stops, chunk)

        if stop_k is None:
            assert shown == full, (ids, stops)
            assert detok.stop_string is None
            assert consumed == ids
        else:
            assert shown == _stable_text(tok, ids[:stop_k], skip)[:cut], (ids, stops)
            assert detok.stop_string == stop_str
            assert consumed == ids[:stop_k]
        assert detok.text == shown
        assert detok.num_output_tokens == len(consumed)


def test_split_emoji_is_held_until_complete(tok):
    ids = _byte_token_ids(tok, "a🤖b")  # 1 + 4 + 1 single-byte tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.update([i]).text for i in ids]
    assert deltas == ["a", "", "", "", "🤖", "b"]


def test_invalid_utf8_tail_is_released_at_finish(tok):
    ids = _byte_token_ids(tok, "ok🤖")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok)
    assert detok.update(ids).text == "ok"
    assert detok.update([], finished=True).text == tok.decode(ids)[2:]
    assert detok.text == tok.decode(ids) and FFFD in detok.text


def test_stop_string_spanning_tokens_is_never_shown(tok):
    ids = _byte_token_ids(tok, "abc STOP def")
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    shown = []
    for i in ids:
        d = detok.update([i])
        shown.append(d.text)
        if d.stop_string:
            break
    assert "".join(shown) == "abc "
    assert all("S" not in s for s in shown)
    assert detok.stop_string == "STOP"
    assert detok.num_output_tokens == len("abc STOP")


def test_unfinished_stop_prefix_released_when_request_ends(tok):
    ids = _byte_token_ids(tok, "abc ST")
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert detok.update(ids).text == "abc "
    assert detok.update([], finished=True).text == "ST"
    assert detok.stop_string is None


def test_stop_terminated_token_is_counted_not_shown(tok):
    ids = tok.encode("hello world").ids
    eos = tok.token_to_id("<|endoftext|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    d = detok.update(ids + [eos], finished=True, stop_terminated=True)
    assert d.text == tok.decode(ids, skip_special_tokens=False)
    assert d.token_ids == ids + [eos]
    assert detok.num_output_tokens == len(ids) + 1


def test_skip_special_tokens(tok):
    ids = tok.encode("hi").ids + [tok.token_to_id("<|im_end|>")] + tok.encode(" there").ids
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.update([i]).text for i in ids) + detok.update([], finished=True).text
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in text) is not skip


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError, match="^stop:"):
        IncrementalDetokenizer(tok, stop=["x", ""])


@pytest.mark.parametrize("error_file", [False, True])
def test_sidecar_start_failure_is_one_line(tmp_path, error_file):
    """A socket the sidecar cannot bind: one line (to the start-error file `serve` reads,
    or to stderr), exit code 2, no traceback."""
    import os
    import subprocess
    import sys

    from jaxserve.config import DEMO_MODEL_DIR
    from jaxserve.logs import START_ERROR_FILE_ENV

    bad = f"ipc://{tmp_path}/no-such-dir/detok"
    path = tmp_path / "detokenizer.start-error"
    env = {k: v for k, v in os.environ.items() if k != START_ERROR_FILE_ENV}
    if error_file:
        env[START_ERROR_FILE_ENV] = str(path)
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.frontend.detokenizer_process",
         "--model", str(DEMO_MODEL_DIR), "--detokenizer-input", bad,
         "--frontend-input", f"ipc://{tmp_path}/f", "--engine-input", f"ipc://{tmp_path}/e",
         "--parent-pid", str(os.getpid())],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    want = f"detokenizer failed to start: cannot bind {bad} ("
    if error_file:
        from jaxserve.logs import EXIT_SYSTEM_REFUSED, read_start_failure_code

        line, code = read_start_failure_code(str(path))
        assert line.startswith(want) and code == EXIT_SYSTEM_REFUSED  # the bind was refused
        assert len(path.read_text().splitlines()) == 2  # the line, then the code
        assert out.stderr == ""
    else:
        lines = out.stderr.splitlines()
        assert len(lines) == 1 and want in lines[0], out.stderr
