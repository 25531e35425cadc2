"""The prefix index: block hash -> the one physical block that holds that prefix's K/V.

This module is only the *index* (vLLM: ``BlockHashToBlockMap`` in ``vllm/v1/core/block_pool.py``); the refcounts,
the free queue and eviction live in :mod:`minienv.kv.kv_cache_manager`, which keeps the index in step with the
block pool. The index answers one question: "which block already holds the K/V of these tokens, after that exact
prefix, for this model?"

Every entry stores, next to its block id, the :class:`CachedBlockKey` the hash was computed from (parent hash,
the block's token ids, the extra key). A lookup returns a block only if the stored key *equals* the request's key,
so a hash collision — forced, like vLLM #12621's ``hash(None)``, or astronomically unlikely, like sha256's — can
only cost a cache miss, never wrong K/V. The check is one tuple comparison of ``block_size`` ints per hit block:
cheap next to computing the block, and it turns "the hash is good enough" from an argument into a guarantee.

Invariants (kept by :meth:`PrefixIndex.insert` / :meth:`PrefixIndex.remove`; the manager checks the rest):

1. at most one block per hash, and at most one hash per block (``_by_hash`` and ``_by_block`` are inverse maps);
2. an entry's hash is ``hash_block_tokens(key.parent_hash, key.token_ids, key.extra_key)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from minienv.kv.hashing import ROOT_HASH, BlockHash, hash_block_chain, hash_block_tokens, make_extra_key

__all__ = [
    "BlockHash", "CachedBlock", "CachedBlockKey", "PrefixCacheStats", "PrefixIndex", "ROOT_HASH", "hash_block_chain",
    "hash_block_tokens", "make_extra_key",
]


@dataclass(frozen=True, slots=True)
class CachedBlockKey:
    """Everything a block hash was computed from. Equal keys <=> the block's K/V are interchangeable."""

    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_key: bytes

    def block_hash(self) -> BlockHash:
        return hash_block_tokens(self.parent_hash, self.token_ids, self.extra_key)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One index entry: the block holding K/V for ``key``, under ``block_hash``."""

    block_id: int
    block_hash: BlockHash
    key: CachedBlockKey


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in **tokens**, like vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``.

    ``queries`` counts prompt tokens looked up, ``hits`` the ones served from cache (whole blocks only, and never a
    prompt's last token). Evictions count blocks whose cached K/V were dropped to make room, and their tokens.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens whose K/V came from the cache (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = self.evicted_blocks = self.evicted_tokens = 0


class PrefixIndex:
    """``block hash -> CachedBlock`` and its inverse, with a key check on every lookup. All operations O(1)."""

    __slots__ = ("_by_hash", "_by_block")

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def __iter__(self) -> Iterator[CachedBlock]:
        return iter(self._by_hash.values())

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._by_hash

    def get(self, block_hash: BlockHash, key: CachedBlockKey) -> int | None:
        """The block holding ``key``'s K/V, or None. A hash hit whose stored key differs is a miss (collision)."""
        entry = self._by_hash.get(block_hash)
        if entry is None or entry.key != key:
            return None
        return entry.block_id

    def entry_for_hash(self, block_hash: BlockHash) -> CachedBlock | None:
        return self._by_hash.get(block_hash)

    def entry_for_block(self, block_id: int) -> CachedBlock | None:
        return self._by_block.get(block_id)

    def insert(self, block_id: int, block_hash: BlockHash, key: CachedBlockKey) -> bool:
        """Index ``block_id`` under ``block_hash``; False (and no change) if the hash or the block is taken."""
        if block_hash in self._by_hash or block_id in self._by_block:
            return False
        entry = CachedBlock(block_id, block_hash, key)
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry  # invariant 1: the two maps stay inverse
        return True

    def remove(self, block_id: int) -> CachedBlock | None:
        """Drop ``block_id``'s entry (an eviction); return it, or None if the block was not indexed."""
        entry = self._by_block.pop(block_id, None)
        if entry is not None:
            del self._by_hash[entry.block_hash]  # invariant 1
        return entry

    def longest_prefix(
        self, token_ids: Sequence[int], block_size: int, extra_key: bytes, max_blocks: int
    ) -> tuple[list[int], list[BlockHash]]:
        """Blocks holding the longest cached run of full blocks of ``token_ids`` (at most ``max_blocks``).

        Walks the chain from the root and stops at the first miss: a block is only usable if every block before
        it is too (its K/V were computed attending to them). Hashes are computed lazily, so a miss on block 0 costs
        one sha256. Returns ``(block_ids, block_hashes)`` of the hit run.
        """
        block_ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = ROOT_HASH
        for j in range(max_blocks):
            tokens = tuple(token_ids[j * block_size:(j + 1) * block_size])
            key = CachedBlockKey(parent, tokens, extra_key)
            block_hash = hash_block_tokens(parent, tokens, extra_key)
            block_id = self.get(block_hash, key)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return block_ids, hashes
