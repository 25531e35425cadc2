"""The KV cache manager: per-request block tables over one block pool, with prefix sharing, copy-on-write forks
and the token-budget LRU evictor. Bookkeeping only: it hands out block ids, slots and copy instructions; the owner
of the K/V arrays (:class:`~minienv.kv.kv_pool.KVPool`) applies them.

The pool is the budget: ``num_blocks`` bounds in-use *plus* cached-free blocks, so ``resident tokens <= budget``
holds by construction. The prefix index maps the chain hash of a full block to the block. Each request's block
table (:class:`RequestKV`, a :class:`~minienv.kv.block_table.BlockTable`) is owned here and only here; the
request's tokens and how many are computed are not: the manager reads them from the request object the caller
passes (``request.all_token_ids``, ``request.num_computed_tokens``, as vLLM's ``KVCacheManager`` does) and keeps
no copy.

A block is ``FREE_EMPTY`` (refcount 0, in the free queue), ``CACHED_FREE`` (refcount 0, in the free queue *and*
the index: K/V kept, evictable) or ``IN_USE`` (refcount >= 1; indexed if full and committed).

Invariants (``check_invariants``):

1. a block's refcount equals the number of block tables holding it;
2. a block is indexed iff it carries a hash, and its hash is its key's chain hash;
3. **eviction is allocation**: a block leaves the index in the call that hands it out, so a reused block is never
   findable; a block with refcount > 0 is never in the free queue, so it is never evicted;
4. a cached-free block's parent is in use or *later* in the free queue (requests free last block first), so
   eviction cuts a cached prefix from its tail, never from its middle;
5. every table holds ``cdiv(num_tokens, block_size)`` blocks.

A request's life: ``allocate(req)`` (prefix hit + slots) -> the step writes K/V, the caller advances
``req.num_computed_tokens`` -> ``commit(req)`` (full computed blocks indexed) -> ``append_slots(req, n)`` ... ->
``free(req.request_id)``. ``allocate`` / ``append_slots`` return ``None`` when the free blocks do not
suffice (the scheduler preempts or waits); misuse raises before anything changes. This class implements the
:class:`~minienv.kv.interface.KVManager` protocol, the seam the engine calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

from minienv.kv.block_pool import BlockPool, KVCacheBlock
from minienv.kv.block_table import BlockTable, cdiv
from minienv.kv.errors import KVBudgetError, KVCacheError
from minienv.kv.hashing import ROOT_HASH, BlockHash, block_key_encoder, hash_block_key
from minienv.kv.kv_pool import num_blocks_for_budget
from minienv.kv.interface import KVCacheStats, KVEvent, KVRequestState, PrefixHit, SlotAllocation
from minienv.kv.prefix_cache import CachedBlock, PrefixCacheStats, PrefixIndex

RequestId = Hashable


class UnknownRequestError(KVCacheError, KeyError):
    """The manager holds no blocks for this request id (never allocated, or already freed)."""

    def __init__(self, request_id: RequestId, action: str):
        self.request_id = request_id
        super().__init__(f"cannot {action} request {request_id!r}: the KV cache manager holds no blocks for it "
                         "(never allocated, or already freed); nothing was changed")

    __str__ = Exception.__str__  # KeyError would repr() the message


class DuplicateRequestError(KVCacheError, ValueError):
    """A request id that already has blocks was allocated again."""

    def __init__(self, request_id: RequestId):
        self.request_id = request_id
        super().__init__(f"request {request_id!r} already has KV blocks; free it first. Nothing was changed")


class BlockState(enum.Enum):
    FREE_EMPTY = "free-empty"
    CACHED_FREE = "cached-free"
    IN_USE = "in-use"


@dataclass
class RequestKV(BlockTable):
    """One request's block table (``num_tokens``: the slots reserved), with what the prefix cache needs besides.

    Only what the manager owns: the request's tokens and progress stay in the request object (read, never copied).
    ``block_hashes[j]`` is the chain hash of full, committed block ``j``; where that hash is indexed,
    ``block_ids[j]`` *is* the indexed block.
    """

    request_id: RequestId = None
    #: prompt tokens the admission took from the prefix cache (counted as hits; :meth:`KVCacheManager.undo_allocate`)
    num_cached_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    #: the admission lookup's hash of block ``len(block_hashes)`` (a ``PrefixHit.miss``), used by the commit that
    #: indexes that block if its key still matches; dropped by a truncation
    pending_hash: CachedBlock | None = field(default=None, compare=False, repr=False)
    #: tokens the admission looked up (counted as prefix-cache queries; :meth:`KVCacheManager.undo_allocate`)
    num_queried_tokens: int = field(default=0, compare=False, repr=False)
    #: the copy-on-write of the latest :meth:`KVCacheManager.append_slots`, if it made one (for
    #: :meth:`KVCacheManager.undo_append_slots`)
    cow: CopyOnWrite | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CopyOnWrite:
    """What an append's copy-on-write changed: the request's last block ``original`` became ``private`` (taken
    from the free queue, where it had ``private_place``); ``original_hash`` is the original's hash then."""

    original: int
    private: int
    original_hash: BlockHash | None
    private_place: int


