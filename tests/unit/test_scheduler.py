"""The scheduler on its own, without a model: each step's plan is checked against the scheduling rules (running
requests first, chunked prefill that keeps decodes flowing, preemption of the most recently admitted request, FCFS
admission within the token and sequence budgets, static batching as the baseline).

A tiny driver plays the engine: ``schedule()``, then ``update_from_output`` (the K/V "exist"), then a fake token
for every request whose chunk reached its last known token, then ``finish_request`` at ``max_tokens``.
"""

from __future__ import annotations

import itertools

import pytest

from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.request import Request, RequestMetrics, RequestStatus
from minienv.sampling import SamplingParams
from minienv.scheduler import Scheduler, SchedulerOutput
from minienv.scheduler import make_scheduler as policy_scheduler

_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int = 4, *, prompt: list[int] | None = None, rid: str | None = None):
    ids = prompt if prompt is not None else [(7 * i + next(_ids)) % 97 for i in range(prompt_len)]
    return Request(rid or f"r{next(_ids)}", ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                   RequestMetrics(0.0, 0))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, **kw):
    mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=kw.pop("caching", True))
    return policy_scheduler(mgr, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **kw)


def drive_step(sch: Scheduler) -> SchedulerOutput:
    out = sch.schedule()
    assert out.num_scheduled_tokens <= sch.max_num_batched_tokens
    sch.update_from_output(out)
    for s in out.scheduled:
        if s.samples:
            req = sch.requests[s.request_id]
            req.append_output_token(1 + req.num_output_tokens)  # deterministic fake tokens
            if req.num_output_tokens >= req.max_tokens:
                sch.finish_request(req.request_id)
                req.finish("length", 0.0, sch.num_steps)
    sch.check_invariants()
    return out


