"""The views the notebooks draw show what the engine recorded.

These asserts used to sit in the notebooks' proof cells; they test the viz library, not the lessons, so they live
here. Each test rebuilds the same view the notebook builds (same seeded workload, same engine settings).
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_driver import admit, append, child, compute
from minienv.engine import InferenceEngine
from minienv.lab.scheduling_demos import mixed_workload, tiny_model
from minienv.sampling import SamplingParams
from minienv.viz.timeline import RequestTimeline

_ENGINE = dict(kv_budget_tokens=4096, block_size=8, max_num_seqs=4, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def sched():
    """Notebook 07's model and mixed workload."""
    model, tok = tiny_model(seed=0)
    lens, prompts, params = mixed_workload(16, seed=0)
    return model, tok, prompts, params, lens


def _timeline(engine, **kw):
    tl = RequestTimeline(live="html", **kw)
    tl.update(engine.timeline(), num_steps=engine.stats.num_steps)
    return tl


def test_07_policy_timelines_match_the_engine(sched):
    model, tok, prompts, params, lens = sched
    tls, outs = {}, {}
    for mode in ("static", "continuous"):
        engine = InferenceEngine(model, tok, scheduling=mode, **_ENGINE)
        outs[mode] = engine.generate(prompts, params)
        tls[mode] = _timeline(engine, title=mode, step_px=10)
    st, ct = tls["static"], tls["continuous"]
    assert st.rows == ct.rows == [o.request_id for o in outs["static"]]
    assert st.count("decode") == ct.count("decode")
    assert st.count("waiting") > 1.5 * ct.count("waiting")
    for mode, tl in tls.items():  # every finish mark sits where the engine says the request finished
        assert all(tl.finish_step(o.request_id) + 1 == o.metrics.finished_step for o in outs[mode])
    # static: a batch is admitted only when the whole previous batch has finished
    first = {r: next(s for s in range(st.num_steps) if st.state_at(r, s) == "prefill") for r in st.rows}
    batches = [st.rows[i:i + 4] for i in range(0, len(st.rows), 4)]
    starts = [0] + [max(st.finish_step(r) + 1 for r in b) for b in batches[:-1]]
    assert all(first[r] == starts[k] for k, b in enumerate(batches) for r in b)


def test_07_live_stepper_draws_every_scheduled_token(sched):
    from minienv.viz import Stepper

    model, tok, prompts, params, _ = sched
    live_tl, live = RequestTimeline(title="request timeline", step_px=10), {}
    mode = {"value": "static"}

    def reset():
        live["engine"] = InferenceEngine(model, tok, scheduling=mode["value"], **_ENGINE)
        for p, sp in zip(prompts, params):
            live["engine"].add_request(p, sp)
        live_tl.reset(caption=mode["value"])

    def step(i):
        engine = live["engine"]
        if not engine.has_unfinished_requests():
            return False
        engine.step()
        live_tl.update(engine.timeline(), num_steps=engine.stats.num_steps, caption=f"step {engine.stats.num_steps}")
        return "stepped"

    stepper = Stepper(step, reset, n_steps=None, interval_ms=300, description="engine step")
    for mode["value"] in ("static", "continuous"):
        stepper.reset()
        stepper.run()
        engine = live["engine"]
        for rec in engine.history:
            for s in rec.scheduler_output.scheduled:
                state = live_tl.state_at(s.request_id, rec.step)
                if s.kind == "padding":  # a finished static member's thrown-away token: nothing drawn
                    assert state is None and mode["value"] == "static"
                else:
                    assert state in (s.kind, "decode" if s.num_new_tokens == 1 else "prefill")
        assert stepper.done and live_tl.num_steps == engine.stats.num_steps
    assert len(live_tl.fig.data) == 6 and sum(len(t.x or ()) for t in live_tl.fig.data[:5]) == len(live_tl.segments)


def test_07_chunked_prefill_and_preemption_views(sched):
    model, tok, *_ = sched
    rng = np.random.default_rng(1)
    engine = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    short_ids = [engine.add_request(rng.integers(0, 128, 6).tolist(), SamplingParams(max_tokens=14, temperature=0))
                 for _ in range(3)]
    engine.run(max_steps=2)
    long_id = engine.add_request(rng.integers(0, 128, 120).tolist(), SamplingParams(max_tokens=3, temperature=0))
    chunks = []
    while not engine.output(long_id).token_ids:
        engine.step()
        chunks.append(engine.history[-1].scheduler_output.by_id()[long_id].num_new_tokens)
    engine.run()
    tl = _timeline(engine, title="chunked", step_px=18)
    assert all(tl.state_at(r, s) == "decode" for r in short_ids for s in range(1, 2 + len(chunks)))
    assert [s.num_tokens for s in tl.segments if s.request_id == long_id and s.state == "prefill"] == chunks

    tight = InferenceEngine(model, tok, kv_budget_tokens=128, block_size=8, max_num_seqs=5, max_num_batched_tokens=64)
    tight.generate([rng.integers(0, 128, 24).tolist() for _ in range(5)], SamplingParams(max_tokens=24, temperature=0))
    pre_tl = _timeline(tight, title="tight", step_px=12)
    preempted, resumes = {}, []
    for rec in tight.history:
        preempted |= {rid: rec.step for rid in rec.scheduler_output.preempted}
        resumes += [(rec.step, s) for s in rec.scheduler_output.scheduled if s.is_resume]
    assert resumes and pre_tl.count("preempted") == tight.stats.num_preemptions == len(resumes)
    assert "preempted" in pre_tl.to_svg()
    for step, s in resumes:
        assert pre_tl.state_at(s.request_id, preempted[s.request_id]) == "preempted"
        assert pre_tl.state_at(s.request_id, step) == "prefill"
        assert [g.num_tokens for g in pre_tl.segments if g.request_id == s.request_id and g.state == "prefill"][-1] \
            == s.num_new_tokens


