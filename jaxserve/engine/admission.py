"""Admission: which waiting requests join the next step, and which never can.

`admit_waiting` takes a rank's waiting requests in FCFS order while the step has budget
and the rank has room (max_num_seqs), reusing prefix-cached blocks and chunking a prompt
to the remaining budget (or leaving it waiting, with chunked prefill off). A request
whose next uncached block is being computed by another row in this step waits a step and
then reuses it, so identical prompts arriving together share KV (`add_inflight`,
`next_block_inflight`). `unservable` names why a request can never be served. Called by
the scheduler (scheduler.py), which owns the step; pure Python, no counters.
"""

from __future__ import annotations

from jaxserve.engine.block_hash import BlockHash
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.rank import Rank
from jaxserve.engine.request import Request, RequestStatus


def max_blocks_needed(
    bm: BlockManager, max_model_len: int, num_prompt_tokens: int, max_tokens: int
) -> int:
    """KV blocks of bm a request needs at its longest (its final token is never computed)."""
    longest = min(num_prompt_tokens + max_tokens, max_model_len)
    return bm.blocks_for(longest - 1)


def unservable(
    seq: Request,
    bm: BlockManager,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    chunked_prefill: bool,
) -> str | None:
    """Why seq can never be served by a pool like bm (the error, naming the field), or None."""
    if seq.num_prompt_tokens >= max_model_len:
        return (
            f"prompt: {seq.num_prompt_tokens} tokens leave no room for output within "
            f"max_model_len={max_model_len}"
        )
    need = max_blocks_needed(bm, max_model_len, seq.num_prompt_tokens, seq.params.max_tokens)
    if need > bm.num_usable_blocks:
        return (
            f"max_tokens: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
            f"({seq.params.max_tokens}) needs {need} KV blocks but the cache has only "
            f"{bm.num_usable_blocks}"
        )
    if not chunked_prefill and seq.num_prompt_tokens > max_num_batched_tokens:
        return (
            f"prompt: {seq.num_prompt_tokens} tokens exceed max_num_batched_tokens="
            f"{max_num_batched_tokens} with chunked prefill disabled"
        )
    return None


def admit_waiting(
    rank: Rank,
    chunks: dict[Request, int],
    budget: int,
    inflight: set[BlockHash],
    *,
    max_num_seqs: int,
    chunked_prefill: bool,
) -> list[Request]:
    """Move rank's waiting requests that fit (FCFS) to running, with their first chunk.

    Args:
        rank: the dp rank; its waiting queue and running list are updated.
        chunks: the step's rows so far, request -> tokens to compute; admitted requests
            are added.
        budget: tokens left in the step.
        inflight: names of the blocks the step's rows complete; admitted rows add theirs.
        max_num_seqs: most running requests of the rank.
        chunked_prefill: whether a prompt may be split to fit the budget.

    Returns:
        The admitted requests, in admission order (each with num_cached_tokens set).
    """
    bm = rank.bm
    admitted: list[Request] = []
    while rank.waiting and budget > 0 and len(rank.running) < max_num_seqs:
        seq = rank.waiting[0]
        cached = bm.lookup_prefix(seq)
        if next_block_inflight(bm, seq, len(cached), inflight):
            break  # another row computes that block now: reuse it from the next step
        num_cached = len(cached) * bm.block_size
        n = seq.num_tokens - num_cached
        if n > budget:
            if not chunked_prefill:
                break
            n = budget
        if not bm.allocate(seq, num_cached + n, cached):
            break
        rank.waiting.popleft()
        seq.status = RequestStatus.RUNNING
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        admitted.append(seq)
        rank.running.append(seq)
        chunks[seq] = n
        budget -= n
        add_inflight(bm, inflight, seq, num_cached, n)
    return admitted


def add_inflight(
    bm: BlockManager, inflight: set[BlockHash], seq: Request, start: int, n: int
) -> None:
    """Add the names of the full blocks that computing tokens [start, start + n) completes."""
    if not bm.caches(seq):
        return
    bs = bm.block_size
    hashes = bm.full_block_hashes(seq)
    inflight.update(hashes[start // bs : (start + n) // bs])


def next_block_inflight(
    bm: BlockManager, seq: Request, num_hit: int, inflight: set[BlockHash]
) -> bool:
    """Whether seq's first uncached block is being computed by another row this step.

    Identical prompts that arrive together (n > 1 samples, a shared system prompt)
    would otherwise all compute the shared prefix; instead the later ones wait for the
    first one's blocks, as a radix-tree scheduler (SGLang) does.
    """
    if not inflight or num_hit >= (seq.num_tokens - 1) // bm.block_size:
        return False
    return bm.full_block_hashes(seq)[num_hit] in inflight
