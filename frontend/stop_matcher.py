"""Streaming stop-string matching: one Aho-Corasick automaton over all of a request's stop
strings, fed the text one character at a time as the detokenizer produces it.

Cost: building is O(total characters of the stop strings) (bounded by the request limits
in `jaxserve.sampling_params`); feeding a character is amortized O(1), whatever the number
of stop strings, and the state says at once how much text to hold back (the longest
suffix of the text that is a proper prefix of a stop string: the depth of the state).
Pure Python, no I/O; used by `frontend.detokenizer.IncrementalDetokenizer`.

Algorithm: Aho & Corasick, "Efficient string matching: an aid to bibliographic search",
CACM 18(6), 1975 (goto / failure functions; here each state also keeps the longest stop
string that ends at it, found along its failure chain, with its lowest index in the list).

Why not a library: pyahocorasick and ahocorasick-rs search a whole string per call and
keep no state between calls, so they cannot say how long a prefix of a stop string the
text ends with (the hold-back), and the tail would have to be searched again per token.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    """A stop string found in the fed text.

    start: index (in characters fed since the matcher was made) where it begins.
    index: its position in the stop list (the lowest, if listed twice).
    """

    start: int
    index: int


class _Automaton:
    """The immutable automaton of one stop list (shared by the matchers of equal lists)."""

    __slots__ = ("goto", "fail", "depth", "out")

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal: list[int] = [-1]  # the stop ending exactly at this state, lowest index
        for index, s in enumerate(stops):
            state = 0
            for ch in s:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    terminal.append(-1)
                state = nxt
            if terminal[state] == -1:
                terminal[state] = index
        fail = [0] * len(goto)
        # out[state]: the longest stop string that is a suffix of the state's string
        # (index into `stops`), or -1. Longest first: it starts earliest.
        out = list(terminal)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != nxt else 0
                if out[nxt] == -1:
                    out[nxt] = out[fail[nxt]]
                queue.append(nxt)
        self.goto, self.fail, self.depth, self.out = goto, fail, depth, out


@functools.lru_cache(maxsize=32)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    # The n samples of a request (and repeated requests) share one stop list: build once.
    # An automaton at the request limits (4 KiB of stop strings) is ~4k states, ~1 MB:
    # 32 of them bound the cache's memory.
    return _Automaton(stops)


class StopMatcher:
    """Finds a request's stop strings in its text as it streams in.

    `feed(text)` returns the earliest-starting match that ends inside `text` (ties: the
    lowest index in the stop list), or None; `hold` is then the number of trailing
    characters that could still begin a stop string.

    Raises ValueError("stop: ...") on an empty stop string.
    """

    __slots__ = ("_a", "_stops", "_state", "_pos")

    def __init__(self, stops: Sequence[str]) -> None:
        stops = tuple(stops)
        if any(not s for s in stops):
            raise ValueError("stop: stop strings must be non-empty")
        self._stops = stops
        self._a = _automaton(stops)
        self._state = 0
        self._pos = 0  # characters fed so far

    @property
    def hold(self) -> int:
        """Length of the longest suffix of the fed text that is a proper prefix of a stop
        string (0 after a match is reported: the caller stops there)."""
        return self._a.depth[self._state]

    def stop_string(self, match: StopMatch) -> str:
        return self._stops[match.index]

    def feed(self, text: str) -> StopMatch | None:
        """Advance over `text`; O(len(text)) amortized, independent of the stop count."""
        a = self._a
        goto, fail, depth, out, stops = a.goto, a.fail, a.depth, a.out, self._stops
        state, pos = self._state, self._pos
        best: StopMatch | None = None
        for ch in text:
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            pos += 1
            found = out[state]
            if found != -1:
                start = pos - len(stops[found])
                if best is None or (start, found) < (best.start, best.index):
                    best = StopMatch(start, found)
            # A match ending later starts at or after pos - depth[state] (its part up to
            # here is a suffix of the text and a prefix of a stop string): past that point
            # none can start before `best` (or tie with it and come earlier in the list).
            if best is not None and pos - depth[state] > best.start:
                break
        self._state, self._pos = state, pos
        if best is not None:
            self._state = 0
        return best
