"""SamplingParams: what a request asks of the sampler and of the stop logic.

Shared by the offline `LLM` API, the gRPC frontend and the engine. Plain data, no JAX.
Field names and meanings follow vLLM's `SamplingParams`.

`SamplingParams.validate` is the single place where a request's parameters are checked,
against every limit the engine's sampler has (the limits live here, the sampler imports
them): the frontend, the offline `LLM` and `EngineCore.add_request` all call it, so a
request the sampler could not pack is rejected at the door with its field named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

# Most top log-probs a request may ask for (vLLM's default max_logprobs is 20); the
# sampler computes this many alternatives for every row.
MAX_LOGPROBS = 20
# Most logit_bias entries per request: the sampler's bias arrays are [rows, MAX_LOGIT_BIAS].
# (OpenAI documents no count limit, only the value range; 64 leaves room for the usual
# ban / boost lists.)
MAX_LOGIT_BIAS = 64
# A logit_bias value lies in [-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE], as OpenAI's
# API requires ("values from -100 to 100"); 100 already bans or forces a token.
MAX_LOGIT_BIAS_VALUE = 100.0
# The most samples one request may ask for (OpenAI's limit for `n`, also vLLM's default
# bound through its OpenAI server): each sample is a full engine request. The gRPC
# frontend and the offline LLM both enforce it (through `validate`).
MAX_N = 128
# The top_k values a request may give, in the words of every top_k error. 0 also means
# "disabled", as in vLLM (its SamplingParams takes 0 or -1): validation turns it into -1.
TOP_K_ACCEPTED = "-1 or 0 (disabled) or >= 1"
# Stop strings: the detokenizer matches all of a request's stop strings with one automaton
# (O(1) per output character whatever their number), but building it costs O(total size)
# on the sidecar's single thread, so the lists are bounded. OpenAI allows 4 stop strings
# and TGI 4 by default; vLLM has no limit. These leave room for prompt-format stops.
MAX_STOP_STRINGS = 64  # entries in `stop`
MAX_STOP_STRING_CHARS = 256  # characters in one stop string
MAX_STOP_TOTAL_BYTES = 4096  # UTF-8 bytes of all stop strings together
# Entries in `stop_token_ids` (vLLM has no limit; models list a handful of EOS ids).
MAX_STOP_TOKEN_IDS = 128
# The sampler holds every float parameter as float32: larger magnitudes would overflow.
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest normal float32 (a top_p below it is raised to it: `validate`).
FLOAT32_TINY = float(np.finfo(np.float32).tiny)

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters.

    temperature: 0 means greedy; > 0 scales logits.
    top_k: keep the k most likely tokens; -1 or 0 disables (0 is stored as -1).
    top_p: nucleus sampling, in (0, 1]; 1 disables.
    min_p: drop tokens with probability < min_p * max probability; 0 disables.
    seed: per-request RNG seed; the same seed gives the same tokens whatever else is batched.
    max_tokens: most output tokens (>= 1); prompt + max_tokens must fit in the model's
        max_model_len (`check_lengths`), for the server and the offline LLM alike.
    stop: strings that end the output; the match is not returned. One string is taken
        as a list of one, as vLLM does (`SamplingParams(stop="\n")`). At most
        MAX_STOP_STRINGS, each non-empty and at most MAX_STOP_STRING_CHARS characters,
        MAX_STOP_TOTAL_BYTES UTF-8 bytes in all.
    stop_token_ids: token ids that end the output (the token is not part of the text); at
        most MAX_STOP_TOKEN_IDS.
    ignore_eos: keep going past the EOS token.
    skip_special_tokens: drop special tokens from the text.
    repetition_penalty / presence_penalty / frequency_penalty: as in vLLM (1.0 / 0 / 0 disable).
    logit_bias: token id -> additive bias on the logit (at most MAX_LOGIT_BIAS entries,
        each value in [-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE] = [-100, 100]).
    n: number of samples for the prompt, in [1, MAX_N].
    logprobs: return the log-prob of each chosen token and of the top-N alternatives (None: off).
    prompt_logprobs: return log-probs of the prompt tokens, with top-N alternatives (None: off).

    Every float must be finite with |x| <= FLOAT32_MAX (the sampler computes in float32).

    Validated at construction, as vLLM's SamplingParams is (`validate()` without a vocab
    size): a bad field raises ValueError naming it. Token ids are checked against the
    model's vocabulary by `validate(vocab_size)`, which the engine, the frontend and the
    offline LLM call once they know it. A field assigned after construction is checked
    by that call only.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # vLLM's `stop: str | list[str]`
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field against its range and the sampler's limits.

        Args:
            vocab_size: when given, token ids (stop_token_ids, logit_bias keys) must lie
                in [0, vocab_size).

        Raises:
            ValueError: whose message starts with the offending field's name
                ("logit_bias: at most 64 entries are supported, got 65").
        """
        self._validate_types()
        for name in _FLOAT_FIELDS:
            _check_float32(name, getattr(self, name))
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        # top_p and repetition_penalty must stay > 0 once cast to float32: a top_p of 0
        # keeps no token, and a penalty of 0 divides logits by zero.
        if not (0.0 < self.top_p <= 1.0 and np.float32(self.top_p) > 0.0):
            raise ValueError(f"top_p: must be in (0, 1] (and > 0 in float32), got {self.top_p}")
        # Below float32's smallest normal number top_p is 0 on the device (XLA's CPU
        # flushes denormals to zero), which kept no token and ended the request with an
        # empty text; so small a top_p means the most likely token, as FLOAT32_TINY does.
        self.top_p = max(self.top_p, FLOAT32_TINY)
        if self.top_k < -1:
            raise ValueError(f"top_k: must be {TOP_K_ACCEPTED}, got {self.top_k}")
        if self.top_k == 0:  # vLLM's "disabled"; the sampler's is -1 (all tokens)
            self.top_k = -1
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not (self.repetition_penalty > 0.0 and np.float32(self.repetition_penalty) > 0.0):
            raise ValueError(
                f"repetition_penalty: must be > 0 (and > 0 in float32), "
                f"got {self.repetition_penalty}"
            )
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty: must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty: must be in [-2, 2], got {self.frequency_penalty}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
        self._validate_stop()
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not (0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be in [0, {MAX_LOGPROBS}], got {k}")
        self._validate_logit_bias(vocab_size)
        if vocab_size is not None:
            self._check_stop_token_ids(vocab_size)

    def check_token_ids(self, vocab_size: int) -> None:
        """What `validate(vocab_size)` adds to `validate()`, for parameters that passed
        `validate()` (e.g. built by `from_dict`): logit_bias keys, then stop_token_ids,
        in [0, vocab_size). On such parameters it raises exactly what `validate(vocab_size)`
        would, at a fraction of the cost (the engine checks every request at the door).

        Raises:
            ValueError: naming the first id outside the vocabulary (logit_bias.<id> or
                stop_token_ids[<i>]).
        """
        for token_id in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise ValueError(token_id_error(f"logit_bias.{token_id}", token_id, vocab_size))
        self._check_stop_token_ids(vocab_size)

    def _check_stop_token_ids(self, vocab_size: int) -> None:
        # Named by index and by key (stop_token_ids[0], logit_bias.5), as the HTTP API
        # names them by their JSON path.
        for i, t in enumerate(self.stop_token_ids):
            if not 0 <= t < vocab_size:
                raise ValueError(token_id_error(f"stop_token_ids[{i}]", t, vocab_size))

    def _validate_types(self) -> None:
        """Integers where the sampler indexes or counts with them, numbers where it
        computes with them: anything else would fail later, inside an engine step."""
        for name in ("top_k", "max_tokens", "n"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Real):
                raise ValueError(f"{name}: must be a number, got {value!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop: must be a list of strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias: must map token ids to biases, got {self.logit_bias!r}")

    def _validate_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop: at most {MAX_STOP_STRINGS} stop strings are supported, got {len(self.stop)}"
            )
        total = 0
        for i, s in enumerate(self.stop):
            # Named by index (stop[0]), as the HTTP API's `param` must name it exactly.
            if not s:
                raise ValueError(f"stop[{i}]: stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop[{i}]: the stop string has {len(s)} characters, "
                    f"at most {MAX_STOP_STRING_CHARS} are supported"
                )
            total += len(s.encode("utf-8", "surrogatepass"))
        if total > MAX_STOP_TOTAL_BYTES:
            raise ValueError(
                f"stop: the stop strings total {total} UTF-8 bytes, "
                f"at most {MAX_STOP_TOTAL_BYTES} are supported"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids are supported, "
                f"got {len(self.stop_token_ids)}"
            )

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(logit_bias_count_error(len(self.logit_bias)))
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id)
            # Named by its key (logit_bias.5), as the HTTP API's body path.
            name = f"logit_bias.{token_id}"
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise ValueError(token_id_error(name, token_id, vocab_size))
            if not isinstance(bias, Real):
                raise ValueError(f"{name}: the bias of token {token_id} is not a number")
            _check_float32(name, bias, f"the bias of token {token_id}")
            if not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
                raise ValueError(
                    f"{name}: the bias of token {token_id} must be in "
                    f"[{-MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {bias}"
                )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """SamplingParams from `to_dict`'s output (logit_bias keys may be strings, as
        after a JSON round trip), validated as at construction (`validate()`): token ids
        against a vocabulary are left to `check_token_ids`.

        Raises:
            TypeError: an unknown field.
            ValueError: a logit_bias key or value that is not a number (named).
        """
        d = dict(d)
        if "logit_bias" in d:
            try:
                d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError(f"logit_bias: must map token ids to numbers ({e})") from None
        return cls(**d)


