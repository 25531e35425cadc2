"""MetricsPanel: every chart shows what the registry holds, the live figure and the SVG draw the same samples."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("plotly")

from engine_harness import tiny_engine_factory  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.metrics import metrics_of  # noqa: E402
from minienv.viz.metrics_panel import MetricsPanel  # noqa: E402


@pytest.fixture(scope="module")
def engine_factory():
    return tiny_engine_factory()


def test_samples_are_the_registry_and_the_figure_draws_them(engine_factory):
    e = engine_factory()
    panel = MetricsPanel(metrics_of(e), window=3)
    prompts = ["The quick brown fox", "The quick brown cat", "To be, or not", "xyz" * 5, "The quick brown owl"]
    for p in prompts:
        e.add_request(p, SamplingParams(max_tokens=10, temperature=0))
    while e.has_unfinished_requests():
        e.step()
        s = panel.update()
        v = metrics_of(e).value
        assert (s.running, s.waiting, s.kv_blocks, s.kv_tokens, s.preemptions, s.evicted_blocks) == (
            v("vllm:num_requests_running"), v("vllm:num_requests_waiting"), v("vllm:kv_cache_usage_perc"),
            v("minienv:kv_cache_token_usage_perc"), v("vllm:num_preemptions_total"),
            v("minienv:kv_cache_evicted_blocks_total"))
    samples = panel.samples
    assert len(samples) == e.stats.num_steps and samples[-1].preemptions > 0
    for i, s in enumerate(samples):  # the hit rate is over the last `window` samples, like rate(...[w])
        past = samples[i - 3] if i >= 3 else None
        dq = s.queries - (past.queries if past else 0)
        dh = s.hits - (past.hits if past else 0)
        assert s.hit_rate == (dh / dq if dq else None)
    fig = panel.widget
    assert list(fig.data[0].y) == [s.running for s in samples] and list(fig.data[3].y) == [s.kv_tokens for s in samples]
    labels, counts = panel.ttft_bars()
    assert list(fig.data[7].y) == counts and sum(counts) == len(prompts) and labels[0] == "1ms"
    svg = panel.to_svg()
    assert svg.count("<polyline") == 7 and f"sample {len(samples) - 1}" in svg
    assert svg.count('fill="#59a14f"') == len(counts)


def test_an_empty_panel_draws_and_bad_windows_are_refused(engine_factory):
    e = engine_factory()
    panel = MetricsPanel(metrics_of(e))
    assert panel.to_svg().startswith("<svg") and panel.samples == []
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            MetricsPanel(metrics_of(e), window=bad)


def test_redraw_every_and_a_panel_without_a_live_figure(engine_factory):
    e = engine_factory()
    live = MetricsPanel(metrics_of(e), redraw_every=3)
    quiet = MetricsPanel(metrics_of(e), live=False)
    e.add_request("The quick brown fox", SamplingParams(max_tokens=7, temperature=0))
    for n in range(1, 6):
        e.step()
        live.update()
        quiet.update()
        assert len(live.widget.data[0].x) == (3 if n >= 3 else 0)  # drawn at samples 3, 6, ...
    live.redraw()
    assert len(live.widget.data[0].x) == 5 and quiet.samples == live.samples
    assert quiet.widget is None and "image/svg+xml" in quiet._repr_mimebundle_()
    with pytest.raises(ValueError, match="live=False"):
        quiet.redraw()
    with pytest.raises(ValueError, match="redraw_every must be an int >= 1"):
        MetricsPanel(metrics_of(e), redraw_every=0)


def test_attach_empties_the_same_figure_and_watches_the_new_registry(engine_factory):
    """A reset (notebook 09's widget) keeps the FigureWidget a view is showing: the browser tier clicks Reset on it."""
    first, second = engine_factory(), engine_factory()
    panel = MetricsPanel(metrics_of(first), title="first")
    widget = panel.widget
    first.add_request("The quick brown fox", SamplingParams(max_tokens=6, temperature=0))
    while first.has_unfinished_requests():
        first.step()
        panel.update()
    assert len(panel.samples) > 0 and len(widget.data[0].x) == len(panel.samples)
    panel.attach(metrics_of(second), title="second")
    assert panel.widget is widget and panel.samples == [] and panel.metrics is metrics_of(second)
    assert widget.layout.title.text == "second" and all(len(t.x) == 0 for t in widget.data[:7])
    fresh = MetricsPanel(metrics_of(second), title="second")
    fresh.redraw()  # the same (no) samples on a new figure: the reset figure must be drawn exactly like it
    axes = ("xaxis", "xaxis2", "xaxis3", "xaxis4", "yaxis", "yaxis4", "yaxis5")
    assert [tuple(widget.layout[a].range) for a in axes] == [tuple(fresh.widget.layout[a].range) for a in axes]
    assert tuple(widget.layout.xaxis.range) == (0, 1)  # not the range of the run drawn before the reset
    assert sum(widget.data[7].y) == 0  # the TTFT bars of the new, idle engine
    second.add_request("To be, or not", SamplingParams(max_tokens=4, temperature=0))
    second.step()
    s = panel.update()
    assert s.index == 0 and s.running == metrics_of(second).value("vllm:num_requests_running") == 1
    quiet = MetricsPanel(metrics_of(first), live=False)
    quiet.attach(metrics_of(second))  # no live figure: only the samples start again
    assert quiet.samples == [] and quiet.widget is None


def test_batch_draws_once_at_the_end_what_step_by_step_drawing_draws(engine_factory):
    drawn = {}
    for batched in (False, True):
        e = engine_factory()
        panel = MetricsPanel(metrics_of(e))
        redraws = []
        original = panel.redraw
        panel.redraw = lambda: (redraws.append(len(panel.samples)), original())  # count the draws
        e.add_request("The quick brown fox", SamplingParams(max_tokens=6, temperature=0))
        if batched:
            with panel.batch():
                while e.has_unfinished_requests():
                    e.step()
                    panel.update()
            assert redraws == [len(panel.samples)] and panel.redraw_every == 1  # one draw, on the way out
        else:
            while e.has_unfinished_requests():
                e.step()
                panel.update()
            assert redraws == list(range(1, len(panel.samples) + 1))  # one draw per sample
        # the TTFT histogram's buckets depend on the wall clock (a loaded machine moves a first token to a later
        # bucket between the two runs): compare its total count; every other trace is the engine's own counters
        drawn[batched] = [(tuple(t.x), tuple(t.y)) if t.type != "bar" else sum(t.y) for t in panel.widget.data]
    assert drawn[True] == drawn[False]