@dataclass(frozen=True)
class SharingStats:
    """Blocks the tables name (logical) vs blocks that exist (physical): ``saved_fraction = 1 - physical / logical``
    is the vLLM paper's memory saving for parallel sampling (Fig. 15)."""

    logical_blocks: int
    physical_blocks: int

    @property
    def saved_blocks(self) -> int:
        return self.logical_blocks - self.physical_blocks

    @property
    def saved_fraction(self) -> float:
        return self.saved_blocks / self.logical_blocks if self.logical_blocks else 0.0


_INT_ONLY = {int}


def check_token_ids(token_ids: object, what: str) -> list[int]:
    """``token_ids`` as a list of non-negative ints, or a clear error naming ``what`` was wrong."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(token_ids).__name__}")
    ids = list(token_ids)  # type: ignore[call-overload]
    if not ids:
        raise ValueError(f"{what} is empty: there must be at least one token to compute")
    # the common case (the scheduler's decode token, a prompt of plain ints) checked without a Python-level loop:
    # it runs for every request in every step
    if set(map(type, ids)) == _INT_ONLY and min(ids) >= 0:
        return ids
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ValueError(f"{what} must hold non-negative int token ids, got {t!r}")
    return [int(t) for t in ids]


def _not_a_request(obj: object, action: str) -> TypeError:
    return TypeError(f"cannot {action} {obj!r}: pass the request object (with request_id, all_token_ids and "
                     "num_computed_tokens, e.g. a minienv.kv.interface.KVRequest), not its id; nothing was changed")


def _check_int(name: str, value: object, low: int, high: float = float("inf")) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


class KVCacheManager:
    """Block tables for every request over one :class:`BlockPool` of ``num_blocks`` blocks of ``block_size`` slots.

    ``enable_prefix_caching=False`` (the differential tests' baseline): no hashing, no index. ``extra_key`` is
    mixed into every block hash (:func:`~minienv.kv.hashing.make_extra_key`). Views read ``stats()``, ``sharing()``,
    ``free_queue()``, ``block_state(b)``, ``ref_cnt(b)`` and :class:`KVEvent` listeners.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 extra_key: bytes = b""):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise KVBudgetError(f"block_size must be a positive int, got {block_size!r}")
        self.pool = BlockPool(num_blocks)  # KVBudgetError for num_blocks < 1
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.extra_key = bytes(extra_key)
        self.index = PrefixIndex()
        self.prefix_stats = PrefixCacheStats()
        self.cow_copies = 0
        #: cached-free blocks, counted as blocks change state (``stats()`` runs after every engine step, so it
        #: must not scan the index); ``check_invariants`` compares it with a scan
        self._num_cached_free = 0
        self._requests: dict[RequestId, RequestKV] = {}
        self._listeners: list[Callable[[KVEvent], None]] = []

    @classmethod
    def from_budget(cls, kv_budget_tokens: int, block_size: int, **kwargs) -> "KVCacheManager":
        """A manager of ``kv_budget_tokens // block_size`` blocks (:class:`KVBudgetError` below one block)."""
        return cls(num_blocks_for_budget(kv_budget_tokens, block_size), block_size, **kwargs)

    # ------------------------------------------------------------------ observers
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def kv_budget_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free-empty plus cached-free (evictable)."""
        return self.pool.num_free_blocks

    def add_listener(self, listener: Callable[[KVEvent], None]) -> None:
        """Call ``listener(event)`` on every :class:`KVEvent`. No listeners, no cost."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[KVEvent], None]) -> None:
        self._listeners.remove(listener)

    def _emit(self, *args) -> None:
        if self._listeners:
            event = KVEvent(*args)
            for listener in self._listeners:
                listener(event)

    def has_request(self, request_id: RequestId) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def request(self, request_id: RequestId) -> RequestKV:
        """The request's live block table (read it; change it only through the manager)."""
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "inspect")
        return req

    def block_ids(self, request_id: RequestId) -> list[int]:
        """The request's physical block ids in logical order (a copy)."""
        return list(self.request(request_id).block_ids)

    def num_tokens(self, request_id: RequestId) -> int:
        return self.request(request_id).num_tokens

    def block_state(self, block_id: int) -> BlockState:
        block = self.pool.blocks[self.pool._check_id(block_id)]
        if block.ref_cnt > 0:
            return BlockState.IN_USE
        return BlockState.CACHED_FREE if block.block_hash is not None else BlockState.FREE_EMPTY

    def ref_cnt(self, block_id: int) -> int:
        return self.pool.ref_cnt(block_id)

    def free_queue(self) -> list[tuple[int, bool]]:
        """The free queue head first, as ``(block_id, is_cached)``: the order allocations take (evict) blocks."""
        return [(b.block_id, b.block_hash is not None) for b in self.pool.free_block_queue]

    def stats(self) -> KVCacheStats:
        """Counts by state (O(1): the cached-free count is kept as blocks change state)."""
        cached_free = self._num_cached_free
        s = self.prefix_stats
        pool = self.pool
        free = pool.num_free_blocks
        return KVCacheStats(pool.num_blocks, self.block_size, free - cached_free, cached_free, pool.num_blocks - free,
                            len(self._requests), s.requests, s.queries, s.hits, s.evicted_blocks, s.evicted_tokens,
                            self.cow_copies)

    def sharing(self) -> SharingStats:
        """Logical blocks named by all tables vs physical blocks in use: the memory saved by sharing."""
        return SharingStats(sum(len(r.block_ids) for r in self._requests.values()), self.pool.num_used_blocks)

    def snapshot(self) -> tuple:
        """Everything observable (equal snapshots <=> equal states): what "an error changed nothing" compares."""
        s = self.prefix_stats
        return (self.pool.snapshot(), tuple(b.block_hash for b in self.pool.blocks),
                frozenset((e.block_hash, e.block_id) for e in self.index),
                tuple((r.request_id, tuple(r.block_ids), r.num_tokens, r.num_cached_tokens, tuple(r.block_hashes))
                      for r in self._requests.values()),
                (s.requests, s.queries, s.hits, s.evicted_blocks, s.evicted_tokens, self.cow_copies))

    # ------------------------------------------------------------------ prefix lookup
    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached run of full blocks of a prompt, without taking them or counting stats.

        At most ``(len - 1) // block_size`` blocks, so at least the last prompt token is computed and gives logits
        (a prompt of exactly k cached blocks recomputes its last block).
        """
        return self._lookup(check_token_ids(token_ids, "token_ids"))

    def _lookup(self, ids: list[int]) -> PrefixHit:
        if not self.enable_prefix_caching:
            return PrefixHit((), (), 0)
        block_ids, hashes, miss = self.index.longest_prefix_and_miss(ids, self.block_size, self.extra_key,
                                                                     (len(ids) - 1) // self.block_size)
        return PrefixHit(tuple(block_ids), tuple(hashes), len(block_ids) * self.block_size, miss)

    # ------------------------------------------------------------------ allocation
    def _take_free_blocks(self, n: int, request_id: RequestId) -> list[int]:
        """``n`` blocks from the head of the free queue, the least recently freed: the token-budget LRU evictor.
        A block that carries a hash is evicted here, in the call that hands it out (invariant 3)."""
        ids = self.pool.allocate(n) if n else []
        blocks = self.pool.blocks
        for bid in ids:
            if blocks[bid].block_hash is not None:
                self._drop_hash(blocks[bid], request_id)
        return ids

    def _drop_hash(self, block: KVCacheBlock, request_id: RequestId | None) -> None:
        """Evict one block's cached content: out of the index, hash cleared, counted (the block stays put). Only
        for a cached-free block (in the free queue, or taken from it by the call evicting it)."""
        evicted_hash, block.block_hash = block.block_hash, None
        self._num_cached_free -= 1
        self.index.discard(block.block_id)
        stats = self.prefix_stats
        stats.evicted_blocks += 1
        stats.evicted_tokens += self.block_size
        if self._listeners:
            self._emit("evict", block.block_id, request_id, evicted_hash)

    def _touch(self, block_ids: Sequence[int], request_id: RequestId) -> None:
        """Take a reference on prefix-hit blocks: a cached-free one leaves the free queue (O(1)), 0 -> 1."""
        for bid in block_ids:
            block = self.pool.blocks[bid]
            if block.ref_cnt == 0:  # cached-free -> in use
                self.pool.free_block_queue.remove(block)
                self._num_cached_free -= 1
            block.ref_cnt += 1
            self._emit("hit", bid, request_id, block.block_hash)

    def _table(self, request: KVRequestState, action: str) -> RequestKV:
        try:
            req = self._requests.get(request.request_id)
        except AttributeError:
            raise _not_a_request(request, action) from None
        if req is None:
            raise UnknownRequestError(request.request_id, action)
        return req

    def allocate(self, request: KVRequestState, num_new_tokens: int | None = None) -> SlotAllocation | None:
        """Admit a request: take the cached prefix blocks of ``request.all_token_ids`` and reserve slots for the
        next ``num_new_tokens`` tokens (default: all the rest; later chunks come through :meth:`append_slots`).

        Returns ``None``, changing nothing and counting nothing, if the blocks do not fit — cached-free hit blocks
        count against the free ones, since taking them removes them from the free queue. The request is only
        read: its caller sets ``num_computed_tokens`` (to the hit, ``alloc.num_cached_tokens``) itself.
        """
        if not hasattr(request, "request_id") or not hasattr(request, "all_token_ids"):
            raise _not_a_request(request, "allocate")
        request_id = request.request_id
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        prompt = check_token_ids(request.all_token_ids, f"request {request_id!r}'s all_token_ids")
        hit = self._lookup(prompt)
        remaining = len(prompt) - hit.num_cached_tokens
        if num_new_tokens is None:
            num_new_tokens = remaining
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or not 1 <= num_new_tokens <= remaining:
            raise ValueError(f"num_new_tokens must be an int in [1, {remaining}] ({len(prompt)} tokens, "
                             f"{hit.num_cached_tokens} cached), got {num_new_tokens!r}")
        n_cached = hit.num_cached_tokens
        total = n_cached + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(hit.block_ids)
        hit_free = sum(1 for bid in hit.block_ids if self.pool.blocks[bid].ref_cnt == 0) if hit.block_ids else 0
        if num_new_blocks + hit_free > self.pool.num_free_blocks:
            return None
        # --- validated; nothing below can fail
        if hit.block_ids:
            self._touch(hit.block_ids, request_id)  # first: the allocation below must not evict a block just hit
        new_ids = self._take_free_blocks(num_new_blocks, request_id)
        req = RequestKV(self.block_size, list(hit.block_ids) + new_ids, total, request_id, n_cached,
                        list(hit.block_hashes), hit.miss, len(prompt))
        self._requests[request_id] = req
        s = self.prefix_stats
        s.requests, s.queries, s.hits = s.requests + 1, s.queries + len(prompt), s.hits + n_cached
        return self._slots(req, n_cached, new_ids, (), n_cached)

    def undo_allocate(self, request_id: RequestId) -> list[int]:
        """Undo an admission whose step failed before it committed: :meth:`free` the request's blocks, put each one
        that was free (a cached-free prefix hit, a block taken from the head) back where it was in the free queue,
        and take its lookup back out of the prefix-cache counters (it never happened). Returns the released
        blocks."""
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "undo the allocation of")
        s = self.prefix_stats
        s.requests, s.queries, s.hits = s.requests - 1, s.queries - req.num_queried_tokens, s.hits - req.num_cached_tokens
        blocks = self.pool.blocks
        places = [(blocks[bid], blocks[bid].free_order) for bid in req.block_ids]  # kept since they left the queue
        released = self.free(request_id)
        self.pool.free_block_queue.put_back(places)
        return released

    def undo_append_slots(self, request_id: RequestId, num_tokens: int, *, kv_written: bool) -> list[int]:
        """Undo the latest :meth:`append_slots` of a step that failed before it committed: :meth:`truncate` the
        request back to ``num_tokens`` (released blocks return to the head of the free queue, where they were
        taken) and undo that append's copy-on-write. Returns the blocks released.

        ``kv_written``: whether the step got as far as writing K/V (its ``blocks_to_copy`` applied, then the model
        called); a step whose planning or input building failed wrote nothing. The request gets its original last
        block back whenever the original's K/V are intact — still held by another request, still cached, or
        nothing written at all (it may have been evicted by the step's planning and returned by its undo). Else
        it keeps the private copy, which the step filled. Never a block whose K/V are not the request's own: a
        private block nothing was copied into must not stay in a table (its old K/V would be read as this
        request's).
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "undo the append of")
        cow, req.cow = req.cow, None
        released = self.truncate(request_id, num_tokens)
        self.return_to_head(released)
        if cow is None or req.block_ids[-1] != cow.private:
            return released
        original = self.pool.blocks[cow.original]
        cached = cow.original_hash is not None and original.block_hash == cow.original_hash
        if not (original.ref_cnt > 0 or cached or not kv_written):
            return released  # the original may have been written: keep the private copy the step made
        if original.ref_cnt == 0:  # cached-free or free-empty: it leaves the free queue again
            self.pool.free_block_queue.remove(original)
            self._num_cached_free -= original.block_hash is not None
        original.ref_cnt += 1
        req.block_ids[-1] = cow.original
        private = self.pool.blocks[cow.private]
        self.pool.free([cow.private])
        self.pool.free_block_queue.put_back([(private, cow.private_place)])
        self.cow_copies -= 1
        return released + [cow.private]

    def append_slots(self, request: KVRequestState, num_new_tokens: int) -> SlotAllocation | None:
        """Reserve slots for the request's next ``num_new_tokens`` tokens (a decode token, the next prefill chunk,
        speculative drafts: counted, never read — only computed tokens of ``request.all_token_ids`` are hashed).

        **Copy-on-write**: if the first new token lands in a not-full last block that is shared (refcount > 1, after
        a fork) or indexed (after :meth:`truncate`; an indexed block is immutable), the request first gets a private
        copy: a new block, ``(old, new)`` in ``blocks_to_copy``, one reference moved. A full shared block is never
        written again, so it is not copied. ``None`` (nothing changed) if the blocks do not fit.
        """
        req = self._table(request, "append slots to")
        request_id = req.request_id
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be a positive int (the slots to reserve), got {num_new_tokens!r}"
                             "; nothing was changed")
        start = req.num_tokens
        last = self.pool.blocks[req.block_ids[-1]] if req.block_ids else None
        needs_cow = start % self.block_size != 0 and last is not None and (
            last.ref_cnt > 1 or last.block_hash is not None)
        num_new_blocks = req.blocks_needed(num_new_tokens)
        if num_new_blocks + needs_cow > self.pool.num_free_blocks:
            return None
        # --- validated; nothing below can fail
        copies: tuple[tuple[int, int], ...] = ()
        req.cow = None
        if needs_cow:
            place = self.pool.free_block_queue.head_place()
            (private,) = self._take_free_blocks(1, request_id)
            req.cow = CopyOnWrite(last.block_id, private, last.block_hash, place)
            # A shared original stays in use by its other holders; an indexed one held only by us becomes
            # cached-free, its K/V intact for future hits.
            self.pool.free([last.block_id])
            self._num_cached_free += last.ref_cnt == 0 and last.block_hash is not None
            req.block_ids[-1] = private
            copies = ((last.block_id, private),)
            self.cow_copies += 1
            self._emit("cow", private, request_id, None, last.block_id)
        new_ids = self._take_free_blocks(num_new_blocks, request_id)
        req.block_ids.extend(new_ids)
        req.num_tokens = start + num_new_tokens  # invariant 5 again
        return self._slots(req, start, new_ids, copies, 0)

    @staticmethod
    def _slots(req: RequestKV, start: int, new_ids: list[int], copies: tuple, n_cached: int) -> SlotAllocation:
        return SlotAllocation(req.request_id, req.num_tokens - start, start,
                              tuple(req.block_ids[start // req.block_size:]), req.block_size, tuple(new_ids), copies,
                              n_cached)

    # ------------------------------------------------------------------ commit: computed blocks become findable
    def commit(self, request: KVRequestState) -> list[int]:
        """Index the newly full blocks among ``request.all_token_ids[:request.num_computed_tokens]`` (the caller
        advanced ``num_computed_tokens`` once the step wrote their K/V); return the ids newly indexed. Computed
        tokens not yet in ``all_token_ids`` (accepted drafts the caller appends after the commit) are indexed by
        the next commit, as vLLM caches ``min(computed, num_tokens)``.

        Only now: indexed at allocation, a block could be "hit" by another request in the same step before its K/V
        exist. If a newly full block's hash is already indexed under another block (two requests computed the same
        prefix at once), the request switches to the indexed block and frees its duplicate: one block per hash, and
        every chain a request holds is the indexed chain, which keeps invariant 4.
        """
        req = self._table(request, "commit")
        computed = request.num_computed_tokens
        if isinstance(computed, bool) or not isinstance(computed, int) or not 0 <= computed <= req.num_tokens:
            raise ValueError(f"request {req.request_id!r} has num_computed_tokens={computed!r}, but the manager "
                             f"reserved {req.num_tokens} slots for it: a token is computed only in a slot reserved "
                             "by allocate / append_slots; nothing was changed")
        # NOTE: the fast exit of every decode step: hashing happens only when a block has filled since the last
        # commit (the loop of _index_full_blocks would run zero times).
        token_ids = request.all_token_ids
        n_full = min(computed, len(token_ids)) // self.block_size
        if not self.enable_prefix_caching or n_full <= len(req.block_hashes):
            return []
        B = self.block_size  # the tokens about to be hashed are checked first: bad ones raise, nothing indexed
        check_token_ids(token_ids[len(req.block_hashes) * B:n_full * B],
                        f"request {req.request_id!r}'s all_token_ids")
        return self._index_full_blocks(req, token_ids, n_full)

    def _index_full_blocks(self, req: RequestKV, token_ids: Sequence[int], n_full: int) -> list[int]:
        """Index the request's first ``n_full`` blocks not yet hashed (the body of :meth:`commit`)."""
        request_id, block_ids, hashes = req.request_id, req.block_ids, req.block_hashes
        B, blocks, extra, index, indexed = self.block_size, self.pool.blocks, self.extra_key, self.index, []
        pending, req.pending_hash = req.pending_hash, None
        encode = block_key_encoder(B, extra)
        for j in range(len(hashes), n_full):
            parent = hashes[j - 1] if j else ROOT_HASH
            if j and blocks[block_ids[j - 1]].block_hash != parent:
                break  # the parent is not the indexed block (a collision left it out): the chain stops here
            tokens = token_ids[j * B:(j + 1) * B]
            key_bytes = encode(parent, tokens)
            if pending is not None and pending.key == (parent, tuple(tokens), extra):
                block_hash = pending.block_hash  # hashed by the admission's lookup (a miss there)
            else:
                block_hash = hash_block_key(key_bytes)
            pending = None
            bid = block_ids[j]
            indexed_bid = index.block_for_hash(block_hash)
            if indexed_bid is None:
                if blocks[bid].block_hash is None:
                    index.insert_key_bytes(bid, block_hash, key_bytes)
                    blocks[bid].block_hash = block_hash  # invariant 2
                    indexed.append(bid)
                    if self._listeners:
                        self._emit("cache", bid, request_id, block_hash)
            elif indexed_bid != bid:
                if index.key_bytes_for_hash(block_hash) != key_bytes:
                    hashes.append(block_hash)
                    break  # a genuine collision: this block (and so its children) stays out of the index
                self._touch([indexed_bid], request_id)  # deduplicate: hold the indexed copy, release ours
                block_ids[j] = indexed_bid
                self._release([bid], request_id)
            hashes.append(block_hash)
        return indexed

    def fork(self, parent: KVRequestState, child_ids: Sequence[RequestId]) -> list[int]:
        """Children sharing every block of ``parent_id`` (parallel sampling, beams); returns the shared block ids.

        Each refcount goes up by exactly the number of children (invariant 1). Nothing is copied now: the first
        write into a shared, not-full last block copies it (:meth:`append_slots`). The parent must be computed
        (``parent.num_computed_tokens`` equal to its reserved slots); each child's caller gives it its own request
        object (a copy of the parent's tokens and progress).
        """
        parent_id, computed = parent.request_id, parent.num_computed_tokens
        parent = self._table(parent, "fork")
        children = list(child_ids)
        if not children or len(set(children)) != len(children):
            raise ValueError(f"fork needs at least one child id, all distinct, got {children!r}")
        for cid in children:
            if cid in self._requests:
                raise DuplicateRequestError(cid)
        if computed != parent.num_tokens:
            raise ValueError(f"request {parent_id!r} has {parent.num_tokens} reserved slots but "
                             f"num_computed_tokens={computed!r}; fork after the step that computes them (commit)")
        for cid in children:
            self.pool.incref(parent.block_ids)
            self._requests[cid] = RequestKV(self.block_size, list(parent.block_ids), parent.num_tokens, cid,
                                            parent.num_cached_tokens, list(parent.block_hashes))
        return list(parent.block_ids)

    # ------------------------------------------------------------------ free / evict
    def _release(self, block_ids: Sequence[int], request_id: RequestId) -> None:
        # ids from this manager's own tables (invariant 1: each is referenced)
        for block in self.pool.release(block_ids):
            if block.block_hash is not None:
                self._num_cached_free += 1  # in use -> cached-free
            if self._listeners:
                self._emit("free", block.block_id, request_id, block.block_hash)

    def free(self, request_id: RequestId) -> list[int]:
        """Release a request's blocks **last block first**; return them in that order.

        A block reaching refcount 0 joins the free queue's tail — cached-free if indexed (findable until evicted),
        free-empty otherwise. Reverse order keeps invariant 4. A double free raises :class:`UnknownRequestError`
        and changes nothing (it must never decrement someone else's refcount).
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "free")
        released = req.block_ids[::-1]
        self._release(released, request_id)
        del self._requests[request_id]
        return released

    def truncate(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """Roll a request back to its first ``num_tokens`` tokens (a failed step, rejected speculation); return the
        blocks released, last first. Full ones stay cached; a new last block that is partial but indexed keeps its
        place in the index, and the request's next write copies it first (:meth:`append_slots`)."""
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "truncate")
        _check_int("num_tokens", num_tokens, 1, req.num_tokens)
        keep = cdiv(num_tokens, self.block_size)
        dropped = req.block_ids[keep:][::-1]
        self._release(dropped, request_id)
        del req.block_ids[keep:], req.block_hashes[num_tokens // self.block_size:]
        req.pending_hash = None
        req.num_tokens = num_tokens
        req.num_cached_tokens = min(req.num_cached_tokens, num_tokens)
        return dropped

    def return_to_head(self, block_ids: Sequence[int]) -> None:
        """Put free-empty blocks a rollback just released (last-taken first) back at the head of the free queue,
        where allocation took them, so a failed step leaves the LRU order as it found it."""
        queue = self.pool.free_block_queue
        for bid in block_ids:
            if bid in queue and self.pool.blocks[bid].block_hash is None:
                queue.move_to_head(bid)

    def evict(self, num_blocks: int = 1) -> list[int]:
        """Evict up to ``num_blocks`` cached-free blocks, LRU first; they stay in the free queue, now free-empty.
        (Allocation evicts on its own; this is for demos and :meth:`reset_prefix_cache`.)"""
        _check_int("num_blocks", num_blocks, 0)
        evicted = [b for b in self.pool.free_block_queue if b.block_hash is not None][:num_blocks]
        for block in evicted:
            self._drop_hash(block, None)
        return [b.block_id for b in evicted]

    def reset_prefix_cache(self) -> int:
        """Evict every cached-free block (vLLM's ``reset_prefix_cache``); return how many."""
        return len(self.evict(self.pool.num_free_blocks))

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (O(blocks + table entries))."""
        pool = self.pool
        pool.check_invariants()
        holders = [0] * pool.num_blocks
        for req in self._requests.values():
            assert len(req.block_ids) == cdiv(req.num_tokens, self.block_size), f"{req.request_id}: table size"
            assert len(req.block_hashes) <= req.num_tokens // self.block_size, f"{req.request_id}: hashes"
            for bid in req.block_ids:
                holders[bid] += 1
        indexed = {e.block_id: e for e in self.index}
        assert len(indexed) == len(self.index), "a block is indexed twice"
        assert self._num_cached_free == sum(pool.blocks[b].ref_cnt == 0 for b in indexed), "cached-free count"
        assert self.enable_prefix_caching or not indexed
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: refcount {block.ref_cnt} but {holders[block.block_id]} tables hold it")
            entry = indexed.get(block.block_id)
            assert (entry is not None) == (block.block_hash is not None), f"block {block.block_id}: index/hash"
            assert entry is None or entry.block_hash == block.block_hash == entry.key.block_hash()
        position = {bid: i for i, bid in enumerate(pool.free_block_queue.block_ids())}
        for entry in indexed.values():  # invariant 4
            if pool.blocks[entry.block_id].ref_cnt == 0 and entry.key.parent_hash != ROOT_HASH:
                parent = self.index.entry_for_hash(entry.key.parent_hash)
                assert parent is not None, f"cached block {entry.block_id} outlived its parent"
                assert pool.blocks[parent.block_id].ref_cnt > 0 or \
                    position[parent.block_id] > position[entry.block_id], \
                    f"parent block {parent.block_id} would be evicted before its child {entry.block_id}"

    def __repr__(self) -> str:
        s = self.stats()
        return (f"KVCacheManager(blocks={s.num_blocks}x{s.block_size}, in_use={s.num_in_use}, "
                f"cached_free={s.num_cached_free}, free_empty={s.num_free_empty}, requests={s.num_requests}, "
                f"prefix_caching={'on' if self.enable_prefix_caching else 'off'})")
