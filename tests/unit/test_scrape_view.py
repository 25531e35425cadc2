"""ScrapeView: each scrape is the registry, its changes are the engine's step, its histogram is cumulative."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("ipywidgets")

from engine_harness import tiny_engine_factory  # noqa: E402
from minienv.metrics import metrics_of  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.viz.scrape_view import ROWS, ScrapeView, scrape  # noqa: E402

PROMPTS = ["The quick brown fox", "The quick brown cat", "To be, or not", "xyz" * 5, "The quick brown owl"]


@pytest.fixture(scope="module")
def engine_factory():
    return tiny_engine_factory()


def _serve(engine, view, on_scrape):
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=10, temperature=0))
    while engine.has_unfinished_requests():
        before = (engine.stats.num_generated_tokens, engine.stats.num_preemptions)
        engine.step()
        caption = view.update()
        on_scrape(caption, before)


def test_every_scrape_is_the_registry_and_its_changes_are_the_step(engine_factory):
    e = engine_factory()
    view = ScrapeView(metrics_of(e), live=False)
    assert view.changes == {} and view.scrapes == 0  # the baseline: nothing changed yet
    seen = {"preempted": 0, "first_tokens": 0, "histogram_steps": 0}

    def check(caption, before):
        m = metrics_of(e)
        assert view.now == scrape(m)  # exactly what a scrape carries now
        for name, _ in ROWS:  # each row's value is the registry's
            if "{" not in name:
                assert view.now[name] == m.values()[name]
        generated, preempted = before
        assert view.delta("vllm:generation_tokens_total") == e.stats.num_generated_tokens - generated
        assert view.delta("vllm:num_preemptions_total") == e.stats.num_preemptions - preempted
        assert set(view.changes) == {k for k in view.now if view.delta(k) != 0}
        for k, (b, a) in view.changes.items():  # counters and histogram parts never go down
            if k.endswith(("_total", "_count", "_sum")) or "_bucket{" in k:
                assert a > b, k
        buckets = view.buckets()
        assert buckets[-1][0] == math.inf and [le for le, _, _ in buckets] == sorted(le for le, _, _ in buckets)
        assert all(b1 <= b2 and n1 <= n2 for (_, b1, n1), (_, b2, n2) in zip(buckets, buckets[1:]))  # cumulative
        added = [n - b for _, b, n in buckets]
        assert all(a1 <= a2 for a1, a2 in zip(added, added[1:]))  # an observation raises every bucket above it
        observed = view.delta("vllm:time_to_first_token_seconds_count")
        assert added[-1] == observed and buckets[-1][2] == view.now["vllm:time_to_first_token_seconds_count"]
        assert caption.startswith(f"scrape {view.scrapes}: ")
        if view.delta("vllm:num_preemptions_total"):
            seen["preempted"] += 1
            assert f"+{view.delta('vllm:num_preemptions_total'):.0f} preemptions" in caption
        if observed:
            seen["histogram_steps"] += 1
            seen["first_tokens"] += observed
            assert "every bucket from le=" in caption and f"+Inf by {observed:.0f}" in caption
        else:
            assert "time_to_first_token" not in caption
        svg = view.to_svg()
        assert svg.startswith("<svg") and svg.count("vllm:") >= len(ROWS)
        # the orange caps: drawn exactly when this scrape observed something, +Inf's cap being the whole count
        assert (f"le=+Inf: +{observed:g} this scrape" in svg) == bool(observed)
        assert bool(re.search(r": \+[0-9.]+ this scrape</title>", svg)) == bool(observed)

    _serve(e, view, check)
    assert view.scrapes == e.stats.num_steps
    assert seen["preempted"] >= 1 and seen["first_tokens"] == len(PROMPTS) and seen["histogram_steps"] >= 1


def test_changed_rows_are_highlighted_and_the_reset_starts_a_new_baseline(engine_factory):
    e = engine_factory()
    view = ScrapeView(metrics_of(e))
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))
    e.step()
    view.update()
    assert view.widget.value == view.to_html()  # the live widget redrawn in place
    changed_rows = [name for name, _ in ROWS if view.delta(name)]
    assert "vllm:num_requests_running" in changed_rows and "vllm:prompt_tokens_total" in changed_rows
    assert view.to_svg().count('fill="#fff3bf"') == len(changed_rows)  # one highlight per changed row
    other = engine_factory()
    widget = view.widget
    view.attach(metrics_of(other))
    assert view.widget is widget and view.scrapes == 0 and view.changes == {}  # same widget, emptied
    assert "no counter moved" in view.caption()
    with pytest.raises(ValueError, match="not a histogram"):
        ScrapeView(metrics_of(other), histogram="vllm:num_requests_running", live=False)
