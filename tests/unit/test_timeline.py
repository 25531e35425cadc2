"""minienv.viz.timeline: per-step entries merge into segments, the view updates in place, renders statically,
agrees with the engine's own records, and rejects bad input without changing."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from minienv.engine import InferenceEngine, TimelineEntry  # noqa: E402
from minienv.model import LlamaConfig, LlamaModel, random_weights  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.viz.timeline import STATES, RequestTimeline, Segment, timeline_segments  # noqa: E402


class Ids:
    eos_token_id = None
    vocab_size = 64

    def encode(self, text):
        return [ord(c) % 64 for c in text]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=128)
    return LlamaModel(cfg, random_weights(cfg, seed=0, scale=0.3))


# ---------------------------------------------------------------------------------------------- segments
def test_runs_merge_but_every_prefill_chunk_is_its_own_segment():
    entries = [("a", 0, "prefill", 4), ("a", 1, "prefill", 4), ("a", 2, "decode", 1), ("a", 3, "decode", 1),
               ("a", 4, "finished", 1), ("b", 0, "waiting"), ("b", 1, "waiting"), ("b", 2, "prefill", 3),
               ("b", 3, "finished", 1)]
    rows, segs = timeline_segments(entries)
    assert rows == ["a", "b"]
    assert segs == [
        Segment("a", "prefill", 0, 1, 4), Segment("a", "prefill", 1, 2, 4), Segment("a", "decode", 2, 5, 3, True),
        Segment("b", "waiting", 0, 2, 0), Segment("b", "prefill", 2, 3, 3), Segment("b", "decode", 3, 4, 1, True),
    ]


def test_finished_in_the_first_chunk_is_a_prefill_and_preemption_splits_runs():
    rows, segs = timeline_segments([
        TimelineEntry("x", 0, "finished", 5),  # sampled its only token in its first chunk
        TimelineEntry("y", 0, "prefill", 3), TimelineEntry("y", 1, "decode", 1), TimelineEntry("y", 2, "preempted"),
        TimelineEntry("y", 3, "waiting"), TimelineEntry("y", 4, "finished", 4),  # a resume that sampled and ended
    ])
    assert segs[0] == Segment("x", "prefill", 0, 1, 5, True)
    assert [(s.state, s.start, s.end) for s in segs[1:]] == [
        ("prefill", 0, 1), ("decode", 1, 2), ("preempted", 2, 3), ("waiting", 3, 4), ("prefill", 4, 5)]
    assert segs[-1].finished


@pytest.mark.parametrize("bad, match", [
    ([("a", -1, "decode", 1)], "step"),
    ([("a", 0, "running", 1)], "state"),
    ([("a", 0, "decode", -2)], "num_tokens"),
    ([("a", 0)], "tuple"),
    ([object()], "timeline entry"),
    ([("a", 0, "decode", 1), ("a", 0, "waiting", 0)], "two entries"),
])
def test_bad_entries_raise_and_leave_the_view_unchanged(bad, match):
    tl = RequestTimeline(live="html")
    tl.update([("a", 0, "prefill", 2)])
    before = (tl.segments, tl.num_steps, tl.widget.value, tl.updates)
    with pytest.raises(ValueError, match=match):
        tl.update(bad)
    assert (tl.segments, tl.num_steps, tl.widget.value, tl.updates) == before


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="live"):
        RequestTimeline(live="svg")
    with pytest.raises(ValueError, match="step_px"):
        RequestTimeline(step_px=0)


# ---------------------------------------------------------------------------------------------- the view
@pytest.mark.parametrize("live", ["figure", "html"])
def test_view_updates_in_place_and_renders_statically(live):
    tl = RequestTimeline(title="t", live=live)
    widget = tl.widget
    tl.update([("r0", 0, "prefill", 8), ("r0", 1, "decode", 1), ("r1", 0, "waiting"), ("r1", 1, "prefill", 6)],
              num_steps=3, caption="step 2")
    assert tl.widget is widget and tl.updates == 1
    assert tl.rows == ["r0", "r1"] and tl.num_steps == 3
    assert tl.state_at("r0", 1) == "decode" and tl.state_at("r1", 0) == "waiting" and tl.state_at("r1", 2) is None
    assert tl.row("r1") == ["waiting", "prefill", None]
    assert tl.count("prefill") == 2 and tl.count("decode", "r0") == 1
    svg = tl.to_svg()
    assert svg.startswith("<svg") and "t — step 2" in svg and "engine step" in svg
    assert all(st in svg for st in STATES)
    assert "t — step 2" in tl.static().data and tl.to_html().count("<svg") == 1
    fig = tl.figure()
    assert [t.name for t in fig.data] == list(STATES) + ["finished"]
    assert list(fig.data[STATES.index("prefill")].base) == [0, 1]
    if live == "figure":
        bars = tl.fig.data[STATES.index("decode")]
        assert list(bars.y) == ["r0"] and list(bars.base) == [1]
        assert "FigureWidget" in repr(tl)
    else:
        assert tl.widget.value == svg
    with pytest.raises(ValueError, match="num_steps"):
        tl.update([("r0", 0, "decode", 1), ("r0", 4, "decode", 1)], num_steps=2)
    tl.reset()
    assert tl.rows == [] and tl.num_steps == 0 and tl.updates == 0


def test_matches_the_engine_history_including_preemptions(model):
    eng = InferenceEngine(model, Ids(), kv_budget_tokens=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    outs = eng.generate([[1 + i] * 10 for i in range(4)], SamplingParams(max_tokens=12, temperature=0))
    assert eng.stats.num_preemptions > 0 and len(outs) == 4
    tl = RequestTimeline(live="html")
    tl.update(eng.timeline(), num_steps=eng.stats.num_steps)
    assert tl.count("preempted") == eng.stats.num_preemptions
    for rec in eng.history:
        for s in rec.scheduler_output.scheduled:
            assert tl.state_at(s.request_id, rec.step) in ("prefill", "decode")
            if s.kind == "prefill":
                assert tl.state_at(s.request_id, rec.step) == "prefill"
        for rid in rec.scheduler_output.preempted:
            assert tl.state_at(rid, rec.step) == "preempted"
    for o in outs:
        assert tl.finish_step(o.request_id) + 1 == o.metrics.finished_step
        decoded = sum(s.num_tokens for s in tl.segments if s.request_id == o.request_id and s.state == "decode")
        samples = sum(1 for s in tl.segments if s.request_id == o.request_id and s.state == "prefill"
                      and (s.finished or tl.state_at(o.request_id, s.end) == "decode"))
        assert decoded + samples >= len(o.token_ids) - 1


def test_hover_counts_steps_from_one_like_the_dashboards_captions(model):
    """The step a hover names is the step the dashboard's caption named when it ran: both count from 1 (the record
    with ``step == 0`` is "step 1"), so a reader can match a bar to a caption and to ``finished_step``."""
    from minienv.viz.dashboard import step_caption

    eng = InferenceEngine(model, Ids(), kv_budget_tokens=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    eng.generate([[1] * 6, [2] * 6, [3] * 6], SamplingParams(max_tokens=3, temperature=0))
    tl = RequestTimeline(live="html")
    tl.update(eng.timeline(), num_steps=eng.stats.num_steps)
    captions = {rec.step: step_caption(rec).split(":")[0] for rec in eng.history}
    assert captions[0] == "step 1"
    for seg in tl.segments:
        hover = tl._hover(seg)
        first = hover.split("<br>")[1].split(":")[0]  # "step 3" or "steps 3–5"
        label = captions[seg.start] if seg.length == 1 else f"steps {seg.start + 1}–{seg.end}"
        assert first == label, (seg, hover)
        if seg.length > 1:
            assert captions[seg.end - 1] == f"step {seg.end}"  # its last step, as the caption said
