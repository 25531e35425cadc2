"""KVCacheManager: prefix sharing, copy-on-write, LRU eviction, bad input, and one regression test per known
prefix-cache bug of real engines that applies to this layer (named after the vLLM / nano-vllm / SGLang / LMCache
issue or PR that reported it)."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.kv import kv_cache_manager as kcm
from minienv.kv import prefix_cache
from minienv.kv.errors import KVBudgetError
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import (
    BlockState,
    DuplicateRequestError,
    KVCacheManager,
    UnknownRequestError,
)
from minienv.kv.kv_pool import KVPool

from kv_driver import admit, append, child, compute

B = 4
REQS: dict = {}  # the requests run() made, by id (the test's caller-side state; the manager only reads them)


def run(mgr: KVCacheManager, rid, prompt, decode=()):
    """Allocate + commit a prompt, then append + commit each decode token (what an engine step does); returns the
    admission's allocation (the request is ``REQS[rid]``)."""
    req, alloc = admit(mgr, rid, prompt)
    compute(mgr, req)
    for t in decode:
        append(mgr, req, [t])
        compute(mgr, req)
    mgr.check_invariants()
    REQS[rid] = req
    return alloc


def fork(mgr: KVCacheManager, parent_id, child_ids):
    """``mgr.fork`` of ``REQS[parent_id]``, each child given its own request (a copy of the parent's)."""
    res = mgr.fork(REQS[parent_id], child_ids)
    REQS.update((c, child(REQS[parent_id], c)) for c in child_ids)
    return res


def test_the_manager_reads_the_request_and_keeps_no_copy_of_its_tokens():
    """State owned once: the request holds its tokens and progress; the manager holds block ids and counts."""
    mgr = KVCacheManager(8, B)
    req = KVRequest("a", [1, 2, 3, 4, 5])
    alloc = mgr.allocate(req)
    assert (alloc.start, alloc.num_new_tokens) == (0, 5) and not hasattr(alloc, "token_ids")
    table = mgr.request("a")
    assert not hasattr(table, "token_ids") and not hasattr(table, "num_computed_tokens")
    assert mgr.commit(req) == [] and len(mgr.index) == 0  # nothing computed yet: nothing indexed
    req.num_computed_tokens = 5
    assert mgr.commit(req) == [table.block_ids[0]]  # the manager read the request's new progress
    req.all_token_ids.append(6)  # the caller appends the sampled token, then asks for its slot
    alloc = mgr.append_slots(req, 1)
    assert (alloc.start, alloc.num_new_tokens, table.num_tokens) == (5, 1, 6)
    mgr.check_invariants()


def test_commit_refuses_progress_beyond_the_reserved_slots():
    mgr = KVCacheManager(8, B)
    req = KVRequest("a", list(range(9)))
    mgr.allocate(req, 3)
    snap = mgr.snapshot()
    for bad in (4, -1, "3", 2.0):
        req.num_computed_tokens = bad
        with pytest.raises(ValueError, match="num_computed_tokens"):
            mgr.commit(req)
        assert mgr.snapshot() == snap
    with pytest.raises(TypeError, match="pass the request object"):
        mgr.commit("a")
    with pytest.raises(TypeError, match="pass the request object"):
        mgr.allocate("b")
    assert mgr.snapshot() == snap


# ---------------------------------------------------------------------- prefix sharing
def test_shared_system_prompt_shares_full_blocks():
    mgr = KVCacheManager(32, B)
    system = list(range(100, 112))  # 3 full blocks
    a = run(mgr, "a", system + [1, 2, 3])
    b = run(mgr, "b", system + [7, 8])
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 12
    assert mgr.block_ids("a")[:3] == mgr.block_ids("b")[:3]
    assert [mgr.ref_cnt(x) for x in mgr.block_ids("a")[:3]] == [2, 2, 2]
    assert b.num_new_tokens == 2 and list(b.positions) == [12, 13]
    s = mgr.stats()
    assert (s.prefix_queries_tokens, s.prefix_hits_tokens) == (15 + 14, 12)
    assert s.prefix_hit_rate == pytest.approx(12 / 29)


