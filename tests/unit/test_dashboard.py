"""minienv.viz.dashboard: the engine dashboard shows exactly the engine's state at every step, updates its widgets in
place, resets to a fresh engine that replays identically, and renders statically."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.model import LlamaConfig, LlamaModel, random_weights  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import BPETokenizer  # noqa: E402
from minienv.viz.dashboard import EngineDashboard, step_caption  # noqa: E402


@pytest.fixture(scope="module")
def parts():
    cfg = LlamaConfig(vocab_size=257, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaModel(cfg, random_weights(cfg, seed=3, scale=0.3)), BPETokenizer([])


PROMPTS = ["abcdefghijkl", "abcdefgh and more", "xyz", "a completely different prompt"]


def make(parts, budget=64):
    model, tok = parts
    return lambda: InferenceEngine(model, tok, kv_budget_tokens=budget, block_size=4, max_num_seqs=3,
                                   max_num_batched_tokens=16)


def requests(n=10):
    return [(p, SamplingParams(max_tokens=n, temperature=0)) for p in PROMPTS]


def agrees(dash):
    eng = dash.engine
    mgr = eng.kv_cache_manager
    assert [c.refcount for c in dash.grid.cells] == [b.ref_cnt for b in mgr.pool.blocks]
    assert list(dash.free_queue.items) == [b for b, _ in mgr.free_queue()]
    assert list(dash.running_view.items) == [r.request_id for r in eng.scheduler.running]
    assert list(dash.waiting_view.items) == [r.request_id for r in eng.scheduler.waiting]
    assert dash.tables.tables == {rid: tuple(mgr.block_ids(rid)) for rid in dash.tables.tables}
    assert set(dash.tables.tables) == {r.request_id for r in eng.scheduler.running}
    assert dash.texts == {rid: eng.output(rid).text for rid in dash.request_ids}
    assert dash.snapshot.step == eng.stats.num_steps


def test_every_view_agrees_with_the_engine_at_every_step_and_texts_equal_generate(parts):
    dash = EngineDashboard(make(parts, budget=48), requests())
    widgets = (dash.widget, dash.grid.widget, dash.free_queue.widget, dash.stats_view.widget, dash.text_view)
    agrees(dash)
    assert list(dash.waiting_view.items) == ["r0", "r1", "r2", "r3"] and dash.snapshot.step == 0
    steps = 0
    while dash.step():
        steps += 1
        agrees(dash)
    assert dash.done and steps == dash.engine.stats.num_steps and len(dash.captions) == steps
    assert dash.engine.stats.num_preemptions > 0  # the 48-token budget is tight: preemptions were drawn too
    assert dash.timeline.count("preempted") == dash.engine.stats.num_preemptions
    assert (dash.widget, dash.grid.widget, dash.free_queue.widget, dash.stats_view.widget, dash.text_view) == widgets
    model, tok = parts
    alone = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=4).generate(PROMPTS, requests()[0][1])
    assert [dash.texts[f"r{i}"] for i in range(4)] == [o.text for o in alone]
    assert not dash.step()  # done: nothing more


def test_reset_builds_a_fresh_engine_and_replays_identically(parts):
    dash = EngineDashboard(make(parts), requests(6))
    dash.run()
    first_engine, captions, texts = dash.engine, list(dash.captions), dict(dash.texts)
    dash.reset()
    assert dash.engine is not first_engine and dash.snapshot.step == 0 and dash.captions == []
    assert set(dash.texts) == set(dash.request_ids) and all(t == "" for t in dash.texts.values())
    assert dash.stepper.position == 0
    agrees(dash)
    dash.run(3)
    assert dash.captions == captions[:3]
    dash.run()
    assert dash.captions == captions and dash.texts == texts


def test_shared_prefix_shows_as_one_block_with_refcount_two_and_new_text_is_highlighted(parts):
    # step 0: r0 (12 tokens) and the filler r1 (4 tokens) fill the 16-token step, so r2 waits; r0's full blocks are
    # in the prefix cache by step 1, when r2 (PROMPTS[1]: the same first 8 tokens, "abcdefgh") is admitted and hits
    # them while r0 is still decoding: two blocks held by r0 and r2 at once, refcount 2.
    dash = EngineDashboard(make(parts, budget=128), [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0)),
                                                     ("wxyz", SamplingParams(max_tokens=2, temperature=0)),
                                                     (PROMPTS[1], SamplingParams(max_tokens=4, temperature=0))])
    dash.step()
    assert list(dash.waiting_view.items) == ["r2"], "the scenario needs r2 to be admitted after r0's prefill"
    shared_steps = 0
    while dash.step():
        agrees(dash)
        shared = [c for c in dash.grid.cells if c.refcount == 2 and set(c.owners) == {"r0", "r2"}]
        shared_steps += bool(shared)
        if shared:
            assert len(shared) == 2  # the two full blocks of "abcdefgh"
            r0, r2 = (dash.engine.kv_cache_manager.block_ids(r) for r in ("r0", "r2"))
            assert r0[:2] == r2[:2]
        if dash.new_text:
            rid, fresh = next(iter(dash.new_text.items()))
            assert fresh and dash.texts[rid].endswith(fresh)
            assert "background:#fff3c4" in dash.text_view.value
    assert all(dash.engine.output(r).finished for r in dash.request_ids)
    assert shared_steps > 0, "r2 never shared r0's prefix blocks"
    assert dash.engine.output("r2").num_cached_tokens == 8  # "abcdefgh" came from the prefix cache


def test_static_rendering_and_captions(parts):
    dash = EngineDashboard(make(parts), requests(4), title="test dash")
    dash.run(2)
    html = dash.to_html()
    assert "test dash" in html and html.count("<svg") >= 5 and "engine stats" in html
    assert "free queue" in html and "text, streaming in" in html and "block tables" in html
    assert dash.static().data == html
    assert dash.captions[0].startswith("step 1:") and "admitted r0" in dash.captions[0]
    rec = dash.engine.history[1]
    assert step_caption(rec) == dash.captions[1]
    assert "FigureWidget" in repr(dash)
    bundle = dash._repr_mimebundle_()
    assert "text/plain" in bundle


def test_bad_arguments(parts):
    with pytest.raises(ValueError, match="make_engine"):
        EngineDashboard(None, requests())
    with pytest.raises(ValueError, match="pair"):
        EngineDashboard(make(parts), ["just a prompt"])
