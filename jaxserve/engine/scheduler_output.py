"""The scheduler's decision for one step (`SchedulerOutput`), row by row.

What `scheduler.Scheduler.schedule` returns and what the input builder packs
(`step_inputs.InputBuilder`); plain records, no scheduling logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step: compute token_ids[start : start + num_tokens] of `seq`.

    samples: whether this chunk reaches the end of seq.token_ids, so the logits at its
        last token give the sequence's next token (False for a partial prefill chunk).
    """

    seq: Request
    start: int
    num_tokens: int
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    """The decision for one step, every rank's rows: rank 0's first, each rank's in
    scheduling order (decodes first); a row's rank is `row.seq.rank`.

    num_steps: decode steps in this device call (> 1 only for a multi-step decode, where
        every row has num_tokens 1 and samples num_steps tokens).
    """

    requests: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        """Tokens per forward pass, all ranks (in a multi-step decode: per decode step)."""
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
