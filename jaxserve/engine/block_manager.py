"""`BlockManager`: the pool of KV blocks, their reference counts, and the prefix cache.

Owns which block ids are free, which are held by which sequence (through the
sequence's block table), and which full blocks are named by a prefix hash so that
later requests can reuse them. It does not decide who runs (the scheduler does) and
never touches device memory (the model runner does).

The design follows vLLM v1's KV cache manager (`vllm/v1/core/block_pool.py`):
- Block 0 is the null block (models/base.py) and is never handed out.
- A block is *free* when no sequence references it (ref count 0). Free blocks wait in
  one LRU queue; a free block may still carry a prefix hash ("cached free"), and a
  lookup that hits it takes it out of the queue again. Allocation pops from the LRU
  end and evicts the popped block's hash, so a block in use is never evicted.
- A sequence's blocks are freed tail first, so its last (least shared) blocks are the
  first to be evicted.
- Full blocks are named once the step that computes their K/V has been dispatched
  (`register_computed`, called by the scheduler after it schedules that step): the
  device runs steps in order, so any step that can hit the name runs after the writes.
  That includes a prompt's partial last block and the blocks its outputs fill while it
  decodes (vLLM caches them too): the next turn of a chat, whose prompt is this prompt
  plus its answer, hits them.
- KV events for the router: an optional `events` log (`engine.kv_events.KvEventLog`,
  attached by the engine process) hears every name given and dropped; None: no cost.
- The n samples of one prompt carry a `cache_group`: with prefix caching off, their
  blocks are still named, with the group as an extra hash key, so the samples share the
  prompt's blocks with one another and with no other request.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.engine.block_hash import BlockHash, hash_block
from jaxserve.engine.request import Request

NULL_BLOCK = 0


class BlockManager:
    """Allocates KV blocks to sequences and keeps the prefix cache.

    Args:
        num_blocks: total blocks in the KV cache, including the null block (>= 2).
        block_size: tokens per block.
        enable_prefix_caching: name full blocks by their chained hash and reuse them.

    Raises:
        ValueError: num_blocks < 2 or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # hash -> block id, for every named block (in use or cached free).
        self.cached_blocks: dict[BlockHash, int] = {}
        # Free blocks in LRU order: the first key is evicted first.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.num_evictions = 0
        self.events = None  # a kv_events.KvEventLog, or None

    # ----- sizes -------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, cached or not (cached ones are evictable)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ----- prefix cache ------------------------------------------------------------------

    def caches(self, seq: Request) -> bool:
        """Whether seq's full blocks are named and looked up (globally, or in its group)."""
        return self.enable_prefix_caching or seq.cache_group is not None

    def full_block_hashes(self, seq: Request) -> list[BlockHash]:
        """The chained hashes of every full block of seq.token_ids (cached on the sequence).

        Pending tokens (not yet sampled) are not part of token_ids, so their blocks are
        not named until they arrive.
        """
        hashes = seq.block_hashes
        bs = self.block_size
        extra = () if self.enable_prefix_caching or seq.cache_group is None else (seq.cache_group,)
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def lookup_prefix(self, seq: Request) -> list[int]:
        """Block ids holding the longest cached prefix of seq.token_ids.

        At least one token is always left uncached: the step needs a query token to
        produce the logits that sample the next token. A sequence that still needs prompt
        log-probs gets no hit: they come from the logits of every prompt position. Pure:
        ref counts do not change until `allocate` takes the blocks.
        """
        if not self.caches(seq) or seq.num_prompt_logprobs_missing > 0:
            return []
        hit: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for block_hash in self.full_block_hashes(seq)[:max_blocks]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def register_computed(self, seq: Request) -> None:
        """Name the sequence's full blocks whose K/V are computed by dispatched steps and
        whose tokens are known (see the module docstring).

        When another block already carries the same name (two requests computed the
        same prefix at once), this block stays unnamed: the first copy serves hits.
        """
        if not self.caches(seq):
            return
        num_known = min(seq.num_computed_tokens, seq.num_tokens)
        num_full = min(num_known // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self.full_block_hashes(seq)
        named = []
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            if self.block_hash[block] is None and hashes[i] not in self.cached_blocks:
                self.block_hash[block] = hashes[i]
                self.cached_blocks[hashes[i]] = block
                named.append(i)
        seq.num_registered_blocks = num_full
        if self.events is not None and named and self.enable_prefix_caching:
            self.events.stored(hashes, named)

    def reset_prefix_cache(self) -> int:
        """Forget the names of all free blocks (blocks in use keep theirs). Returns how many."""
        dropped = 0
        for block in self.free_queue:
            if self._drop_hash(block):
                dropped += 1
        return dropped

    # ----- allocation --------------------------------------------------------------------

    def can_allocate(self, seq: Request, num_tokens: int, cached: list[int] = ()) -> bool:
        """Whether `allocate(seq, num_tokens, cached)` would succeed."""
        need = self.blocks_for(num_tokens) - len(seq.block_table) - len(cached)
        # Cached hits that sit in the free queue stop being free once taken.
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        return max(need, 0) + revived <= len(self.free_queue)

    def allocate(self, seq: Request, num_tokens: int, cached: list[int] = ()) -> bool:
        """Grow seq.block_table to hold its first `num_tokens` tokens.

        Args:
            seq: the sequence; `cached` (from `lookup_prefix`) is appended first, then
                fresh blocks from the LRU end of the free queue.
            num_tokens: tokens the table must cover after this call (computed + new).
            cached: prefix-cache hits; only valid on a sequence with an empty block table.

        Returns:
            False (and changes nothing) when there are not enough free blocks.
        """
        if cached and seq.block_table:
            raise ValueError("cached: prefix hits can only start an empty block table")
        if not cached and -(-num_tokens // self.block_size) <= len(seq.block_table):
            return True  # the table already covers them (most decode steps)
        if not self.can_allocate(seq, num_tokens, cached):
            return False
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        if cached:  # hits are named already; the table's other blocks are named when
            # full and computed (`register_computed`), decode-filled ones included
            seq.block_table.extend(cached)
            seq.num_registered_blocks = len(cached)
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            block, _ = self.free_queue.popitem(last=False)
            if self._drop_hash(block):
                self.num_evictions += 1
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Request) -> None:
        """Release all of seq's blocks (tail first, so tails are evicted first)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _drop_hash(self, block: int) -> bool:
        block_hash = self.block_hash[block]
        if block_hash is None:
            return False
        self.block_hash[block] = None
        if self.cached_blocks.get(block_hash) == block:
            del self.cached_blocks[block_hash]
            if self.events is not None and self.enable_prefix_caching:
                self.events.removed([block_hash])
        return True
