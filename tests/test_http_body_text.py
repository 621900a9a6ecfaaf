"""frontend/http/body_text and protocol.parse_body: what the bytes of a request body are
read as (UTF-8, a BOM skipped, UTF-16 and UTF-32, as vLLM's FastAPI reads them with
json.loads(bytes); the Content-Type charset not read) and what bytes that are not JSON
text are called."""

import json

import pytest
from starlette.requests import Request

from jaxserve.frontend.http.protocol import CompletionRequest, FieldError, parse_body
from jaxserve.frontend.http.responses import check_json_content_type


def _body_error(body: bytes, charset: str | None = None) -> tuple[str | None, str]:
    with pytest.raises(FieldError) as info:
        parse_body(CompletionRequest, body, charset)
    return info.value.param, str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "\\ud800"}',  # a lone leading surrogate: no Unicode text
        b'{"prompt": "a", "user": "\\udc00x"}',  # a lone trailing one
        b'{"prompt": "a\xff"}',  # bytes that are not UTF-8
        b'{"prompt": ',  # cut short
    ],
)
def test_a_body_that_is_not_json_text_is_named_as_such(body):
    """Bytes that are not JSON text in UTF-8 (a lone surrogate escape included) are a 400
    on `body` that says so; "not a JSON object" (what they used to get) is kept for valid
    JSON of another type."""

    def strict_json(raw: bytes):
        # Independent of pydantic: UTF-8, JSON, and every string encodable as UTF-8.
        value = json.loads(raw.decode("utf-8"))
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value

    with pytest.raises((UnicodeError, ValueError)):
        strict_json(body)
    param, message = _body_error(body)
    assert param == "body"
    assert message.startswith("body: not valid JSON in UTF-8 ("), message
    assert "line 1 column" in message  # where the fault is

    array = b'["\\ud83d\\ude00"]'  # valid JSON text (a surrogate pair), but not an object
    assert strict_json(array) == ["\U0001f600"]
    param, message = _body_error(array)
    assert param == "body" and message.startswith("body: not a JSON object")


@pytest.mark.parametrize("body", [b"", b"  \n", b"\xef\xbb\xbf"])
def test_an_empty_body_is_said_so(body):
    # jiter said "EOF while parsing a value at line 1 column 0".
    assert _body_error(body) == ("body", "body: empty; send a JSON object")


@pytest.mark.parametrize("body", [b'{"prompt": "\\ud800"}', b'{"prompt": "a", "user": "\\udc00x"}'])
def test_a_lone_surrogate_escape_is_said_so(body):
    """jiter calls "\\ud800" followed by a quote "unexpected end of hex escape": the 400
    says what is wrong (a lone surrogate escape) and where."""
    param, message = _body_error(body)
    assert param == "body"
    assert message.startswith("body: not valid JSON in UTF-8 (a string holds a lone UTF-16 ")
    assert "hex escape" not in message and "at line 1 column " in message
    # A surrogate pair is a character; an escaped backslash before "ud800" is no escape.
    assert parse_body(CompletionRequest, b'{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"
    assert parse_body(CompletionRequest, b'{"prompt": "\\\\ud800"}').prompt == "\\ud800"


def test_a_utf8_byte_order_mark_is_skipped_as_python_json_skips_it():
    """vLLM's and SGLang's FastAPI parse a body with json.loads(bytes), which decodes a
    leading UTF-8 BOM away (utf-8-sig): the same body is the same request here. A BOM
    anywhere else is no whitespace in JSON and stays an error."""
    bom = "\ufeff".encode()
    body = bom + b'{"prompt": "a\\u00e9", "max_tokens": 3}'
    expected = json.loads(body)  # Python's json: the FastAPI path
    parsed = parse_body(CompletionRequest, body)
    assert (parsed.prompt, parsed.max_tokens) == (expected["prompt"], expected["max_tokens"])
    with pytest.raises(ValueError):
        json.loads(b'{"prompt": ' + bom + b'"a"}')
    assert _body_error(b'{"prompt": ' + bom + b'"a"}')[0] == "body"


# ---------------------------------------------------------------- UTF-16, UTF-32, charset


@pytest.mark.parametrize(
    "encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)
def test_a_utf16_or_utf32_body_is_read_as_python_json_reads_it(encoding):
    """vLLM's FastAPI reads a body with json.loads(bytes), which takes UTF-16 and UTF-32
    (with a byte-order mark or without, told by the first bytes): the same request here,
    whatever the Content-Type's charset says (it is not read). Was "byte b'\\xff' is not
    UTF-8" (or b'\\x00')."""
    text = '{"prompt": "caf\u00e9 \U0001f600", "max_tokens": 3}'  # a pair in UTF-16
    body = text.encode(encoding)
    expected = json.loads(body)  # Python's json: the FastAPI path
    for charset in (None, "utf-8", encoding):
        parsed = parse_body(CompletionRequest, body, charset)
        assert (parsed.prompt, parsed.max_tokens) == (expected["prompt"], expected["max_tokens"])


def test_utf16_bytes_that_do_not_decode_are_said_so():
    body = '{"prompt": "a"}'.encode("utf-16")[:-1]  # an odd count of bytes
    with pytest.raises(UnicodeDecodeError):
        json.loads(body)  # FastAPI: 400 "There was an error parsing the body"
    param, message = _body_error(body)
    assert param == "body"
    last = len(body) - 1  # the byte without its pair
    assert (
        message
        == f"body: not valid UTF-16 text (truncated data at byte {last}); send JSON in UTF-8"
    )
    # JSON that decodes but does not parse names the encoding it was read in.
    param, message = _body_error('{"prompt": '.encode("utf-32"))
    assert param == "body" and message.startswith("body: not valid JSON in UTF-32 (")


def test_a_latin1_body_is_not_utf8_and_its_charset_is_named():
    """A charset other than UTF-8 is not read (as FastAPI, and RFC 8259: JSON between
    systems is UTF-8): an ASCII body is the same request, a Latin-1 one is a 400 that
    names the byte and says the charset was not read."""
    ascii_body = b'{"prompt": "cafe"}'
    assert parse_body(CompletionRequest, ascii_body, "latin-1").prompt == "cafe"
    body = '{"prompt": "caf\u00e9"}'.encode("latin-1")
    with pytest.raises(UnicodeDecodeError):
        body.decode("utf-8")
    column = body.index(b"\xe9") + 1
    cause = f"body: not valid JSON in UTF-8 (byte b'\\xe9' is not UTF-8, at line 1 column {column}"
    for charset in ("latin-1", "ISO-8859-1"):
        param, message = _body_error(body, charset)
        assert param == "body" and message.startswith(cause), message
        assert message.endswith(
            f"; the Content-Type's charset={charset} is not read: JSON is UTF-8)"
        )
    for charset in (None, "utf-8", "UTF8"):
        param, message = _body_error(body, charset)
        assert message.startswith(cause) and "charset" not in message, message


@pytest.mark.parametrize(
    ("header", "charset"),
    [
        (b"application/json", None),
        (b"application/json; charset=utf-8", "utf-8"),
        (b'Application/JSON;Charset="ISO-8859-1"', "ISO-8859-1"),
        (b"application/json; foo=bar; charset=latin-1", "latin-1"),
    ],
)
def test_the_content_types_charset_is_returned_for_the_400_only(header, charset):
    request = Request({"type": "http", "method": "POST", "headers": [(b"content-type", header)]})
    assert check_json_content_type(request) == charset
