"""The KV cache manager: per-request block tables over one block pool, with prefix sharing, copy-on-write forks
and the token-budget LRU evictor. Bookkeeping only: it hands out block ids and copy instructions; the owner of
the K/V arrays (the engine) applies them.

Its parts:

* **Block pool** (:class:`~minienv.kv.block_pool.BlockPool`): refcounts and the free queue, all O(1). The budget is
  the pool: ``num_blocks = kv_budget_tokens // block_size`` bounds in-use *plus* cached-free blocks, so
  ``resident tokens <= budget`` holds by construction, never by a check that could be forgotten.
* **Prefix index** (:class:`~minienv.kv.prefix_cache.PrefixIndex`): chain hash of a full block -> the block.
* **Block tables**, one per request (:class:`RequestKV`), owned here and only here (the pool knows nothing of
  requests; the scheduler and the engine read them).

Every block is in exactly one of three states (:class:`BlockState`):

=============  ==========  ================  ============================================
state          refcount    in free queue     in prefix index
=============  ==========  ================  ============================================
FREE_EMPTY     0           yes               no
CACHED_FREE    0           yes               yes (K/V and hash kept, evictable)
IN_USE         >= 1        no                maybe (a full, committed block)
=============  ==========  ================  ============================================

Invariants (``check_invariants``):

1. a block's refcount equals the number of block tables holding it;
2. a block is indexed iff it carries a hash, and its hash is its key's chain hash;
3. **eviction is allocation**: a block leaves the index in the same call that hands it out, so a block can never
   be reused while it is still findable;
4. a block with refcount > 0 is never in the free queue, so it can never be evicted;
5. a cached-free block's parent is in use or *later* in the free queue: requests free last block first, so
   eviction cuts a cached prefix from its tail, never from its middle.

The request life cycle, as the scheduler drives it::

    a = mgr.allocate("r1", prompt_ids)        # prefix lookup, take hit blocks, slots for the rest of the prompt
    # ... the step writes K/V of a.token_ids at a.slot_mapping, after applying a.blocks_to_copy ...
    mgr.commit("r1")                           # those K/V now exist: newly full blocks enter the prefix index
    a = mgr.append_slots("r1", [next_token])   # one decode token (copy-on-write if its block is shared)
    mgr.commit("r1")
    mgr.fork("r1", ["r1.1", "r1.2"])           # parallel sampling: children share every block
    mgr.truncate("r1.1", n)                    # roll back to n tokens (a failed step, rejected speculation)
    mgr.free("r1")                             # refcounts -1, last block first; cached blocks stay findable

``allocate`` and ``append_slots`` return ``None`` when the free blocks do not suffice (an expected outcome: the
scheduler preempts and retries); errors are for misuse. Every public method validates first and raises before
changing anything, so after any error the manager equals its :meth:`KVCacheManager.snapshot` from before the call.

Observers for views and metrics: ``stats()``, ``sharing()``, ``free_queue()``, ``block_state(b)``, ``ref_cnt(b)``,
``add_listener(fn)`` (a :class:`KVEvent` per eviction / cache / hit / CoW / free), ``snapshot()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from minienv.kv.block_pool import BlockPool, KVCacheBlock, PoolSnapshot
from minienv.kv.block_table import BlockTable, cdiv
from minienv.kv.errors import KVBudgetError, KVCacheError
from minienv.kv.hashing import ROOT_HASH, BlockHash, hash_block_tokens
from minienv.kv.kv_pool import KVPool, num_blocks_for_budget
from minienv.kv.prefix_cache import CachedBlockKey, PrefixCacheStats, PrefixIndex

__all__ = [
    "BlockCopies", "BlockState", "DuplicateRequestError", "ForkResult", "KVCacheManager", "KVCacheStats", "KVEvent",
    "ManagerSnapshot", "PrefixHit", "RequestKV", "SharingStats", "SlotAllocation", "UnknownRequestError",
    "copy_blocks",
]

RequestId = Hashable
#: ``(src_block, dst_block)`` pairs whose K/V must be copied before the step's writes (vLLM's ``blocks_to_copy``).
BlockCopies = list[tuple[int, int]]


# ---------------------------------------------------------------------- errors
class UnknownRequestError(KVCacheError, KeyError):
    """The manager holds no blocks for this request id (never allocated, or already freed)."""

    def __init__(self, request_id: RequestId, action: str):
        self.request_id = request_id
        super().__init__(
            f"cannot {action} request {request_id!r}: the KV cache manager holds no blocks for it (never "
            "allocated, or already freed); nothing was changed"
        )

    __str__ = Exception.__str__  # KeyError would repr() the message


class DuplicateRequestError(KVCacheError, ValueError):
    """A request id that already has blocks was allocated again."""

    def __init__(self, request_id: RequestId):
        self.request_id = request_id
        super().__init__(f"request {request_id!r} already has KV blocks; free it first. Nothing was changed")


# ---------------------------------------------------------------------- records
class BlockState(enum.Enum):
    FREE_EMPTY = "free-empty"
    CACHED_FREE = "cached-free"
    IN_USE = "in-use"


@dataclass
class RequestKV:
    """The manager's record of one request: its block table, its tokens, and how far they are computed.

    Invariants: ``len(block_ids) == cdiv(len(token_ids), block_size)``; ``num_computed_tokens <= len(token_ids)``;
    ``block_hashes[j]`` is the chain hash of full, committed block ``j`` (prefix caching on), and for every ``j``
    with an indexed hash, ``block_ids[j]`` *is* the indexed block (the chain a request holds is the indexed chain).
    """

    request_id: RequestId
    block_ids: list[int]
    token_ids: list[int]
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix lookup: the cached run of full blocks, and how many prompt tokens it covers."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    num_cached_tokens: int


@dataclass(frozen=True)
class SlotAllocation:
    """What the model step needs to compute ``token_ids`` of one request.

    ``positions[i]`` and ``slot_mapping[i]`` are token ``i``'s absolute position and its KV pool slot.
    ``blocks_to_copy`` lists copy-on-write copies that must be applied to the KV pool *before* the step writes
    (:func:`copy_blocks`, by whoever owns the pool). ``num_cached_tokens`` is the
    prefix-cache hit of a newly allocated request (0 for later steps).
    """

    request_id: RequestId
    token_ids: tuple[int, ...]
    positions: np.ndarray
    slot_mapping: np.ndarray
    new_block_ids: tuple[int, ...]
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    num_cached_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ForkResult:
    """Children created by :meth:`KVCacheManager.fork` and the blocks they share with the parent."""

    parent_id: RequestId
    child_ids: tuple[RequestId, ...]
    shared_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SharingStats:
    """Memory saved by sharing: blocks the tables name (logical) vs blocks that physically exist (in use).

    ``saved_fraction = 1 - physical / logical`` — the vLLM paper's "memory saving" for parallel sampling and beam
    search (Fig. 15): what fraction of blocks would exist without sharing but does not.
    """

    logical_blocks: int
    physical_blocks: int

    @property
    def saved_blocks(self) -> int:
        return self.logical_blocks - self.physical_blocks

    @property
    def saved_fraction(self) -> float:
        return self.saved_blocks / self.logical_blocks if self.logical_blocks else 0.0


@dataclass(frozen=True)
class KVCacheStats:
    """A point-in-time summary. Block counts are *physical* blocks, each counted once however many requests share
    it: counting a shared block once per holder would report blocks that do not exist."""

    num_blocks: int
    block_size: int
    num_free_empty: int
    num_cached_free: int
    num_in_use: int
    num_requests: int
    prefix_requests: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evicted_blocks: int
    evicted_tokens: int
    cow_copies: int

    @property
    def kv_budget_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def resident_tokens(self) -> int:
        """Token slots of in-use plus cached-free blocks: everything the budget has to hold."""
        return (self.num_in_use + self.num_cached_free) * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage``; cached-free blocks are reclaimable, not used)."""
        return self.num_in_use / self.num_blocks


