"""The block pool: which physical KV blocks are free, which are in use, and how many users each has.

A *block* is ``block_size`` token slots of K/V across every layer (the arrays live in :mod:`minienv.kv.kv_pool`;
this module only does the bookkeeping, so it is pure Python and knows nothing of requests or tensors).

The design is vLLM v1's (``vllm/v1/core/block_pool.py`` and ``FreeKVCacheBlockQueue`` in
``vllm/v1/core/kv_cache_utils.py``), because it is the one the next layer — prefix caching with LRU eviction —
needs:

* every block is a small :class:`KVCacheBlock` record with its id, a **refcount** and room for a content hash;
* the **free queue** keeps free blocks in eviction order and supports, all in O(1): take the head (allocate),
  append at the tail (free), and remove from the middle (a prefix-cache hit on a cached-free block). The
  naive design's ``free_list.pop(0)`` is O(n) — every allocation shifts the whole list — and ``deque.remove`` is O(n)
  too, so neither appears here.

Invariants (kept by :meth:`BlockPool.allocate` and :meth:`BlockPool.free`, checked by
:meth:`BlockPool.check_invariants` and the stateful test):

1. ``num_free_blocks + num_used_blocks == num_blocks``;
2. a block is in the free queue **iff** its refcount is 0 (no block is both free and in use);
3. every operation either succeeds completely or raises before changing anything.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

from minienv.kv.errors import DoubleFreeError, KVBudgetError, OutOfBlocksError, UnknownBlockError


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical KV block's metadata (vLLM: ``KVCacheBlock``).

    ``ref_cnt`` counts the block tables holding this block: 0 means the block sits in the free queue. The
    ``block_hash`` field is where the prefix cache (notebook 05) records the hash of a *full* block's tokens, so a
    freed block can keep its contents ("cached-free") until it is evicted from the head of the free queue.
    ``eq=False``: blocks compare by identity, as physical things do.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0


class FreeBlockQueue:
    """Free blocks in eviction order: the head is taken first, freed blocks join at the tail.

    Backed by an :class:`~collections.OrderedDict` keyed by block id — a C-implemented doubly linked list plus a
    hash map — so ``popleft``, ``append`` and ``remove`` (from anywhere in the queue) are all O(1). vLLM's
    ``FreeKVCacheBlockQueue`` hand-rolls the same doubly linked list with ``prev/next`` pointers on each block.
    """

    __slots__ = ("_queue",)

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._queue

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks head first (the order in which they would be allocated / evicted)."""
        return iter(self._queue.values())

    def block_ids(self) -> list[int]:
        """Free block ids, head first."""
        return list(self._queue)

    def popleft(self) -> KVCacheBlock:
        """Take the head block. O(1)."""
        return self._queue.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (freed most recently, so allocated / evicted last). O(1)."""
        self._queue[block.block_id] = block

    def move_to_head(self, block_id: int) -> None:
        """Make a free block the next one allocated (undoing an allocation). O(1)."""
        self._queue.move_to_end(block_id, last=False)

    def remove(self, block: KVCacheBlock) -> None:
        """Take a block out of the middle of the queue (a prefix-cache hit on a cached-free block). O(1)."""
        del self._queue[block.block_id]

    def __repr__(self) -> str:
        ids = self.block_ids()
        shown = ", ".join(map(str, ids[:12])) + (", ..." if len(ids) > 12 else "")
        return f"FreeBlockQueue(head-> [{shown}] <-tail, {len(ids)} free)"


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything observable about a pool's state: the free queue in order, and every block's refcount.

    Two snapshots are equal iff the pools are in the same state; the tests use this to prove a failed operation
    left the pool exactly as it was.
    """

    free_queue: tuple[int, ...]
    ref_cnts: tuple[int, ...]


