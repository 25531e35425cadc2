"""Notebook 06's exercises: predict which cached blocks an allocation evicts, and fix the naive evictor."""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.kv import OutOfBlocksError
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager


def _random_manager(rng: np.random.Generator) -> KVCacheManager:
    """A 12-block manager (block size 2) after a few requests, most of them finished: a mixed free queue."""
    mgr = KVCacheManager(12, 2)
    for i in range(int(rng.integers(1, 6))):
        prompt = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 8)))]
        req = KVRequest(i, prompt)
        if mgr.allocate(req) is None:
            continue
        req.num_computed_tokens = req.num_tokens
        mgr.commit(req)
        if rng.random() < 0.7:
            mgr.free(i)
    return mgr


@exercise("write my_evictions(free_queue, n): the ids of the cached blocks an allocation of n blocks evicts")
def check_evictions(fn) -> str:
    """Ask ``fn``, then let the real manager allocate n blocks and compare with the ``evict`` events it emits."""
    rng = np.random.default_rng(5)
    tried = 0
    for case in range(80):
        mgr = _random_manager(rng)
        queue = mgr.free_queue()
        if not queue:
            continue
        n = int(rng.integers(1, len(queue) + 1))
        predicted = fn(list(queue), n)
        predicted = None if predicted is None else list(predicted)
        seen: list[int] = []
        mgr.add_listener(lambda e: seen.append(e.block_id) if e.kind == "evict" else None)
        assert mgr.allocate(KVRequest("new", [1000 + k for k in range(2 * n)])) is not None  # n new blocks, no hits
        if predicted == seen:
            tried += 1
            continue
        where = f"case {case}: free queue (block, cached) head first {queue}, n={n}: expected {seen}, got {predicted}"
        taken = [b for b, _ in queue[:n]]
        if predicted is None or any(b not in taken for b in predicted) or sorted(predicted) == sorted(seen):
            fail("an allocation of n blocks takes the first n blocks of the free queue, head first (least "
                 "recently freed)", where)
        cached = dict(queue)
        if any(not cached[b] for b in predicted):
            fail("a free-empty block holds nothing: taking it evicts nothing", where)
        fail("every cached block among the n taken is evicted, in queue order", where)
    assert tried > 20, f"the check itself saw only {tried} cases"  # guards the check, not the answer
    return f"my_evictions predicts the manager's evictions in all {tried} cases"


def safe_victims_reference(lru_order: list[int], refcount: dict[int, int], n: int) -> list[int]:
    """The rule ``check_safe_victims`` grades: the first ``n`` blocks of ``lru_order`` nobody holds, in that order;
    ``OutOfBlocksError`` when fewer than ``n`` are free. Notebook 14 plugs it in when a student has not pasted their
    own ``safe_victims``."""
    victims = [b for b in lru_order if refcount[b] == 0][:n]
    if len(victims) < n:
        raise OutOfBlocksError(n, len(victims), len(lru_order))
    return victims


@exercise("write safe_victims(lru_order, refcount, n): the first n blocks of lru_order with refcount 0, or "
          "raise OutOfBlocksError")
def check_safe_victims(fn) -> str:
    rng = np.random.default_rng(8)
    for case in range(200):
        order = [int(b) for b in rng.permutation(10)]
        refcount = {b: int(rng.choice([0, 0, 1, 2])) for b in order}
        n = int(rng.integers(1, 6))
        free = [b for b in order if refcount[b] == 0]
        given_order, given_rc = list(order), dict(refcount)
        where = f"case {case}: lru_order {order}, refcounts {refcount}, n={n}"
        try:
            got = fn(given_order, given_rc, n)
            refused = False
        except OutOfBlocksError:
            got, refused = None, True
        require((given_order, given_rc) == (order, refcount), "change nothing: the evictor only chooses",
                f"{where}: the inputs became {given_order}, {given_rc}")
        if len(free) < n:
            require(refused, "fewer than n blocks nobody holds: raise OutOfBlocksError instead of returning fewer "
                             "(or in-use) blocks", f"{where}: only {len(free)} evictable, got {got}")
            continue
        require(not refused, "refuse only when fewer than n blocks are free", f"{where}: {len(free)} evictable")
        got = list(got)
        held = [b for b in got if refcount[b] > 0]
        require(not held, "never evict a block a request still holds (refcount > 0) — the naive design's bug",
                f"{where}: got {got}, blocks {held} are in use")
        require(got == free[:n], "take victims in LRU order: the least recently used free blocks first",
                f"{where}: expected {free[:n]}, got {got}")
    return "safe_victims never touches a block in use, keeps LRU order, and refuses cleanly"