@pytest.mark.parametrize("budget", [48, 64, 96, 128])
def test_06_eviction_views_draw_exactly_the_lru_evictions(budget):
    """Notebook 06's live pool: every eviction comes from the queue's head side and the views draw exactly those."""
    from minienv.kv.kv_cache_manager import KVCacheManager
    from minienv.lab.eviction_experiments import CacheStream, popular_prefix_workload
    from minienv.viz.kv_views import ManagerView

    requests = popular_prefix_workload(12, popular_share=0.3, prefix_len=8, num_tail_prefixes=3,
                                       question_mean=4, output_mean=3, vocab=50, seed=3)
    mgr = KVCacheManager.from_budget(budget, 4)
    view = ManagerView(mgr, title="pool", columns=16, cell_px=56)
    stream = CacheStream(requests, mgr, max_running=2)
    busiest = None
    try:
        while True:
            queue_before = [b for b, _ in mgr.free_queue()]
            caption = stream.step()
            if caption is None:
                break
            mgr.check_invariants()
            view.update(caption=caption)
            evicted, highlighted = view.last_evicted, view.queue.evicted
            queue_after = [b for b, _ in mgr.free_queue()]
            assert set(highlighted) <= set(evicted)
            for b in evicted:  # LRU: every block ahead of an evicted one left the queue in the same step
                ahead = queue_before[: queue_before.index(b)] if b in queue_before else queue_before
                assert not set(ahead) & set(queue_after), (budget, b, queue_before, queue_after)
            if queue_after:
                assert view.queue.head == queue_after[0]  # the marked head is the queue's head
            if evicted and (busiest is None or len(evicted) > busiest):
                busiest = len(evicted)
                assert "head" in view.queue.to_svg() or not queue_after
    finally:
        stream.close()
    assert stream.done and stream.evicted_in_use == []
    if budget <= 64:
        assert busiest  # small budgets do evict


def _prefix_prompts():
    """Notebook 05's six prompts (the bundled demo model's tokenizer) and their common prefix length."""
    from minienv.lab.serving import load_demo_model

    demo = load_demo_model()
    system = ("You are the prompter of the Globe Theatre. Answer each question in the voice of Shakespeare, "
              "in plain words and in one short sentence, and never break character.\n\n")
    questions = ["Who is the king?", "Where is Romeo?", "What is the hour?", "Why weep you so?",
                 "Who knocks at the gate?", "What news from Rome?"]
    prompts = {f"r{i}": demo.encode(system + f"HAMLET.\n{q}\n\nHORATIO.\n") for i, q in enumerate(questions)}
    seqs = list(prompts.values())
    shared = next(i for i in range(min(map(len, seqs))) if len({s[i] for s in seqs}) > 1)
    return prompts, shared


def test_05_hash_chain_picture_draws_each_shared_block_once():
    from minienv.viz.kv_views import hash_chain_svg

    prompts, shared = _prefix_prompts()
    svg = hash_chain_svg(prompts, 4, title="chains", cell_w=66)
    assert svg.count(f"×{len(prompts)}") == shared // 4


def test_05_manager_views_draw_refcounts_and_cached_free_blocks():
    from minienv.kv.kv_cache_manager import KVCacheManager
    from minienv.viz.kv_views import ManagerView

    prompts, shared = _prefix_prompts()
    mgr = KVCacheManager(48, 4)
    view = ManagerView(mgr, title="pool", columns=16, cell_px=56)
    for rid in ("r0", "r1", "r2", "r3"):
        compute(mgr, admit(mgr, rid, prompts[rid])[0])
    mgr.free("r0")
    view.update(caption="r1..r3 run")
    sys_blocks = mgr.lookup(prompts["r1"]).block_ids[: shared // 4]
    assert sys_blocks and all(view.grid.cells[b].text()[0] == f"{b} ·rc3" and view.grid.cells[b].shared
                              for b in sys_blocks)
    for rid in ("r1", "r2", "r3"):
        mgr.free(rid)
    view.update(caption="everyone left")
    assert all(view.grid.cells[b].state == "cached" for b in sys_blocks)
    compute(mgr, admit(mgr, "r5", prompts["r5"])[0])
    view.update(caption="r5")
    assert "rc1" in view.to_html() and sum(c.state == "cached" for c in view.grid.cells) > 0

    fork = KVCacheManager(16, 4)
    fork_view = ManagerView(fork, title="fork", columns=16, cell_px=56)
    parent, _ = admit(fork, "P", prompts["r0"][:10])
    compute(fork, parent)
    fork.fork(parent, ["S1", "S2"])
    fork_view.update(caption="fork")
    assert fork_view.grid.cells[0].text()[0] == "0 ·rc3" and fork_view.grid.cells[0].shared
    append(fork, child(parent, "S1"), [500])
    fork_view.update(caption="S1 writes")
    assert fork_view.last_copies == ((2, 3),)
