"""The student's capstone class in the real engine: :func:`plug`, and :func:`audit` of its invariants.

The student's ``MyKVCacheManager`` already takes what the engine's :class:`~minienv.kv.interface.KVManager`
protocol takes — the request object in ``allocate`` / ``append_slots`` / ``commit`` (it reads
``request.all_token_ids`` and ``request.num_computed_tokens`` itself), ids elsewhere — so the engine's calls reach
it unchanged: no token is read, copied or translated here. :class:`PluggedManager` supplies only what the contract
leaves out: the protocol's return records (a :class:`~minienv.kv.interface.SlotAllocation` built from the
student's block table, a :class:`~minienv.kv.interface.PrefixHit`), the reserved-slot count per request, the
prefix-cache counters, a pool view and the events a widget or metrics listen to. It adds no policy: every block
id, refcount, hit and eviction is the student's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from minienv.exercises._check import require
from minienv.kv.block_table import cdiv
from minienv.kv.errors import KVCacheError
from minienv.kv.hashing import hash_block_chain
from minienv.kv.interface import KVCacheStats, KVEvent, KVRequestState, PrefixHit, SlotAllocation
from minienv.kv.prefix_cache import PrefixCacheStats


@dataclass(frozen=True, slots=True)
class BlockState:
    """One block as the pool view shows it (what :func:`minienv.viz.kv_views.manager_cells` reads)."""

    block_id: int
    ref_cnt: int
    block_hash: bytes | None


class _PoolView:
    """``manager.pool``: the counts the engine reads after every step, and the blocks a view draws."""

    def __init__(self, plugged: "PluggedManager", num_blocks: int):
        self._m, self.num_blocks = plugged, num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._m.core.free_queue())

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def blocks(self) -> list[BlockState]:
        core = self._m.core
        return [BlockState(b, core.ref_cnt(b), self._m._hash_of.get(b, b"?") if core.is_cached(b) else None)
                for b in range(self.num_blocks)]


@dataclass(slots=True)
class _Held:
    """What the contract leaves out about one request: slots reserved, and its admission's lookup (to uncount)."""

    block_ids: list[int]
    num_tokens: int
    num_queried_tokens: int
    num_cached_tokens: int


