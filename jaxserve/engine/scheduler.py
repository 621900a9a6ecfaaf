"""`Scheduler`: which sequences compute how many tokens in the next step, on every dp rank.

Continuous batching under two limits per step, `max_num_batched_tokens` (the token
budget) and `max_num_seqs`, in the style of vLLM v1's scheduler
(`vllm/v1/core/sched/scheduler.py`): there is no prefill or decode phase, only a number
of tokens each sequence still has to compute. One step:

1. Running sequences that are decoding (one missing token) are scheduled first, oldest
   first, so a long prompt being prefilled never stalls them; then running sequences
   still in (chunked) prefill take what is left of the budget.
2. When a running sequence needs a KV block and none is free, the newest running
   sequence is preempted by recompute: its blocks are freed and it goes back to the
   head of the waiting queue (Kwon et al., "Efficient Memory Management for Large
   Language Model Serving with PagedAttention", SOSP 2023, section 4.5).
3. If nothing was preempted, waiting sequences are admitted in FCFS order, reusing
   prefix-cached blocks, with their prompt chunked to fit the remaining budget
   (admission.py: which requests join a step, and which never can).

4. A step is committed when it is scheduled: each row's `num_computed_tokens` advances
   and the tokens it will sample count as pending (request.py), so the engine can
   schedule step N+1 while the device runs step N. A sequence whose pending tokens
   already reach max_tokens or max_model_len is not scheduled again.
5. Multi-step decode: when every running sequence is decoding and nothing waiting could
   be admitted, a step may run `num_decode_steps` decode steps in one device call (KV
   blocks are allocated for all of them up front, as vLLM's multi-step scheduling
   allocates lookahead slots).

After the device step, `update` appends the sampled tokens, checking the stop conditions
after every token (tokens sampled past a stop are discarded), and returns the
`TokenOutput`s. Aborts and requests that can never fit end with one final output on
the next `update` (or `drain_finished`). Pure Python: no JAX, no sockets, no text.

Ranks. With DP attention each dp rank has its own requests and its own KV cache (a
`Rank`, rank.py; one device is one rank). A request is assigned to a rank when it
arrives and stays there (`rank.pick_rank`). The budgets (max_num_seqs,
max_num_batched_tokens) and the steps above apply per rank. Every step is one device
call for all ranks, so their decisions share the number of decode steps (multi-step
decode only when every busy rank wants it); the input builder pads every rank to the
busiest one's bucket (`step_shapes.StepBuckets.shape_for`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

from jaxserve.engine import admission
from jaxserve.engine.block_hash import BlockHash
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.outputs import (
    StepSamples,
    add_prompt_logprobs,
    request_output,
    row_logprobs,
)
from jaxserve.engine.rank import Rank, pick_rank
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.ipc import TokenOutput

__all__ = ["Rank", "ScheduledRequest", "Scheduler", "SchedulerOutput", "StepSamples"]


class Scheduler:
    """Continuous-batching scheduler over one `BlockManager` per dp rank.

    Args:
        block_managers: the KV block pools, one per dp rank (a single `BlockManager`:
            one rank), all of one size and block size.
        max_num_seqs: most running sequences (and rows per step) of one rank.
        max_num_batched_tokens: token budget per step of one rank.
        max_model_len: most tokens (prompt + output) of one sequence.
        eos_token_ids: the model's end-of-sequence ids (honoured unless ignore_eos).
        enable_chunked_prefill: split prompts over steps; when off, a prompt waits until
            it fits the step's budget whole.
        num_decode_steps: decode steps per multi-step device call (1 disables multi-step).
        decode_steps_for_rows: the decode steps of a multi-step call of n rows (of the
            busiest rank), when they depend on n (`InputBuilder.decode_steps_for_rows`);
            None: num_decode_steps. Called only while num_decode_steps > 1.

    Raises:
        ValueError: no block manager, or a limit out of range (named).

    Counters (monotonic, all ranks): num_preemptions, num_prefix_queries,
    num_prefix_hits, num_prefill_tokens_computed, num_decode_tokens_computed.
    """

    def __init__(
        self,
        block_managers: BlockManager | Sequence[BlockManager],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        enable_chunked_prefill: bool = True,
        num_decode_steps: int = 1,
        decode_steps_for_rows: Callable[[int], int] | None = None,
    ):
        if isinstance(block_managers, BlockManager):
            block_managers = [block_managers]
        if not block_managers:
            raise ValueError("block_managers: need one per dp rank, got none")
        if len({(bm.num_blocks, bm.block_size) for bm in block_managers}) != 1:
            raise ValueError("block_managers: every dp rank's pool must have one size")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_num_seqs ({max_num_seqs}), "
                f"got {max_num_batched_tokens}"
            )
        self.ranks = [Rank(k, bm) for k, bm in enumerate(block_managers)]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        if num_decode_steps < 1:
            raise ValueError(f"num_decode_steps: must be >= 1, got {num_decode_steps}")
        self.num_decode_steps = num_decode_steps
        self.decode_steps_for_rows = decode_steps_for_rows
        # Live (waiting or running) requests of every rank by id.
        self.requests: dict[str, Request] = {}
        self._finished: list[TokenOutput] = []
        self._arrivals = itertools.count()
        # Counters for the metrics layer (monotonic).
        self.num_preemptions = 0
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found cached
        self.num_prefill_tokens_computed = 0  # tokens computed by non-decode rows
        self.num_decode_tokens_computed = 0

    # ----- ranks and requests ------------------------------------------------------------

    @property
    def block_managers(self) -> list[BlockManager]:
        """The KV block pools, rank k's at [k]."""
        return [r.bm for r in self.ranks]

    @property
    def bm(self) -> BlockManager:
        """Rank 0's KV block pool (with one rank: the pool)."""
        return self.ranks[0].bm

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests, rank by rank (a copy)."""
        return [seq for r in self.ranks for seq in r.waiting]

    @property
    def running(self) -> list[Request]:
        """Running requests, rank by rank (a copy)."""
        return [seq for r in self.ranks for seq in r.running]

    @property
    def num_waiting(self) -> int:
        return sum(len(r.waiting) for r in self.ranks)

    @property
    def num_running(self) -> int:
        return sum(len(r.running) for r in self.ranks)

    @property
    def num_assigned(self) -> list[int]:
        """Requests ever assigned to each rank."""
        return [r.num_assigned for r in self.ranks]

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._finished)

    def max_blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a request needs at its longest (its final token is never computed)."""
        return admission.max_blocks_needed(
            self.bm, self.max_model_len, num_prompt_tokens, max_tokens
        )

    def add(self, seq: Request) -> None:
        """Assign seq to a rank (`pick_rank`) and queue it there; one that can never be
        served is finished with an error output.

        Raises:
            ValueError: seq.request_id is already live (a caller bug, not a bad request).
        """
        if seq.request_id in self.requests:
            raise ValueError(f"request_id: {seq.request_id!r} is already running")
        rank = self.ranks[self.pick_rank(seq)]
        rank.num_assigned += 1
        seq.rank = rank.index
        seq.arrival_seq = next(self._arrivals)
        seq.status = RequestStatus.WAITING
        error = admission.unservable(
            seq,
            self.bm,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=self.enable_chunked_prefill,
        )
        if error is not None:
            seq.status = RequestStatus.FINISHED
            seq.finish_reason, seq.error = "error", error
            self._finished.append(request_output(seq, []))
            return
        self.requests[seq.request_id] = seq
        rank.waiting.append(seq)

    def pick_rank(self, seq: Request) -> int:
        """The rank seq would join now (`rank.pick_rank`)."""
        return pick_rank(self.ranks, seq)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish waiting or running requests with "abort"; unknown ids are ignored."""
        for request_id in request_ids:
            seq = self.requests.get(request_id)
            if seq is None:
                continue
            rank = self.ranks[seq.rank]
            if seq.status is RequestStatus.WAITING:
                rank.waiting.remove(seq)
            else:
                rank.running.remove(seq)
            self._finish(seq, "abort")
            self._finished.append(request_output(seq, []))

    def drain_finished(self) -> list[TokenOutput]:
        """Final outputs of aborted and rejected requests since the last call."""
        out, self._finished = self._finished, []
        return out

    # ----- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide and commit the next step of every rank, with one num_steps (the least
        any busy rank wants, `wanted_decode_steps`). Allocates (and may preempt) KV
        blocks; see the module doc. May be called again before `update` has seen the
        previous step."""
        for rank in self.ranks:
            for seq in rank.running:
                rank.bm.register_computed(seq)  # blocks of steps already dispatched
        out = SchedulerOutput(num_steps=self.wanted_decode_steps())
        for rank in self.ranks:
            self._schedule_rank(rank, out)
        return out

    def _schedule_rank(self, rank: Rank, out: SchedulerOutput) -> None:
        """Append rank's rows of the step to `out` and commit them."""
        chunks: dict[Request, int] = {}
        budget, preempted = self._schedule_running(rank, chunks, out.num_steps)
        out.num_preempted += preempted
        if preempted == 0 and out.num_steps == 1:
            inflight: set[BlockHash] = set()
            for seq, n in chunks.items():
                admission.add_inflight(rank.bm, inflight, seq, seq.num_computed_tokens, n)
            admitted = admission.admit_waiting(
                rank,
                chunks,
                budget,
                inflight,
                max_num_seqs=self.max_num_seqs,
                chunked_prefill=self.enable_chunked_prefill,
            )
            for seq in admitted:
                self.num_prefix_queries += seq.num_tokens
                self.num_prefix_hits += seq.num_cached_tokens
        for seq, n in chunks.items():
            start = seq.num_computed_tokens
            item = ScheduledRequest(seq, start, n, start + n == seq.num_total_tokens)
            out.requests.append(item)
            self._commit(item, out.num_steps)

    def _commit(self, item: ScheduledRequest, num_steps: int) -> None:
        """Advance a scheduled row's sequence as if the step had already run."""
        seq = item.seq
        if num_steps > 1:
            seq.num_computed_tokens = item.start + num_steps
            seq.num_pending_tokens += num_steps
            self.num_decode_tokens_computed += num_steps
            return
        seq.num_computed_tokens = item.start + item.num_tokens
        if item.samples:
            seq.num_pending_tokens += 1
        if item.samples and item.num_tokens == 1 and item.start >= seq.num_prompt_tokens:
            self.num_decode_tokens_computed += 1
        else:
            self.num_prefill_tokens_computed += item.num_tokens

    def wanted_decode_steps(self) -> int:
        """The decode steps `schedule()` would choose now (see `_num_decode_steps`)."""
        busy = [r for r in self.ranks if r.running or r.waiting]
        k = self.num_decode_steps
        if k > 1 and busy and self.decode_steps_for_rows is not None:
            k = self.decode_steps_for_rows(max(len(r.running) for r in busy))
        return min((self._num_decode_steps(r, k) for r in busy), default=1)

    def _num_decode_steps(self, rank: Rank, k: int) -> int:
        """k (the call's decode steps) when every schedulable running sequence of rank is
        decoding, has room for that many more positions (max_model_len) and can use the
        multi-step call, and nothing waiting could be admitted instead; else 1.

        A sequence with fewer than that many tokens left before max_tokens does not
        force single steps on the batch: the call samples past its limit and `update`
        discards the surplus, as it does past a stop token (the KV it wrote lies in
        blocks allocated for the call and freed with the sequence). Otherwise, with
        equal max_tokens, every batch ended in num_decode_steps - 1 single-step calls,
        each costing about as much as a multi-step one at batch 1 on the CPU."""
        if k == 1 or not rank.running:
            return 1
        if rank.waiting and len(rank.running) < self.max_num_seqs:
            return 1
        candidates = [s for s in rank.running if not self._pending_reach_limit(s)]
        if not candidates or len(candidates) > self.max_num_batched_tokens:
            return 1
        for seq in candidates:
            if (
                seq.single_step_only
                or seq.num_missing_tokens != 1
                or seq.num_total_tokens + k > self.max_model_len
            ):
                return 1
        return k

    def _pending_reach_limit(self, seq: Request) -> bool:
        """Whether the tokens already scheduled end seq by max_tokens or max_model_len."""
        return seq.num_pending_tokens > 0 and (
            seq.num_output_tokens + seq.num_pending_tokens >= seq.params.max_tokens
            or seq.num_total_tokens >= self.max_model_len
        )

    def _schedule_running(
        self, rank: Rank, chunks: dict[Request, int], num_steps: int
    ) -> tuple[int, int]:
        """Schedule rank's running sequences into `chunks`; returns (budget left,
        sequences preempted)."""
        budget, preempted = self.max_num_batched_tokens, 0
        # Decodes (1 missing token) before prefill chunks; oldest first within each.
        order = sorted(rank.running, key=lambda s: (s.num_missing_tokens > 1, s.arrival_seq))
        for seq in order:
            if budget == 0:
                break
            if seq.status is not RequestStatus.RUNNING or self._pending_reach_limit(seq):
                continue  # preempted earlier in this loop, or nothing left to compute
            n = min(seq.num_missing_tokens, budget)
            # A multi-step decode writes the K/V of num_steps tokens (n == 1 there).
            span = n if num_steps == 1 else num_steps
            while not rank.bm.allocate(seq, seq.num_computed_tokens + span):
                victim = max(rank.running, key=lambda s: s.arrival_seq)
                budget += chunks.pop(victim, 0)
                self._preempt(rank, victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                chunks[seq] = n
                budget -= n
        return budget, preempted

    def _preempt(self, rank: Rank, seq: Request) -> None:
        rank.running.remove(seq)
        rank.bm.free(seq)
        seq.status = RequestStatus.WAITING
        seq.num_computed_tokens = 0
        # A token still in flight for it is dropped: recomputing gives the same one (its
        # RNG step is the number of output tokens before it).
        seq.num_pending_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Head of the queue: it arrived before everything still waiting (FCFS).
        rank.waiting.appendleft(seq)

    def update(self, sched: SchedulerOutput, samples: StepSamples) -> list[TokenOutput]:
        """Apply a finished step: append samples, stop, emit.

        Args:
            sched: the decision `schedule` returned for this step.
            samples: the sampler's outputs, row r for sched.requests[r] (all ranks).

        Returns:
            Outputs for every request that got a token or finished (aborts included).
        """
        outputs = self.drain_finished()
        # Each row's tokens as Python ints in one conversion (not one NumPy scalar each).
        row_tokens = samples.token_ids.T.tolist()
        for row, item in enumerate(sched.requests):
            seq = item.seq
            if seq.status is not RequestStatus.RUNNING:
                continue  # finished, aborted or preempted after this step was scheduled
            rank = self.ranks[seq.rank]
            add_prompt_logprobs(seq, samples.prompt_logprobs.get(row))
            if not item.samples:
                rank.bm.register_computed(seq)
                continue
            new_tokens: list[int] = []
            for token in row_tokens[row]:
                seq.num_pending_tokens -= 1
                seq.append_token(token)
                new_tokens.append(token)
                self._check_stop(seq, token)
                if seq.finish_reason is not None:
                    break  # tokens sampled past a stop are discarded
            rank.bm.register_computed(seq)
            if seq.finish_reason is not None:
                rank.running.remove(seq)
                self._finish(seq, seq.finish_reason)
            logprobs = row_logprobs(seq, samples, row, len(new_tokens))
            outputs.append(request_output(seq, new_tokens, logprobs))
        return outputs

    # ----- finishing ---------------------------------------------------------------------

    def _check_stop(self, seq: Request, token: int) -> None:
        """Set finish_reason/stop_reason: stop tokens win over length limits."""
        params = seq.params
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _finish(self, seq: Request, reason: str) -> None:
        self.ranks[seq.rank].bm.free(seq)
        seq.num_pending_tokens = 0
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
