"""minienv.lab.memory_accounting: every category checked on tiny hand-computed workloads, plus properties."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minienv.lab.memory_accounting import (
    CATEGORIES,
    SCHEMES,
    BuddyAllocator,
    ContiguousMemory,
    FirstFitAllocator,
    PagedMemory,
    StepSlots,
    average_slots,
    blocks_needed,
    contiguous_reservation,
    figure2,
    format_figure2_table,
    kv_memory,
    next_pow2,
    paged_internal_fragmentation,
    simulate,
)
from minienv.lab.workload import RequestSpec, sharegpt_like


def req(i, p, o, t=0.0):
    return RequestSpec(request_id=i, prompt_len=p, output_len=o, arrival_time=t)


def rows(result):
    """Per-step (token, reservation, internal, external, free) tuples from a recorded timeline."""
    tl = result.timeline
    return list(zip(*(tl[c] for c in CATEGORIES), strict=True))


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
    reqs = [req(0, 2, 3), req(1, 1, 2), req(2, 1, 5)]
    r = simulate(reqs, "orca_oracle", 16, max_len=8, measure="all", record_timeline=True)
    assert rows(r)[0] == (3, 3 + 2, 0, 4 + 3 + 1, 0)
    assert r.hole_blocked_fraction == 0.0  # 4 free < 8: not a hole problem



def test_oracle_two_requests_exact():
    # kv=10. A: prompt 2, output 3 (L=5) at [0,5); B: prompt 1, output 2 (L=3) at [5,8).
    r = simulate([req(0, 2, 3), req(1, 1, 2)], "orca_oracle", 10, allocator="first_fit", max_len=8, measure="all", record_timeline=True)
    assert rows(r) == [
        (3, 5, 0, 0, 2),  # step 0: admit both; tokens 2+1, reserved (5-2)+(3-1)
        (5, 3, 0, 0, 2),  # step 1: both grow
        (4, 1, 0, 0, 5),  # step 2: B reaches 3 and leaves; A holds 4 of its 5
    ]
    assert r.steps == 3  # A finished in step 3 (not accounted)
    b = r.breakdown
    assert (b.token_states, b.reservation, b.free) == (4.0, 3.0, 3.0)
    assert r.percent()["token_states"] == 40.0
    assert r.percent(include_free=False) == pytest.approx(
        {"token_states": 400 / 7, "reservation": 300 / 7, "internal_frag": 0.0, "external_frag": 0.0, "free": 0.0})
    # the loaded window ends at the last admission (step 0)
    loaded = simulate([req(0, 2, 3), req(1, 1, 2)], "orca_oracle", 10, allocator="first_fit", max_len=8)
    assert loaded.window_steps == 1 and loaded.breakdown.token_states == 3 and loaded.breakdown.reservation == 5


def test_max_reservation_internal_and_external_fragmentation_exact():
    # kv=20, max_len=8: A (2+3) and B (1+2) each reserve 8; C (1+1) needs 8 but only 4 slots are left.
    reqs = [req(0, 2, 3), req(1, 1, 2), req(2, 1, 1)]
    r = simulate(reqs, "orca_max", 20, allocator="first_fit", max_len=8, measure="all", record_timeline=True)
    assert rows(r)[:3] == [
        (3, 5, 8, 4, 0),  # internal (8-5)+(8-3)=8; C waits, so the 4 free slots are external fragmentation
        (5, 3, 8, 4, 0),
        # B left and C was admitted at B's old address: A 4 tokens (1 reserved, 3 internal),
        # C 1 token (1 reserved, 8-2=6 internal); nobody waits, so the 4 slots at the end are just free
        (4 + 1, 1 + 1, 3 + 6, 0, 4),
    ]
    assert r.hole_blocked_fraction == 0.0  # C was blocked by total free memory (4 < 8), not by a hole


def test_pow2_reservation_split():
    # prompt 3, output 5 -> reserve 3 + 8 = 11; L = 8: internal 3 for the whole life
    r = simulate([req(0, 3, 5)], "orca_pow2", 16, allocator="first_fit", max_len=16, measure="all", record_timeline=True)
    assert rows(r)[0] == (3, 5, 3, 0, 5)
    assert all(row[2] == 3 for row in rows(r))


def test_external_fragmentation_from_a_hole():
    # kv=10, oracle. Step 0: A (1+2) at [0,3), B (1+4) at [3,8), C (1+1) at [8,10). Step 1: C finishes,
    # hole [8,10); D (2+2, arrives at t=1) needs 4 and waits (2 free: not enough in total). Step 2: A finishes,
    # holes [0,3) and [8,10): 5 slots free >= 4, but no hole of 4 -> D still waits (a hole-blocked step).
    reqs = [req(0, 1, 2), req(1, 1, 4), req(2, 1, 1), req(3, 2, 2, t=1.0)]
    r = simulate(reqs, "orca_oracle", 10, allocator="first_fit", max_len=10, measure="all", record_timeline=True)
    assert rows(r)[1] == (2 + 2, 1 + 3, 0, 2, 0)  # A 2/3, B 2/5, C gone; D waits: 2 free slots external
    assert rows(r)[2] == (3, 2, 0, 5, 0)  # only B (3/5); D waits although 5 >= 4 slots are free
    assert r.hole_blocked_fraction > 0


def test_paged_exact_with_internal_fragmentation_and_unusable_tail():
    # B=4, kv=9 -> 2 blocks + 1 slot too few for a block (always external). Prompt 1, output 5 (L=6).
    r = simulate([req(0, 1, 5)], "paged", 9, block_size=4, max_len=8, measure="all", record_timeline=True,
                 watermark=0.0)
    assert rows(r) == [
        (1, 3, 0, 1, 4),
        (2, 2, 0, 1, 4),
        (3, 1, 0, 1, 4),
        (4, 0, 0, 1, 4),
        (5, 1, 2, 1, 0),  # second block: slot 6 will be used (reservation), slots 7-8 never (internal)
    ]
    assert r.steps == 5 and r.preemptions == 0


def test_paged_preemption_by_recompute():
    # B=1, 3 blocks. A and B: prompt 1, output 2. Step 1: A takes the last block, B has none and is the most
    # recent request, so B is preempted (its block freed, no admission in that step).
    r = simulate([req(0, 1, 2), req(1, 1, 2)], "paged", 3, block_size=1, max_len=4, measure="all",
                 record_timeline=True, watermark=0.0)
    assert r.preemptions == 1
    assert rows(r)[:3] == [
        (2, 0, 0, 0, 1),
        (2, 0, 0, 1, 0),  # A at 2 tokens; B waits at the head of the queue: its freed block is external
        (1, 0, 0, 0, 2),  # A finished and left; B re-admitted (recomputes its prompt)
    ]


def test_first_fit_places_what_the_buddy_cannot_and_watermark_never_starves_a_lone_request():
    r = simulate([req(0, 30, 40)], "orca_oracle", 100, max_len=80, allocator="first_fit")
    assert r.breakdown.token_states == 30
    # 100 blocks, 1 % watermark: a request needing all 100 blocks still runs when it is alone
    r = simulate([req(0, 99, 1)], "paged", 100, block_size=1, max_len=100, watermark=0.01)
    assert r.steps == 1 and r.preemptions == 0


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([req(0, 1, 1)], "buddy", 10), {}, "unknown scheme"),
        (([req(0, 1, 1)], "paged", 0), {}, "kv_slots"),
        (([req(0, 1, 1)], "paged", 8), {"block_size": 16}, "no block"),
        (([req(0, 1, 1)], "paged", 8), {"block_size": 0}, "block_size"),
        (([req(0, 5, 5)], "orca_oracle", 100), {"max_len": 8}, "max_len"),
        (([req(0, 1, 1)], "orca_max", 100), {"max_len": 2048}, "never fit"),
        (([req(0, 30, 40)], "orca_oracle", 100), {"max_len": 80}, "never fit"),  # buddy: 128 > region of 64
        (([req(0, 1, 1)], "orca_oracle", 10), {"measure": "some"}, "measure"),
        (([], "orca_oracle", 10), {}, "at least one"),
        (([req(0, 1, 1)], "orca_oracle", 10), {"allocator": "slab"}, "allocator"),
        (([req(0, 1, 1)], "paged", 16), {"watermark": 1.5}, "watermark"),
    ],
)
def test_bad_arguments_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(*args, **kwargs)


# ------------------------------------------------------------------ properties
requests_st = st.lists(
    st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=12
).map(lambda xs: [req(i, p, o, float(t)) for i, (p, o, t) in enumerate(xs)])


@settings(max_examples=200, deadline=None)
@given(requests_st, st.sampled_from(SCHEMES), st.integers(0, 60), st.sampled_from([1, 2, 4, 8, 16]),
       st.sampled_from(["buddy", "first_fit"]))
def test_categories_partition_the_pool_at_every_step(reqs, scheme, extra, block_size, allocator):
    max_len = 40
    kv = 64 + extra  # every request fits (max_len 40 -> a buddy block of 64; 40 + a block of 16 <= 64)
    r = simulate(reqs, scheme, kv, max_len=max_len, block_size=block_size, measure="all", record_timeline=True,
                 allocator=allocator)
    assert rows(r), "the timeline recorded no steps"
    for row in rows(r):
        assert sum(row) == kv
        assert min(row) >= 0
    if scheme == "orca_oracle":
        assert all(row[2] == 0 for row in rows(r))  # knowing the output length: no internal fragmentation
    assert r.breakdown.total == pytest.approx(kv)
    # every request was served: the run is at least as long as the longest output
    assert r.steps >= max(x.output_len for x in reqs)


@settings(max_examples=100, deadline=None)
@given(requests_st, st.sampled_from(SCHEMES[:3]), st.integers(0, 60), st.sampled_from(["buddy", "first_fit"]),
       st.sampled_from([1.0, 0.3]))
def test_fast_forward_equals_stepping_one_by_one(reqs, scheme, extra, allocator, step_duration):
    kw = dict(max_len=40, allocator=allocator, step_duration=step_duration, record_timeline=True, measure="all")
    fast = simulate(reqs, scheme, 64 + extra, **kw)
    slow = simulate(reqs, scheme, 64 + extra, fast_forward=False, **kw)
    assert fast.timeline == slow.timeline
    assert (fast.steps, fast.window_steps, fast.breakdown, fast.hole_blocked_fraction, fast.mean_running) == (
        slow.steps, slow.window_steps, slow.breakdown, slow.hole_blocked_fraction, slow.mean_running)


def test_figure2_shape_on_the_sharegpt_like_workload():
    res = figure2(sharegpt_like(300, seed=0), 15_700)
    pct = {s: r.percent() for s, r in res.items()}
    tok = [pct[s]["token_states"] for s in SCHEMES]
    assert tok == sorted(tok)  # Max < Pow2 < Oracle < paged, as in the paper
    assert pct["paged"]["token_states"] >= 96.0
    assert pct["orca_oracle"]["internal_frag"] == 0.0 and pct["orca_oracle"]["reservation"] > 10
    assert "Orca (Max)" in format_figure2_table(res)


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


# ------------------------------------------------------------------ notebook 03's loop
def _notebook_serve():
    """The `serve` loop notebook 03 shows its reader, taken from the notebook itself (so this tests what they read)."""
    src = (Path(__file__).resolve().parents[2] / "notebooks" / "03_kv_memory.py").read_text(encoding="utf-8")
    start = src.index("def serve(requests, memory):")
    end = src.index("\n\n\n", start)
    namespace = {"deque": deque}
    exec(src[start:end], namespace)  # noqa: S102 - the repository's own notebook
    return namespace["serve"]


@settings(max_examples=150, deadline=None)
@given(requests_st, st.sampled_from(SCHEMES), st.integers(0, 60), st.sampled_from([1, 4, 16]),
       st.sampled_from(["buddy", "first_fit"]))
def test_notebook_loop_gives_simulate_step_by_step(reqs, scheme, extra, block_size, allocator):
    # all at t = 0, the notebook's setting; a small paged memory so that requests are preempted
    reqs = [req(r.request_id, r.prompt_len, r.output_len) for r in reqs]
    kv = 64 + extra
    steps = list(_notebook_serve()(reqs, kv_memory(scheme, kv, max_len=40, block_size=block_size,
                                                   allocator=allocator)))
    ref = simulate(reqs, scheme, kv, max_len=40, block_size=block_size, allocator=allocator, measure="all",
                   record_timeline=True)
    # simulate does not account the step in which the last request finished; the loop yields it (all free)
    assert [tuple(s)[:5] for s in steps[:-1]] == rows(ref)
    assert steps[-1].running == steps[-1].waiting == 0 and steps[-1].free == kv - (
        kv % block_size if scheme == "paged" else 0)
    loaded = simulate(reqs, scheme, kv, max_len=40, block_size=block_size, allocator=allocator)
    assert average_slots(steps) == (loaded.breakdown, loaded.mean_running)


def test_figure2_loop_equals_simulate_and_preempts():
    reqs = sharegpt_like(150, max_len=2048, seed=1)
    for scheme in SCHEMES:
        steps = list(_notebook_serve()(reqs, kv_memory(scheme, 4096)))
        ref = simulate(reqs, scheme, 4096)
        assert average_slots(steps) == (ref.breakdown, ref.mean_running)
    assert simulate(reqs, "paged", 4096).preemptions > 0  # the loop's preemption branch ran


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
    assert chunks.slots([x, y], [req(2, 1, 1)]) == StepSlots(4, 4, 8, 4, 0, 2, 1)
    assert chunks.hole_blocked(req(2, 1, 1)) is False
    with pytest.raises(ValueError, match="unknown scheme"):
        kv_memory("orca_min", 16)
    with pytest.raises(ValueError, match="at least one step"):
        average_slots([])