def test_cached_free_block_is_hit_after_owner_finishes():
    mgr = KVCacheManager(16, B)
    run(mgr, "a", list(range(9)))
    blocks = mgr.block_ids("a")
    mgr.free("a")
    assert [mgr.block_state(x) for x in blocks] == [BlockState.CACHED_FREE, BlockState.CACHED_FREE,
                                                   BlockState.FREE_EMPTY]
    b = mgr.allocate(KVRequest("b", list(range(9))))
    assert b.num_cached_tokens == 8 and mgr.block_ids("b")[:2] == blocks[:2]
    assert all(mgr.ref_cnt(x) == 1 for x in blocks[:2])
    mgr.check_invariants()


def test_free_releases_last_block_first():
    mgr = KVCacheManager(16, B)
    run(mgr, "a", list(range(10)))
    ids = mgr.block_ids("a")
    assert mgr.free("a") == ids[::-1]


def test_prefix_caching_off_never_hits():
    mgr = KVCacheManager(16, B, enable_prefix_caching=False)
    run(mgr, "a", list(range(9)))
    b = run(mgr, "b", list(range(9)))
    assert b.num_cached_tokens == 0 and len(mgr.index) == 0
    assert set(mgr.block_ids("a")).isdisjoint(mgr.block_ids("b"))


def test_cache_salt_separates_tenants():
    from minienv.kv.hashing import make_extra_key

    alice = KVCacheManager(16, B, extra_key=make_extra_key("m", cache_salt="alice"))
    run(alice, "a", list(range(9)))
    assert alice.lookup(list(range(9))).num_cached_tokens == 8
    bob_view = KVCacheManager(16, B, extra_key=make_extra_key("m", cache_salt="bob"))
    bob_view.index = alice.index  # same index, other salt: nothing matches
    assert bob_view.lookup(list(range(9))).num_cached_tokens == 0


def test_chunked_prefill_continues_prompt():
    mgr = KVCacheManager(16, B)
    req, a = admit(mgr, "a", list(range(10)), 3)
    assert a.num_new_tokens == 3 and mgr.num_tokens("a") == 3
    compute(mgr, req)
    a2 = mgr.append_slots(req, 7)  # the rest of the prompt, already in the request
    assert list(a2.positions) == list(range(3, 10))
    compute(mgr, req)
    mgr.check_invariants()
    assert len(mgr.index) == 2


def test_block_table_and_slot_mapping_agree():
    mgr = KVCacheManager(16, B)
    compute(mgr, admit(mgr, "x", [5])[0])
    _, alloc = admit(mgr, "a", list(range(6)))
    table = mgr.request("a")
    assert table.num_tokens == 6 and table.block_ids == mgr.block_ids("a")
    np.testing.assert_array_equal(alloc.slot_mapping, table.slot_mapping())


def test_commit_dedupes_a_block_computed_twice():
    """Two requests prefill the same prompt in one step: the second's block is swapped for the indexed one."""
    mgr = KVCacheManager(16, B)
    a, _ = admit(mgr, "a", list(range(8)))
    b, _ = admit(mgr, "b", list(range(8)))  # not committed yet: no hit
    assert set(mgr.block_ids("a")).isdisjoint(mgr.block_ids("b"))
    compute(mgr, a)
    compute(mgr, b)
    assert mgr.block_ids("a") == mgr.block_ids("b")
    mgr.check_invariants()


