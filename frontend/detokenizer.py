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
- the concatenated deltas equal decode(ids), cut before the earliest stop-string match
  (among the matches in the text of the first token that completes one, the earliest
  starting; ties go to the stop string listed first).

Cost per token is bounded, whatever the request: the decoded window holds at most
`MAX_PENDING_TOKENS` tokens past the last stable point plus `_CONTEXT_TOKENS` before it
(runs of tokens that decode to "" and runs of bytes that never form valid UTF-8 are cut),
stop strings are matched by one automaton (`frontend.stop_matcher`), and only the
held-back tail of the text is kept as a string. The one exception to exact agreement
with decode(ids): a character whose bytes are spread over more than MAX_PENDING_TOKENS
tokens with no UTF-8 boundary between any two of them (only hostile id sequences do
this) may be shown as U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from jaxserve.frontend.stop_matcher import StopMatcher

_REPLACEMENT_CHAR = "\ufffd"
# Tokens past the last point where the decoded text ended on a complete character after
# which the window is cut anyway (vLLM/HF let it grow without bound). A UTF-8 character
# is at most 4 bytes and a byte-level token holds at least one, so 16 leaves room for
# tokens that decode to nothing in between.
MAX_PENDING_TOKENS = 16


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
    found at the token that completes it; and once more than MAX_PENDING_TOKENS tokens
    wait past read_offset, the window is cut at the latest token boundary where decoding
    splits cleanly (decode(a) + decode(b) == decode(a + b)), so its length stays bounded.
    Context starts at the first output token (no prompt tokens), so the text equals
    `tokenizer.decode(output_ids)`.

    Stop strings: after each token, the earliest match of any stop string in the text not
    yet emitted ends the output (text cut before it); otherwise the longest suffix that
    is a proper prefix of a stop string is held back (the "stop buffer" of vLLM/TGI).
    Both come from one Aho-Corasick automaton (`StopMatcher`), O(1) per character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        """Raises ValueError("stop: ...") on an empty stop string."""
        self._matcher = StopMatcher(stop) if stop else None
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # ids fed to the decoder (not stop tokens)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._window_done = 0  # chars of the window after prefix_text already decoded
        self._pending = ""  # decoded text not yet returned (held back for stop strings)
        self._emitted: list[str] = []  # the deltas returned so far
        self._num_released = 0  # characters returned or about to be (before _pending)
        self._num_consumed = 0  # output ids consumed, stop tokens included
        self.stop_string: str | None = None

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later updates return nothing."""
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """All text returned so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

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

        Raises whatever the tokenizer raises for an id it cannot decode (OverflowError
        for a negative id); an id past the vocabulary decodes to "" in `tokenizers`.
        """
        if self.finished:
            return DetokenizedDelta("")
        out: list[str] = []
        decode_ids = list(new_token_ids)
        if stop_terminated and decode_ids:
            decode_ids.pop()
        consumed: list[int] = []
        for token_id in decode_ids:
            consumed.append(token_id)
            self._ids.append(token_id)
            if self._add_text(self._decode_window(), out):
                break
        if not self.finished:
            if stop_terminated and new_token_ids:
                consumed.append(new_token_ids[-1])
            if finished:
                self._flush(out)
        self._num_consumed += len(consumed)
        text = "".join(out)
        if text:
            self._emitted.append(text)
        return DetokenizedDelta(text, consumed, self.stop_string)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self) -> str:
        """The newly complete characters of the window (and slide or cut it)."""
        window = self._decode(self._ids[self._prefix_offset :])
        stable = window.rstrip(_REPLACEMENT_CHAR)
        done = len(self._prefix_text) + self._window_done
        new = ""
        if len(stable) > done:
            new = stable[done:]
            self._window_done = len(stable) - len(self._prefix_text)
        if len(stable) == len(window) and (
            len(window) > len(self._prefix_text)
            or len(self._ids) - self._read_offset > MAX_PENDING_TOKENS
        ):
            # The window ends on a complete character (or only tokens decoding to ""
            # came): slide it so it stays short.
            self._slide(self._read_offset, len(self._ids))
        elif len(self._ids) - self._read_offset > MAX_PENDING_TOKENS:
            new += self._cut_window(window, done + len(new))
        return new

    def _slide(self, prefix_offset: int, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = prefix_offset, read_offset
        self._prefix_text = self._decode(self._ids[prefix_offset:read_offset])
        self._window_done = 0

    def _cut_window(self, window: str, done: int) -> str:
        """The window ends in U+FFFD after too many tokens: keep only the tokens after the
        latest clean split point (their bytes may still complete a character), release
        the text before it, U+FFFD included. Returns that text."""
        ids, p = self._ids, self._prefix_offset
        cut = len(ids)  # no clean split: release everything (hostile ids only)
        for b in range(len(ids) - 1, self._read_offset, -1):
            head = self._decode(ids[p:b])
            if head + self._decode(ids[b:]) == window:
                cut = b
                break
        head = window if cut == len(ids) else self._decode(ids[p:cut])
        new = head[done:]
        # Restart the window at the cut, with no left context: `cut` is a point where
        # decoding splits cleanly, so nothing after it depends on what came before.
        self._prefix_offset = self._read_offset = cut
        self._prefix_text = ""
        self._window_done = max(0, done - len(head))  # chars after the cut already taken
        return new

    def _add_text(self, new: str, out: list[str]) -> bool:
        """Append decoded text: cut it at a stop match (True), else move what cannot be
        part of a stop string to `out`."""
        if not new:
            return False
        self._pending += new
        if self._matcher is None:
            self._release(len(self._pending), out)
            return False
        match = self._matcher.feed(new)
        if match is not None:
            self._release(match.start - self._num_released, out)
            self._pending = ""
            self.stop_string = self._matcher.stop_string(match)
            return True
        self._release(len(self._pending) - self._matcher.hold, out)
        return False

    def _release(self, n: int, out: list[str]) -> None:
        """Move the first n characters of `_pending` to `out`."""
        if n > 0:
            out.append(self._pending[:n])
            self._pending = self._pending[n:]
            self._num_released += n

    def _flush(self, out: list[str]) -> None:
        """At the finish: release the incomplete UTF-8 tail and any stop prefix."""
        window = self._decode(self._ids[self._prefix_offset :])
        done = len(self._prefix_text) + self._window_done
        if not self._add_text(window[done:], out):
            self._release(len(self._pending), out)
