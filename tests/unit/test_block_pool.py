"""Block pool, free queue, block tables and KV pool: O(1) bookkeeping, typed errors that change nothing, and a
stateful test of the invariants over random allocate / append / truncate / free sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minienv.kv import (
    BlockPool,
    BlockTable,
    DoubleFreeError,
    FreeBlockQueue,
    KVBudgetError,
    KVCacheBlock,
    KVPool,
    OutOfBlocksError,
    UnknownBlockError,
    batch_slot_mapping,
    cdiv,
    num_blocks_for_budget,
    pad_block_tables,
    slot_mapping,
)


# ------------------------------------------------------------------------------------------- budget -> blocks
@pytest.mark.parametrize("budget, block_size, expected", [(16, 16, 1), (17, 16, 1), (1000, 16, 62), (5, 1, 5)])
def test_num_blocks_is_budget_floor_divided_by_block_size(budget, block_size, expected):
    assert num_blocks_for_budget(budget, block_size) == expected
    pool = KVPool.from_budget(budget, block_size, num_layers=2, num_kv_heads=2, head_dim=4)
    assert pool.num_blocks == expected
    assert pool.k_cache.shape == (2, expected, block_size, 2, 4) == pool.v_cache.shape
    assert pool.k_cache.dtype == np.float32
    assert pool.nbytes == 2 * 2 * expected * block_size * 2 * 4 * 4


@pytest.mark.parametrize("budget", [15, 0, -16, 1])
def test_budget_below_one_block_is_a_clear_error(budget):
    with pytest.raises(KVBudgetError, match="smaller than one block"):
        KVPool.from_budget(budget, 16, num_layers=1, num_kv_heads=1, head_dim=2)


@pytest.mark.parametrize("budget", [64.0, "64", None, True])
def test_budget_must_be_an_int(budget):
    with pytest.raises(KVBudgetError, match="must be an int"):
        num_blocks_for_budget(budget, 16)


@pytest.mark.parametrize("block_size", [0, -1, 2.0, True])
def test_block_size_must_be_a_positive_int(block_size):
    with pytest.raises(KVBudgetError, match="block_size"):
        num_blocks_for_budget(64, block_size)


@pytest.mark.parametrize("n", [0, -3, 2.5, True, None])
def test_block_pool_needs_at_least_one_block(n):
    with pytest.raises(KVBudgetError):
        BlockPool(n)


# ------------------------------------------------------------------------------------------- free queue
def test_free_queue_pops_head_appends_tail_and_removes_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])  # a prefix-cache hit on a cached-free block in the middle
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 0]
    assert [q.popleft().block_id, q.popleft().block_id] == [1, 3]
    q.append(blocks[2])
    q.append(blocks[1])
    assert q.block_ids() == [4, 0, 2, 1] and len(q) == 4 and 2 in q and 3 not in q


def test_no_linear_time_list_operations_in_the_pool():
    """The naive design's O(n) ``free_list.pop(0)`` (and ``deque.remove``) must not come back."""
    import inspect

    import minienv.kv.block_pool as bp

    src = inspect.getsource(bp)
    code = "\n".join(line.split("#")[0] for line in src.splitlines() if '"' not in line and "``" not in line)
    assert ".pop(0)" not in code and "deque" not in code and ".index(" not in code


# ------------------------------------------------------------------------------------------- allocate / free
def test_allocate_takes_from_the_head_and_free_appends_to_the_tail():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(1)
    assert a == [0, 1] and b == [2]
    assert [pool.ref_cnt(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    pool.free([1, 0])  # freed in reverse order: the tail block goes first
    assert pool.free_block_ids() == [3, 4, 5, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5 and pool.usage == pytest.approx(5 / 6)
    pool.check_invariants()


def test_allocate_zero_blocks_is_a_no_op():
    pool = BlockPool(3)
    before = pool.snapshot()
    assert pool.allocate(0) == []
    assert pool.snapshot() == before


def test_out_of_blocks_allocates_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool.snapshot()
    with pytest.raises(OutOfBlocksError, match="asked for 2 block.*only 1 of 4") as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free, info.value.total) == (2, 1, 4)
    assert pool.snapshot() == before
    pool.allocate(1)
    before = pool.snapshot()
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.snapshot() == before


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True])
def test_allocate_rejects_bad_counts(bad):
    pool = BlockPool(3)
    before = pool.snapshot()
    with pytest.raises(ValueError):
        pool.allocate(bad)
    assert pool.snapshot() == before