def run_all(sch: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sch.has_unfinished_requests():
        outs.append(drive_step(sch))
        assert len(outs) < max_steps, "no progress"
    return outs


def test_every_running_request_decodes_every_step_and_admission_fills_the_batch():
    sch = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    reqs = [make_request(5, max_tokens=3 + i) for i in range(5)]
    for r in reqs:
        sch.add_request(r)
    first = drive_step(sch)
    assert first.admitted == [r.request_id for r in reqs[:3]]  # cap max_num_seqs
    assert [s.kind for s in first.scheduled] == ["prefill"] * 3
    second = drive_step(sch)
    assert [s.kind for s in second.scheduled] == ["decode"] * 3
    assert all(s.num_new_tokens == 1 for s in second.scheduled)
    outs = [first, second] + run_all(sch)
    # the first request finishes after 3 tokens; in that same step... the next step admits request 3
    admitted_at = {rid: o.step for o in outs for rid in o.admitted}
    assert admitted_at[reqs[3].request_id] == 3  # continuous: a slot is refilled as soon as it frees
    for o in outs:  # every request running at a step's start is scheduled in it (budget is ample)
        assert len(o.scheduled) == len(o.running)


def test_chunked_prefill_keeps_decodes_flowing_and_chunks_start_mid_prompt():
    sch = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    short = make_request(3, max_tokens=20)
    sch.add_request(short)
    drive_step(sch)  # short is now decoding
    long = make_request(30, max_tokens=2)
    sch.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = drive_step(sch)
        by = out.by_id()
        assert by[short.request_id].kind == "decode"  # the decode is never starved by the long prefill
        if long.request_id in by:
            chunks.append((by[long.request_id].num_computed_tokens, by[long.request_id].num_new_tokens))
    assert chunks == [(0, 7), (7, 7), (14, 7), (21, 7), (28, 2)]  # 8-token budget minus 1 reserved decode
    assert sum(n for _, n in chunks) == 30


def test_prefix_cache_hit_shortens_the_prefill():
    sch = make_scheduler(block_size=4, max_num_batched_tokens=64)
    shared = list(range(40, 52))  # 12 tokens = 3 full blocks
    a = make_request(0, prompt=shared + [1, 2], max_tokens=2)
    sch.add_request(a)
    run_all(sch)
    b = make_request(0, prompt=shared + [3], max_tokens=2)
    sch.add_request(b)
    out = drive_step(sch)
    (s,) = out.scheduled
    assert s.num_cached_tokens == 12 and s.num_computed_tokens == 12 and s.num_new_tokens == 1
    assert b.metrics.num_cached_tokens == 12


def test_preemption_victim_is_most_recent_goes_to_front_and_resumes_from_cache():
    # 6 blocks of 4 = 24 slots; three requests of 8 prompt tokens each take 2 blocks, then all want a 3rd
    sch = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    reqs = [make_request(8, max_tokens=8) for _ in range(3)]
    later = make_request(3, max_tokens=2)
    for r in reqs + [later]:
        sch.add_request(r)
    drive_step(sch)  # all three prefilled (6 blocks in use), each sampled a token
    out = drive_step(sch)  # each needs a 3rd block for its decode: the last admitted is preempted
    victim = reqs[2]
    assert out.preempted == [victim.request_id]
    assert out.admitted == []  # no admission in a step that preempted
    assert [s.request_id for s in out.scheduled] == [reqs[0].request_id, reqs[1].request_id]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert list(sch.waiting)[:2] == [victim, later]  # the victim went to the FRONT of the queue
    assert victim.output_token_ids == [1]  # its generated tokens are kept
    assert not sch.kv.has_request(victim.request_id)
    # its two freed blocks were cached-free for an instant, then the LRU evictor handed them to r0 and r1
    assert sch.kv.stats().evicted_blocks == 2 and sch.kv.stats().num_cached_free == 0
    run_all(sch)
    assert victim.metrics.num_preemptions >= 1 and sch.num_preemptions >= 1
    assert victim.output_token_ids == list(range(1, 9))  # it continued exactly where it stopped


def test_self_preemption_keeps_the_prefix_cached_so_the_resume_is_cheap():
    # 8 blocks of 4. r0, r1, r2 prefill 8 tokens each (6 blocks); at the next decode r0 and r1 take the last two
    # free blocks and r2, the most recently admitted, can only preempt itself.
    sch = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    r0, r1, r2 = make_request(8, max_tokens=3), make_request(8, max_tokens=3), make_request(8, max_tokens=8)
    for r in (r0, r1, r2):
        sch.add_request(r)
    drive_step(sch)
    out = drive_step(sch)
    assert out.preempted == [r2.request_id]
    assert [s.request_id for s in out.scheduled] == [r0.request_id, r1.request_id]
    assert sch.kv.stats().num_cached_free == 2  # r2's full prompt blocks: cached-free in the LRU, still findable
    outs = run_all(sch)
    resume = next(s for o in outs for s in o.scheduled if s.request_id == r2.request_id and s.is_new)
    assert resume.is_resume and resume.num_cached_tokens == 8  # resumed from its cached blocks...
    assert resume.num_new_tokens == 1  # ...recomputing only the generated token it had not fed yet
    assert r2.metrics.num_preemptions == 1 and r2.metrics.num_cached_tokens == 0  # (first admission: no hit)
    assert r2.output_token_ids == list(range(1, 9))


def test_the_oldest_request_always_progresses():
    sch = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = make_request(8, max_tokens=6), make_request(8, max_tokens=6)
    sch.add_request(a)
    sch.add_request(b)
    drive_step(sch)
    out = drive_step(sch)  # a needs a 3rd block, none is free: b (the most recent) is preempted, a proceeds
    assert out.preempted == [b.request_id]
    run_all(sch)
    assert a.num_output_tokens == b.num_output_tokens == 6


def test_static_batching_waits_for_the_whole_batch():
    sch = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, scheduling="static")
    short, long, third = make_request(3, max_tokens=1), make_request(3, max_tokens=6), make_request(3, max_tokens=1)
    for r in (short, long, third):
        sch.add_request(r)
    outs = run_all(sch)
    admitted_at = {rid: o.step for o in outs for rid in o.admitted}
    assert admitted_at[short.request_id] == admitted_at[long.request_id] == 0
    assert admitted_at[third.request_id] == 6  # only after `long` (the batch's longest member) has finished
    assert len(outs) == 7
    cont = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for r in (make_request(3, max_tokens=1), make_request(3, max_tokens=6), make_request(3, max_tokens=1)):
        cont.add_request(r)
    assert len(run_all(cont)) == 6  # continuous admits `third` as soon as `short` leaves


