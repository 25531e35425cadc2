"""Regression tests for live-view defects found by clicking through the notebooks in JupyterLab: each test states
what a reader saw, and fails on the code that showed it.

Label fit is measured with ``_style.CHAR_EM`` (an upper bound on the monospace glyph width of the views' font), the
same measure the views use, checked here from the drawn SVG / figure rather than from the helper's own answer.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from minienv.kv.kv_cache_manager import KVCacheManager  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.viz import BlockCell, BlockGrid, BlockTableView, QueueView, _style  # noqa: E402
from minienv.viz.dashboard import EngineDashboard  # noqa: E402
from minienv.viz.kv_views import ManagerView  # noqa: E402
from minienv.viz.timeline import RequestTimeline  # noqa: E402
from test_dashboard import PROMPTS, make, parts  # noqa: E402,F401  (one tiny model and prompt set for both files)


# ---------------------------------------------------------------------------------------------- helpers
def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


def svg_labels_in_boxes(svg: str) -> list[tuple[str, float, float, float]]:
    """Every ``<text>`` drawn inside a ``<rect>`` of the SVG: (text, its half-width at its font size, the box's
    half-width, the box's stroke width). A text belongs to the smallest rect that contains its anchor point."""
    rects = []
    for m in re.finditer(r"<rect [^>]*>", svg):
        a = _attrs(m.group(0))
        if "x" in a and "width" in a and not a["width"].endswith("%"):
            rects.append(tuple(float(a[k]) for k in ("x", "y", "width", "height")) + (float(a["stroke-width"]),))
    out = []
    for m in re.finditer(r"(<text [^>]*>)([^<]*)</text>", svg):
        a = _attrs(m.group(1))
        if a.get("text-anchor", "middle") != "middle":
            continue
        x, y, size = float(a["x"]), float(a["y"]), float(a["font-size"])
        text = m.group(2).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#x27;", "'")
        inside = [r for r in rects if r[0] <= x <= r[0] + r[2] and r[1] <= y <= r[1] + r[3]]
        if inside:
            rx, ry, rw, rh, stroke = min(inside, key=lambda r: r[2] * r[3])
            out.append((text, len(text) * _style.CHAR_EM * size / 2, rw / 2, stroke))
    return out


def assert_labels_clear_of_outline(svg: str, expect: list[str]) -> None:
    labels = svg_labels_in_boxes(svg)
    seen = {t for t, *_ in labels}
    for e in expect:
        assert e in seen, f"label {e!r} not drawn whole (drawn: {sorted(seen)})"
    for text, half, box_half, stroke in labels:
        assert half <= box_half - stroke / 2, (
            f"{text!r} is {2 * half:.1f} px wide; its box leaves {2 * box_half - stroke:.1f} px inside the outline")


# ---------------------------------------------------------------------------------------------- 05 / 06
def test_manager_view_shows_its_free_queue_live_even_while_the_queue_view_is_empty():
    """05 and 06 promised a live free queue but showed none: the QueueView (which has __len__) was empty when the
    box was built, so ``[queue.widget] if queue else []`` dropped it."""
    mgr = KVCacheManager(8, 4)
    view = ManagerView(mgr)
    assert view.queue.widget in view.widget.children
    assert len(view.widget.children) == 2
    assert len(ManagerView(KVCacheManager(8, 4), queue=False).widget.children) == 1  # no queue: the grid only


# ---------------------------------------------------------------------------------------------- label fit (04, 08)
def test_block_grid_labels_are_never_covered_by_the_changed_outline():
    """04: the thick outline of a changed cell covered the first and last character of "A[1] 4/4"."""
    grid = BlockGrid(4, columns=4)
    grid.update([BlockCell(1, owner="A", refcount=1, label="A[1] 4/4"), BlockCell(2, owner="B", refcount=1,
                                                                                label="B[12] 3/4")])
    assert grid.changed == {1, 2}
    assert_labels_clear_of_outline(grid.to_svg(), ["1 ·rc1", "A[1] 4/4", "B[12] 3/4"])
    # the live figure: same text, per-cell font sizes that fit inside the marker minus its outline
    trace = grid.fig.data[0]
    room = grid.cell_px - 6 - max(trace.marker.line.width)
    for text, size in zip(trace.text, trace.textfont.size):
        for line in re.sub(r"</?b>", "", text).split("<br>"):
            assert len(line) * _style.CHAR_EM * size <= room, (line, size, room)
    assert "A[1] 4/4" in trace.text[1]


def test_block_table_labels_fit_their_cells():
    """08: "p10 ·rc1" overran its 50 px cell and "p11 ·rc1" was cut."""
    tables = BlockTableView(block_size=8, cell_px=50, min_columns=6)
    tables.update({"r0": [10, 11], "r1": [10, 3]}, refcounts={10: 2, 11: 1, 3: 1}, tokens={"r0": 13, "r1": 9})
    assert_labels_clear_of_outline(tables.to_svg(), ["p10 ·rc2", "p11 ·rc1", "5/8", "p3 ·rc1"])
    tables.update({"r0": [10, 11, 12], "r1": [10, 3]}, refcounts={10: 2, 11: 1, 12: 1, 3: 1},
                  tokens={"r0": 17, "r1": 9})
    assert ("r0", 2) in tables.changed
    assert_labels_clear_of_outline(tables.to_svg(), ["p12 ·rc1"])


def test_queue_items_and_labels_fit_their_boxes():
    q = QueueView(item_px=46)
    q.update([12, 13], labels={12: "#a1b2", 13: "#c3d4"})
    q.update([13, 12, 40], labels={12: "#a1b2", 13: "#c3d4", 40: "r10 99 tok"})
    assert_labels_clear_of_outline(q.to_svg(), ["12", "#a1b2", "40"])


def test_fit_text_shrinks_before_it_shortens():
    assert _style.fit_text("abc", 100) == ("abc", 10)
    text, size = _style.fit_text("p10 ·rc1", 40)
    assert text == "p10 ·rc1" and 7 <= size < 10 and len(text) * _style.CHAR_EM * size <= 40
    text, size = _style.fit_text("a-very-long-request-name", 30)
    assert text.endswith("…") and size == 7 and len(text) * _style.CHAR_EM * size <= 30


# ---------------------------------------------------------------------------------------------- 08: the dashboard
def dashboard(parts, budget=48):
    return EngineDashboard(make(parts, budget), [(p, SamplingParams(max_tokens=10, temperature=0)) for p in PROMPTS])


def test_dashboard_reset_restores_the_first_picture(parts):
    """08: after a run, Reset (and ■) left the running view listing "left the queue this step: r0 ..."."""
    dash = dashboard(parts)
    first = dash.to_html()
    assert "left the queue" not in first
    dash.run()
    assert dash.done
    dash.reset()
    assert "left the queue" not in dash.running_view.to_svg()
    assert dash.to_html() == first
    assert dash.widget.children[2].children[1].children[1].value == dash.running_view.to_svg()  # the live widget too
    dash.run(3)
    dash.stepper.play.value = 0  # what ■ does: Play goes back to 0, the stepper resets
    assert dash.stepper.position == 0 and dash.to_html() == first


def test_dashboard_counter_captions_and_view_titles_name_the_same_step(parts):
    """08: the counter said "engine step 1" while the caption and every view title said "step 0"."""
    dash = dashboard(parts)
    for n in (1, 2, 3):
        dash.step()
        assert dash.stepper.counter.value.startswith(f"engine step {n} ")
        assert dash.captions[-1].startswith(f"step {n}:")
        for view in (dash.grid, dash.free_queue, dash.running_view, dash.waiting_view, dash.tables, dash.stats_view):
            assert view.caption == f"step {n}", (type(view).__name__, view.caption)
        assert dash.stats_view.values["steps run"] == n


def test_dashboard_says_why_a_request_left_or_joined_the_running_list(parts):
    """08: a preempted request left the running list labelled "taken" and came back labelled "new"."""
    dash = dashboard(parts)
    seen = {"preempted": 0, "resumed": 0, "finished": 0, "admitted": 0}
    while dash.step():
        plan = dash.engine.history[-1].scheduler_output
        svg = dash.running_view.to_svg()
        for rid in plan.preempted:
            assert rid in dash.running_view.removed
            assert re.search(rf">{rid}</text>.*?>preempted</text>", svg), svg
            assert "taken" not in svg
            seen["preempted"] += 1
        for rid in dash.running_view.added:
            view = next(v for v in dash.snapshot.running if v.request_id == rid)
            note = "resumed" if view.num_preemptions else "admitted"
            assert re.search(rf">{rid}</text>.*?>{note}</text>", svg), svg
            seen[note] += 1
        for rid in dash.engine.history[-1].finished:
            if rid in dash.running_view.removed:
                assert re.search(rf">{rid}</text>.*?>finished</text>", svg), svg
                seen["finished"] += 1
        if plan.preempted:
            wsvg = dash.waiting_view.to_svg()
            assert all(re.search(rf">{rid}</text>.*?>preempted</text>", wsvg) for rid in plan.preempted), wsvg
    assert all(seen.values()), seen  # the tight budget shows every case


def test_queue_notes_only_for_items_that_moved_in_or_out():
    q = QueueView()
    q.update(["a", "b"])
    q.update(["b", "c"], notes={"a": "preempted", "c": "resumed"})
    svg = q.to_svg()
    assert ">preempted</text>" in svg and ">resumed</text>" in svg and ">taken</text>" not in svg
    with pytest.raises(ValueError, match="joined or left"):
        q.update(["b", "c", "d"], notes={"b": "x"})
    assert q.items == ("b", "c")


# ---------------------------------------------------------------------------------------------- 07: the timeline
def test_timeline_reset_leaves_no_ticks_of_the_previous_run():
    """07: after Reset, the empty live timeline kept the request rows and step ticks of the run before."""
    tl = RequestTimeline()
    tl.update([("r0", 0, "prefill", 8), ("r1", 0, "waiting", 0), ("r0", 1, "decode", 1), ("r1", 1, "prefill", 4),
               ("r0", 2, "finished", 1), ("r1", 2, "finished", 1)], num_steps=3)
    ly = tl.fig.layout
    assert tuple(ly.yaxis.tickvals) == ("r0", "r1") and tuple(ly.xaxis.tickvals) == (0, 1, 2, 3)
    tl.reset()
    ly = tl.fig.layout
    assert tuple(ly.yaxis.tickvals or ()) == () and tuple(ly.xaxis.tickvals) == (0, 1)
    assert list(ly.xaxis.range) == [0, 1] and ly.xaxis.autorange is False and ly.yaxis.autorange is False
    assert all(len(t.x or ()) == 0 for t in tl.fig.data)


# ---------------------------------------------------------------------------------------------- what a page must show
def test_a_displayed_view_names_its_parts_and_tags_their_widgets(parts):
    """The browser tier compares the views a widget output's repr names with the views drawn on the page (by CSS
    class), which is how a free queue missing from the live widget gets caught."""
    view = ManagerView(KVCacheManager(8, 4))
    assert "QueueView(" in repr(view) and "BlockGrid(" in repr(view)
    view._repr_mimebundle_()
    assert "minienv-queue" in view.queue.widget._dom_classes and "minienv-blockgrid" in view.grid.widget._dom_classes
    dash = dashboard(parts)
    bundle = dash._repr_mimebundle_()
    assert bundle["text/plain"].count("QueueView(") == 3  # free queue, running, waiting
    for name, part in (("BlockTableView(", dash.tables), ("RequestTimeline(", dash.timeline)):
        assert name in bundle["text/plain"] and part.css_class in part.widget._dom_classes