# ---------------------------------------------------------------------- copy-on-write fork
def test_fork_shares_and_reports_memory_saved():
    mgr = KVCacheManager(32, B)
    run(mgr, "p", list(range(10)))
    res = fork(mgr, "p", ["c1", "c2", "c3"])
    assert res == mgr.block_ids("p")
    sh = mgr.sharing()
    assert (sh.logical_blocks, sh.physical_blocks) == (12, 3)
    assert sh.saved_fraction == pytest.approx(0.75)
    mgr.check_invariants()


def test_cow_copies_kv_data_in_pool():
    pool = KVPool(num_layers=2, num_blocks=8, block_size=B, num_kv_heads=1, head_dim=2)
    mgr = KVCacheManager(8, B)  # bookkeeping only: the pool's owner applies the copies it asks for
    run(mgr, "p", [1, 2, 3, 4, 5, 6])
    last = mgr.block_ids("p")[-1]
    pool.k_cache[:, last] = 7.0
    pool.v_cache[:, last] = -7.0
    fork(mgr, "p", ["c"])
    alloc = append(mgr, REQS["c"], [9])
    ((src, dst),) = alloc.blocks_to_copy
    assert src == last and dst == mgr.block_ids("c")[-1] != last
    pool.copy_blocks(alloc.blocks_to_copy)
    assert (pool.k_cache[:, dst] == 7.0).all() and (pool.v_cache[:, dst] == -7.0).all()
    assert mgr.ref_cnt(src) == 1 and mgr.ref_cnt(dst) == 1
    # the write goes into the copy, never the shared original
    assert alloc.slot_mapping[0] // B == dst


def test_copy_blocks_function():
    pool = KVPool(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=1)
    pool.k_cache[0, 1] = 3.0
    pool.copy_blocks([(1, 2)])
    assert (pool.k_cache[0, 2] == 3.0).all()
    pool.copy_blocks([])


# ---------------------------------------------------------------------- LRU eviction
def test_eviction_is_lru_and_leaves_index_in_same_step():
    mgr = KVCacheManager(4, B)
    run(mgr, "a", list(range(5)))  # 1 full block (cached) + 1 partial
    run(mgr, "b", list(range(50, 55)))
    a_full = mgr.block_ids("a")[0]
    mgr.free("a")
    mgr.free("b")  # queue: a.partial, a.full, b.partial, b.full  (a freed first = least recent)
    events = []
    mgr.add_listener(events.append)
    run(mgr, "c", list(range(90, 98)))  # needs 2 blocks: a.partial (empty) then a.full (evicted)
    evicted = [e.block_id for e in events if e.kind == "evict"]
    assert evicted == [a_full]
    assert mgr.lookup(list(range(5))).num_cached_tokens == 0
    assert mgr.lookup(list(range(50, 55))).num_cached_tokens == 4
    s = mgr.stats()
    assert (s.evicted_blocks, s.evicted_tokens) == (1, B)


def test_nothing_evictable_returns_none_state_unchanged():
    mgr = KVCacheManager(3, B)
    run(mgr, "a", list(range(9)))  # all 3 blocks in use
    snap = mgr.snapshot()
    assert mgr.allocate(KVRequest("b", [1, 2])) is None
    assert mgr.append_slots(REQS["a"], 4) is None
    assert mgr.snapshot() == snap


def test_explicit_evict_and_reset():
    mgr = KVCacheManager(8, B)
    run(mgr, "a", list(range(12)))  # 3 full blocks, all indexed
    chain = mgr.block_ids("a")
    mgr.free("a")
    assert mgr.evict(1) == [chain[2]]  # LRU head among cached blocks: the chain's tail
    assert mgr.stats().num_cached_free == 2
    assert mgr.reset_prefix_cache() == 2
    assert mgr.stats().num_cached_free == 0 and len(mgr.index) == 0
    mgr.check_invariants()


# ---------------------------------------------------------------------- bad input: clear errors, state unchanged
def test_free_twice():
    mgr = KVCacheManager(8, B)
    run(mgr, "a", [1, 2, 3])
    mgr.free("a")
    snap = mgr.snapshot()
    with pytest.raises(UnknownRequestError, match="already freed"):
        mgr.free("a")
    assert mgr.snapshot() == snap


