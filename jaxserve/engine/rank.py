"""`Rank`: one dp rank's share of the scheduler, and which rank a new request joins.

With DP attention (README.md, Parallelism) each dp rank has its own requests and its own
KV cache: a `Rank`, with its own `BlockManager` (its own null block and prefix cache;
block ids are rank-local), waiting queue and running list; one device is one rank. A
request is assigned to a rank when it arrives and stays there (`Request.rank`):
`pick_rank` chooses the rank holding the longest cached prefix of its prompt, else the
least loaded one (fewest waiting + running requests), as SGLang's DP-attention
controller does with its "shortest queue" policy. Plain data and one choice: no
scheduling of steps here (scheduler.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.request import Request


@dataclass(slots=True, eq=False)
class Rank:
    """One dp rank's share of the scheduler: its KV block pool and its requests.

    index: k, the rank (`Request.rank` of its requests); bm: its `BlockManager`;
    waiting: its queue (FCFS, preempted requests at the head); running: admitted
    requests, in admission order; num_assigned: requests ever assigned to it.
    """

    index: int
    bm: BlockManager
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    num_assigned: int = 0


def pick_rank(ranks: Sequence[Rank], seq: Request) -> int:
    """The index of the rank with the longest cached prefix of seq, ties and misses to
    the least loaded (then the lowest index). ranks: not empty."""

    def key(rank: Rank) -> tuple[int, int, int]:
        hit = len(rank.bm.lookup_prefix(seq)) if rank.bm.caches(seq) else 0
        return (-hit, len(rank.waiting) + len(rank.running), rank.index)

    return min(ranks, key=key).index
