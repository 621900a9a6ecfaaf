"""Engine outputs -> OpenAI response JSON: choices, stream chunks, log-probs and usage.

Text and token counts come from the request's `TextOutput`s (frontend/requests.py), the
same ones the gRPC servicer answers from, so both protocols give the same text. A token's
text in log-probs is the tokenizer's decoding of that one token (special tokens kept), as
vLLM reports it; its `bytes` are that text's UTF-8 bytes.

Choice index: with several prompts, choice i * n + j is sample j of prompt i (OpenAI's
order). finish_reason is "stop", "length" or "abort"; `stop_reason` (vLLM's extra) is the
matched stop string or stop token id, else null.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from jaxserve.ipc import TextOutput


def _dumps(obj) -> bytes:
    """Compact JSON, UTF-8 (non-ASCII text as is, as OpenAI sends it)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


_dumps_str = json.JSONEncoder(ensure_ascii=False).encode  # a str, int or None as JSON


class TokenTexts:
    """The text of single tokens, decoded once each (vocabularies are finite)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(outputs: list[TextOutput], texts: TokenTexts, offset: int) -> dict:
    """The `logprobs` object of a completions choice (or chunk) for these outputs' tokens:
    tokens, token_logprobs, top_logprobs (token text -> logprob, most likely first) and
    text_offset (character offset of each token in the choice's text, from `offset`).

    As OpenAI's legacy completions and vLLM, a position's top_logprobs also holds the
    sampled token, after the N most likely when it is not one of them (so N + 1 entries).
    Chat's top_logprobs (`chat_logprobs`) holds exactly the N most likely, as OpenAI's.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for out in outputs:
        for token_id, (logprob, top) in zip(out.token_ids, out.logprobs or (), strict=False):
            text = texts(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            alternatives = {texts(t): lp for t, lp in top}
            if all(t != token_id for t, _ in top):
                alternatives.setdefault(text, logprob)
            tops.append(alternatives)
            offsets.append(offset)
            offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(outputs: list[TextOutput], texts: TokenTexts) -> dict:
    """The `logprobs` object of a chat choice (or chunk): {"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}, ...]}, ...]}."""
    content = []
    for out in outputs:
        for token_id, (logprob, top) in zip(out.token_ids, out.logprobs or (), strict=False):
            entry = _chat_token(texts(token_id), logprob)
            entry["top_logprobs"] = [_chat_token(texts(t), lp) for t, lp in top]
            content.append(entry)
    return {"content": content}


@dataclass(slots=True)
class Choice:
    """One choice's whole output, gathered from its outputs (non-streaming answers)."""

    index: int
    text: list[str] = field(default_factory=list)
    outputs: list[TextOutput] = field(default_factory=list)  # kept only with logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int = 0

    def add(self, outputs: list[TextOutput], keep: bool) -> None:
        for out in outputs:
            self.text.append(out.text)
            self.completion_tokens += len(out.token_ids)
        if keep:
            self.outputs.extend(outputs)
        last = outputs[-1]
        if last.finish_reason is not None:
            self.finish_reason = last.finish_reason
            self.stop_reason = last.stop_reason
            self.completion_tokens = last.completion_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseWriter:
    """Builds the JSON objects of one response (its id, model and creation time fixed).

    chat: chat.completion(.chunk) objects, else text_completion ones. logprobs: whether the
    request asked for them (each choice then carries a logprobs object).
    """

    def __init__(
        self, response_id: str, model: str, chat: bool, logprobs: bool, texts: TokenTexts
    ) -> None:
        self.id = response_id
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.created = int(time.time())
        self._texts = texts
        self._offsets: dict[int, int] = {}  # choice -> characters streamed so far
        self._prefix: str | None = None  # a chunk's JSON up to its choice's index

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def event(
        self, index: int, outputs: list[TextOutput], first: bool, include_usage: bool
    ) -> bytes | None:
        """The server-sent event (`data: {chunk}\\n\\n`) of one choice's new outputs
        (`first`: its first chunk, which in a chat carries the assistant role); None when
        it has nothing to send. include_usage: the chunk carries "usage": null (the usage
        comes in the last chunk). Without log-probs the JSON is written from a prefix
        built once per response (this runs once per streamed chunk)."""
        last = outputs[-1]
        text = "".join(o.text for o in outputs) if len(outputs) > 1 else last.text
        finish = last.finish_reason
        first = first and self.chat  # a chat's first chunk names the role, even empty
        if not (text or finish or first or (self.logprobs and any(o.token_ids for o in outputs))):
            return None
        if self.logprobs or first:
            chunk = self._chunk(index, outputs, text, first)
            if include_usage:
                chunk["usage"] = None
            return b"data: " + _dumps(chunk) + b"\n\n"
        if self._prefix is None:
            head = self._head("chat.completion.chunk" if self.chat else "text_completion")
            self._prefix = _dumps(head)[:-1].decode() + ',"choices":[{"index":'
        stop = last.stop_reason if finish is not None else None
        body = (
            f'"delta":{{"content":{_dumps_str(text)}}}' if self.chat and text
            else '"delta":{}' if self.chat
            else f'"text":{_dumps_str(text)}'
        )  # fmt: skip
        tail = ',"usage":null}' if include_usage else "}"
        return (
            f'data: {self._prefix}{index},{body},"logprobs":null,'
            f'"finish_reason":{_dumps_str(finish)},"stop_reason":{_dumps_str(stop)}}}]{tail}\n\n'
        ).encode()

    def _chunk(self, index: int, outputs: list[TextOutput], text: str, first: bool) -> dict:
        last = outputs[-1]
        finish = last.finish_reason
        choice: dict = {"index": index}
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(outputs, self._texts) if self.logprobs else None
        else:
            choice["text"] = text
            if self.logprobs:
                offset = self._offsets.get(index, 0)
                choice["logprobs"] = completion_logprobs(outputs, self._texts, offset)
                self._offsets[index] = offset + len(text)
            else:
                choice["logprobs"] = None
        choice["finish_reason"] = finish
        choice["stop_reason"] = last.stop_reason if finish is not None else None
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [choice]
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk of a stream with stream_options.include_usage: no choices."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    def response(self, choices: list[Choice], prompt_tokens: int) -> dict:
        """The whole (non-streaming) response."""
        out = self._head("chat.completion" if self.chat else "text_completion")
        items = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            item: dict = {"index": c.index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                item["logprobs"] = chat_logprobs(c.outputs, self._texts) if self.logprobs else None
            else:
                item["text"] = text
                item["logprobs"] = (
                    completion_logprobs(c.outputs, self._texts, 0) if self.logprobs else None
                )
            item["finish_reason"] = c.finish_reason
            item["stop_reason"] = c.stop_reason
            items.append(item)
        out["choices"] = items
        out["usage"] = usage(prompt_tokens, sum(c.completion_tokens for c in choices))
        return out