def test_fork_unknown_request():
    mgr = KVCacheManager(8, B)
    run(mgr, "a", [1, 2, 3])
    snap = mgr.snapshot()
    with pytest.raises(UnknownRequestError, match="fork"):
        mgr.fork(KVRequest("nope", [1]), ["c"])
    with pytest.raises(DuplicateRequestError):
        mgr.fork(REQS["a"], ["a"])
    with pytest.raises(ValueError):
        mgr.fork(REQS["a"], [])
    with pytest.raises(ValueError):
        mgr.fork(REQS["a"], ["x", "x"])
    assert mgr.snapshot() == snap


def test_fork_of_uncommitted_request_rejected():
    mgr = KVCacheManager(8, B)
    req, _ = admit(mgr, "a", [1, 2, 3])
    snap = mgr.snapshot()
    with pytest.raises(ValueError, match="commit"):
        mgr.fork(req, ["c"])
    assert mgr.snapshot() == snap


@pytest.mark.parametrize("budget", [0, -4, 3, B - 1])
def test_budget_below_one_block(budget):
    with pytest.raises(KVBudgetError, match="smaller than one block|positive"):
        KVCacheManager.from_budget(budget, B)


def test_budget_rounds_down_to_blocks():
    assert KVCacheManager.from_budget(4 * B + 3, B).num_blocks == 4
    with pytest.raises(KVBudgetError):
        KVCacheManager(0, B)
    with pytest.raises(KVBudgetError):
        KVCacheManager(4, 0)


def test_other_bad_input_leaves_state_unchanged():
    mgr = KVCacheManager(8, B)
    run(mgr, "a", [1, 2, 3])
    snap = mgr.snapshot()
    with pytest.raises(DuplicateRequestError):
        mgr.allocate(KVRequest("a", [1]))
    with pytest.raises(ValueError, match="empty"):
        mgr.allocate(KVRequest("b", []))
    with pytest.raises(ValueError):
        mgr.allocate(KVRequest("b", [1, -2]))
    with pytest.raises(TypeError):
        mgr.allocate(KVRequest("b", "hello"))
    with pytest.raises(ValueError):
        mgr.allocate(KVRequest("b", [1, 2]), 3)
    with pytest.raises(UnknownRequestError):
        mgr.append_slots(KVRequest("zz", [1]), 1)
    for bad in (0, -1, 1.5, True, [1]):
        with pytest.raises(ValueError, match="num_new_tokens"):
            mgr.append_slots(REQS["a"], bad)
    with pytest.raises(UnknownRequestError):
        mgr.commit(KVRequest("zz", [1]))
    with pytest.raises(ValueError):
        mgr.evict(-1)
    assert mgr.snapshot() == snap
    bad_tokens = KVRequest("c", [1, 2, 3, 4, 5])
    mgr.allocate(bad_tokens)
    snap = mgr.snapshot()
    bad_tokens.all_token_ids[1] = -7  # the caller broke its own tokens: commit names them, indexes nothing
    bad_tokens.num_computed_tokens = 5
    with pytest.raises(ValueError, match="all_token_ids"):
        mgr.commit(bad_tokens)
    assert mgr.snapshot() == snap


# ------------------------------------------------- known prefix-cache bugs of real engines, one test each
def test_vllm_12621_forced_hash_collision_cannot_serve_wrong_blocks(monkeypatch):
    """hash(None) was constant in 3.12 -> forced collisions. Force every hash equal: hits must still be right."""
    const = lambda key_bytes: b"\x42" * 32  # noqa: E731
    monkeypatch.setattr(kcm, "hash_block_key", const)
    monkeypatch.setattr(prefix_cache, "hash_block_key", const)
    mgr = KVCacheManager(16, B)
    run(mgr, "a", list(range(9)))
    b = run(mgr, "b", list(range(50, 59)))
    assert mgr.request("a").block_hashes[0] == mgr.request("b").block_hashes[0] == const(b""), "collision forced"
    assert b.num_cached_tokens == 0, "a colliding hash with different tokens must be a miss"
    assert set(mgr.block_ids("a")).isdisjoint(mgr.block_ids("b"))
    c = run(mgr, "c", list(range(9)))
    assert c.num_cached_tokens == 4  # the first block really matches; the colliding second is not indexed


