"""The prefix index: block hash -> the one physical block holding that prefix's K/V (vLLM's ``BlockHashToBlockMap``).

Only the index: refcounts, the free queue and eviction live in :mod:`minienv.kv.kv_cache_manager`, which keeps the
index in step with the pool. Each entry stores, beside its block id, the key its hash came from (parent hash, token
ids, extra key; a :class:`CachedBlockKey`, stored as the bytes that were hashed), and a lookup returns a block only
if the stored key *equals* the query's. So a hash collision, forced or astronomically unlikely, can only cost a
cache miss, never wrong K/V — for one comparison of ~``8 * block_size`` bytes per hit block.

Invariants: at most one block per hash and one hash per block (``_by_hash`` and ``_by_block`` are inverse maps);
an entry's hash is its key's :meth:`CachedBlockKey.block_hash`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

from minienv.kv.hashing import (ROOT_HASH, BlockHash, block_key_bytes, block_key_encoder, hash_block_key,
                                 parse_block_key_bytes)


class CachedBlockKey(NamedTuple):
    """Everything a block hash is computed from. Equal keys <=> the blocks' K/V are interchangeable.

    Named tuples (this and :class:`CachedBlock`), not frozen dataclasses: one of each is made per full block on the
    engine's path, and a tuple is built several times faster while staying immutable."""

    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_key: bytes

    def block_hash(self) -> BlockHash:
        return hash_block_key(block_key_bytes(self.parent_hash, self.token_ids, self.extra_key))


class CachedBlock(NamedTuple):
    """One index entry: the block holding K/V for ``key``, under ``block_hash``."""

    block_id: int
    block_hash: BlockHash
    key: CachedBlockKey


@dataclass
class PrefixCacheStats:
    """Counters in **tokens**, like vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``: prompt tokens looked up,
    and those served from cache (whole blocks, never a prompt's last token); evicted blocks and their tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0
    evicted_tokens: int = 0


class PrefixIndex:
    """``block hash -> block id`` and its inverse, with a key check on every lookup. All operations O(1).

    Stored flat, as three dicts of ``int`` and ``bytes`` (a hash's key is its :func:`block_key_bytes` encoding,
    the very bytes that were hashed), not as one :class:`CachedBlock` per entry: the index lives as long as the
    engine and grows by one entry per computed full block, and every tuple or object in it would be one more
    object Python's cyclic garbage collector counts toward its next collection and walks in each full one. Ints
    and bytes are never tracked, so a large index costs the collector nothing. :class:`CachedBlock` entries are
    built on demand for readers (``entry_for_hash``, iteration); they are equal to what was inserted.
    """

    __slots__ = ("_by_hash", "_by_block", "_keys")

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._by_block: dict[int, BlockHash] = {}
        self._keys: dict[BlockHash, bytes] = {}  # hash -> block_key_bytes(parent, tokens, extra)

    def __len__(self) -> int:
        return len(self._by_hash)

    def __iter__(self) -> Iterator[CachedBlock]:
        return (self._entry(h, bid) for h, bid in list(self._by_hash.items()))

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._by_hash

    def _entry(self, block_hash: BlockHash, block_id: int) -> CachedBlock:
        return CachedBlock(block_id, block_hash, CachedBlockKey(*parse_block_key_bytes(self._keys[block_hash])))

    def get(self, block_hash: BlockHash, key: CachedBlockKey) -> int | None:
        """The block holding ``key``'s K/V, or None: a hash hit whose stored key differs is a miss."""
        return self.get_by_key_bytes(block_hash, block_key_bytes(*key))

    def get_by_key_bytes(self, block_hash: BlockHash, key_bytes: bytes) -> int | None:
        """:meth:`get` with the key already encoded (:func:`block_key_bytes`)."""
        block_id = self._by_hash.get(block_hash)
        return block_id if block_id is not None and self._keys[block_hash] == key_bytes else None

    def entry_for_hash(self, block_hash: BlockHash) -> CachedBlock | None:
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else self._entry(block_hash, block_id)

    def entry_for_block(self, block_id: int) -> CachedBlock | None:
        block_hash = self._by_block.get(block_id)
        return None if block_hash is None else self._entry(block_hash, block_id)

    def block_for_hash(self, block_hash: BlockHash) -> int | None:
        """The block indexed under ``block_hash`` (no key check, no entry object), or None."""
        return self._by_hash.get(block_hash)

    def key_bytes_for_hash(self, block_hash: BlockHash) -> bytes | None:
        return self._keys.get(block_hash)

    def insert(self, block_id: int, block_hash: BlockHash, key: CachedBlockKey) -> bool:
        """Index ``block_id`` under ``block_hash``; False (and no change) if the hash or the block is taken."""
        return self.insert_key_bytes(block_id, block_hash, block_key_bytes(*key))

    def insert_key_bytes(self, block_id: int, block_hash: BlockHash, key_bytes: bytes) -> bool:
        """:meth:`insert` with the key already encoded (:func:`block_key_bytes`)."""
        if block_hash in self._by_hash or block_id in self._by_block:
            return False
        self._by_hash[block_hash] = block_id
        self._by_block[block_id] = block_hash
        self._keys[block_hash] = key_bytes
        return True

    def remove(self, block_id: int) -> CachedBlock | None:
        """Drop ``block_id``'s entry (an eviction); return it, or None if the block was not indexed."""
        block_hash = self._by_block.pop(block_id, None)
        if block_hash is None:
            return None
        del self._by_hash[block_hash]
        return CachedBlock(block_id, block_hash,
                           CachedBlockKey(*parse_block_key_bytes(self._keys.pop(block_hash))))

    def discard(self, block_id: int) -> None:
        """:meth:`remove` without building the removed entry (the manager's eviction)."""
        block_hash = self._by_block.pop(block_id, None)
        if block_hash is not None:
            del self._by_hash[block_hash], self._keys[block_hash]

    def longest_prefix(self, token_ids: Sequence[int], block_size: int, extra_key: bytes,
                       max_blocks: int) -> tuple[list[int], list[BlockHash]]:
        """``(block_ids, block_hashes)`` of the longest cached run of full blocks of ``token_ids`` (<= max_blocks).

        Stops at the first miss: a block is usable only if every block before it is (its K/V attended to them).
        Hashes are computed lazily, so a miss on block 0 costs one sha256.
        """
        block_ids, hashes, _ = self.longest_prefix_and_miss(token_ids, block_size, extra_key, max_blocks)
        return block_ids, hashes

    def longest_prefix_and_miss(self, token_ids: Sequence[int], block_size: int, extra_key: bytes, max_blocks: int
                                ) -> tuple[list[int], list[BlockHash], CachedBlock | None]:
        """:meth:`longest_prefix`, and the missed block's ``CachedBlock(-1, hash, key)`` when the lookup hashed one
        (a miss before ``max_blocks``), so an admission's commit need not hash that block again."""
        block_ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = ROOT_HASH
        by_hash, keys = self._by_hash, self._keys
        encode = block_key_encoder(block_size, extra_key)
        for j in range(max_blocks):
            tokens = token_ids[j * block_size:(j + 1) * block_size]
            key_bytes = encode(parent, tokens)
            block_hash = hash_block_key(key_bytes)  # hashing.hash_block_tokens(parent, tokens, extra_key)
            block_id = by_hash.get(block_hash)
            if block_id is None or keys[block_hash] != key_bytes:  # get()'s key check
                return block_ids, hashes, CachedBlock(-1, block_hash, CachedBlockKey(parent, tuple(tokens), extra_key))
            block_ids.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return block_ids, hashes, None