def test_double_free_leaves_the_pool_unchanged():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    pool.free([ids[1]])
    before = pool.snapshot()
    with pytest.raises(DoubleFreeError, match="block 1 is already free"):
        pool.free([ids[1]])
    assert pool.snapshot() == before
    # a batch with one bad id changes nothing, even the good ids before it
    with pytest.raises(DoubleFreeError):
        pool.free([ids[0], ids[1]])
    assert pool.snapshot() == before
    # the same id twice in one call when it has one reference is a double free too
    with pytest.raises(DoubleFreeError):
        pool.free([ids[2], ids[2]])
    assert pool.snapshot() == before
    pool.check_invariants()


@pytest.mark.parametrize("bad", [4, -1, 100, "0", 1.0, None, True])
def test_freeing_an_unknown_block_leaves_the_pool_unchanged(bad):
    pool = BlockPool(4)
    pool.allocate(2)
    before = pool.snapshot()
    with pytest.raises(UnknownBlockError, match="unknown block"):
        pool.free([bad])
    with pytest.raises(UnknownBlockError):
        pool.free([0, bad])
    assert pool.snapshot() == before


def test_numpy_integer_ids_are_accepted():
    pool = BlockPool(4)
    ids = np.asarray(pool.allocate(2))
    pool.free(ids[::-1])
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_shared_block_is_freed_only_at_refcount_zero():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_cnt(b) == 2
    pool.free([b])
    assert pool.ref_cnt(b) == 1 and b not in pool.free_block_ids()
    pool.free([b])
    assert pool.ref_cnt(b) == 0 and pool.free_block_ids()[-1] == b
    with pytest.raises(ValueError):
        pool.incref([b])  # taking a free block is the prefix cache's job
    pool.check_invariants()


# ------------------------------------------------------------------------------------------- block tables
@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_a_new_block_is_taken_exactly_at_each_block_boundary(block_size):
    pool = BlockPool(64)
    table = BlockTable(block_size)
    for t in range(40):  # token t is appended; it needs a new block iff t % B == 0
        new = table.append_tokens(1, pool)
        assert len(new) == (1 if t % block_size == 0 else 0), t
        assert table.num_blocks == cdiv(t + 1, block_size)
    assert pool.num_used_blocks == cdiv(40, block_size)


