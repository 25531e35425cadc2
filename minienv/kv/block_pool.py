"""The block pool: which physical KV blocks are free, which are in use, and how many users each has.

A *block* is ``block_size`` token slots of K/V in every layer; the arrays live in :mod:`minienv.kv.kv_pool`, so
this module is pure bookkeeping and knows nothing of requests or tensors. The design is vLLM v1's
(``vllm/v1/core/block_pool.py``, ``FreeKVCacheBlockQueue``), the one prefix caching with LRU eviction needs: each
block is a small :class:`KVCacheBlock` (id, refcount, room for a content hash), and the **free queue** keeps free
blocks in eviction order with O(1) take-the-head (allocate), append-at-the-tail (free) and remove-from-the-middle
(a prefix hit on a cached-free block). The naive design's ``free_list.pop(0)`` is O(n), and so is ``deque.remove``.

Invariants (``check_invariants`` and the stateful test):

1. ``num_free_blocks + num_used_blocks == num_blocks``;
2. a block is in the free queue **iff** its refcount is 0;
3. every operation either succeeds completely or raises before changing anything;
4. the free queue is sorted by each block's ``free_order`` (a block freed to the tail gets a higher one than all
   others, a block moved to the head a lower one), so a rollback can put a block back exactly where it was.

**The garbage collector.** Each block is one small object, so a pool of ``n`` blocks is ``n`` objects that Python's
cyclic collector walks in every *full* collection (measured: about +7 ms per full collection at 100 k blocks on a
2-core machine, vs about +0.7 ms for two plain lists of ``n`` ints; nano-vllm's blocks, which each hold a list,
cost about +9 ms). It is kept so because the blocks do no harm between full collections, and full ones are rare:
one runs only once the objects that survived since the last one reach a quarter of all long-lived objects, and
the KV cache manager's own work leaves next to nothing behind (its prefix index holds only ints and bytes, its
per-request objects die with the request) — a benchmark trace of 20 k manager operations triggers no collection at
all. Parallel lists of refcounts and hashes would save those milliseconds at the price of the object every
notebook and view reads (``pool.blocks[b].ref_cnt``). ``gc.freeze()`` after building an engine would exempt the
blocks too, but it freezes every object of the process: an application's decision, not this module's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

from minienv.kv.errors import DoubleFreeError, KVBudgetError, OutOfBlocksError, UnknownBlockError


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical block's metadata (vLLM: ``KVCacheBlock``); blocks compare by identity, as physical things do.

    ``ref_cnt`` counts the block tables holding it (0: in the free queue). ``block_hash`` is where the prefix cache
    records a full block's hash, so a freed block keeps its contents ("cached-free") until it is evicted.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    #: its place in the free queue (invariant 4); kept when it leaves, so :meth:`FreeBlockQueue.put_back` can
    #: return it there
    free_order: int = 0


class FreeBlockQueue:
    """Free blocks in eviction order: the head is taken first, freed blocks join at the tail.

    An :class:`~collections.OrderedDict` keyed by block id — a C doubly linked list plus a hash map — so ``popleft``,
    ``append`` and ``remove`` from anywhere are O(1) (vLLM hand-rolls the list with ``prev/next`` on each block).
    """

    __slots__ = ("_queue", "next_tail", "_next_head")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)
        for i, block in enumerate(self._queue.values()):
            block.free_order = i
        self.next_tail, self._next_head = len(self._queue), -1  # the free_order of the next tail / head block

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._queue

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks head first: the order in which they would be allocated (evicted)."""
        return iter(self._queue.values())

    def block_ids(self) -> list[int]:
        return list(self._queue)

    def popleft(self) -> KVCacheBlock:
        return self._queue.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        block.free_order, self.next_tail = self.next_tail, self.next_tail + 1
        self._queue[block.block_id] = block

    def head_place(self) -> int:
        """The ``free_order`` of the block at the head (the next one allocated): its place, for :meth:`put_back`."""
        return next(iter(self._queue.values())).free_order

    def move_to_head(self, block_id: int) -> None:
        """Make a free block the next one allocated (undoing an allocation)."""
        block = self._queue[block_id]
        block.free_order, self._next_head = self._next_head, self._next_head - 1
        self._queue.move_to_end(block_id, last=False)

    def put_back(self, blocks: Iterable[tuple[KVCacheBlock, int]]) -> None:
        """Return free blocks to the places they left (``(block, its free_order then)``): a rolled-back prefix
        hit. O(n log n), for a failed step only."""
        moved = False
        for block, order in blocks:
            if block.block_id in self._queue:
                block.free_order, moved = order, True
        if moved:
            items = sorted(self._queue.items(), key=lambda item: item[1].free_order)
            self._queue.clear()
            self._queue.update(items)

    def remove(self, block: KVCacheBlock) -> None:
        del self._queue[block.block_id]

    def __repr__(self) -> str:
        ids = self.block_ids()
        shown = ", ".join(map(str, ids[:12])) + (", ..." if len(ids) > 12 else "")
        return f"FreeBlockQueue(head-> [{shown}] <-tail, {len(ids)} free)"


