"""Notebook 05's exercises: the hash chain of a prompt's full blocks, and copy-on-write when a forked request
appends tokens (which block is copied, which are taken, how every refcount moves — or ``None`` when they do not fit).

The second check diagnoses a wrong answer by *what* differs from the rule (a copy where none belongs, a table that
still names the shared block, a refcount off by one, blocks taken out of order...), so the rule named is the one the
answer breaks, whichever case showed it first.
"""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.kv.block_table import cdiv
from minienv.kv.hashing import ROOT_HASH, hash_block_chain


@exercise("write chain_hashes(tokens, block_size): the chain hash of every full block, from ROOT_HASH")
def check_chain_hashes(fn) -> str:
    tokens = list(range(10, 22))
    got = fn(tokens[:4], 4)
    want = hash_block_chain(tokens[:4], 4)
    require(list(got) == want, "the first block's hash is hash_block_tokens(ROOT_HASH, its tokens)",
            f"tokens {tokens[:4]}, block size 4: expected {[h.hex()[:8] for h in want]}, "
            f"got {[getattr(h, 'hex', lambda: h)()[:8] for h in got]}")
    got = list(fn(tokens[:10], 4))
    require(len(got) == 2, "only full blocks get a hash: a partial block's K/V are not final yet",
            f"10 tokens in blocks of 4: expected 2 hashes, got {len(got)}")
    want = hash_block_chain(tokens[:10], 4)
    require(got == want, "each block's hash covers its parent's hash too (the chain): a block's K/V depend on "
                         "every token before it", "10 tokens in blocks of 4: the second hash differs")
    same_block = [1, 2, 3, 4] + [5, 6, 7, 8]
    other_prefix = [9, 9, 9, 9] + [5, 6, 7, 8]
    a, b = list(fn(same_block, 4)), list(fn(other_prefix, 4))
    require(a[1] != b[1], "the same tokens after a different prefix hash differently (the chain)",
            f"[5, 6, 7, 8] after [1, 2, 3, 4] and after [9, 9, 9, 9] got the same hash")
    rng = np.random.default_rng(3)
    for case in range(30):
        bs = int(rng.choice([1, 2, 4, 8]))
        toks = [int(t) for t in rng.integers(0, 50, int(rng.integers(0, 40)))]
        got, want = list(fn(toks, bs)), hash_block_chain(toks, bs)
        require(got == want, "the hashes equal minienv's hash_block_chain", f"case {case}: {len(toks)} tokens, "
                f"block size {bs}: {len(want)} hashes expected, {len(got)} given, first difference at "
                f"{next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))}")
    return "chain_hashes keys each full block by its whole prefix"


# ====================================================================== exercise 2: copy-on-write on append
SLOTS = ("the new tokens fill the last block's free slots first, then one new block per block boundary crossed: "
         "ceil((n + k) / B) − ceil(n / B) new blocks")
COPY = ("a shared block (refcount > 1) that the new tokens write into is copied first: the table names the private "
        "copy, copies = [(shared, copy)]")
FULL = ("a full block is never written, so never copied, even when shared: the first new token writes into the "
        "last block only when num_tokens % block_size != 0")
IN_PLACE = "a block with refcount 1 is written in place: its only holder copies nothing"
REFS = ("refcounts: the shared original loses exactly one reference (its other holders keep theirs); the copy and "
        "each new block start at 1; no other refcount changes")
ORDER = ("blocks come from the head of the free queue, in the order the tokens need them: the copy first, then the "
         "new blocks")
ROOM = ("return None exactly when the free queue holds fewer blocks than the copy plus the new blocks need (a "
        "request that needs no block always fits)")
INPUTS = "leave the inputs unchanged: return a new table, new refcounts and the list of copies"
SHAPE = "return (table, ref_cnt, copies), or None when the blocks do not fit"


def append_reference(table: list[int], ref_cnt: list[int], num_tokens: int, num_new: int, block_size: int,
                     free: list[int]) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
    """The rules the exercise states, written plainly (``KVCacheManager.append_slots`` after a fork agrees;
    tests/unit/test_exercises.py checks): copy the last block only if it is not full and shared, take the copy
    and then the new blocks from the free queue's head, or ``None`` when they do not fit."""
    copy = num_tokens % block_size != 0 and ref_cnt[table[-1]] > 1
    num_new_blocks = cdiv(num_tokens + num_new, block_size) - cdiv(num_tokens, block_size)
    if copy + num_new_blocks > len(free):
        return None
    table, ref_cnt, taken = list(table), list(ref_cnt), list(free[: copy + num_new_blocks])
    copies = []
    if copy:
        shared, private = table[-1], taken.pop(0)
        table[-1] = private
        ref_cnt[shared] -= 1
        ref_cnt[private] = 1
        copies.append((shared, private))
    for block in taken:
        table.append(block)
        ref_cnt[block] = 1
    return table, ref_cnt, copies


def _rule_for(table, ref_cnt, num_tokens, num_new, block_size, free) -> str:
    """The rule a case exercises: the one named when the student's code raises on it. A case at the edge of the
    free queue (no room, or exactly the blocks it needs, none included) is about room: a crash there is most often
    an off-by-one or a look at an empty queue."""
    copy = num_tokens % block_size != 0 and ref_cnt[table[-1]] > 1
    needed = copy + cdiv(num_tokens + num_new, block_size) - cdiv(num_tokens, block_size)
    if needed >= len(free):
        return ROOM
    if num_tokens % block_size == 0:
        return FULL if table and ref_cnt[table[-1]] > 1 else SLOTS
    return COPY if ref_cnt[table[-1]] > 1 else IN_PLACE