def test_append_many_tokens_and_slot_mapping_formula():
    pool = BlockPool(16)
    pool.allocate(3)  # someone else holds 0..2
    table = BlockTable(4)
    assert table.append_tokens(6, pool) == [3, 4]
    assert table.append_tokens(1, pool) == []
    assert table.append_tokens(2, pool) == [5]
    assert table.num_tokens == 9 and table.num_free_slots == 3
    t = np.arange(9)
    expected = np.asarray(table.block_ids)[t // 4] * 4 + t % 4
    assert table.slot_mapping().tolist() == expected.tolist() == [12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert table.slot_mapping(6, 9).tolist() == [18, 19, 20]
    assert slot_mapping(table.as_array(), [0, 5, 8], 4).tolist() == [12, 17, 20]


def test_append_tokens_is_all_or_nothing():
    pool = BlockPool(3)
    table = BlockTable(2)
    table.append_tokens(3, pool)  # 2 blocks
    before, tokens = pool.snapshot(), (list(table.block_ids), table.num_tokens)
    with pytest.raises(OutOfBlocksError):
        table.append_tokens(4, pool)  # needs 2 more blocks, 1 free
    assert pool.snapshot() == before and (table.block_ids, table.num_tokens) == tokens


def test_truncate_and_free_return_blocks_tail_first():
    pool = BlockPool(8)
    table = BlockTable(2)
    table.append_tokens(7, pool)  # blocks 0..3
    assert table.truncate(3, pool) == [2, 3]
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2]
    assert table.num_blocks == 2 and table.num_tokens == 3
    table.free(pool)
    assert pool.free_block_ids()[-2:] == [1, 0] and table.num_blocks == 0
    pool.check_invariants()


def test_block_table_rejects_inconsistent_construction():
    with pytest.raises(ValueError):
        BlockTable(4, [1], num_tokens=5)
    with pytest.raises(ValueError):
        BlockTable(0)


def test_batch_slot_mapping_matches_per_table_slot_mapping():
    pool = BlockPool(32)
    tables = [BlockTable(4) for _ in range(3)]
    for n in (5, 1, 9):
        for t in tables:
            t.append_tokens(n, pool)
    bt = pad_block_tables([t.block_ids for t in tables])
    seq_idx = np.repeat([0, 1, 2], [15, 3, 7])
    pos = np.concatenate([np.arange(15), np.arange(4, 7), np.arange(8, 15)])
    got = batch_slot_mapping(bt, seq_idx, pos, 4)
    want = np.concatenate([tables[0].slot_mapping(0, 15), tables[1].slot_mapping(4, 7), tables[2].slot_mapping(8, 15)])
    assert got.tolist() == want.tolist()


# ------------------------------------------------------------------------------------------- KV pool writes
def test_kv_pool_write_scatters_through_the_slot_mapping():
    kv = KVPool(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3)
    k = np.arange(9, dtype=np.float32).reshape(3, 1, 3)
    kv.write(1, np.array([5, 0, 6]), k, -k)
    assert np.array_equal(kv.k_cache[1, 2, 1], k[0]) and np.array_equal(kv.k_cache[1, 0, 0], k[1])
    assert np.array_equal(kv.v_cache[1, 3, 0], -k[2])
    got_k, got_v = kv.read_slots(1, np.array([5, 0, 6]))
    assert np.array_equal(got_k, k) and np.array_equal(got_v, -k)
    assert not kv.k_cache[0].any()
    with pytest.raises(IndexError):
        kv.write(0, np.array([8]), k[:1], k[:1])
    with pytest.raises(ValueError):
        kv.write(0, np.array([1, 2]), k, k)


# ------------------------------------------------------------------------------------------- stateful test
class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate (via appends), free, truncate and bad frees; the invariants are checked after every step."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.tables: dict[int, BlockTable] = {}
        self.next_id = 0
        self.freed_ids: list[int] = []  # block ids freed at some point (candidates for a double free)

    @rule()
    def new_sequence(self):
        self.tables[self.next_id] = BlockTable(self.block_size)
        self.next_id += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 40))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[sid]
        before = (self.pool.snapshot(), list(table.block_ids), table.num_tokens)
        need = table.blocks_needed(n)
        try:
            new = table.append_tokens(n, self.pool)
        except OutOfBlocksError:
            assert need > self.pool.num_free_blocks
            assert (self.pool.snapshot(), table.block_ids, table.num_tokens) == before
        else:
            assert len(new) == need

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_sequence(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        self.freed_ids += self.tables.pop(sid).free(self.pool)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[sid]
        keep = data.draw(st.integers(0, table.num_tokens))
        self.freed_ids += table.truncate(keep, self.pool)

    @rule(data=st.data())
    def bad_free(self, data):
        """A double free (a block nobody holds) or an unknown id: typed error, pool unchanged."""
        before = self.pool.snapshot()
        held = {b for t in self.tables.values() for b in t.block_ids}
        double = [b for b in self.freed_ids if b not in held]
        if double and data.draw(st.booleans()):
            with pytest.raises(DoubleFreeError):
                self.pool.free([data.draw(st.sampled_from(double))])
        else:
            bad = data.draw(st.sampled_from([-1, self.pool.num_blocks, self.pool.num_blocks + 7, "x", 0.5]))
            with pytest.raises(UnknownBlockError):
                self.pool.free([bad])
        assert self.pool.snapshot() == before

    @invariant()
    def free_plus_in_use_is_total(self):
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        held = [b for t in self.tables.values() for b in t.block_ids]
        assert self.pool.num_used_blocks == len(held)

    @invariant()
    def no_block_both_free_and_used(self):
        free = set(self.pool.free_block_ids())
        held = {b for t in self.tables.values() for b in t.block_ids}
        assert not free & held
        self.pool.check_invariants()

    @invariant()
    def each_used_block_is_in_exactly_one_table(self):
        held = [b for t in self.tables.values() for b in t.block_ids]
        assert len(held) == len(set(held))
        for b in held:
            assert self.pool.ref_cnt(b) == 1

    @invariant()
    def tables_hold_exactly_the_blocks_their_tokens_need(self):
        for t in self.tables.values():
            assert t.num_blocks == cdiv(t.num_tokens, t.block_size)


BlockPoolMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestBlockPoolStateful = BlockPoolMachine.TestCase