def test_vllm_pr4764_block_popped_for_reuse_leaves_index():
    """vLLM #4764 (the merged fix; #4761 was closed unmerged): a block popped for reuse stayed findable."""
    mgr = KVCacheManager(2, B)
    run(mgr, "a", list(range(8)))
    mgr.free("a")
    assert mgr.stats().num_cached_free == 2
    run(mgr, "b", list(range(20, 25)))  # takes both blocks: both evicted as they are handed out
    assert len(mgr.index) == 1  # only b's own full block
    assert mgr.lookup(list(range(8)) + [0]).num_cached_tokens == 0
    for bid in mgr.block_ids("b"):
        entry = mgr.index.entry_for_block(bid)
        assert entry is None or entry.key.token_ids == tuple(range(20, 24))


def test_freeing_a_request_twice_is_refused_and_changes_no_refcount():
    mgr = KVCacheManager(8, B)
    run(mgr, "a", list(range(8)))
    run(mgr, "b", list(range(8)) + [1])  # shares a's two blocks
    mgr.free("a")
    with pytest.raises(UnknownRequestError):
        mgr.free("a")
    assert [mgr.ref_cnt(x) for x in mgr.block_ids("b")[:2]] == [1, 1]
    mgr.check_invariants()


def test_vllm_1556_fork_increments_refcount_exactly_n():
    """vLLM #1556, fixed by PR #3347: with a sliding window a table named a block twice and fork incremented it once
    per entry, so the block was later freed twice ("Double free!"). One reference per child per block."""
    mgr = KVCacheManager(16, B)
    run(mgr, "p", list(range(10)))
    before = {x: mgr.ref_cnt(x) for x in mgr.block_ids("p")}
    assert len(before) == 3  # 10 tokens in blocks of 4
    fork(mgr, "p", [f"c{i}" for i in range(5)])
    assert all(mgr.ref_cnt(x) == before[x] + 5 for x in before)
    for rid in ["p"] + [f"c{i}" for i in range(5)]:
        mgr.free(rid)
    assert mgr.stats().num_in_use == 0
    mgr.check_invariants()