@dataclass(frozen=True)
class KVEvent:
    """Something worth drawing or counting: ``kind`` is ``"evict"`` (a cached block's hash dropped as it is reused),
    ``"cache"`` (a full block entered the index), ``"hit"`` (a request took a cached block), ``"cow"`` (a shared
    block copied before a write; ``block_id`` is the copy, ``src_block_id`` the original) or ``"free"`` (a block's
    refcount reached 0)."""

    kind: str
    block_id: int
    request_id: RequestId | None = None
    block_hash: BlockHash | None = None
    src_block_id: int | None = None


@dataclass(frozen=True)
class ManagerSnapshot:
    """Everything observable about a manager; equal snapshots <=> equal states (for "error left it unchanged")."""

    pool: PoolSnapshot
    block_hashes: tuple[BlockHash | None, ...]
    index: frozenset[tuple[BlockHash, int]]
    requests: tuple[tuple[RequestId, tuple[int, ...], tuple[int, ...], int, int, tuple[BlockHash, ...]], ...]
    stats: tuple[int, ...]


def copy_blocks(kv_pool: KVPool, blocks_to_copy: Iterable[tuple[int, int]]) -> None:
    """Apply copy-on-write copies to the KV pool: block ``dst`` gets block ``src``'s K and V in every layer.

    Whole blocks are copied (the slots past the shared tokens are garbage either way and are overwritten before
    they are read). One fancy-indexed assignment per array, like vLLM's ``copy_blocks`` kernel.
    """
    pairs = list(blocks_to_copy)
    if not pairs:
        return
    src = np.fromiter((s for s, _ in pairs), dtype=np.int64, count=len(pairs))
    dst = np.fromiter((d for _, d in pairs), dtype=np.int64, count=len(pairs))
    kv = kv_pool.kv_cache  # [layers, 2 (K, V), blocks, B, H, D]: K and V of every layer in one assignment
    kv[:, :, dst] = kv[:, :, src]


