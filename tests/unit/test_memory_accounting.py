"""minienv.lab.memory_accounting, driven by notebook 03's own `serve` loop (the one route the chapter's results come
from): every category checked on tiny hand-computed workloads, plus properties."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minienv.lab.memory_accounting as ma
from minienv.lab.memory_accounting import (
    CATEGORIES,
    SCHEMES,
    Arrivals,
    BuddyAllocator,
    ContiguousMemory,
    FirstFitAllocator,
    PagedMemory,
    StepSlots,
    average_slots,
    blocks_needed,
    contiguous_reservation,
    format_figure2_table,
    hole_blocked_fraction,
    kv_memory,
    next_pow2,
    notebook_serve,
    paged_internal_fragmentation,
)
from minienv.lab.workload import RequestSpec, sharegpt_like

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "03_kv_memory.py"
SERVE = notebook_serve(NOTEBOOK)  # the loop notebook 03 shows its reader, from the notebook itself


class Watched:
    """A memory that counts what the loop did to it: refused grows (each one preempts a request) and the requests
    freed when finished (each request must finish exactly once: nothing dropped, nothing served twice)."""

    def __init__(self, memory):
        self.memory, self.refused, self.finished = memory, 0, []

    def grow(self, r):
        ok = self.memory.grow(r)
        self.refused += not ok
        return ok

    def free(self, r):
        if r.done:
            self.finished.append(r.spec.request_id)
        self.memory.free(r)

    def __getattr__(self, name):
        return getattr(self.memory, name)


def run(reqs, scheme, kv, *, step_duration=1.0, watch=None, **kwargs):
    """Every step's slots of the notebook's loop serving ``reqs`` in a fresh memory."""
    memory = Watched(kv_memory(scheme, kv, **kwargs))
    steps = list(SERVE(reqs, memory, step_duration))
    if watch is not None:
        watch.append(memory)
    return steps


def req(i, p, o, t=0.0):
    return RequestSpec(request_id=i, prompt_len=p, output_len=o, arrival_time=t)


def rows(steps):
    """Per-step (token, reservation, internal, external, free) tuples."""
    return [tuple(st)[:5] for st in steps]


# ------------------------------------------------------------------ sizes
def test_sizes():
    assert [next_pow2(n) for n in (1, 2, 3, 25, 32, 33)] == [1, 2, 4, 32, 32, 64]
    assert contiguous_reservation("orca_max", 10, 25, 2048) == 2048
    assert contiguous_reservation("orca_pow2", 10, 25, 2048) == 10 + 32  # the paper's 25 -> 32 example
    assert contiguous_reservation("orca_pow2", 1500, 600, 2048) == 2048  # capped at max_len
    assert contiguous_reservation("orca_oracle", 10, 25, 2048) == 35
    assert blocks_needed(33, 16) == 3 and paged_internal_fragmentation(33, 16) == 15
    assert paged_internal_fragmentation(32, 16) == 0
    with pytest.raises(ValueError):
        contiguous_reservation("paged", 1, 1, 8)
    with pytest.raises(ValueError):
        next_pow2(0)


# ------------------------------------------------------------------ first fit
def test_first_fit_makes_holes_and_merges_them():
    a = FirstFitAllocator(10)
    assert [a.allocate(3) for _ in range(3)] == [0, 3, 6]
    a.free(3, 3)
    assert a.holes == [[3, 3], [9, 1]] and a.free_slots == 4
    assert a.allocate(4) is None  # 4 slots free, but no hole of 4: external fragmentation
    assert a.largest_hole() == 3
    a.free(0, 3)
    assert a.holes == [[0, 6], [9, 1]]
    assert a.allocate(4) == 0  # lowest address that fits
    a.free(6, 3)
    assert a.holes == [[4, 6]]
    with pytest.raises(ValueError, match="double free"):
        a.free(5, 2)
    with pytest.raises(ValueError):
        a.free(9, 5)


def test_buddy_rounds_to_powers_of_two_splits_and_merges():
    b = BuddyAllocator(12)  # regions: 8 slots at 0, 4 slots at 8
    assert b.allocate(3) == 8  # smallest free block that fits (4 at 8), no split of the 8
    assert b.allocate(3) == 0  # splits [0,8) into [0,4) + [4,8)
    assert b.allocate(4) == 4
    assert b.allocate(1) is None and b.free_slots == 0
    b.free(0, 3)
    b.free(4)
    assert b.largest_hole() == 8 and b.allocate(5) == 0  # the two halves merged back into 8
    b.free(8, 3)
    assert b.largest_hole() == 4  # [8,12) never merges with the 8-slot region
    with pytest.raises(ValueError, match="double free"):
        b.free(8)
    with pytest.raises(ValueError):
        b.free(0, 2)  # the block at 0 holds 8 slots, not a request of 2


# ------------------------------------------------------------------ hand-computed runs
def test_buddy_rounding_is_external_fragmentation_exact():
    # kv=16, oracle, buddy. A (2+3)=5 -> block of 8 at 0 (3 rounding slots); B (1+2)=3 -> block of 4 at 8
    # (1 rounding slot); C (1+5)=6 needs 8 but only 4 slots at 12 are free -> waits.
    steps = run([req(0, 2, 3), req(1, 1, 2), req(2, 1, 5)], "orca_oracle", 16, max_len=8)
    assert rows(steps)[0] == (3, 3 + 2, 0, 4 + 3 + 1, 0)
    assert steps[0].waiting == 1 and not steps[0].hole_blocked  # 4 free < 8: not a hole problem
    assert hole_blocked_fraction(steps) == 0.0


def test_oracle_two_requests_exact():
    # kv=10. A: prompt 2, output 3 (L=5) at [0,5); B: prompt 1, output 2 (L=3) at [5,8).
    steps = run([req(0, 2, 3), req(1, 1, 2)], "orca_oracle", 10, allocator="first_fit", max_len=8)
    assert rows(steps) == [
        (3, 5, 0, 0, 2),  # step 0: admit both; tokens 2+1, reserved (5-2)+(3-1)
        (5, 3, 0, 0, 2),  # step 1: both grow
        (4, 1, 0, 0, 5),  # step 2: B reaches 3 and leaves; A holds 4 of its 5
        (0, 0, 0, 0, 10),  # step 3: A finished and left: the last step, all free
    ]
    b, mean_running = average_slots(steps, window="all")
    assert (b.token_states, b.reservation, b.free) == (3.0, 2.25, 4.75) and mean_running == 5 / 4
    assert b.percent()["token_states"] == 30.0
    assert b.percent(include_free=False) == pytest.approx(
        {"token_states": 400 / 7, "reservation": 300 / 7, "internal_frag": 0.0, "external_frag": 0.0, "free": 0.0})
    loaded, _ = average_slots(steps)  # the loaded window ends at the last admission (step 0)
    assert loaded.token_states == 3 and loaded.reservation == 5


def test_max_reservation_internal_and_external_fragmentation_exact():
    # kv=20, max_len=8: A (2+3) and B (1+2) each reserve 8; C (1+1) needs 8 but only 4 slots are left.
    steps = run([req(0, 2, 3), req(1, 1, 2), req(2, 1, 1)], "orca_max", 20, allocator="first_fit", max_len=8)
    assert rows(steps)[:3] == [
        (3, 5, 8, 4, 0),  # internal (8-5)+(8-3)=8; C waits, so the 4 free slots are external fragmentation
        (5, 3, 8, 4, 0),
        # B left and C was admitted at B's old address: A 4 tokens (1 reserved, 3 internal),
        # C 1 token (1 reserved, 8-2=6 internal); nobody waits, so the 4 slots at the end are just free
        (4 + 1, 1 + 1, 3 + 6, 0, 4),
    ]
    assert hole_blocked_fraction(steps) == 0.0  # C was blocked by total free memory (4 < 8), not by a hole


def test_pow2_reservation_split():
    # prompt 3, output 5 -> reserve 3 + 8 = 11; L = 8: internal 3 for the whole life
    steps = run([req(0, 3, 5)], "orca_pow2", 16, allocator="first_fit", max_len=16)
    assert rows(steps)[0] == (3, 5, 3, 0, 5)
    assert all(row[2] == 3 for row in rows(steps)[:-1]) and rows(steps)[-1] == (0, 0, 0, 0, 16)


def test_external_fragmentation_from_a_hole():
    # kv=10, oracle. Step 0: A (1+2) at [0,3), B (1+4) at [3,8), C (1+1) at [8,10). Step 1: C finishes,
    # hole [8,10); D (2+2, arrives at t=1) needs 4 and waits (2 free: not enough in total). Step 2: A finishes,
    # holes [0,3) and [8,10): 5 slots free >= 4, but no hole of 4 -> D still waits (a hole-blocked step).
    steps = run([req(0, 1, 2), req(1, 1, 4), req(2, 1, 1), req(3, 2, 2, t=1.0)], "orca_oracle", 10,
                allocator="first_fit", max_len=10)
    assert rows(steps)[1] == (2 + 2, 1 + 3, 0, 2, 0) and not steps[1].hole_blocked  # D waits: 2 free, external
    assert rows(steps)[2] == (3, 2, 0, 5, 0) and steps[2].hole_blocked  # only B; D waits though 5 >= 4 are free
    assert 0 < hole_blocked_fraction(steps) < 1


def test_arrivals_join_the_queue_on_time_in_fcfs_order():
    # D arrives at t = 0.5: with 1-second steps it is queued in step 1 (t = 1), with 0.25-second steps in step 2
    late = [req(1, 1, 1, t=0.5), req(0, 1, 1, t=0.5), req(2, 1, 1)]
    arrivals = Arrivals(late, step_duration=0.25)
    assert [[spec.request_id for spec, _ in arrivals.next_step()] for _ in range(3)] == [[2], [], [0, 1]]
    assert len(arrivals) == 0 and arrivals.next_step() == []
    steps = run(late, "orca_oracle", 16, max_len=8)
    assert [(st.running, st.waiting) for st in steps] == [(1, 0), (2, 0), (0, 0)]  # 2 alone, then 0 and 1


def test_paged_exact_with_internal_fragmentation_and_unusable_tail():
    # B=4, kv=9 -> 2 blocks + 1 slot too few for a block (always external). Prompt 1, output 5 (L=6).
    watch = []
    steps = run([req(0, 1, 5)], "paged", 9, block_size=4, max_len=8, watermark=0.0, watch=watch)
    assert rows(steps) == [
        (1, 3, 0, 1, 4),
        (2, 2, 0, 1, 4),
        (3, 1, 0, 1, 4),
        (4, 0, 0, 1, 4),
        (5, 1, 2, 1, 0),  # second block: slot 6 will be used (reservation), slots 7-8 never (internal)
        (0, 0, 0, 1, 8),  # finished: its blocks are free, the odd slot stays external
    ]
    assert watch[0].refused == 0 and watch[0].finished == [0]


def test_paged_preemption_by_recompute():
    # B=1, 3 blocks. A and B: prompt 1, output 2. Step 1: A takes the last block, B has none and is the most
    # recent request, so B is preempted (its block freed, no admission in that step).
    watch = []
    steps = run([req(0, 1, 2), req(1, 1, 2)], "paged", 3, block_size=1, max_len=4, watermark=0.0, watch=watch)
    assert watch[0].refused == 1 and sorted(watch[0].finished) == [0, 1]
    assert rows(steps)[:3] == [
        (2, 0, 0, 0, 1),
        (2, 0, 0, 1, 0),  # A at 2 tokens; B waits at the head of the queue: its freed block is external
        (1, 0, 0, 0, 2),  # A finished and left; B re-admitted (recomputes its prompt)
    ]


def test_first_fit_places_what_the_buddy_cannot_and_watermark_never_starves_a_lone_request():
    steps = run([req(0, 30, 40)], "orca_oracle", 100, max_len=80, allocator="first_fit")
    assert average_slots(steps)[0].token_states == 30
    # 100 blocks, 1 % watermark: a request needing all 100 blocks still runs when it is alone
    watch = []
    steps = run([req(0, 99, 1)], "paged", 100, block_size=1, max_len=100, watermark=0.01, watch=watch)
    assert len(steps) == 2 and watch[0].refused == 0 and watch[0].finished == [0]


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: kv_memory("buddy", 10), "unknown scheme"),
        (lambda: kv_memory("paged", 0), "no block"),
        (lambda: kv_memory("orca_oracle", 0), "size must be >= 1"),
        (lambda: kv_memory("paged", 8, block_size=16), "no block"),
        (lambda: kv_memory("paged", 8, block_size=0), "block_size"),
        (lambda: kv_memory("orca_oracle", 10, allocator="slab"), "allocator"),
        (lambda: kv_memory("paged", 16, watermark=1.5), "watermark"),
        (lambda: run([req(0, 5, 5)], "orca_oracle", 100, max_len=8), "max_len"),
        (lambda: run([req(0, 1, 1)], "orca_max", 100, max_len=2048), "never fit"),
        (lambda: run([req(0, 30, 40)], "orca_oracle", 100, max_len=80), "never fit"),  # buddy: 128 > region of 64
        (lambda: run([req(0, 10, 10)], "paged", 16, block_size=4), "never fit"),  # 5 blocks of 4 > 4 blocks
        (lambda: run([req(0, 0, 3)], "orca_oracle", 16, max_len=8), "prompt_len"),
        (lambda: run([req(0, 2, 0)], "paged", 16, block_size=4), "output_len"),
        (lambda: run([], "orca_oracle", 10), "no request"),
        (lambda: Arrivals([req(0, 1, 1)], step_duration=0), "step_duration"),
        (lambda: average_slots([]), "at least one step"),
        (lambda: average_slots(run([req(0, 1, 1)], "orca_oracle", 8, max_len=4), window="some"), "window"),
    ],
)
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("scheme, kv, spec", [
    ("orca_oracle", 100, req(9, 30, 40)),  # 70 slots -> a buddy block of 128; the largest region is 64
    ("orca_max", 128, req(9, 60, 10)),  # 70 tokens > max_len 64
    ("paged", 100, req(9, 30, 70)),  # 100 tokens need 7 blocks of 16; the pool has 6
    ("paged", 100, req(9, 0, 4)),  # no prompt
])
def test_a_request_that_can_never_fit_is_refused_and_changes_nothing(scheme, kv, spec):
    # the loop would otherwise wait for it forever (contiguous) or preempt and resume it forever (paged)
    memory = kv_memory(scheme, kv, max_len=64, block_size=16)
    held = memory.admit(req(0, 4, 4))
    before = (memory.slots([held], []), held.length, held.alloc)
    with pytest.raises(ValueError):
        memory.admit(spec)
    assert (memory.slots([held], []), held.length, held.alloc) == before


# ------------------------------------------------------------------ properties
requests_st = st.lists(
    st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=12
).map(lambda xs: [req(i, p, o, float(t)) for i, (p, o, t) in enumerate(xs)])


@settings(max_examples=200, deadline=None)
@given(requests_st, st.sampled_from(SCHEMES), st.integers(0, 60), st.sampled_from([1, 2, 4, 8, 16]),
       st.sampled_from(["buddy", "first_fit"]), st.sampled_from([1.0, 0.3]))
def test_categories_partition_the_pool_at_every_step(reqs, scheme, extra, block_size, allocator, step_duration):
    kv = 64 + extra  # every request fits (max_len 40 -> a buddy block of 64; 40 + a block of 16 <= 64)
    watch = []
    steps = run(reqs, scheme, kv, max_len=40, block_size=block_size, allocator=allocator, watch=watch,
                step_duration=step_duration)
    for row in rows(steps):
        assert sum(row) == kv
        assert min(row) >= 0
    if scheme == "orca_oracle":
        assert all(row[2] == 0 for row in rows(steps))  # knowing the output length: no internal fragmentation
    if scheme == "paged":
        assert not any(st.hole_blocked for st in steps)  # any free block will do
    assert average_slots(steps, window="all")[0].total == pytest.approx(kv)
    # every request was served exactly once, and the run is at least as long as the longest output
    assert sorted(watch[0].finished) == [r.request_id for r in reqs]
    assert len(steps) > max(x.output_len for x in reqs)
    assert steps[-1].running == steps[-1].waiting == 0


def test_figure2_shape_on_the_sharegpt_like_workload():
    res = {s: average_slots(run(sharegpt_like(300, seed=0), s, 15_700))[0] for s in SCHEMES}
    pct = {s: r.percent() for s, r in res.items()}
    tok = [pct[s]["token_states"] for s in SCHEMES]
    assert tok == sorted(tok)  # Max < Pow2 < Oracle < paged, as in the paper
    assert pct["paged"]["token_states"] >= 96.0
    assert pct["orca_oracle"]["internal_frag"] == 0.0 and pct["orca_oracle"]["reservation"] > 10
    assert "Orca (Max)" in format_figure2_table(res)


def test_the_loop_preempts_on_a_small_paged_memory_and_serves_everyone():
    reqs, watch = sharegpt_like(150, max_len=2048, seed=1), []
    steps = run(reqs, "paged", 4096, watch=watch)
    assert watch[0].refused > 0  # the loop's preemption branch ran
    assert sorted(watch[0].finished) == sorted(r.request_id for r in reqs)
    assert all(sum(row) == 4096 for row in rows(steps))


def test_notebook_03_has_one_route():
    """Every memory notebook 03 measures is served by its own `serve` loop: no second simulator in the lab."""
    src = NOTEBOOK.read_text(encoding="utf-8")
    assert not hasattr(ma, "simulate") and not hasattr(ma, "figure2")
    memories = re.findall(r"kv_memory\(", src)
    served = re.findall(r"serve\([^()]*kv_memory\(", src)
    assert len(memories) >= 4 and len(served) == len(memories), "a memory the notebook reads outside its loop"


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([FirstFitAllocator, BuddyAllocator]), st.integers(1, 200),
       st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=60))
def test_allocators_never_overlap_and_count_free_slots(cls, size, ops):
    a = cls(size)
    live: dict[int, tuple[int, int]] = {}  # start -> (slots requested, slots occupied)
    for do_alloc, n in ops:
        if do_alloc or not live:
            start = a.allocate(n)
            if start is None:
                assert a.largest_hole() < a.block_size(n)  # refused only when no hole fits
                continue
            occupied = a.block_size(n)
            assert 0 <= start and start + occupied <= size
            assert all(start + occupied <= s or s + k <= start for s, (_, k) in live.items())
            if cls is BuddyAllocator:
                assert start % occupied == 0  # buddy blocks are aligned to their size
            live[start] = (n, occupied)
        else:
            start = sorted(live)[n % len(live)]
            a.free(start, live.pop(start)[0])
        assert a.free_slots == size - sum(k for _, k in live.values())


def test_memories_change_nothing_when_they_refuse():
    paged = PagedMemory(32, block_size=8, watermark=0.0)
    a = paged.admit(req(0, 8, 4))
    b = paged.admit(req(1, 24, 4))
    assert a is not None and b is not None and paged.pool.num_free_blocks == 0
    before = (paged.slots([a, b], []), a.length, a.alloc, list(a.blocks))
    assert paged.grow(a) is False  # a's block is full and none is free
    assert (paged.slots([a, b], []), a.length, a.alloc, list(a.blocks)) == before
    assert paged.admit(req(2, 1, 1)) is None and paged.slots([a, b], []) == before[0]
    paged.free(b)
    assert paged.grow(a) is True and a.alloc == 16 and a.generated == 1
    with_watermark = PagedMemory(64, block_size=8, watermark=0.25)  # 2 of 8 blocks kept free while others run
    first = with_watermark.admit(req(0, 40, 1), busy=False)
    assert first is not None and with_watermark.admit(req(1, 16, 1), busy=True) is None  # 2 + 2 > 3 free
    assert with_watermark.admit(req(1, 16, 1), busy=False) is not None  # alone, the watermark does not apply

    chunks = ContiguousMemory("orca_max", 20, max_len=8, allocator="first_fit")
    x, y = chunks.admit(req(0, 2, 2)), chunks.admit(req(1, 2, 2))
    assert chunks.admit(req(2, 1, 1)) is None  # 4 slots left, a reservation of 8
    assert chunks.slots([x, y], [(req(2, 1, 1), 0)]) == StepSlots(4, 4, 8, 4, 0, 2, 1, False)
    assert chunks.hole_blocked(req(2, 1, 1)) is False
    with pytest.raises(ValueError, match="unknown scheme"):
        kv_memory("orca_min", 16)
    with pytest.raises(ValueError, match="at least one step"):
        average_slots([])