@pytest.mark.parametrize("prompt_len,shared_after_write,copies", [
    (6, False, 1),  # shared, not full -> copy
    (8, True, 0),   # shared, full -> no copy: the new token goes to a new block
])
def test_vllm_417_copy_on_write_condition(prompt_len, shared_after_write, copies):
    mgr = KVCacheManager(16, B)
    run(mgr, "p", list(range(prompt_len)))
    fork(mgr, "p", ["c"])
    alloc = append(mgr, REQS["c"], [99])
    assert len(alloc.blocks_to_copy) == copies
    last_full = mgr.block_ids("p")[prompt_len // B - 1] if prompt_len % B == 0 else None
    if shared_after_write:
        assert last_full in mgr.block_ids("c") and mgr.ref_cnt(last_full) == 2
    # never write into a slot another table still reads
    written_block = alloc.slot_mapping[0] // B
    assert mgr.ref_cnt(written_block) == 1
    compute(mgr, REQS["c"])
    mgr.check_invariants()


def test_vllm_417_unshared_not_full_block_is_not_copied():
    mgr = KVCacheManager(16, B)
    run(mgr, "p", list(range(6)))
    fork(mgr, "p", ["c"])
    append(mgr, REQS["c"], [1])  # c copies
    alloc = append(mgr, REQS["p"], [2])  # p is now the only holder of the original: writes in place
    assert alloc.blocks_to_copy == ()


def test_nanovllm_144_fully_cached_prompt_still_computes_last_token():
    mgr = KVCacheManager(16, B)
    for n in (8, 9):  # a multiple of the block size, and not
        prompt = list(range(100 + n, 100 + 2 * n))
        run(mgr, f"a{n}", prompt)
        hit = mgr.lookup(prompt)
        b = run(mgr, f"b{n}", prompt)
        assert b.num_new_tokens >= 1 and b.positions[-1] == n - 1
        assert hit.num_cached_tokens == b.num_cached_tokens < n
    assert mgr.block_ids("a8") == mgr.block_ids("b8")  # recomputed last block deduplicated on commit


def test_sglang_35270_shared_blocks_counted_once_as_evictable():
    mgr = KVCacheManager(16, B)
    run(mgr, "p", list(range(8)))
    fork(mgr, "p", ["c1", "c2"])
    run(mgr, "q", list(range(8)) + [5])
    for rid in ("p", "c1", "c2", "q"):
        mgr.free(rid)
    s = mgr.stats()
    assert s.num_cached_free == 2 and s.num_in_use == 0
    assert s.num_free_empty + s.num_cached_free + s.num_in_use == s.num_blocks


def test_lmcache_184_tail_evicted_before_parent():
    mgr = KVCacheManager(4, B)
    run(mgr, "a", list(range(12)))  # 3 full blocks, a chain
    chain = mgr.block_ids("a")
    mgr.free("a")
    assert [bid for bid, cached in mgr.free_queue() if cached] == chain[::-1]
    run(mgr, "b", [7])  # takes the one free-empty block
    run(mgr, "c", [8])  # must evict: the chain's tail
    assert mgr.lookup(list(range(12)) + [0]).num_cached_tokens == 8, "prefix kept, cut from its end"
    mgr.check_invariants()


# ---------------------------------------------------------------------- rollback (speculative decoding)
def test_truncate_frees_tail_keeps_full_blocks_cached():
    mgr = KVCacheManager(16, B)
    run(mgr, "a", list(range(12)), decode=[1, 2, 3])  # 15 tokens, 3 full blocks indexed
    ids = mgr.block_ids("a")
    dropped = mgr.truncate("a", 8)
    assert dropped == ids[2:][::-1] and mgr.num_tokens("a") == 8
    assert mgr.block_state(ids[2]) is BlockState.CACHED_FREE  # still right for its tokens
    mgr.check_invariants()


def test_truncate_into_an_indexed_block_keeps_it_cached_and_copies_on_write():
    """An indexed block is immutable: rolled back into, it stays findable and the next write goes to a copy."""
    mgr = KVCacheManager(16, B)
    run(mgr, "a", list(range(12)), decode=[1])  # blocks 0..2 full and indexed
    ids = mgr.block_ids("a")
    a = REQS["a"]
    mgr.truncate("a", 6)  # the new last block (ids[1]) is partial, indexed, held only by a
    del a.all_token_ids[6:]  # the caller rolls its request back too
    a.num_computed_tokens = 6
    assert mgr.index.entry_for_block(ids[1]) is not None and mgr.stats().evicted_blocks == 0
    assert mgr.lookup(list(range(12)) + [0]).num_cached_tokens == 12
    alloc = append(mgr, a, [99])
    ((src, dst),) = alloc.blocks_to_copy
    assert src == ids[1] and alloc.slot_mapping[0] // B == dst != ids[1]
    assert mgr.block_state(ids[1]) is BlockState.CACHED_FREE
    compute(mgr, a)
    mgr.check_invariants()


def test_truncate_into_a_shared_indexed_block_copies_on_next_write():
    mgr = KVCacheManager(16, B)
    run(mgr, "a", list(range(8)) + [1])
    run(mgr, "b", list(range(8)) + [2])  # shares a's two full blocks
    shared = mgr.block_ids("a")[1]
    a = REQS["a"]
    mgr.truncate("a", 6)
    del a.all_token_ids[6:]
    a.num_computed_tokens = 6
    assert mgr.index.entry_for_block(shared) is not None, "b still holds it: it stays indexed"
    alloc = append(mgr, a, [42])
    assert alloc.blocks_to_copy[0][0] == shared
    assert mgr.block_ids("b")[1] == shared
    compute(mgr, a)
    mgr.check_invariants()


def test_truncate_bad_input():
    mgr = KVCacheManager(16, B)
    run(mgr, "a", [1, 2, 3])
    snap = mgr.snapshot()
    for n in (0, 4, -1, 2.5):
        with pytest.raises(ValueError):
            mgr.truncate("a", n)
    with pytest.raises(UnknownRequestError):
        mgr.truncate("zz", 1)
    assert mgr.snapshot() == snap


def test_from_budget_rounds_down_to_blocks_and_salts_the_key():
    from minienv.kv.hashing import make_extra_key

    mgr = KVCacheManager.from_budget(10 * B + 1, B, extra_key=make_extra_key("m", cache_salt="s"))
    assert mgr.num_blocks == 10 and mgr.kv_budget_tokens == 10 * B
    assert mgr.extra_key == make_extra_key("m", cache_salt="s") != make_extra_key("m")
    with pytest.raises(KVBudgetError):
        KVCacheManager.from_budget(B - 1, B)


# ---------------------------------------------------------------------- rollback through the manager's API
def test_undo_allocate_frees_the_admission_and_uncounts_its_lookup():
    mgr = KVCacheManager(8, B)
    compute(mgr, admit(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])[0])
    before = mgr.stats()
    _, alloc = admit(mgr, "b", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11])  # a two-block hit, then its own tokens
    assert alloc.num_cached_tokens == 2 * B
    released = mgr.undo_allocate("b")
    assert len(released) == 3 and not mgr.has_request("b")
    assert mgr.stats() == before  # prefix queries / hits / requests as if "b" never came
    mgr.check_invariants()
    with pytest.raises(UnknownRequestError):
        mgr.undo_allocate("b")


