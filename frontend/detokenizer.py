"""Incremental, UTF-8-safe detokenization with stop strings, for one request.

`IncrementalDetokenizer` turns a request's output token ids, as they arrive, into text
deltas. It is pure Python over a `tokenizers.Tokenizer` (no sockets, no JAX), used by the
detokenizer sidecar and in-process by the offline `LLM` API, so both produce the same text.

Guarantees, for a tokenizer whose decode is a concatenation of token bytes (byte-level
BPE), with T_k = decode(ids[:k]) stripped of trailing U+FFFD:
- after k tokens the text emitted so far is T_k minus the longest suffix of T_k that is a
  proper prefix of a stop string (so no stop string and no prefix of one reaches the
  client before it is known not to be a stop);
- a delta carries U+FFFD only if the full decoded text does (an incomplete UTF-8 sequence
  at the end is held back until the next token completes it, or until the finish);
- the concatenated deltas equal decode(ids), cut before the earliest stop-string match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizedDelta:
    """What one `update` produced.

    text: new text for the client (may be empty while text is held back).
    token_ids: the ids this update consumed; after a stop-string match, the ids that came
        after the token completing the match are dropped.
    stop_string: the stop string that matched in this update, or None.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Detokenizes one request's output ids incrementally.

    Algorithm: the prefix/read-offset technique of vLLM's `detokenize_incrementally`
    (also HF `TextStreamer`): decode a short window `ids[prefix_offset:]` and take the
    part after the text of `ids[prefix_offset:read_offset]`, so decoders whose output
    depends on the left neighbour (Metaspace, WordPiece) render each token in context;
    text ending in U+FFFD (an incomplete UTF-8 sequence) is held back. Unlike vLLM, the
    complete characters before such a tail are emitted at once, so a stop string is
    found at the token that completes it. Context starts at the first output token (no
    prompt tokens), so the text equals `tokenizer.decode(output_ids)`.

    Stop strings: after each token, the earliest match of any stop string in the text not
    yet emitted ends the output (text cut before it); otherwise the longest suffix that
    is a proper prefix of a stop string is held back (the "stop buffer" of vLLM/TGI).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        """Raises ValueError("stop: ...") on an empty stop string."""
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []  # ids fed to the decoder (not stop tokens)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._window_done = 0  # chars of the window after prefix_text already in `_text`
        self._text = ""  # all text decoded so far (emitted + held back for stop strings)
        self._emitted = 0  # chars of `_text` already returned
        self._num_consumed = 0  # output ids consumed, stop tokens included
        self.stop_string: str | None = None

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later updates return nothing."""
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """All text returned so far."""
        return self._text[: self._emitted]

    @property
    def num_output_tokens(self) -> int:
        """Output ids consumed so far (including a stop token; none after a stop string)."""
        return self._num_consumed

    def update(
        self,
        new_token_ids: Sequence[int],
        *,
        finished: bool = False,
        stop_terminated: bool = False,
    ) -> DetokenizedDelta:
        """Consume new output ids and return the text that is now safe to show.

        new_token_ids: ids produced since the last update (any number, may be empty).
        finished: the request ends with these ids; held-back text (an unfinished stop
            prefix, an incomplete UTF-8 tail) is released, as `decode` would show it.
        stop_terminated: the last id is the EOS or a stop token id (engine finish_reason
            "stop"); it is consumed but not detokenized, as in vLLM.
        """
        if self.finished:
            return DetokenizedDelta("")
        start = self._emitted
        decode_ids = list(new_token_ids)
        if stop_terminated and decode_ids:
            decode_ids.pop()
        consumed: list[int] = []
        for token_id in decode_ids:
            consumed.append(token_id)
            self._ids.append(token_id)
            self._decode_window()
            if self._check_stop():
                break
        if not self.finished:
            if stop_terminated and new_token_ids:
                consumed.append(new_token_ids[-1])
            if finished:
                self._flush()
        self._num_consumed += len(consumed)
        return DetokenizedDelta(self._text[start : self._emitted], consumed, self.stop_string)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self) -> None:
        """Append the newly complete characters of the window to `_text`."""
        window = self._decode(self._ids[self._prefix_offset :])
        stable = window.rstrip(_REPLACEMENT_CHAR)
        done = len(self._prefix_text) + self._window_done
        if len(stable) > done:
            self._text += stable[done:]
            self._window_done = len(stable) - len(self._prefix_text)
        if len(stable) == len(window) and len(window) > len(self._prefix_text):
            # The window ends on a complete character: slide it so it stays short.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self._window_done = 0

    def _check_stop(self) -> bool:
        """Cut at the earliest stop match, or advance `_emitted` past safe text."""
        if not self._stop:
            self._emitted = len(self._text)
            return False
        # No match can start inside emitted text (it was never a stop prefix).
        best = -1
        for s in self._stop:
            i = self._text.find(s, self._emitted)
            if i != -1 and (best == -1 or i < best):
                best, self.stop_string = i, s
        if best != -1:
            self._text = self._text[:best]
            self._emitted = best
            return True
        self._emitted = len(self._text) - self._stop_prefix_len()
        return False

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of unemitted text that is a proper stop prefix."""
        pending = len(self._text) - self._emitted
        for k in range(min(pending, self._max_stop_len - 1), 0, -1):
            suffix = self._text[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self._stop):
                return k
        return 0

    def _flush(self) -> None:
        """At the finish: release the incomplete UTF-8 tail and any stop prefix."""
        window = self._decode(self._ids[self._prefix_offset :])
        done = len(self._prefix_text) + self._window_done
        self._text += window[done:]
        self._window_done = len(window) - len(self._prefix_text)
        if not self._check_stop():
            self._emitted = len(self._text)