def _check_token_ids(token_ids: object, what: str) -> list[int]:
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(token_ids).__name__}")
    try:
        ids = list(token_ids)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(token_ids).__name__}") from None
    if not ids:
        raise ValueError(f"{what} is empty: there must be at least one token to compute")
    if all(type(t) is int for t in ids) and min(ids) >= 0:  # the common case, checked at C speed
        return ids
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ValueError(f"{what} must hold non-negative int token ids, got {t!r}")
        out.append(int(t))
    return out


class KVCacheManager:
    """Block tables for every request over one :class:`BlockPool`, with prefix caching and copy-on-write.

    Parameters
    ----------
    num_blocks, block_size:
        The pool: ``num_blocks`` blocks of ``block_size`` token slots (:meth:`from_budget` takes a token budget).
    enable_prefix_caching:
        Off: no hashing, no index, every freed block is free-empty — the baseline the differential test compares.
    extra_key:
        Bytes mixed into every block hash (:func:`minienv.kv.hashing.make_extra_key`: model id, dtype, cache salt).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        extra_key: bytes = b"",
    ):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise KVBudgetError(f"block_size must be a positive int, got {block_size!r}")
        self.pool = BlockPool(num_blocks)  # raises KVBudgetError for num_blocks < 1
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.extra_key = bytes(extra_key)
        self.index = PrefixIndex()
        self.prefix_stats = PrefixCacheStats()
        self.cow_copies = 0
        self._requests: dict[RequestId, RequestKV] = {}
        self._listeners: list[Callable[[KVEvent], None]] = []

    @classmethod
    def from_budget(cls, kv_budget_tokens: int, block_size: int, **kwargs) -> "KVCacheManager":
        """A manager whose pool holds ``kv_budget_tokens // block_size`` blocks.

        A budget of zero, a negative one, or one smaller than a block is a :class:`KVBudgetError`.
        """
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
        """Blocks an allocation can take right now: free-empty plus cached-free (evictable)."""
        return self.pool.num_free_blocks

    def add_listener(self, listener: Callable[[KVEvent], None]) -> None:
        """Call ``listener(event)`` on every :class:`KVEvent` (live views, metrics). No listeners, no cost."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[KVEvent], None]) -> None:
        self._listeners.remove(listener)

    def _emit(self, *args, **kwargs) -> None:
        if self._listeners:
            event = KVEvent(*args, **kwargs)
            for listener in self._listeners:
                listener(event)

    def has_request(self, request_id: RequestId) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def request(self, request_id: RequestId) -> RequestKV:
        """The live record of a request (do not mutate it; use the manager's methods)."""
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "inspect")
        return req

    def block_ids(self, request_id: RequestId) -> list[int]:
        """The request's physical block ids in logical order (a copy)."""
        return list(self.request(request_id).block_ids)

    def block_table(self, request_id: RequestId) -> BlockTable:
        """The request's blocks as a :class:`~minienv.kv.block_table.BlockTable` (a copy, for paged attention)."""
        req = self.request(request_id)
        return BlockTable(self.block_size, list(req.block_ids), req.num_tokens)

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
        """Counts by state (O(indexed blocks)); each physical block counted once."""
        cached_free = sum(1 for entry in self.index if self.pool.blocks[entry.block_id].ref_cnt == 0)
        free = self.pool.num_free_blocks
        s = self.prefix_stats
        return KVCacheStats(
            num_blocks=self.pool.num_blocks, block_size=self.block_size, num_free_empty=free - cached_free,
            num_cached_free=cached_free, num_in_use=self.pool.num_used_blocks, num_requests=len(self._requests),
            prefix_requests=s.requests, prefix_queries_tokens=s.queries, prefix_hits_tokens=s.hits,
            evicted_blocks=s.evicted_blocks, evicted_tokens=s.evicted_tokens, cow_copies=self.cow_copies,
        )

    def sharing(self) -> SharingStats:
        """Logical blocks named by all tables vs physical blocks in use: the memory saved by sharing."""
        logical = sum(len(r.block_ids) for r in self._requests.values())
        return SharingStats(logical_blocks=logical, physical_blocks=self.pool.num_used_blocks)

    def snapshot(self) -> ManagerSnapshot:
        s = self.prefix_stats
        return ManagerSnapshot(
            pool=self.pool.snapshot(),
            block_hashes=tuple(b.block_hash for b in self.pool.blocks),
            index=frozenset((e.block_hash, e.block_id) for e in self.index),
            requests=tuple(
                (r.request_id, tuple(r.block_ids), tuple(r.token_ids), r.num_computed_tokens, r.num_cached_tokens,
                 tuple(r.block_hashes))
                for r in self._requests.values()
            ),
            stats=(s.requests, s.queries, s.hits, s.evicted_blocks, s.evicted_tokens, self.cow_copies),
        )

    # ------------------------------------------------------------------ prefix lookup
    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached run of full blocks of a prompt — without taking them or counting stats.

        Never covers the whole prompt: at most ``(len - 1) // block_size`` blocks, so at least the last prompt
        token is computed and there are logits to sample from (a fully cached prompt would leave zero tokens
        with zero tokens to run). Block-granular: a prompt of exactly k full blocks, all cached, recomputes its
        last block.
        """
        return self._lookup(_check_token_ids(token_ids, "token_ids"))

    def _lookup(self, ids: list[int]) -> PrefixHit:
        if not self.enable_prefix_caching:
            return PrefixHit((), (), 0)
        max_blocks = (len(ids) - 1) // self.block_size  # leave >= 1 token to compute
        block_ids, hashes = self.index.longest_prefix(ids, self.block_size, self.extra_key, max_blocks)
        return PrefixHit(tuple(block_ids), tuple(hashes), len(block_ids) * self.block_size)

    # ------------------------------------------------------------------ allocation
    def _take_free_blocks(self, n: int, request_id: RequestId) -> list[int]:
        """Allocate ``n`` blocks from the head of the free queue; evict (un-index) any that carry a hash.

        This is the token-budget LRU evictor: the head is the least recently freed block, and dropping its hash
        happens here, in the same call as handing it out (invariant 3: a reused block is never findable). The
        caller has checked there are ``n`` free blocks.
        """
        if n == 0:
            return []
        ids = self.pool.allocate(n)
        blocks = self.pool.blocks
        for bid in ids:
            block = blocks[bid]
            if block.block_hash is not None:
                self._drop_hash(block, request_id)
        return ids

    def _drop_hash(self, block: KVCacheBlock, request_id: RequestId | None) -> None:
        """Evict one block's cached content: out of the index, hash cleared, counted (the block itself stays put)."""
        evicted_hash = block.block_hash
        self.index.remove(block.block_id)
        block.block_hash = None  # invariant: indexed <=> block_hash set
        self.prefix_stats.evicted_blocks += 1
        self.prefix_stats.evicted_tokens += self.block_size
        self._emit("evict", block.block_id, request_id, evicted_hash)

    def _touch(self, block_ids: Sequence[int], request_id: RequestId) -> None:
        """Take a reference on prefix-hit blocks (vLLM's ``BlockPool.touch``).

        A cached-free block leaves the free queue (O(1) removal from the middle) and goes 0 -> 1; an in-use block
        goes +1. Either way the pool's invariant "refcount 0 <=> in the free queue" holds after each block.
        """
        pool = self.pool
        for bid in block_ids:
            block: KVCacheBlock = pool.blocks[bid]
            if block.ref_cnt == 0:
                pool.free_block_queue.remove(block)
            block.ref_cnt += 1
            self._emit("hit", bid, request_id, block.block_hash)

    def allocate(
        self, request_id: RequestId, prompt_token_ids: Sequence[int], *, num_new_tokens: int | None = None
    ) -> SlotAllocation | None:
        """Admit a new request: take its cached prefix blocks and reserve slots for the tokens to compute now.

        ``num_new_tokens`` (default: the rest of the prompt) lets a scheduler prefill in chunks; later chunks come
        through :meth:`append_slots`. All or nothing: if the blocks do not fit, it returns ``None`` and the
        manager is unchanged (no stats counted either). Hit blocks that are cached-free count against the free
        blocks, because taking them removes them from the free queue.
        """
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        prompt = _check_token_ids(prompt_token_ids, "prompt_token_ids")
        hit = self._lookup(prompt)
        n_cached = hit.num_cached_tokens
        remaining = len(prompt) - n_cached
        if num_new_tokens is None:
            num_new_tokens = remaining
        if (isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int)
                or not 1 <= num_new_tokens <= remaining):
            raise ValueError(
                f"num_new_tokens must be an int in [1, {remaining}] (prompt of {len(prompt)} tokens, {n_cached} "
                f"cached), got {num_new_tokens!r}"
            )
        total = n_cached + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(hit.block_ids)
        hit_free = sum(1 for bid in hit.block_ids if self.pool.blocks[bid].ref_cnt == 0)
        if num_new_blocks + hit_free > self.pool.num_free_blocks:
            return None
        # --- validated; from here nothing can fail
        self._touch(hit.block_ids, request_id)  # first: allocation below must not evict a block we just hit
        new_ids = self._take_free_blocks(num_new_blocks, request_id)
        req = RequestKV(request_id, list(hit.block_ids) + new_ids, prompt[:total], num_computed_tokens=n_cached,
                        num_cached_tokens=n_cached, block_hashes=list(hit.block_hashes))
        self._requests[request_id] = req
        s = self.prefix_stats
        s.requests += 1
        s.queries += len(prompt)
        s.hits += n_cached
        return self._slot_allocation(req, n_cached, tuple(new_ids), (), n_cached)

    def append_slots(self, request_id: RequestId, token_ids: Sequence[int]) -> SlotAllocation | None:
        """Reserve slots for ``token_ids`` appended to a request (a decode token, or the next prefill chunk).

        **Copy-on-write**: if the first new token lands in the last block, and that block is *not full* and
        *shared* (refcount > 1, after a fork) or indexed (after :meth:`truncate`), the request gets a private copy
        first: a new block, the pair ``(old, new)`` in ``blocks_to_copy``, one reference moved from old to new. A
        shared block that is full is never written again (new tokens go to a new block), so it is not copied —
        Copying a full shared block instead would be waste; not copying a partial one would corrupt the other
        holders' text. All or nothing, like :meth:`allocate` (``None`` when the blocks do not fit).
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "append slots to")
        new_tokens = _check_token_ids(token_ids, "token_ids")
        start = req.num_tokens
        last = req.block_ids[-1] if req.block_ids else None
        # Copy before writing into a not-full block that others read (shared) or that the index names (immutable:
        # only a block rolled back by truncate() can be both indexed and not full).
        needs_cow = start % self.block_size != 0 and last is not None and (
            self.pool.blocks[last].ref_cnt > 1 or self.pool.blocks[last].block_hash is not None)
        num_new_blocks = cdiv(start + len(new_tokens), self.block_size) - len(req.block_ids)
        needed = num_new_blocks + (1 if needs_cow else 0)
        if needed > self.pool.num_free_blocks:
            return None
        # --- validated; from here nothing can fail
        copies: BlockCopies = []
        if needs_cow:
            (private,) = self._take_free_blocks(1, request_id)
            # One reference moves to the copy: a shared original stays in use by its other holders; an indexed one
            # held only by us becomes cached-free, its K/V intact for future hits.
            self.pool.free([last])
            req.block_ids[-1] = private
            copies.append((last, private))
            self.cow_copies += 1
            self._emit("cow", private, request_id, None, last)
        new_ids = self._take_free_blocks(num_new_blocks, request_id)
        req.block_ids.extend(new_ids)
        req.token_ids.extend(new_tokens)  # invariant: len(block_ids) == cdiv(num_tokens, B) again
        return self._slot_allocation(req, start, tuple(new_ids), tuple(copies), 0)

    def _slot_allocation(self, req: RequestKV, start: int, new_ids: tuple[int, ...], copies, n_cached: int):
        B = self.block_size
        positions = np.arange(start, req.num_tokens, dtype=np.int64)
        table = np.asarray(req.block_ids, dtype=np.int64)
        slots = table[positions // B] * B + positions % B
        return SlotAllocation(req.request_id, tuple(req.token_ids[start:]), positions, slots, new_ids, copies,
                              n_cached)

    # ------------------------------------------------------------------ commit: computed blocks become findable
    def commit(self, request_id: RequestId) -> list[int]:
        """Mark every reserved token of the request as computed (its K/V are written); index newly full blocks.

        Call after the model step that wrote them: a block becomes findable only once its K/V exist (index it at
        allocation and a second request in the same step could "hit" a block whose K/V are still unwritten).
        Returns the ids of blocks newly indexed.

        If a newly full block's hash is already indexed under another block (two requests computed the same prefix
        at the same time, or a fully cached prompt recomputed its last block), the request switches to the indexed
        block and frees its duplicate: one block per hash, and every chain a request holds is the indexed chain,
        which keeps "a parent is evicted after its children" true.
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "commit")
        req.num_computed_tokens = req.num_tokens
        if not self.enable_prefix_caching:
            return []
        B = self.block_size
        blocks = self.pool.blocks
        indexed: list[int] = []
        num_full = req.num_computed_tokens // B
        for j in range(len(req.block_hashes), num_full):
            parent = req.block_hashes[j - 1] if j else ROOT_HASH
            if j and blocks[req.block_ids[j - 1]].block_hash != parent:
                break  # the parent is not the indexed block (a hash collision left it unindexed): stop the chain
            key = CachedBlockKey(parent, tuple(req.token_ids[j * B:(j + 1) * B]), self.extra_key)
            block_hash = hash_block_tokens(parent, key.token_ids, self.extra_key)
            bid = req.block_ids[j]
            entry = self.index.entry_for_hash(block_hash)
            if entry is None:
                if blocks[bid].block_hash is None:
                    self.index.insert(bid, block_hash, key)
                    blocks[bid].block_hash = block_hash  # invariant: indexed <=> block_hash set
                    indexed.append(bid)
                    self._emit("cache", bid, request_id, block_hash)
            elif entry.block_id != bid:
                if entry.key != key:
                    req.block_hashes.append(block_hash)
                    break  # a genuine collision: leave this block (and so its children) out of the index
                # Deduplicate: hold the indexed copy, release ours (its K/V are the same tokens' K/V).
                self._touch([entry.block_id], request_id)
                req.block_ids[j] = entry.block_id
                self._release([bid], request_id)
            req.block_hashes.append(block_hash)
        return indexed

    # ------------------------------------------------------------------ fork (copy-on-write)
    def fork(self, parent_id: RequestId, child_ids: Sequence[RequestId]) -> ForkResult:
        """Create ``len(child_ids)`` children sharing every block of ``parent_id`` (parallel sampling, beams).

        Each shared block's refcount goes up by exactly the number of children — once per new table holding it
        (invariant 1; one more and the blocks would never be freed). Nothing is copied now; the first
        write into a shared, not-full last block copies it (:meth:`append_slots`). The parent must be committed.
        """
        parent = self._requests.get(parent_id)
        if parent is None:
            raise UnknownRequestError(parent_id, "fork")
        children = list(child_ids)
        if not children:
            raise ValueError("fork needs at least one child id")
        if len(set(children)) != len(children):
            raise ValueError(f"child ids must be distinct, got {children!r}")
        for cid in children:
            if cid in self._requests:
                raise DuplicateRequestError(cid)
        if parent.num_computed_tokens != parent.num_tokens:
            raise ValueError(
                f"request {parent_id!r} has {parent.num_tokens - parent.num_computed_tokens} reserved tokens not yet "
                "committed; fork after the step that computes them (commit), so children share written K/V"
            )
        # --- validated
        for _ in children:
            self.pool.incref(parent.block_ids)  # +1 per block per child: exact
        for cid in children:
            self._requests[cid] = RequestKV(cid, list(parent.block_ids), list(parent.token_ids),
                                            parent.num_computed_tokens, parent.num_cached_tokens,
                                            list(parent.block_hashes))
        return ForkResult(parent_id, tuple(children), tuple(parent.block_ids))

    # ------------------------------------------------------------------ free / evict
    def _release(self, block_ids: Sequence[int], request_id: RequestId) -> None:
        self.pool.free(block_ids)
        if self._listeners:
            for bid in block_ids:
                if self.pool.blocks[bid].ref_cnt == 0:
                    self._emit("free", bid, request_id, self.pool.blocks[bid].block_hash)

    def free(self, request_id: RequestId) -> list[int]:
        """Release a request's blocks, **last block first**; return the ids in the order released.

        Each refcount drops by one; a block reaching 0 joins the free queue's tail — cached-free if indexed (K/V and
        hash kept, findable until evicted), free-empty otherwise. Reverse order puts a chain's tail ahead of its
        parent in the queue, so eviction cuts a cached prefix from its end (invariant 5). Freeing an unknown or
        already freed request raises :class:`UnknownRequestError` and changes nothing (a double free must never
        decrement someone else's refcount).
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "free")
        released = req.block_ids[::-1]
        self._release(released, request_id)
        del self._requests[request_id]
        return released

    def truncate(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """Roll a request back to its first ``num_tokens`` tokens (rejected speculative tokens); return freed blocks.

        Blocks past the new end are released last-first, like :meth:`free` (the full ones stay cached: their K/V are
        still right for their tokens). If the new last block is partial but indexed (it was full before), it keeps
        its place in the index — an indexed block is immutable — and the request's next write into it copies it
        first (:meth:`append_slots`), exactly as for a shared block. Nothing is evicted.
        """
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "truncate")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 < num_tokens <= req.num_tokens:
            raise ValueError(f"num_tokens must be an int in [1, {req.num_tokens}], got {num_tokens!r}")
        B = self.block_size
        keep = cdiv(num_tokens, B)
        dropped = req.block_ids[keep:][::-1]
        self._release(dropped, request_id)
        del req.block_ids[keep:]
        del req.token_ids[num_tokens:]
        del req.block_hashes[num_tokens // B:]  # only blocks still full keep their hash in the request's chain
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)
        req.num_cached_tokens = min(req.num_cached_tokens, num_tokens)
        return dropped

    def return_to_head(self, block_ids: Sequence[int]) -> None:
        """Put free-empty blocks a rollback just released back at the head of the free queue, where allocation
        took them, so a failed step leaves the LRU order as it found it. ``block_ids`` last-taken first."""
        queue = self.pool.free_block_queue
        for bid in block_ids:
            if bid in queue and self.pool.blocks[bid].block_hash is None:
                queue.move_to_head(bid)

    def evict(self, num_blocks: int = 1) -> list[int]:
        """Evict up to ``num_blocks`` cached-free blocks in LRU order (head of the free queue first); return them.

        Allocation evicts on its own; this explicit form is for demos, tests and a future "drop cache" call. The
        blocks stay in the free queue, now free-empty. O(blocks scanned): free-empty blocks ahead are skipped.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        evicted: list[int] = []
        for block in self.pool.free_block_queue:
            if len(evicted) == num_blocks:
                break
            if block.block_hash is not None:
                evicted.append(block.block_id)
        for bid in evicted:
            self._drop_hash(self.pool.blocks[bid], None)
        return evicted

    def reset_prefix_cache(self) -> int:
        """Evict every cached-free block (vLLM's ``reset_prefix_cache``); return how many."""
        return len(self.evict(self.pool.num_free_blocks))

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert every invariant of the module docstring (O(blocks + table entries); tests and notebooks)."""
        pool = self.pool
        pool.check_invariants()  # refcount 0 <=> in free queue; free + used == total
        holders = [0] * pool.num_blocks
        for req in self._requests.values():
            assert len(req.block_ids) == cdiv(req.num_tokens, self.block_size), f"{req.request_id}: table size"
            assert 0 <= req.num_computed_tokens <= req.num_tokens
            for bid in req.block_ids:
                holders[bid] += 1
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: refcount {block.ref_cnt} but {holders[block.block_id]} tables hold it"
            )
        indexed = {e.block_id: e for e in self.index}
        assert len(indexed) == len(self.index), "a block is indexed twice"
        for block in pool.blocks:
            entry = indexed.get(block.block_id)
            assert (entry is not None) == (block.block_hash is not None), f"block {block.block_id}: index/hash"
            if entry is not None:
                assert entry.block_hash == block.block_hash == entry.key.block_hash()
        if not self.enable_prefix_caching:
            assert len(self.index) == 0
        # Invariant 5: a cached-free block's parent is in use, or later in the free queue (evicted after it).
        position = {bid: i for i, bid in enumerate(pool.free_block_queue.block_ids())}
        for entry in indexed.values():
            if pool.blocks[entry.block_id].ref_cnt == 0 and entry.key.parent_hash != ROOT_HASH:
                parent = self.index.entry_for_hash(entry.key.parent_hash)
                assert parent is not None, f"cached block {entry.block_id} outlived its parent"
                if pool.blocks[parent.block_id].ref_cnt == 0:
                    assert position[parent.block_id] > position[entry.block_id], (
                        f"parent block {parent.block_id} would be evicted before its child {entry.block_id}"
                    )

    def __repr__(self) -> str:
        s = self.stats()
        return (f"KVCacheManager(blocks={s.num_blocks}x{s.block_size}, in_use={s.num_in_use}, "
                f"cached_free={s.num_cached_free}, free_empty={s.num_free_empty}, requests={s.num_requests}, "
                f"prefix_caching={'on' if self.enable_prefix_caching else 'off'})")