def test_undo_allocate_puts_cached_free_hit_blocks_back_where_they_were():
    """A failed step's admission took cached-free blocks out of the middle of the free queue: undone, they return to
    those places (not the tail), so a failed step leaves the LRU order as it found it."""
    mgr = KVCacheManager(8, B)
    compute(mgr, admit(mgr, "a", list(range(9)))[0])
    compute(mgr, admit(mgr, "x", [50, 51, 52, 53, 54])[0])
    mgr.free("a")
    mgr.free("x")
    before = mgr.free_queue()
    _, alloc = admit(mgr, "b", list(range(8)) + [99])  # a two-block hit on a's cached-free blocks
    assert alloc.num_cached_tokens == 2 * B
    mgr.undo_allocate("b")  # what the scheduler's rollback does for an admission
    assert mgr.free_queue() == before
    mgr.check_invariants()


def test_commit_reuses_the_lookups_miss_hash_only_for_the_same_block():
    """The admission's lookup hashed block 0 (a miss); the commit reuses that hash only while the block still holds
    the tokens it was computed from — a chunked prompt whose next chunk differs is hashed afresh."""
    from minienv.kv.hashing import ROOT_HASH, hash_block_tokens

    mgr = KVCacheManager(8, B)
    hit = mgr.lookup([1, 2, 3, 4, 5])
    assert hit.miss is not None and hit.miss.key == (ROOT_HASH, (1, 2, 3, 4), b"")
    req, _ = admit(mgr, "a", [1, 2, 3, 4, 5], 2)  # only [1, 2] reserved now
    compute(mgr, req)
    req.all_token_ids[2:] = [9, 9]  # the request's next tokens turn out other than the looked-up [3, 4, 5]
    mgr.append_slots(req, 2)  # block 0 becomes [1, 2, 9, 9], not the looked-up [1, 2, 3, 4]
    compute(mgr, req)
    assert mgr.request("a").block_hashes == [hash_block_tokens(ROOT_HASH, (1, 2, 9, 9))]
    mgr.check_invariants()
    assert mgr.lookup([1, 2, 9, 9, 7]).num_cached_tokens == B and mgr.lookup([1, 2, 3, 4, 7]).num_cached_tokens == 0


