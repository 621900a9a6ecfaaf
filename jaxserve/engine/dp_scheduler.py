"""`DPScheduler`: one scheduler per attention data-parallel (dp) rank, kept in step.

With DP attention (README.md, Parallelism) each dp rank has its own requests and its own
KV cache: here, its own `Scheduler` and `BlockManager` (with its own null block and
prefix cache; block ids are rank-local). A request is assigned to a rank when it arrives
and stays there: the rank holding the longest cached prefix of its prompt, else the
least loaded one (fewest waiting + running requests), as SGLang's DP-attention
controller does with its "shortest queue" policy. Budgets (max_num_seqs,
max_num_batched_tokens) apply per rank.

Every step is one device call for all ranks, so their decisions must share a shape: the
ranks agree on the number of decode steps first (multi-step decode only when every busy
rank wants it), then the input builder pads each to the busiest rank's bucket
(`InputBuilder.common_shape`). With dp = 1 the engine uses a plain `Scheduler`.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable
from dataclasses import dataclass

from jaxserve.engine.outputs import StepSamples
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.ipc import RequestOutput


@dataclass(slots=True)
class DPSchedulerOutput:
    """One step's decisions, ranks[k] for dp rank k (all with the same num_steps)."""

    ranks: list[SchedulerOutput]

    @property
    def is_empty(self) -> bool:
        return all(s.is_empty for s in self.ranks)

    @property
    def num_steps(self) -> int:
        return self.ranks[0].num_steps


class DPScheduler:
    """The dp ranks' schedulers behind the one interface `EngineCore` uses.

    Args:
        ranks: one `Scheduler` per dp rank (each over its own `BlockManager`).

    Counters (sums over ranks): num_preemptions, num_prefix_queries, num_prefix_hits,
    num_prefill_tokens_computed, num_decode_tokens_computed; `num_assigned[k]`: requests
    ever assigned to rank k.
    """

    def __init__(self, ranks: list[Scheduler]):
        if not ranks:
            raise ValueError("ranks: need at least one scheduler")
        self.ranks = ranks
        self.num_assigned = [0] * len(ranks)

    # ----- requests ----------------------------------------------------------------------

    @property
    def requests(self) -> ChainMap[str, Request]:
        """Live requests of every rank by id (a read-only view)."""
        return ChainMap(*(s.requests for s in self.ranks))

    def add(self, seq: Request) -> None:
        """Assign seq to a rank (see the module doc) and queue it there.

        Raises:
            ValueError: seq.request_id is already live on some rank.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"request_id: {seq.request_id!r} is already running")
        rank = self.pick_rank(seq)
        self.num_assigned[rank] += 1
        self.ranks[rank].add(seq)

    def pick_rank(self, seq: Request) -> int:
        """The rank with the longest cached prefix of seq, ties and misses to the least
        loaded (then the lowest index)."""

        def key(k: int) -> tuple[int, int, int]:
            s = self.ranks[k]
            hit = len(s.bm.lookup_prefix(seq)) if s.bm.caches(seq) else 0
            return (-hit, s.num_waiting + s.num_running, k)

        return min(range(len(self.ranks)), key=key)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for s in self.ranks:
            s.abort(ids)

    def drain_finished(self) -> list[RequestOutput]:
        return [out for s in self.ranks for out in s.drain_finished()]

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.ranks)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.ranks)

    # ----- one step ----------------------------------------------------------------------

    def schedule(self) -> DPSchedulerOutput:
        """Every rank's decision for the next step, with one common num_steps."""
        busy = [s for s in self.ranks if s.running or s.waiting]
        num_steps = min((s.wanted_decode_steps() for s in busy), default=1)
        return DPSchedulerOutput([s.schedule(num_steps) for s in self.ranks])

    def update(self, sched: DPSchedulerOutput, samples: list[StepSamples]) -> list[RequestOutput]:
        """Apply a finished step; samples[k] holds rank k's rows."""
        outputs = []
        for s, decision, rank_samples in zip(self.ranks, sched.ranks, samples, strict=True):
            outputs += s.update(decision, rank_samples)
        return outputs

    # ----- counters ----------------------------------------------------------------------

    def _sum(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.ranks)

    @property
    def num_preemptions(self) -> int:
        return self._sum("num_preemptions")

    @property
    def num_prefix_queries(self) -> int:
        return self._sum("num_prefix_queries")

    @property
    def num_prefix_hits(self) -> int:
        return self._sum("num_prefix_hits")

    @property
    def num_prefill_tokens_computed(self) -> int:
        return self._sum("num_prefill_tokens_computed")

    @property
    def num_decode_tokens_computed(self) -> int:
        return self._sum("num_decode_tokens_computed")
