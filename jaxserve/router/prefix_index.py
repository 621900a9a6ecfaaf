"""`PrefixIndex`: which replica holds which full KV blocks, as a radix tree over block hashes.

The router's view of every engine replica's prefix cache, built from the replicas' KV
events (`jaxserve.engine.kv_events`) and snapshots. A block is named by its chained hash
(`jaxserve.engine.block_hash`: h_i covers every token up to the end of block i), so the
tree's node for a prefix of i+1 blocks is the node of h_i, and its parent is the node of
h_{i-1}. Each node holds the set of replicas that cache that block. This is the shape of
NVIDIA Dynamo's KV router index (`lib/llm/src/kv_router/indexer.rs`, `RadixTree`: nodes
keyed by block hash, one worker set per node, a lookup table from hash to node); because
the hashes are chained, a node is reached straight from its hash (one dict lookup per
block) instead of walking children, which also keeps a block whose parent the index never
saw (a stored event that overtook a resync) findable.

Matching a prompt: `match(hashes)` walks the prompt's block hashes in order and counts,
per replica, the leading blocks it caches; a replica drops out at its first missing
block (a later block without the earlier ones cannot be reused: the engine's lookup stops
at its first miss too). Cost: one dict lookup and a set intersection per matched block.

Nothing here touches a socket or JAX; `jaxserve.router.events` feeds it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from jaxserve.engine.block_hash import BlockHash

ReplicaId = Hashable


class _Node:
    __slots__ = ("block_hash", "parent", "children", "replicas")

    def __init__(self, block_hash: BlockHash | None, parent: _Node | None) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.children: dict[BlockHash, _Node] = {}
        self.replicas: set[ReplicaId] = set()


class PrefixIndex:
    """The cached full blocks of every replica, one radix tree shared by all of them.

    Replicas are any hashable ids (the router uses ints). All operations are
    idempotent: storing a block twice or removing an absent one changes nothing, so a
    snapshot may overlap the events around it.
    """

    def __init__(self) -> None:
        self._root = _Node(None, None)
        self._nodes: dict[BlockHash, _Node] = {}
        # replica -> the hashes it caches (for clear and for sizes).
        self._by_replica: dict[ReplicaId, set[BlockHash]] = {}

    # ----- sizes ---------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Distinct blocks cached by at least one replica (or kept as an inner node)."""
        return len(self._nodes)

    def num_blocks(self, replica: ReplicaId) -> int:
        """Blocks the index believes `replica` caches."""
        return len(self._by_replica.get(replica, ()))

    def replicas(self) -> list[ReplicaId]:
        """Replicas with at least one cached block."""
        return [r for r, blocks in self._by_replica.items() if blocks]

    def blocks(self, replica: ReplicaId) -> set[BlockHash]:
        """A copy of the hashes `replica` caches."""
        return set(self._by_replica.get(replica, ()))

    # ----- updates -------------------------------------------------------------------------

    def store(
        self, replica: ReplicaId, parent: BlockHash | None, block_hashes: Sequence[BlockHash]
    ) -> None:
        """`replica` cached the chain `block_hashes` (in block order) after `parent`.

        Args:
            replica: the replica's id.
            parent: hash of the block before block_hashes[0], or None if the chain starts a
                sequence. An unknown parent is accepted (the chain is found by its hashes).
            block_hashes: 16-byte chained hashes (`block_hash.hash_token_blocks`).
        """
        node = self._root if parent is None else self._nodes.get(parent, self._root)
        mine = self._by_replica.setdefault(replica, set())
        for block_hash in block_hashes:
            child = self._nodes.get(block_hash)
            if child is None:
                child = _Node(block_hash, node)
                node.children[block_hash] = child
                self._nodes[block_hash] = child
            child.replicas.add(replica)
            mine.add(block_hash)
            node = child

    def remove(self, replica: ReplicaId, block_hashes: Iterable[BlockHash]) -> None:
        """`replica` evicted these blocks. A node no replica caches and with no children
        is deleted, and so are its ancestors that become the same."""
        mine = self._by_replica.get(replica)
        if not mine:
            return
        for block_hash in block_hashes:
            if block_hash not in mine:
                continue
            mine.discard(block_hash)
            node = self._nodes[block_hash]
            node.replicas.discard(replica)
            self._prune(node)

    def clear(self, replica: ReplicaId) -> None:
        """Forget every block of `replica` (its cache was cleared, it died or restarted)."""
        mine = self._by_replica.pop(replica, None)
        if mine:
            for block_hash in mine:
                node = self._nodes.get(block_hash)
                if node is not None:
                    node.replicas.discard(replica)
                    self._prune(node)

    def _prune(self, node: _Node) -> None:
        while node is not self._root and not node.replicas and not node.children:
            parent = node.parent
            del self._nodes[node.block_hash]
            del parent.children[node.block_hash]
            node = parent

    # ----- lookup --------------------------------------------------------------------------

    def match(
        self, block_hashes: Sequence[BlockHash], replicas: Iterable[ReplicaId] | None = None
    ) -> dict[ReplicaId, int]:
        """The longest cached prefix of a prompt, in blocks, per replica.

        Args:
            block_hashes: the prompt's full-block chained hashes, in order.
            replicas: the replicas to report (default: every replica with blocks).

        Returns:
            {replica: number of leading blocks of `block_hashes` it caches}, with 0 for
            the replicas asked for that cache none of them.
        """
        wanted = list(self._by_replica) if replicas is None else list(replicas)
        matched = dict.fromkeys(wanted, 0)
        active = set(wanted)
        nodes = self._nodes
        for depth, block_hash in enumerate(block_hashes):
            node = nodes.get(block_hash)
            if node is None:
                break
            holders = node.replicas
            if not active <= holders:
                for replica in active - holders:
                    matched[replica] = depth
                active &= holders
                if not active:
                    return matched
        else:
            depth = len(block_hashes)
            for replica in active:
                matched[replica] = depth
            return matched
        for replica in active:
            matched[replica] = depth
        return matched
