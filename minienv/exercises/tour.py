"""Notebook 00's exercises, on the ten-line block allocator the notebook builds.

``ToyPool`` below is that allocator (free queue head first, a refcount per block, a block table per request),
kept here so the checks run without the notebook: the exercises read and change a pool through exactly the
attributes the notebook's version has (``free``, ``refcount``, ``tables``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

from minienv.exercises._check import exercise, fail, require


def reference_release(pool, req: str) -> None:
    """The toy pool's ``release`` (notebook 00's second exercise; the notebook's demo borrows it until the student
    writes their own): refcount -1 per block, table's last block first, refcount 0 -> the free queue's tail."""
    for block in reversed(pool.tables.pop(req)):
        pool.refcount[block] -= 1
        if pool.refcount[block] == 0:
            pool.free[block] = None


class ToyPool:
    """Notebook 00's allocator: ``free`` is the free queue (an OrderedDict, head = next out)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}

    def allocate(self, req: str, n: int) -> None:
        if n > len(self.free):
            raise MemoryError(f"{req} needs {n} blocks, only {len(self.free)} free")
        table = self.tables.setdefault(req, [])
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self.refcount[block] = 1
            table.append(block)

    def share(self, req: str, other: str, n: int) -> None:
        shared = self.tables[other][:n]
        for block in shared:
            self.refcount[block] += 1
        self.tables.setdefault(req, []).extend(shared)

    def release(self, req: str) -> None:
        reference_release(self, req)

    def state(self) -> tuple:
        return list(self.free), list(self.refcount), {r: list(t) for r, t in self.tables.items()}


# The notebook's demo sequence, plus a longer one where three requests share a block and finish out of order.
ACTIONS = [("arrive", "A", 3), ("arrive", "B", 2), ("share", "C", "A", 1), ("grow", "C", 1), ("grow", "A", 1),
           ("finish", "B"), ("grow", "C", 2), ("finish", "A"), ("finish", "C")]
MORE_ACTIONS = [("arrive", "A", 2), ("share", "B", "A", 2), ("grow", "B", 2), ("share", "C", "B", 3),
                ("grow", "C", 1), ("finish", "B"), ("arrive", "D", 1), ("finish", "A"), ("finish", "D"),
                ("finish", "C")]


def apply(pool: ToyPool, action: tuple, release=None) -> None:
    kind, req, *args = action
    if kind in ("arrive", "grow"):
        pool.allocate(req, args[0])
    elif kind == "share":
        pool.share(req, args[0], args[1])
    else:
        (release or ToyPool.release)(pool, req)


@exercise("write next_blocks(pool, n): the first n blocks of pool.free, head first, without changing the pool")
def check_next_blocks(fn) -> str:
    """Compare ``fn`` with what ``allocate`` really takes, after every step of both demo sequences, for every n."""
    tried = 0
    for actions in (ACTIONS, MORE_ACTIONS):
        pool = ToyPool(8)
        for i, action in enumerate([None, *actions]):
            if action is not None:
                apply(pool, action)
            for n in range(1, len(pool.free) + 1):
                before = copy.deepcopy(pool.state())
                answer = fn(pool, n)
                require(pool.state() == before, "next_blocks must not change the pool (it only predicts)",
                        f"after step {i}, n={n}: the pool was {before}, now {pool.state()}")
                trial = copy.deepcopy(pool)
                trial.allocate("new", n)
                expected = trial.tables["new"]
                got = None if answer is None else list(answer)
                if got != expected:
                    rule = ("allocation takes the head of the free queue first (the block free the longest), "
                            "in queue order")
                    if got is not None and sorted(got) == sorted(expected):
                        rule += " — right blocks, wrong order"
                    fail(rule, f"after step {i}, free queue {list(pool.free)}, n={n}: "
                               f"expected {expected}, got {answer}")
                tried += 1
    return f"next_blocks matches the allocator in all {tried} cases"


@exercise("write release(pool, req): refcount -1 on each of req's blocks, table's last block first; a block "
          "whose refcount reaches 0 goes to the tail of pool.free", none_ok=True)
def check_release(fn) -> str:
    """Run both demo sequences with ``fn`` as the release and compare the whole pool with the reference after
    every step."""
    for actions in (ACTIONS, MORE_ACTIONS):
        mine, ref = ToyPool(8), ToyPool(8)
        for i, action in enumerate(actions):
            apply(ref, action)
            apply(mine, action, release=fn)
            (free, rc, tables), (want_free, want_rc, want_tables) = mine.state(), ref.state()
            where = f"step {i} {action}"
            if action[0] != "finish":
                continue
            req = action[1]
            require(req not in tables, "the request's block table is removed", f"{where}: tables {tables}")
            require(tables == want_tables, "other requests' tables are left alone",
                    f"{where}: expected {want_tables}, got {tables}")
            require(rc == want_rc, "each of the request's blocks loses exactly one reference",
                    f"{where}: refcounts expected {want_rc}, got {rc}")
            held = [b for b in free if rc[b] > 0]
            require(not held, "a block goes back to the free queue only when its refcount reaches 0 "
                              "(another request still reads it)", f"{where}: blocks {held} are free but still held")
            require(sorted(free) == sorted(want_free), "every block whose refcount reaches 0 goes back to the queue",
                    f"{where}: free queue expected {want_free}, got {free}")
            if free != want_free:
                fail("freed blocks join the tail of the queue, the table's last block first (so the head stays "
                     "the block free the longest)", f"{where}: free queue expected {want_free}, got {free}")
    return "release keeps refcounts, tables and the free queue exactly as the allocator does"
