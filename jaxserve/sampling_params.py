"""SamplingParams: what a request asks of the sampler and of the stop logic.

Shared by the offline `LLM` API, the gRPC frontend and the engine. Plain data, no JAX.
Field names and meanings follow vLLM's `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters.

    temperature: 0 means greedy; > 0 scales logits.
    top_k: keep the k most likely tokens; -1 disables.
    top_p: nucleus sampling, in (0, 1]; 1 disables.
    min_p: drop tokens with probability < min_p * max probability; 0 disables.
    seed: per-request RNG seed; the same seed gives the same tokens whatever else is batched.
    max_tokens: most output tokens (>= 1).
    stop: strings that end the output; the match is not returned.
    stop_token_ids: token ids that end the output (the token is not part of the text).
    ignore_eos: keep going past the EOS token.
    skip_special_tokens: drop special tokens from the text.
    repetition_penalty / presence_penalty / frequency_penalty: as in vLLM (1.0 / 0 / 0 disable).
    logit_bias: token id -> additive bias on the logit.
    n: number of samples for the prompt.
    logprobs: return the log-prob of each chosen token and of the top-N alternatives (None: off).
    prompt_logprobs: return log-probs of the prompt tokens, with top-N alternatives (None: off).
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError whose message starts with the offending field's name."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number, got {getattr(self, name)}")
        if not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise ValueError("logit_bias: biases must be finite numbers")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k: must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty: must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty: must be in [-2, 2], got {self.frequency_penalty}")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        for s in self.stop:
            if not s:
                raise ValueError("stop: stop strings must be non-empty")
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not (0 <= k <= 20):
                raise ValueError(f"{name}: must be in [0, 20], got {k}")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids: token id {t} outside [0, {vocab_size})")
            for t in self.logit_bias:
                if not 0 <= int(t) < vocab_size:
                    raise ValueError(f"logit_bias: token id {t} outside [0, {vocab_size})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        d = dict(d)
        if "logit_bias" in d:
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
        return cls(**d)
