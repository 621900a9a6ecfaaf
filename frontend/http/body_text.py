"""The bytes of a JSON request body as the UTF-8 text pydantic's parser (jiter) reads, and
words a client can act on for bytes that are not JSON text.

A body is read as vLLM's and SGLang's FastAPI read it (`json.loads` of the bytes): UTF-8,
a leading byte-order mark skipped, or UTF-16 / UTF-32, told apart by its first bytes
(`json.detect_encoding`; RFC 8259 section 8.1 lets a parser take them). The charset
parameter of Content-Type is not read, as FastAPI does not read it: application/json
defines no charset, and RFC 8259 says JSON exchanged between systems MUST be UTF-8. A
body that is not UTF-8 and came with another charset is told so in its 400 (`why_not_json`).
"""

from __future__ import annotations

import json
import re

_POSITION = re.compile(r" at line \d+ column \d+$")
_GZIP_MAGIC = b"\x1f\x8b"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def utf8(body: bytes) -> tuple[bytes, str]:
    """(the body as UTF-8 without a byte-order mark, the encoding it came in: "UTF-8",
    "UTF-16" or "UTF-32"). Bytes that are UTF-8 come back unchanged, checked later by
    the parser. Raises ValueError("body: not valid UTF-16 text ...") for UTF-16 or UTF-32
    bytes that do not decode (odd length, a lone surrogate)."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body, "UTF-8"
    if encoding == "utf-8-sig":
        return body[3:], "UTF-8"
    name = encoding[:6].upper()  # utf-16-le -> UTF-16
    try:
        return body.decode(encoding).encode("utf-8"), name
    except UnicodeDecodeError as e:
        raise ValueError(
            f"body: not valid {name} text ({e.reason} at byte {e.start}); send JSON in UTF-8"
        ) from None


def why_not_json(body: bytes, why: str, charset: str | None = None) -> str:
    """jiter's reason a body (from `utf8`) is not JSON text (`why`, "... at line L column
    C"), in words a client can act on where jiter's mislead: compressed bytes sent without
    a Content-Encoding, a lone UTF-16 surrogate escape ("\\ud800" without its pair), which
    jiter reports as "unexpected end of hex escape" or "lone leading surrogate", and
    bytes that are not UTF-8 (naming the Content-Type's `charset` when one other than
    UTF-8 was given). Python's json, which takes lone surrogates, tells them apart: only
    on this error path."""
    if body.startswith(_GZIP_MAGIC):  # compressed, but without a Content-Encoding header
        return (
            "it starts with bytes 1f 8b, as gzip data does: compressed bodies are not "
            "supported; send plain JSON"
        )
    if len(body) >= 2 and body[0] == 0x78 and (body[0] * 256 + body[1]) % 31 == 0:
        # A zlib header (RFC 1950: CMF 0x78 = deflate with a 32 KiB window, FLG a check
        # that makes CMF*256+FLG a multiple of 31): HTTP's "deflate" encoding.
        return (
            f"it starts with bytes 78 {body[1]:02x}, as zlib (deflate) data does: compressed "
            "bodies are not supported; send plain JSON"
        )
    match = _POSITION.search(why)
    where = match.group(0).removeprefix(" ") if match else "position unknown"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        words = f"byte {body[e.start : e.start + 1]!r} is not UTF-8, {where}"
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            words += f"; the Content-Type's charset={charset} is not read: JSON is UTF-8"
        return words
    if _SURROGATE_ESCAPE.search(body):
        try:
            json.loads(text)
        except ValueError:
            return why
        return (
            "a string holds a lone UTF-16 surrogate escape such as \\ud800, half of a pair "
            f"and no character: send the character itself or both halves; {where}"
        )
    return why