def _diagnose(args, want, got) -> str | None:
    """The rule ``got`` breaks on this case (``None`` if it is right), judged by what differs from ``want``."""
    table, ref_cnt, num_tokens, num_new, block_size, free = args
    if want is None or got is None:
        return None if want is got else ROOM
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return SHAPE
    try:
        g_table, g_refs = [int(b) for b in got[0]], [int(r) for r in got[1]]
        g_copies = [tuple(int(x) for x in c) for c in got[2]]
    except (TypeError, ValueError):
        return SHAPE
    w_table, w_refs, w_copies = want
    if any(len(c) != 2 for c in g_copies):
        return SHAPE
    last_partial = num_tokens % block_size != 0
    if g_copies != w_copies:
        if len(g_copies) > 1 or any(not last_partial or src != table[-1] for src, _ in g_copies):
            return FULL  # copied a block the new tokens do not write into: a full one
        if not g_copies:
            return COPY
        if not w_copies:
            return IN_PLACE  # the last block is partial and written, but its refcount is 1
        return ORDER  # the right block, copied into another block than the free queue's head
    if g_table != w_table:
        if len(g_table) != len(w_table):
            return SLOTS
        if w_copies and g_table[len(table) - 1] == table[-1]:
            return COPY  # copied, but the table still names the shared block
        return ORDER
    if g_refs != w_refs:
        return REFS
    return None


@exercise("write my_append_slots(table, ref_cnt, num_tokens, num_new, block_size, free) -> (table, ref_cnt, copies) "
          "or None")
def check_append_slots(fn) -> str:
    """Hand-made cases, one or more per rule and edge, then random pool states against the rule written plainly."""
    B = 4
    fork = [3, 3, 3] + [0] * 9  # notebook 05's fork: P, S1, S2 share blocks 0, 1, 2 (10 tokens, 2 in block 2)
    cases = [
        ([0, 1, 2], fork, 10, 1, B, [3, 4, 5]),  # a child writes into the shared partial block: copy it
        ([0, 1, 2], [3, 3, 1] + [0] * 9, 10, 1, B, [3, 4]),  # its only holder left: in place
        ([0, 1, 5], [3, 3, 0, 0, 0, 1] + [0] * 6, 10, 2, B, [2, 3]),  # shared full blocks before: still no copy
        ([0, 1], [3, 3] + [0] * 10, 8, 1, B, [2, 3]),  # the shared last block is full: a new block, no copy
        ([0, 1, 2], fork, 10, 5, B, [3, 4, 5]),  # copy, then cross a boundary: copy first, then the new block
        ([0, 1, 2], fork, 10, 2, B, [7, 3, 5]),  # fills the copied block; the free queue is not sorted
        ([0, 1, 2], [2, 2, 2] + [0] * 9, 10, 1, B, [6, 4]),  # refcount 2: the original keeps 1 (the other holder)
        ([], [0] * 12, 0, 5, B, [9, 8, 7]),  # an empty table: new blocks only
        ([0, 1, 2], [2, 2, 2] + [0] * 9, 3, 2, 1, [3, 4]),  # block size 1: every block is full, never copied
        ([0, 1, 2], [1, 1, 1] + [0] * 9, 10, 1, B, []),  # needs no block: fits with an empty free queue
        ([0, 1, 2], fork, 10, 2, B, []),  # needs only the copy, and there is no block: None
        ([0, 1, 2], fork, 10, 3, B, [3]),  # a new block fits, the copy does not: None
        ([0, 1, 2], fork, 10, 3, B, [3, 4]),  # copy + new block = exactly the free queue: fits
        ([0, 1], [3, 3] + [0] * 10, 8, 1, B, []),  # a full last block and no free block: None
        ([0, 1, 2], [1, 1, 1] + [0] * 9, 14, 10, 6, [4]),  # block size 6, 4 slots left, 10 new: one new block
    ]
    rng = np.random.default_rng(5)
    for _ in range(80):
        bs = int(rng.choice([1, 2, 3, 4, 8]))
        n = int(rng.integers(0, 4 * bs + 1))
        num_blocks = 16
        order = [int(b) for b in rng.permutation(num_blocks)]
        table = order[: cdiv(n, bs)]
        refs = [0] * num_blocks
        for b in table:
            refs[b] = int(rng.choice([1, 1, 2, 3]))
        rest = order[len(table):]
        for b in rest[: int(rng.integers(0, 3))]:
            refs[b] = int(rng.integers(1, 3))  # held by other requests
        free = [b for b in rest if refs[b] == 0][: int(rng.integers(0, 5))]
        cases.append((table, refs, n, int(rng.integers(1, 2 * bs + 2)), bs, free))
    for args in cases:
        table, ref_cnt, num_tokens, num_new, block_size, free = args
        want = append_reference(*args)
        given = [list(table), list(ref_cnt), num_tokens, num_new, block_size, list(free)]
        where = (f"table {table}, ref_cnt {ref_cnt}, num_tokens {num_tokens}, num_new {num_new}, block_size "
                 f"{block_size}, free {free}")
        fn.rule = _rule_for(*args)
        got = fn(*given)
        if given != [table, ref_cnt, num_tokens, num_new, block_size, free]:
            fail(INPUTS, f"{where}: your function changed its arguments")
        rule = _diagnose(args, want, got)
        if rule is not None:
            shown = "None" if want is None else f"table {want[0]}, copies {want[2]}, refcounts of " \
                f"{sorted(set(table) | set(want[0]))}: {[want[1][b] for b in sorted(set(table) | set(want[0]))]}"
            fail(rule, f"{where}\n  expected {shown}\n  got {_short(got)}")
    return (f"my_append_slots is right in all {len(cases)} cases: only a shared, not-full block is copied, once, "
            "into the free queue's head; every refcount moves by exactly one holder")


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