def test_budget_caps_admissions_and_fcfs_head_is_never_overtaken():
    sch = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big = make_request(16, max_tokens=2)  # 4 blocks + 1 for its output
    small = make_request(2, max_tokens=2)
    sch.add_request(big)
    out = drive_step(sch)
    sch.add_request(make_request(12, max_tokens=2))  # needs 3 blocks: cannot fit beside `big`
    sch.add_request(small)
    out = drive_step(sch)
    assert out.admitted == []  # `small` would fit, but it does not overtake the head of the queue
    run_all(sch)


def test_finish_and_abort_free_blocks():
    sch = make_scheduler()
    a, b = make_request(9), make_request(9)
    sch.add_request(a)
    sch.add_request(b)
    drive_step(sch)
    sch.finish_request(a.request_id)  # running
    assert not sch.kv.has_request(a.request_id)
    sch.add_request(c := make_request(3))
    sch.finish_request(c.request_id)  # waiting
    assert c not in sch.waiting
    sch.check_invariants()


@pytest.mark.parametrize("kw,msg", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "must be >= max_num_seqs"),
    (dict(scheduling="fifo"), "scheduling"),
])
def test_bad_configuration(kw, msg):
    with pytest.raises(ValueError, match=msg):
        make_scheduler(**kw)


def test_property_any_workload_any_budget_every_request_finishes_with_invariants_kept():
    """Random workloads, budgets down to the largest single request, both policies, cache on/off: every request
    finishes with exactly its tokens, the invariants hold after every step, and no step exceeds its budgets."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None)
    @given(
        lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=10),
        block_size=st.sampled_from([1, 2, 4, 8]),
        slack_blocks=st.integers(0, 12),
        max_num_seqs=st.integers(1, 5),
        extra_tokens=st.integers(0, 40),
        static=st.booleans(),
        caching=st.booleans(),
        shared=st.booleans(),
    )
    def check(lens, block_size, slack_blocks, max_num_seqs, extra_tokens, static, caching, shared):
        largest = max(-(-(p + m) // block_size) for p, m in lens)
        sch = make_scheduler(num_blocks=largest + slack_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_seqs + extra_tokens,
                             scheduling="static" if static else "continuous", caching=caching)
        reqs = []
        for i, (p, m) in enumerate(lens):
            prompt = [(3 * j + (0 if shared else i)) % 50 for j in range(p)]
            reqs.append(make_request(0, prompt=prompt, max_tokens=m))
            sch.add_request(reqs[-1])
        steps = run_all(sch, max_steps=5000)
        for r, (p, m) in zip(reqs, lens, strict=True):
            assert r.output_token_ids == list(range(1, m + 1))
        for o in steps:
            assert len(o.running) <= max_num_seqs
        assert sch.kv.pool.num_used_blocks == 0

    check()


def test_static_padding_keeps_a_finished_member_computing_until_its_batch_ends():
    """The faithful baseline: `short` finishes after step 0 but keeps its row (and KV) while `long` runs steps
    1..5 — five discarded tokens at its next positions, counted by hand; the lone third batch pads nothing."""
    sch = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, scheduling="static")
    short, long, third = make_request(3, max_tokens=1), make_request(3, max_tokens=6), make_request(3, max_tokens=1)
    for r in (short, long, third):
        sch.add_request(r)
    outs = [drive_step(sch)]
    assert sch.padding_slots == [short.request_id] and sch.kv.has_request(short.request_id)
    outs += run_all(sch)
    assert len(outs) == 7  # padding never changes the schedule of live work
    pads = [(o.step, s.num_computed_tokens) for o in outs for s in o.scheduled if s.kind == "padding"]
    assert all(s.request_id == short.request_id for o in outs for s in o.scheduled if s.kind == "padding")
    assert pads == [(step, 3 + step - 1) for step in range(1, 6)]  # steps 1..5, positions 3, 4, 5, 6, 7
    assert sch.num_padding_tokens == sum(o.num_padding_tokens for o in outs) == 5
    assert short.output_token_ids == [1] and long.output_token_ids == [1, 2, 3, 4, 5, 6]
    assert sch.padding_slots == [] and sch.kv.pool.num_used_blocks == 0  # the batch's end freed the padding KV

    charitable = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, scheduling="static", static_padding=False)
    for r in (make_request(3, max_tokens=1), make_request(3, max_tokens=6), make_request(3, max_tokens=1)):
        charitable.add_request(r)
    c_outs = run_all(charitable)
    assert len(c_outs) == 7 and charitable.num_padding_tokens == 0
    # the same live work step by step; padding is on top of it
    assert [o.num_scheduled_tokens - o.num_padding_tokens for o in outs] == [o.num_scheduled_tokens for o in c_outs]


def test_static_padding_gives_its_blocks_back_before_a_live_request_is_preempted():
    """Padding holds KV, but it is the first thing to go under memory pressure: `long` never gets preempted."""
    sch = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, scheduling="static")
    short, long = make_request(4, max_tokens=1), make_request(4, max_tokens=12)  # 1 block + 4 blocks at the end
    sch.add_request(short)
    sch.add_request(long)
    outs = run_all(sch)
    assert sch.num_preemptions == 0 and long.output_token_ids == list(range(1, 13))
    assert 0 < sch.num_padding_tokens < 11  # it padded, then was released when `long` needed its blocks
    assert sch.kv.pool.num_used_blocks == 0 and all(not o.preempted for o in outs)


def _reference_plan(needs, budget):  # notebook 07's plan_step (the scheduler's own rule, without memory)
    from minienv.exercises.scheduling import plan_reference
    return plan_reference(needs, budget)


def test_a_step_planner_with_the_schedulers_rule_plans_every_step_as_the_default_does():
    """The seam notebook 14 plugs the student's 07 plan_step into: with the rule it states, every plan is the
    default's; it was asked for each prefill chunk."""
    def workload(sch):
        for n in (3, 30, 9, 17, 5):
            sch.add_request(make_request(n, max_tokens=6, rid=f"w{n}"))
        return [[(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in o.scheduled] for o in run_all(sch)]
    asked = []
    planned = workload(make_scheduler(max_num_batched_tokens=8, step_planner=lambda needs, budget: asked.append(
        (needs, budget)) or _reference_plan(needs, budget)))
    assert planned == workload(make_scheduler(max_num_batched_tokens=8)) and asked


@pytest.mark.parametrize("planner, words", [
    (lambda needs, budget: list(needs), "more tokens than the budget"),
    (lambda needs, budget: [0] * (len(needs) + 1), "one number per running request"),
    (lambda needs, budget: [-1] * len(needs), "a negative count"),
])
def test_a_step_plan_that_breaks_a_rule_is_refused_and_the_step_rolled_back(planner, words):
    sch = make_scheduler(max_num_batched_tokens=8, step_planner=planner)
    long = make_request(30, max_tokens=2)
    sch.add_request(long)
    sch.update_from_output(sch.schedule())  # the admission takes the first chunk (the planner is not asked)
    before = (long.num_computed_tokens, list(sch.kv.block_ids(long.request_id)), sch.num_steps)
    with pytest.raises(ValueError, match=words):
        sch.schedule()
    assert (long.num_computed_tokens, list(sch.kv.block_ids(long.request_id)), sch.num_steps) == before
    sch.check_invariants()


def test_a_step_planner_must_be_callable():
    with pytest.raises(ValueError, match="step_planner must be a callable"):
        make_scheduler(step_planner=[1, 2])