def _into_an_indexed_block(num_blocks=16):
    """Request "a" rolled back into its indexed block 1 (partial now, held only by a): its next append copies it."""
    mgr = KVCacheManager(num_blocks * B, B)
    run(mgr, "a", list(range(12)), decode=[1])
    a = REQS["a"]
    mgr.truncate("a", 6)
    del a.all_token_ids[6:]
    a.num_computed_tokens = 6
    return mgr, a


@pytest.mark.parametrize("kv_written", [False, True])
def test_undoing_a_failed_steps_copy_on_write_gives_the_original_back(kv_written):
    """A step that copied a block on write, then failed: the request holds its original block again (its K/V are
    still there, cached) and the copy goes back to the head of the free queue. The old rollback (truncate) kept
    the copy, into which nothing may have been copied: the request would read that block's previous K/V."""
    mgr, a = _into_an_indexed_block()
    before, table = mgr.snapshot(), list(mgr.block_ids("a"))
    alloc = append(mgr, a, [99])
    ((original, private),) = alloc.blocks_to_copy
    assert mgr.block_ids("a")[-1] == private
    mgr.undo_append_slots("a", 6, kv_written=kv_written)
    del a.all_token_ids[6:]
    assert mgr.block_ids("a") == table and table[-1] == original
    assert mgr.snapshot() == before, "the failed step left a trace"
    mgr.check_invariants()
    again = append(mgr, a, [99])  # the retried step copies again, into the same block
    assert again.blocks_to_copy == ((original, private),)
    compute(mgr, a)
    mgr.check_invariants()


def test_undo_of_a_copy_on_write_whose_original_was_evicted_keeps_only_blocks_with_the_requests_kv():
    """The step's planning evicted the original (freed by the copy-on-write, then taken by an admission): if the
    step wrote K/V, the original may hold the admission's now and the copy is the request's; if nothing was
    written, the copy is empty and the original still holds the request's K/V."""
    for kv_written in (True, False):
        mgr, a = _into_an_indexed_block(num_blocks=5)
        alloc = append(mgr, a, [99])
        ((original, private),) = alloc.blocks_to_copy
        assert mgr.block_state(original) is BlockState.CACHED_FREE
        n_free = mgr.pool.num_free_blocks
        other, got = admit(mgr, "b", [50 + i for i in range(n_free * B)])
        assert got is not None and original in mgr.block_ids("b"), "the admission evicted the original"
        mgr.undo_allocate("b")
        mgr.undo_append_slots("a", 6, kv_written=kv_written)
        assert mgr.block_ids("a")[-1] == (private if kv_written else original)
        mgr.check_invariants()


def test_undo_append_slots_without_a_copy_is_a_truncate_back_in_place():
    mgr = KVCacheManager(16 * B, B)
    run(mgr, "a", list(range(7)))
    a = REQS["a"]
    before = mgr.snapshot()
    append(mgr, a, [1, 2])  # fills block 1 and takes block 2 from the head
    assert mgr.undo_append_slots("a", 7, kv_written=True) == [mgr.pool.free_block_ids()[0]]
    assert mgr.snapshot() == before
    with pytest.raises(UnknownRequestError):
        mgr.undo_append_slots("nobody", 1, kv_written=True)
    assert mgr.snapshot() == before
