"""Dynamic block size, built so that it can run in the real engine: one physical block, two allocation grains.

The roadmap idea this tests: *small blocks waste little memory on short sequences, large blocks cost less
overhead on long ones — so give each sequence the size that suits its length.* Taken literally (two block
sizes in one pool), the attention kernel would need two layouts, the budget would be split into two pools that
fragment it, and a prefix hashed in 16-token blocks could never be found by a request hashing 256-token blocks.
This module keeps what can be kept and measures the rest:

* **One physical block size** ``block_size`` for the KV pool, the attention kernel, the block tables and the
  prefix hashes. So prefix sharing across "sizes" is complete: every request hashes the same chain.
* **Two allocation grains.** A request's first ``threshold_tokens`` tokens get blocks one at a time, as in the
  plain manager. Past the threshold, blocks come in *runs*: when the request needs a block at the start of a run
  it takes ``run_blocks`` blocks with consecutive physical ids at once, uses the first and **reserves** the rest
  for its next blocks. A long sequence therefore lies in the pool as a few contiguous slabs — the layout of a
  large block (one table run, one contiguous copy per slab) — while a short one never reserves anything.
* **The budget is shared.** Reserved blocks come out of the same pool. They are the cost: slots held but empty
  (internal fragmentation of the large grain). A reservation is a *hint*: when an allocation would fail, every
  request's reserve is taken back first, so reserves never cause a preemption the plain manager would not make.
  Runs are only cut from free-*empty* blocks (never by evicting cached blocks out of LRU order); when no run is
  free, the request falls back to single blocks and the run is counted as missed.

Invariants (``check_invariants``, on top of the plain manager's):

1. a reserved block has refcount 1, no hash, and is in no block table (one owner: the reserve of one request);
2. ``in use = blocks named by tables + reserved blocks``;
3. a request's reserve is a run of consecutive ids that continues its table's last block (when it was cut).

The plain manager's public API is unchanged (``allocate`` / ``append_slots`` / ``commit`` / ``truncate`` /
``free`` / ``fork`` / ``lookup``, same return values), so the scheduler and the engine drive it as they are:
:func:`dynamic_blocks_factory` builds an :class:`~minienv.engine.InferenceEngine` on it (the
:class:`~minienv.kv.interface.KVManager` seam).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from minienv.kv.block_table import cdiv
from minienv.kv.errors import KVBudgetError
from minienv.kv.interface import KVRequestState
from minienv.kv.kv_cache_manager import KVCacheManager, RequestId, SlotAllocation, check_token_ids

__all__ = ["DynamicBlockConfig", "DynamicKVCacheManager", "DynamicStats", "dynamic_blocks_factory"]


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KVBudgetError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class DynamicBlockConfig:
    """The scheme's knobs: physical ``block_size``; blocks one by one up to ``threshold_tokens``; then runs of
    ``run_blocks`` contiguous blocks (a "large block" of ``run_blocks * block_size`` slots).

    Consistency (checked here, :class:`~minienv.kv.errors.KVBudgetError` otherwise): all three are ints;
    ``block_size >= 1``; ``threshold_tokens >= 0`` and a multiple of ``block_size`` (runs start on a block
    boundary); ``run_blocks >= 2`` (a run of one block is the plain manager).
    """

    block_size: int = 16
    threshold_tokens: int = 128
    run_blocks: int = 8

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("threshold_tokens", self.threshold_tokens, 0)
        _positive_int("run_blocks", self.run_blocks, 2)
        if self.threshold_tokens % self.block_size:
            raise KVBudgetError(
                f"threshold_tokens ({self.threshold_tokens}) must be a multiple of block_size ({self.block_size}): "
                "runs of large blocks start on a block boundary"
            )

    @property
    def large_block_tokens(self) -> int:
        return self.run_blocks * self.block_size

    def check_budget(self, kv_budget_tokens: int) -> None:
        """A budget must hold at least one large block (else no run could ever be cut)."""
        if isinstance(kv_budget_tokens, bool) or not isinstance(kv_budget_tokens, int):
            raise KVBudgetError(f"kv_budget_tokens must be an int, got {kv_budget_tokens!r}")
        if kv_budget_tokens < self.large_block_tokens:
            raise KVBudgetError(
                f"a KV budget of {kv_budget_tokens} tokens cannot hold one large block of run_blocks x block_size = "
                f"{self.run_blocks} x {self.block_size} = {self.large_block_tokens} tokens"
            )


@dataclass(frozen=True)
class DynamicStats:
    """What the scheme did: runs cut, runs missed (no free-empty run: single blocks instead), reserves reclaimed
    under pressure, and blocks reserved right now."""

    runs_cut: int
    runs_missed: int
    reserves_reclaimed: int
    reserved_blocks: int


class DynamicKVCacheManager(KVCacheManager):
    """A :class:`KVCacheManager` that allocates past ``threshold_tokens`` in runs of ``run_blocks`` contiguous
    blocks (see the module docstring). Same API and return values; ``reserved(rid)`` and ``dynamic_stats()`` add
    what the scheme holds."""

    def __init__(self, num_blocks: int, config: DynamicBlockConfig, *, enable_prefix_caching: bool = True,
                 extra_key: bytes = b""):
        if not isinstance(config, DynamicBlockConfig):
            raise TypeError(f"config must be a DynamicBlockConfig, got {type(config).__name__}")
        super().__init__(num_blocks, config.block_size, enable_prefix_caching=enable_prefix_caching,
                         extra_key=extra_key)
        config.check_budget(self.kv_budget_tokens)
        self.config = config
        self._reserve: dict[RequestId, list[int]] = {}
        self._ctx: tuple[RequestId, int, list[int]] | None = None  # (request, next logical block, own reserve)
        self.runs_cut = 0
        self.runs_missed = 0
        self.reserves_reclaimed = 0

    @classmethod
    def from_budget(cls, kv_budget_tokens: int, config: DynamicBlockConfig, **kwargs) -> "DynamicKVCacheManager":
        if not isinstance(config, DynamicBlockConfig):
            raise TypeError(f"config must be a DynamicBlockConfig, got {type(config).__name__}")
        config.check_budget(kv_budget_tokens)
        return cls(kv_budget_tokens // config.block_size, config, **kwargs)

    # ------------------------------------------------------------------ observers
    def reserved(self, request_id: RequestId) -> list[int]:
        """Blocks held for the request's next blocks (not in its table yet)."""
        return list(self._reserve.get(request_id, ()))

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(r) for r in self._reserve.values())

    def dynamic_stats(self) -> DynamicStats:
        return DynamicStats(self.runs_cut, self.runs_missed, self.reserves_reclaimed, self.num_reserved_blocks)

    # ------------------------------------------------------------------ reserves
    def _hold(self, block_ids: Sequence[int]) -> None:
        """Take specific free-empty blocks out of the free queue (refcount 0 -> 1)."""
        queue = self.pool.free_block_queue
        for bid in block_ids:
            block = self.pool.blocks[bid]
            assert block.ref_cnt == 0 and block.block_hash is None
            queue.remove(block)
            block.ref_cnt = 1

    def _release_reserve(self, request_id: RequestId) -> list[int]:
        """Give a request's reserve back to the head of the free queue (never used: first to be reused)."""
        ids = self._reserve.pop(request_id, [])
        if ids:
            self.pool.free(list(ids))
            self.return_to_head(ids[::-1])
        return ids

    def _find_run(self, m: int) -> int | None:
        """The lowest id starting ``m`` consecutive free-empty blocks, or None. O(num_blocks)."""
        run = 0
        for block in self.pool.blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                run += 1
                if run == m:
                    return block.block_id - m + 1
            else:
                run = 0
        return None

    def _take_free_blocks(self, n: int, request_id: RequestId) -> list[int]:
        """Hand out ``n`` blocks for logical positions ``j0 .. j0 + n - 1`` of the request in the current call:
        one by one before the threshold; past it, the next block of the request's run, or a newly cut run."""
        ctx = self._ctx
        if ctx is None or ctx[0] != request_id or n == 0:
            return super()._take_free_blocks(n, request_id)
        _, j, own = ctx
        t0 = self.config.threshold_tokens // self.block_size
        m = self.config.run_blocks
        blocks = self.pool.blocks
        out: list[int] = []
        for i in range(n):
            pos = j + i
            if pos >= t0 and own and blocks[own[0]].ref_cnt == 0 and blocks[own[0]].block_hash is None:
                bid = own.pop(0)  # the next block of this request's run (lent to the free queue for this call)
                self._hold([bid])
                out.append(bid)
                continue
            own.clear()  # a reserve not used in order is not a run any more
            remaining = n - i
            if pos >= t0 and (pos - t0) % m == 0 and self.pool.num_free_blocks >= remaining + m - 1:
                start = self._find_run(m)
                if start is not None:
                    run = list(range(start, start + m))
                    self._hold(run)
                    self.runs_cut += 1
                    out.append(run[0])
                    own.extend(run[1:])
                    self.pool.free(run[1:])  # lent to the free queue's tail until the call ends (see below)
                    continue
                self.runs_missed += 1
            out.extend(super()._take_free_blocks(1, request_id))
        self._ctx = (request_id, j + n, own)
        return out

    def _with_reserves(self, request_id: RequestId, first_block: int, call) -> SlotAllocation | None:
        """Run ``call`` (the plain ``allocate`` / ``append_slots``) with reserves counted as free, then keep what is
        left of the request's run as its reserve.

        During the call a reserve is *lent* to the free queue's tail: the plain room check counts it, and
        :meth:`_take_free_blocks` takes the request's own run back in order. If there is no room, every other
        request's reserve is lent too and the call is tried once more (reserves never cause a preemption). After
        the call the blocks still free are held again — on ``None`` that restores the manager exactly (all or
        nothing, like the plain manager); reserves used by others are gone, and their owners' leftovers return to
        the head of the free queue (never used: reused first, before any cached block is evicted).
        """
        own = self._reserve.pop(request_id, [])
        lent = list(own)
        self.pool.free(lent)
        self._ctx = (request_id, first_block, own)
        others: dict[RequestId, list[int]] = {}
        try:
            alloc = call()
            if alloc is None and self._reserve:
                others = self._reserve
                self._reserve = {}
                for ids in others.values():
                    self.pool.free(list(ids))
                self._ctx = (request_id, first_block, own)
                alloc = call()
        except BaseException:
            alloc = None  # the plain manager validates before it changes anything: restore the reserves, re-raise
            self._restore(request_id, lent, others)
            raise
        finally:
            ctx, self._ctx = self._ctx, None
        blocks = self.pool.blocks
        if alloc is None:
            self._restore(request_id, lent, others)
            return None
        left = ctx[2] if ctx is not None else []
        if left and all(blocks[b].ref_cnt == 0 and blocks[b].block_hash is None for b in left):
            self._hold(left)
            self._reserve[request_id] = list(left)
        spare = [b for b in lent + [b for ids in others.values() for b in ids]
                 if blocks[b].ref_cnt == 0 and b not in self._reserve.get(request_id, ())]
        if others:
            self.reserves_reclaimed += len(others)
        self.return_to_head(spare[::-1])
        return alloc

    def _restore(self, request_id: RequestId, lent: list[int], others: dict[RequestId, list[int]]) -> None:
        """Take lent reserves back exactly as they were (a call that found no room, or raised)."""
        self._hold(lent)
        if lent:
            self._reserve[request_id] = list(lent)
        for rid, ids in others.items():
            self._hold(ids)
            self._reserve[rid] = ids

    # ------------------------------------------------------------------ the plain API, reserve-aware
    def allocate(self, request: KVRequestState, num_new_tokens: int | None = None) -> SlotAllocation | None:
        if not hasattr(request, "all_token_ids") or self.has_request(request.request_id):
            return super().allocate(request, num_new_tokens)  # raises
        prompt = check_token_ids(request.all_token_ids, f"request {request.request_id!r}'s all_token_ids")
        first = len(self._lookup(prompt).block_ids)
        return self._with_reserves(request.request_id, first, lambda: super(DynamicKVCacheManager, self).allocate(
            request, num_new_tokens))

    def append_slots(self, request: KVRequestState, num_new_tokens: int) -> SlotAllocation | None:
        if not hasattr(request, "request_id") or not self.has_request(request.request_id):
            return super().append_slots(request, num_new_tokens)  # raises
        first = len(self.request(request.request_id).block_ids)
        return self._with_reserves(request.request_id, first, lambda: super(
            DynamicKVCacheManager, self).append_slots(request, num_new_tokens))

    def free(self, request_id: RequestId) -> list[int]:
        released = super().free(request_id)  # validates first
        self._release_reserve(request_id)
        return released

    def truncate(self, request_id: RequestId, num_tokens: int) -> list[int]:
        dropped = super().truncate(request_id, num_tokens)  # validates first
        self._release_reserve(request_id)  # the run no longer continues the table's end
        return dropped

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """The plain manager's invariants with reserves set aside, then the reserve invariants."""
        held = [bid for ids in self._reserve.values() for bid in ids]
        assert len(set(held)) == len(held), "a block is reserved twice"
        for rid, ids in self._reserve.items():
            assert self.has_request(rid), f"reserve of {rid!r}, which holds no table"
            table = self.request(rid).block_ids
            for bid in ids:
                block = self.pool.blocks[bid]
                assert block.ref_cnt == 1 and block.block_hash is None, f"reserved block {bid} is shared or hashed"
                assert bid not in table, f"reserved block {bid} is also in {rid!r}'s table"
            assert ids == list(range(ids[0], ids[0] + len(ids))), f"reserve of {rid!r} is not a run: {ids}"
        # Lend the reserved blocks to the free queue (tail, free-empty) for the plain checks, then take them back.
        queue = self.pool.free_block_queue
        for bid in held:
            self.pool.blocks[bid].ref_cnt = 0
            queue.append(self.pool.blocks[bid])
        try:
            super().check_invariants()
        finally:
            self._hold(held)


def dynamic_blocks_factory(config: DynamicBlockConfig) -> Callable[[int, int, bool], DynamicKVCacheManager]:
    """``InferenceEngine(..., kv_cache_manager_factory=dynamic_blocks_factory(config))``: the engine built on a
    :class:`DynamicKVCacheManager` from the start (same pool, budget and prefix-caching setting as its own manager
    would have). ``config.block_size`` must equal the engine's ``block_size`` (the KV pool and the attention kernel
    are laid out for one physical block size)."""
    def factory(num_blocks: int, block_size: int, enable_prefix_caching: bool) -> DynamicKVCacheManager:
        if config.block_size != block_size:
            raise KVBudgetError(f"config.block_size {config.block_size} != the engine's block size {block_size}: "
                                "the KV pool and the attention kernel are laid out for one physical block size")
        return DynamicKVCacheManager(num_blocks, config, enable_prefix_caching=enable_prefix_caching)
    return factory