def logit_bias_count_error(count: int) -> str:
    """The message of a logit_bias map past MAX_LOGIT_BIAS entries (the gRPC and HTTP
    frontends check the count before reading the map, with these words)."""
    return f"logit_bias: at most {MAX_LOGIT_BIAS} entries are supported, got {count}"


def token_id_error(field: str, token_id: int, vocab_size: int) -> str:
    """The message of a token id outside the vocabulary, in the same words wherever an id
    is checked (prompt, stop_token_ids, logit_bias; gRPC, HTTP, the offline LLM)."""
    return f"{field}: token id {token_id} outside the vocabulary [0, {vocab_size})"


def check_lengths(prompt_len: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """The length rules of a request, shared by the gRPC frontend and the offline LLM:
    the prompt leaves room for output, and prompt + max_tokens (when given) fits in
    max_model_len.

    Raises ValueError starting with "prompt:" or "max_tokens:".
    """
    if prompt_len >= max_model_len:
        raise ValueError(
            f"prompt: {prompt_len} tokens leave no room for output within "
            f"max_model_len {max_model_len}"
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
            f"exceeds max_model_len ({max_model_len})"
        )


def check_prompt_text(field: str, text: str, *, noun: str = "UTF-8") -> None:
    """Raise ValueError naming `field` when the str `text` has no UTF-8 encoding: a lone
    surrogate, as bytes decoded with surrogateescape (sys.stdin's invalid bytes) leave.
    Shared by the gRPC client and the offline LLM, where the tokenizer's or protobuf's
    own error for it would name no field.

    `noun` words the message "{field}: not valid {noun} text ({reason} at {index})":
    "UTF-8" where the text came from bytes, "Unicode" where a caller built the str.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        if 0xDC80 <= char <= 0xDCFF:  # surrogateescape's stand-in for an undecodable byte
            what = f"byte {bytes([char - 0xDC00])!r} is not UTF-8"
        else:
            what = f"a lone surrogate U+{char:04X}"
        raise ValueError(f"{field}: not valid {noun} text ({what} at {e.start})") from None


def _check_int(name: str, value: object) -> None:
    # bool is an Integral, but True is no count or id (SamplingParams(max_tokens=True)).
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name}: must be an integer, got {value!r}")


def _check_float32(name: str, value: float, what: str = "") -> None:
    """Raise ValueError naming `name` unless value is finite with |value| <= FLOAT32_MAX."""
    try:
        x = float(value)
    except OverflowError:  # an int beyond the float64 range
        x = math.inf
    if not (math.isfinite(x) and abs(x) <= FLOAT32_MAX):
        subject = f"{what} must be" if what else "must be"
        raise ValueError(
            f"{name}: {subject} a finite number within the float32 range "
            f"(|x| <= {FLOAT32_MAX:.8g}), got {value}"
        )