class BlockPool:
    """A fixed set of ``num_blocks`` physical blocks, handed out and taken back in O(1).

    ``allocate(n)`` takes ``n`` blocks from the head of the free queue (refcount 0 -> 1) — all of them or, if fewer
    are free, none (:class:`OutOfBlocksError`, which the scheduler catches). ``free(ids)`` drops one reference per
    id; a block whose refcount reaches 0 joins the tail of the free queue. The pool knows nothing about requests:
    block tables (:mod:`minienv.kv.block_table`) record which blocks a sequence holds.
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise KVBudgetError(f"a block pool needs num_blocks >= 1 (an int), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # Invariant 2 at birth: every block has refcount 0 and is in the free queue, in id order.
        self.free_block_queue = FreeBlockQueue(self.blocks)

    # ------------------------------------------------------------------ state
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        # Invariant 1 is what makes this a subtraction rather than a count.
        return self.num_blocks - len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage``)."""
        return self.num_used_blocks / self.num_blocks

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[self._check_id(block_id)].ref_cnt

    def free_block_ids(self) -> list[int]:
        """Free block ids in queue order (head first): the order in which ``allocate`` will hand them out."""
        return self.free_block_queue.block_ids()

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(tuple(self.free_block_queue.block_ids()), tuple(b.ref_cnt for b in self.blocks))

    # ------------------------------------------------------------------ allocate / free
    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue; return their ids in allocation order.

        All or nothing: if fewer than ``num_blocks`` are free, raise :class:`OutOfBlocksError` and allocate none
        (a half-served request would hold blocks it cannot use while the scheduler preempts others).
        """
        queue = self.free_block_queue._queue
        if num_blocks == 1 and type(num_blocks) is int:  # the hot path: one new block at a block boundary
            if not queue:
                raise OutOfBlocksError(1, 0, self.num_blocks)
            block = queue.popitem(False)[1]
            # Invariant 2: leaves the free queue exactly when its refcount becomes 1.
            block.ref_cnt = 1
            return [block.block_id]
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if num_blocks > len(queue):
            # Invariant 3: checked before anything is popped.
            raise OutOfBlocksError(num_blocks, len(queue), self.num_blocks)
        pop = queue.popitem
        ids = []
        for _ in range(num_blocks):
            block = pop(False)[1]
            block.ref_cnt = 1  # invariant 2
            ids.append(block.block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching refcount 0 join the free queue's tail, in order.

        Callers free a sequence's blocks in *reverse* logical order (vLLM does too), so that once prefix caching
        keeps freed blocks' contents, a chain's tail is evicted before its parent.

        Raises, before changing anything (invariant 3): :class:`UnknownBlockError` for an id not in the pool,
        :class:`DoubleFreeError` for a block freed more times than it is referenced (including the same id twice
        in one call when its refcount is 1).
        """
        blocks = self.blocks
        if type(block_ids) is list and len(block_ids) == 1:  # hot path: one block
            bid = block_ids[0]
            if type(bid) is not int or not 0 <= bid < self.num_blocks:
                bid = self._check_id(bid)
            block = blocks[bid]
            if block.ref_cnt == 0:
                raise DoubleFreeError(bid)
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue._queue[bid] = block  # invariant 2: refcount 0 <=> in the free queue
            return
        ids = [self._check_id(b) for b in block_ids]
        # Validate the whole call first (invariant 3): each block must be referenced at least as many times as
        # it appears here.
        if len(set(ids)) == len(ids):
            for bid in ids:
                if blocks[bid].ref_cnt == 0:
                    raise DoubleFreeError(bid)
        else:
            counts: dict[int, int] = {}
            for bid in ids:
                counts[bid] = counts.get(bid, 0) + 1
                if counts[bid] > blocks[bid].ref_cnt:
                    raise DoubleFreeError(bid)
        queue = self.free_block_queue._queue
        for bid in ids:
            block = blocks[bid]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue[bid] = block  # invariant 2

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks already in use (sharing: a fork, or a prefix-cache hit on an in-use block).

        Taking a *free* block this way is the prefix cache's job (it must also remove it from the free queue and
        check its hash), so here it is an error. Validated first; the pool is unchanged on error.
        """
        ids = [self._check_id(b) for b in block_ids]
        for bid in ids:
            if self.blocks[bid].ref_cnt == 0:
                raise ValueError(f"block {bid} is free; incref only shares blocks already in use")
        for bid in ids:
            self.blocks[bid].ref_cnt += 1

    # ------------------------------------------------------------------ checks
    def _check_id(self, block_id: object) -> int:
        """Return ``block_id`` as an int if it names a block of this pool, else raise UnknownBlockError."""
        if isinstance(block_id, bool):
            raise UnknownBlockError(block_id, self.num_blocks)
        try:
            bid = block_id.__index__()  # int, or a numpy integer read out of a block-table array
        except (AttributeError, TypeError):
            raise UnknownBlockError(block_id, self.num_blocks) from None
        if not 0 <= bid < self.num_blocks:
            raise UnknownBlockError(block_id, self.num_blocks)
        return bid

    def check_invariants(self) -> None:
        """Assert invariants 1 and 2 (O(num_blocks); for tests and notebooks, not the hot path)."""
        free = set(self.free_block_queue.block_ids())
        assert len(free) == len(self.free_block_queue), "a block appears twice in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative refcount {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free), (
                f"block {block.block_id}: refcount {block.ref_cnt} but in free queue = {block.block_id in free}"
            )
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free_blocks}, used={self.num_used_blocks})"