@dataclass(frozen=True)
class PoolSnapshot:
    """The free queue in order and every refcount: equal snapshots <=> equal pools (for "an error changed nothing")."""

    free_queue: tuple[int, ...]
    ref_cnts: tuple[int, ...]


class BlockPool:
    """``num_blocks`` physical blocks, handed out and taken back in O(1).

    ``allocate(n)`` takes ``n`` blocks from the head of the free queue (refcount 0 -> 1), all or none
    (:class:`OutOfBlocksError`); ``free(ids)`` drops one reference per id, and a block reaching 0 joins the tail.
    Block tables (:mod:`minienv.kv.block_table`) record which blocks a sequence holds.
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise KVBudgetError(f"a block pool needs num_blocks >= 1 (an int), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)  # invariant 2 at birth: all free, in id order

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue._queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_queue)  # invariant 1

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage``)."""
        return self.num_used_blocks / self.num_blocks

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[self._check_id(block_id)].ref_cnt

    def free_block_ids(self) -> list[int]:
        """Free block ids head first: the order in which ``allocate`` hands them out."""
        return self.free_block_queue.block_ids()

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(tuple(self.free_block_queue.block_ids()), tuple(b.ref_cnt for b in self.blocks))

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue; return their ids in allocation order. All or
        nothing: a half-served request would hold blocks it cannot use while others are preempted."""
        if type(num_blocks) is not int or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        queue = self.free_block_queue._queue
        if num_blocks > len(queue):
            raise OutOfBlocksError(num_blocks, len(queue), self.num_blocks)
        ids = []
        for _ in range(num_blocks):
            block = queue.popitem(False)[1]
            block.ref_cnt = 1  # invariant 2: it leaves the queue exactly as its refcount becomes 1
            ids.append(block.block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue's tail, in order. (Callers free a
        sequence last block first, so a cached chain's tail is evicted before its parent.)

        Raises before changing anything: :class:`UnknownBlockError` for an id not in the pool,
        :class:`DoubleFreeError` for a block freed more times than it is referenced.
        """
        ids = [self._check_id(b) for b in block_ids]
        counts: dict[int, int] = {}
        for bid in ids:
            counts[bid] = counts.get(bid, 0) + 1
            if counts[bid] > self.blocks[bid].ref_cnt:
                raise DoubleFreeError(bid)
        self.release(ids)

    def release(self, block_ids: Iterable[int]) -> list[KVCacheBlock]:
        """The body of :meth:`free`, without its checks: for an owner of block tables releasing ids it took from this
        pool (the KV cache manager), where each id names a block its tables hold (in range, referenced; asserted).
        Returns the blocks that became free, in order."""
        blocks, append, freed = self.blocks, self.free_block_queue.append, []
        for bid in block_ids:
            block = blocks[bid]
            assert block.ref_cnt > 0, f"block {bid} released more times than it is referenced"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)  # invariant 2
                freed.append(block)
        return freed

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks already in use (a fork). Taking a *free* block is the prefix cache's job (it
        must leave the free queue and be checked against the index), so here it is an error."""
        ids = [self._check_id(b) for b in block_ids]
        for bid in ids:
            if self.blocks[bid].ref_cnt == 0:
                raise ValueError(f"block {bid} is free; incref only shares blocks already in use")
        for bid in ids:
            self.blocks[bid].ref_cnt += 1

    def _check_id(self, block_id: object) -> int:
        """``block_id`` as an int if it names a block of this pool (a numpy integer read from a table will do)."""
        if type(block_id) is int and 0 <= block_id < self.num_blocks:
            return block_id
        try:
            bid = None if isinstance(block_id, bool) else block_id.__index__()  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            bid = None
        if bid is None or not 0 <= bid < self.num_blocks:
            raise UnknownBlockError(block_id, self.num_blocks)
        return bid

    def check_invariants(self) -> None:
        free = set(self.free_block_queue.block_ids())
        assert len(free) == len(self.free_block_queue), "a block appears twice in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative refcount {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free), (
                f"block {block.block_id}: refcount {block.ref_cnt} but in free queue = {block.block_id in free}")
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        orders = [b.free_order for b in self.free_block_queue]
        assert orders == sorted(orders), "the free queue is out of free_order (invariant 4)"

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free_blocks}, used={self.num_used_blocks})"
