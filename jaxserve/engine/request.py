"""`Request`: the engine's record of one request, from arrival to its final status.

A request (a sequence) is a token list (prompt, then sampled outputs) plus how much of it has its
K/V in the cache (`num_computed_tokens`) and where (`block_table`). The scheduler moves
it between WAITING and RUNNING and finishes it; the block manager fills its block table.
Plain data: no JAX, no scheduling decisions here.

There is no separate prefill/decode state (as in vLLM v1): each step a running sequence
computes some of its missing tokens; once none are missing, the step's logits at its
last token give the next token. The scheduler advances `num_computed_tokens` when it
schedules a step, not when the step returns, and counts the tokens a scheduled step will
sample as `num_pending_tokens` until they arrive: so the next step can be scheduled while
the device still runs this one (the pending token is then the next step's input,
supplied by the model runner). A preempted sequence simply forgets its computed tokens
and recomputes prompt + outputs later.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from jaxserve.engine.block_hash import BlockHash
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Request:
    """One request inside the engine. Identity (not value) equality: usable as a dict key.

    request_id: the caller's id, unique among live requests.
    token_ids: prompt followed by outputs so far.
    num_prompt_tokens: length of the prompt prefix of token_ids.
    params: the request's sampling and stopping parameters.
    seed: the resolved per-request RNG seed (drawn by the engine when params.seed is None).
    arrival_seq: admission order (FCFS position; larger = newer; preemption picks the largest).
    rank: the dp rank the scheduler assigned it to on arrival (its KV blocks live in that
        rank's pool; block ids are local to it). 0 with one rank.
    num_computed_tokens: tokens whose K/V are in the cache (a prefix of token_ids).
    block_table: KV block ids; block i holds tokens [i * block_size, (i + 1) * block_size).
    block_hashes: chained hashes of the full blocks of token_ids, filled lazily.
    num_registered_blocks: leading blocks of block_table already offered to the prefix cache.
    num_cached_tokens: prompt tokens found in the prefix cache at the last admission.
    num_pending_tokens: tokens that scheduled steps will sample but that have not arrived
        (they follow token_ids; see the module docstring).
    single_step_only: the request needs the sampler's token history (penalties) or
        prompt log-probs, which the multi-step decode call does not carry.
    prompt_logprobs: when params.prompt_logprobs is set, one entry per prompt token after
        the first, in ipc.TokenOutput.logprobs format ([logprob, [[id, logprob], ...]]).
    cache_group: extra key of this request's block names; requests with the same group
        (the n samples of one prompt) share blocks even with global prefix caching off.
    first_output_sent: whether an output (with its `first` header) already left the engine.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_seq: int = 0
    rank: int = 0
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    num_pending_tokens: int = 0
    single_step_only: bool = False
    prompt_logprobs: list | None = None
    cache_group: str | None = None
    num_preemptions: int = 0
    first_output_sent: bool = False
    first_scheduled_time: float | None = None  # time.time() of its first step (queue time)
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    _prompt_array: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> np.ndarray:
        """[P] int32, built once (the sampler's penalties read it every step)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.token_ids[: self.num_prompt_tokens], np.int32)
        return self._prompt_array

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus the pending ones that scheduled steps will sample."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_missing_tokens(self) -> int:
        """Tokens still to compute before this sequence can sample (1 while decoding)."""
        return self.num_total_tokens - self.num_computed_tokens

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt positions whose log-probs are still to compute (0 when not asked for)."""
        if self.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