class PluggedManager:
    """The student's manager (``core``) seen through the :class:`~minienv.kv.interface.KVManager` protocol.

    Not supported, with a clear error: rolling a request back to fewer tokens (``truncate``, a failed step's
    ``undo_append_slots``: speculative decoding), reserving slots ahead of ``num_computed_tokens`` (static
    batching's padding), ``reset_prefix_cache``. Events (``evict``, ``cache``, ``free``) are derived from the
    student's observers, and only while someone listens (a widget).
    """

    extra_key = b""

    def __init__(self, core: Any, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.core, self.block_size = core, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = _PoolView(self, num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._held: dict[Any, _Held] = {}
        self._listeners: list[Callable[[KVEvent], None]] = []
        self._hash_of: dict[int, bytes] = {}  # block -> chain hash, for events and views (kept while listened to)

    num_blocks = property(lambda self: self.pool.num_blocks)
    kv_budget_tokens = property(lambda self: self.pool.num_blocks * self.block_size)
    num_free_blocks = property(lambda self: self.pool.num_free_blocks)

    # ------------------------------------------------------------------ events
    def add_listener(self, listener: Callable[[KVEvent], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[KVEvent], None]) -> None:
        self._listeners.remove(listener)

    def _emit(self, event: KVEvent) -> None:
        for listener in self._listeners:
            listener(event)

    def _cached(self) -> set[int]:
        return {b for b in range(self.num_blocks) if self.core.is_cached(b)} if self._listeners else set()

    def _evicted_since(self, cached: set[int], request_id: Any) -> None:
        for b in sorted(cached):
            if not self.core.is_cached(b):
                self._emit(KVEvent("evict", b, request_id, self._hash_of.pop(b, None)))

    # ------------------------------------------------------------------ observers
    def has_request(self, request_id: Any) -> bool:
        return request_id in self._held

    def request_ids(self) -> list:
        return list(self._held)

    def _table(self, request_id: Any, num_tokens: int) -> list[int]:
        table = list(self.core.block_table(request_id))
        if len(table) != cdiv(num_tokens, self.block_size):
            raise KVCacheError(f"your block_table({request_id!r}) has {len(table)} blocks for {num_tokens} tokens; "
                               f"it must have ceil(tokens / block_size) = {cdiv(num_tokens, self.block_size)}")
        return table

    def request(self, request_id: Any) -> _Held:
        held = self._held[request_id]
        held.block_ids = self._table(request_id, held.num_tokens)
        return held

    def block_ids(self, request_id: Any) -> list[int]:
        return list(self.request(request_id).block_ids)

    def ref_cnt(self, block_id: int) -> int:
        return self.core.ref_cnt(block_id)

    def free_queue(self) -> list[tuple[int, bool]]:
        return [(b, bool(self.core.is_cached(b))) for b in self.core.free_queue()]

    # ------------------------------------------------------------------ the protocol's calls, passed through
    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        hit = tuple(self.core.lookup(token_ids))
        return PrefixHit(hit, (), len(hit) * self.block_size)

    def _slots(self, request_id: Any, start: int, before: int, n_cached: int) -> SlotAllocation:
        held = self.request(request_id)
        table = held.block_ids
        return SlotAllocation(request_id, held.num_tokens - start, start, tuple(table[start // self.block_size:]),
                              self.block_size, tuple(table[before:]), (), n_cached)

    def allocate(self, request: KVRequestState, num_new_tokens: int | None = None) -> SlotAllocation | None:
        tokens = request.all_token_ids
        if num_new_tokens is None:
            num_new_tokens = len(tokens) - self.lookup(tokens).num_cached_tokens
        cached = self._cached()
        n_cached = self.core.allocate(request, num_new_tokens)
        if n_cached is None:
            return None
        rid = request.request_id
        self._held[rid] = _Held([], n_cached + num_new_tokens, len(tokens), n_cached)
        s = self.prefix_stats
        s.requests, s.queries, s.hits = s.requests + 1, s.queries + len(tokens), s.hits + n_cached
        self._evicted_since(cached, rid)
        return self._slots(rid, n_cached, n_cached // self.block_size, n_cached)

    def append_slots(self, request: KVRequestState, num_new_tokens: int) -> SlotAllocation | None:
        rid = request.request_id
        held = self._held[rid]
        start = held.num_tokens
        if request.num_computed_tokens != start:
            raise KVCacheError(f"the capstone's append_slots reserves slots after the computed tokens: request "
                               f"{rid!r} has {start} slots reserved but {request.num_computed_tokens} computed "
                               "(run without static batching's padding)")
        cached, before = self._cached(), len(held.block_ids)
        if not self.core.append_slots(request, num_new_tokens):
            return None
        held.num_tokens = start + num_new_tokens
        self._evicted_since(cached, rid)
        return self._slots(rid, start, before, 0)

    def commit(self, request: KVRequestState) -> list[int]:
        """The student's commit; returns the blocks it indexed (read through ``is_cached``)."""
        table = self._held[request.request_id].block_ids
        was = [self.core.is_cached(b) for b in table]
        self.core.commit(request)
        new = [j for j, b in enumerate(table) if not was[j] and self.core.is_cached(b)]
        if new and self._listeners:
            hashes = hash_block_chain(request.all_token_ids[:(new[-1] + 1) * self.block_size], self.block_size)
            for j in new:
                self._hash_of[table[j]] = hashes[j]
                self._emit(KVEvent("cache", table[j], request.request_id, hashes[j]))
        return [table[j] for j in new]

    def free(self, request_id: Any) -> list[int]:
        released = self.core.block_table(request_id)[::-1]
        self.core.free(request_id)
        del self._held[request_id]
        for b in released if self._listeners else ():
            if self.core.ref_cnt(b) == 0:
                self._emit(KVEvent("free", b, request_id))
        return released

    def undo_allocate(self, request_id: Any) -> list[int]:
        """A failed step's admission: freed, and its lookup uncounted."""
        held, s = self._held[request_id], self.prefix_stats
        s.requests, s.queries = s.requests - 1, s.queries - held.num_queried_tokens
        s.hits -= held.num_cached_tokens
        return self.free(request_id)

    def undo_append_slots(self, request_id: Any, num_tokens: int, *, kv_written: bool) -> list[int]:
        """A failed step's append: rolled back as :meth:`truncate` would (the contract has no rollback)."""
        return self.truncate(request_id, num_tokens)

    def truncate(self, request_id: Any, num_tokens: int) -> list[int]:
        raise KVCacheError("the capstone's manager cannot roll a request back to fewer tokens (a failed step, "
                           "speculative decoding): run the engine without speculation")

    def stats(self) -> KVCacheStats:
        free = self.core.free_queue()
        cached = sum(1 for b in free if self.core.is_cached(b))
        s = self.prefix_stats
        return KVCacheStats(self.num_blocks, self.block_size, len(free) - cached, cached,
                            self.num_blocks - len(free), len(self._held), s.requests, s.queries, s.hits, 0, 0, 0)

    def check_invariants(self) -> None:
        audit(self.core, self.num_blocks, {rid: self.request(rid).block_ids for rid in self._held})


def plug(manager_class: type) -> Callable[[int, int, bool], PluggedManager]:
    """``InferenceEngine(..., kv_cache_manager_factory=plug(MyKVCacheManager))``: the student's class in the engine."""
    def factory(num_blocks: int, block_size: int, enable_prefix_caching: bool) -> PluggedManager:
        core = manager_class(num_blocks, block_size, enable_prefix_caching)
        return PluggedManager(core, num_blocks, block_size, enable_prefix_caching)
    return factory


def audit(core: Any, num_blocks: int, tables: dict[Any, Sequence[int]]) -> None:
    """The structural invariants, read through the observers; ``tables`` are the block tables the caller expects."""
    holders = [0] * num_blocks
    for rid, want in tables.items():
        got = list(core.block_table(rid))
        require(got == list(want), "block_table(rid) is the request's blocks in logical order, and only allocate / "
                "append_slots change it", f"request {rid!r}: block_table {got}, expected {list(want)}")
        for b in got:
            holders[b] += 1
    queue = list(core.free_queue())
    require(len(set(queue)) == len(queue), "a block is in the free queue at most once", f"free queue {queue}")
    for b in range(num_blocks):
        rc = core.ref_cnt(b)
        require(rc == holders[b], "a block's refcount equals the number of block tables holding it",
                f"block {b}: ref_cnt {rc}, held by {holders[b]} table(s) {[r for r, t in tables.items() if b in t]}")
        require((rc == 0) == (b in queue), "a block is in the free queue exactly when its refcount is 0 (an in-use "
                "block must never be handed out, so never evicted)",
                f"block {b}: ref_cnt {rc}, {'in' if b in queue else 'not in'} the free queue")
