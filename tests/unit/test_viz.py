"""minienv.viz: views update one widget in place, highlight what changed, render statically, reject bad input."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from minienv.viz import BlockCell, BlockGrid, QueueView, Stepper, block_cells, panel  # noqa: E402
from minienv.viz import _style as S  # noqa: E402


# ---------------------------------------------------------------------------------------------- BlockCell
def test_blockcell_infers_state_and_normalizes_owner():
    assert BlockCell(3).state == "free"
    assert BlockCell(3, "A", 1).state == "used"
    assert BlockCell(3, ["A"], 1).owner == "A"
    assert BlockCell(3, ["A", "B"], 2).owners == ("A", "B")
    assert BlockCell(3, {"B", "A", "C"}, 3).owners == ("A", "B", "C")
    assert BlockCell(7, ("A", "B"), 2).text() == ("7 ·rc2", "A+B")
    assert BlockCell(7, "A", 1, label="A[0]").text() == ("7 ·rc1", "A[0]")
    assert BlockCell(2, state="cached").text() == ("2", "cached")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_id=-1), "block_id"),
        (dict(block_id=1.5), "block_id"),
        (dict(block_id=0, refcount=-1), "negative refcount"),
        (dict(block_id=0, refcount=0, state="used"), "refcount >= 1"),
        (dict(block_id=0, refcount=2, state="cached"), "refcount 0"),
        (dict(block_id=0, owner="A", state="free"), "no owner"),
        (dict(block_id=0, refcount=1, state="busy"), "state must be"),
    ],
)
def test_blockcell_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockCell(**kwargs)


def test_block_cells_checks_lengths():
    cells = block_cells([1, 0, 2], owners=["A", None, ("A", "B")])
    assert [c.state for c in cells] == ["used", "free", "used"]
    with pytest.raises(ValueError, match="mismatched lengths"):
        block_cells([1, 0, 2], owners=["A", None])


# ---------------------------------------------------------------------------------------------- BlockGrid
def _trace(grid):
    return grid.fig.data[0]


def test_grid_updates_same_figurewidget_in_place():
    grid = BlockGrid(6, title="pool")
    fig, trace = grid.fig, _trace(grid)
    before = tuple(trace.marker.color)
    assert set(before) == {S.FREE}
    changed = grid.update([BlockCell(0, "A", 1), BlockCell(4, "B", 1)], caption="step 1")
    assert grid.fig is fig and _trace(grid) is trace and len(fig.data) == 1
    colors = tuple(trace.marker.color)
    assert colors != before
    assert colors[0] == grid.owner_color("A") and colors[4] == grid.owner_color("B")
    assert colors[0] != colors[4] and colors[1] == S.FREE
    assert changed == frozenset({0, 4}) == grid.changed
    assert "pool" in fig.layout.title.text and "step 1" in fig.layout.title.text
    assert trace.text[0] == "<b>0 ·rc1</b><br>A"
    assert grid.updates == 1


def test_grid_highlights_exactly_the_changed_cells():
    grid = BlockGrid(5)
    grid.update([BlockCell(0, "A", 1), BlockCell(1, "A", 1)])
    changed = grid.update([BlockCell(0, "A", 1), BlockCell(1, ("A", "B"), 2), BlockCell(2, "B", 1)])
    assert changed == frozenset({1, 2})
    widths = tuple(_trace(grid).marker.line.width)
    lines = tuple(_trace(grid).marker.line.color)
    assert [i for i, w in enumerate(widths) if w > 1] == [1, 2]
    assert [i for i, c in enumerate(lines) if c == S.CHANGED] == [1, 2]
    assert _trace(grid).text[1] == "<b>1 ·rc2</b><br>A+B"
    assert _trace(grid).marker.color[1] == S.SHARED
    # an identical snapshot changes nothing
    assert grid.update(grid.cells) == frozenset()
    assert max(_trace(grid).marker.line.width) == 1


def test_grid_partial_updates_and_mappings():
    grid = BlockGrid(4)
    grid.update({0: BlockCell(0, "A", 1), 2: {"owner": "B", "refcount": 1}})
    assert [c.state for c in grid.cells] == ["used", "free", "used", "free"]
    changed = grid.update({3: BlockCell(3, state="cached", label="h:ab")}, partial=True)
    assert changed == {3}
    assert [c.state for c in grid.cells] == ["used", "free", "used", "cached"]
    assert _trace(grid).marker.color[3] == S.CACHED
    # non-partial: what is not mentioned is free
    grid.update({3: None})
    assert [c.state for c in grid.cells] == ["free"] * 4


def test_grid_owner_colors_are_stable_and_fixable():
    grid = BlockGrid(3, owner_colors={"B": "#000000"})
    grid.update([BlockCell(0, "A", 1), BlockCell(1, "B", 1)])
    a = grid.owner_color("A")
    grid.reset()
    grid.update([BlockCell(2, "A", 1)])
    assert grid.owner_color("A") == a and _trace(grid).marker.color[2] == a
    assert grid.owner_color("B") == "#000000"


@pytest.mark.parametrize(
    "bad, match",
    [
        ([BlockCell(9, "A", 1)], "unknown block id 9"),
        ({9: BlockCell(9, "A", 1)}, "unknown block id 9"),
        ({-1: None}, "unknown block id -1"),
        ([BlockCell(1, "A", 1), BlockCell(1, "B", 1)], "twice"),
        ({1: {"owner": "A", "refcount": -2}}, "negative refcount"),
        ({1: {"colour": "red"}}, "unknown BlockCell fields"),
        ({1: BlockCell(2, "A", 1)}, "holds a BlockCell for block 2"),
        (["A"], "expected BlockCell"),
        ("AB", "expected a sequence"),
    ],
)
def test_grid_bad_input_leaves_view_unchanged(bad, match):
    grid = BlockGrid(4)
    grid.update([BlockCell(0, "A", 1)], caption="ok")
    trace = _trace(grid)
    snapshot = (grid.cells, grid.changed, grid.caption, grid.updates, tuple(trace.marker.color),
                tuple(trace.text), tuple(trace.marker.line.width), grid.fig.layout.title.text)
    with pytest.raises(ValueError, match=match):
        grid.update(bad, caption="bad")
    after = (grid.cells, grid.changed, grid.caption, grid.updates, tuple(trace.marker.color),
             tuple(trace.text), tuple(trace.marker.line.width), grid.fig.layout.title.text)
    assert after == snapshot


def test_grid_update_arrays_length_mismatch():
    grid = BlockGrid(3)
    with pytest.raises(ValueError, match="mismatched lengths"):
        grid.update_arrays([1, 0])
    with pytest.raises(ValueError, match="mismatched lengths"):
        grid.update_arrays([1, 0, 0], owners=["A"])
    assert grid.updates == 0
    grid.update_arrays([1, 0, 2], owners=["A", None, ("A", "B")])
    assert [c.refcount for c in grid.cells] == [1, 0, 2]


def test_grid_constructor_rejects_bad_sizes():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            BlockGrid(bad)
    with pytest.raises(ValueError):
        BlockGrid(4, columns=0)


def test_grid_static_rendering_has_labels_and_highlight():
    grid = BlockGrid(8, title="KV pool", columns=4)
    grid.update([BlockCell(7, ("A", "B"), 2), BlockCell(1, state="cached", label="h:3f")], caption="step 2")
    svg = grid.to_svg()
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    for text in ("KV pool — step 2", "7 ·rc2", "A+B", "h:3f", "cached-free", "changed last step"):
        assert text in svg
    assert svg.count(f'stroke="{S.CHANGED}" stroke-width="{BlockGrid.CHANGED_WIDTH}"') == 2
    assert "KV pool" in grid.to_html()
    static = grid.static()
    assert "7 ·rc2" in static.data
    fig = grid.figure()
    assert type(fig).__name__ == "Figure" and tuple(fig.data[0].marker.color) == tuple(_trace(grid).marker.color)


def test_grid_displays_as_live_widget():
    grid = BlockGrid(2)
    bundle = grid._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == grid.fig.model_id
    assert "FigureWidget(" in bundle["text/plain"]
    assert grid.widget is grid.fig


# ---------------------------------------------------------------------------------------------- QueueView
def test_queue_marks_head_and_highlights_changes_in_place():
    q = QueueView(title="free queue", head_label="head → evicted next")
    widget = q.widget
    q.update([0, 1, 2, 3])
    assert q.head == 0 and q.added == (0, 1, 2, 3)
    v1 = widget.value
    assert "head → evicted next" in v1 and "length 4" in v1
    change = q.update([2, 3, 1, 5], evicted=[0], labels={5: "h:aa"}, caption="alloc")
    assert q.widget is widget and widget.value != v1
    assert change.added == (5,) and change.removed == (0,) and change.evicted == (0,)
    assert change.moved == (1,)  # 1 went to the tail
    assert q.head == 2 and q.items == (2, 3, 1, 5)
    v2 = widget.value
    for text in ("evicted", "left the queue", "new", "moved", "h:aa", "free queue — alloc"):
        assert text in v2
    assert v2 == q.to_svg() and "evicted" in q.static().data


def test_queue_taken_vs_evicted_and_empty():
    q = QueueView(head_label="head → allocated next")
    q.update([4, 5])
    change = q.update([5])
    assert change.removed == (4,) and change.evicted == ()
    assert "taken" in q.to_svg() and "evicted" not in q.to_svg()
    q.update([])
    assert q.head is None and "(empty)" in q.to_svg()


def test_queue_long_queue_is_truncated():
    q = QueueView(max_items=5)
    q.update(range(20))
    assert "+15 more" in q.to_svg() and len(q) == 20


@pytest.mark.parametrize(
    "items, kw, match",
    [
        ([1, 1, 2], {}, "twice"),
        ([1, 2], {"labels": {9: "x"}}, "not in the queue"),
        ([1, 2], {"kinds": {1: "purple"}}, "kinds must be"),
        ([1, 2], {"evicted": [1]}, "still in it"),
        ([1], {"evicted": [7]}, "must have been in the queue"),
        ("ab", {}, "iterable"),
        ([[1]], {}, "hashable"),
    ],
)
def test_queue_bad_input_leaves_view_unchanged(items, kw, match):
    q = QueueView()
    q.update([1, 2, 3], caption="ok")
    state = (q.items, q.last_change, q.caption, q.updates, q.widget.value)
    with pytest.raises(ValueError, match=match):
        q.update(items, **kw)
    assert (q.items, q.last_change, q.caption, q.updates, q.widget.value) == state


def test_queue_shares_owner_colors_with_grid():
    grid = BlockGrid(4)
    grid.update([BlockCell(0, "A", 1)])
    q = QueueView(default_kind="owner", colors_from=grid)
    q.update(["B", "A"])
    assert grid.owner_color("A") in q.to_svg() and grid.owner_color("B") in q.to_svg()


def test_queue_reset_clears_highlights():
    q = QueueView()
    q.update([1, 2])
    q.update([2], evicted=[1])
    q.reset([0, 1, 2])
    assert q.items == (0, 1, 2) and q.last_change.added == () and q.updates == 0
    assert "left the queue" not in q.widget.value


# ---------------------------------------------------------------------------------------------- Stepper
def test_stepper_calls_back_in_order_and_resets():
    calls = []
    s = Stepper(lambda i: calls.append(("step", i)) or f"did {i}", lambda: calls.append(("reset",)), n_steps=3)
    assert s.position == 0 and not s.done
    assert s.step() and s.step()
    assert calls == [("step", 0), ("step", 1)] and s.position == 2
    assert s.slider.value == 2 and s.play.value == 2 and "step 2 / 3" in s.counter.value
    assert s.caption == "did 1" and "did 1" in s.status.value
    assert s.run() == 1 and s.done and not s.step()
    assert s.step_button.disabled
    s.reset()
    assert calls[-1] == ("reset",) and s.position == 0 and not s.done and s.history == []
    assert s.slider.value == 0 and s.play.value == 0
    s.go_to(2)
    assert [c for c in calls if c[0] == "step"][-2:] == [("step", 0), ("step", 1)] and s.position == 2


def test_stepper_play_ticks_drive_the_callback():
    seen = []
    s = Stepper(seen.append, n_steps=5)
    s.play.value = 1  # what a Play tick from the browser does
    s.play.value = 2
    assert seen == [0, 1] and s.position == 2
    echoed = []
    s.play.observe(lambda ch: echoed.append(ch["new"]), names="value")
    s.play.value = 4  # ticks can arrive coalesced
    assert seen == [0, 1, 2, 3] and s.position == 4
    assert echoed == [4]  # the kernel never pushes the browser's Play value back to an intermediate step
    s.play.value = 0  # Play's stop button = back to the start
    assert s.position == 0
    s.step_button.click()
    assert seen[-1] == 0 and s.position == 1
    s.reset_button.click()
    assert s.position == 0


def test_stepper_unbounded_stops_when_callback_says_so():
    s = Stepper(lambda i: None if i < 4 else False)
    assert s.run() == 4 and s.done and s.position == 4
    assert s.slider.max >= 4 and "step 4 / ?" in s.counter.value


def test_stepper_errors_from_clicks_are_shown_not_raised():
    def boom(i):
        raise RuntimeError("no blocks")

    s = Stepper(boom, n_steps=2)
    s.step_button.click()
    assert s.position == 0 and "RuntimeError: no blocks" in s.status.value
    with pytest.raises(RuntimeError):
        s.step()


def test_stepper_rejects_bad_arguments():
    with pytest.raises(ValueError):
        Stepper("not callable")
    with pytest.raises(ValueError):
        Stepper(print, n_steps=-1)
    with pytest.raises(ValueError):
        Stepper(print, interval_ms=0)


def test_panel_stacks_views_and_renders_static():
    grid = BlockGrid(2, title="g")
    q = QueueView(title="q")
    s = Stepper(print, n_steps=1)
    p = panel(s, grid, q)
    assert list(p.widget.children) == [s.widget, grid.fig, q.widget]
    bundle = p._repr_mimebundle_()
    assert "FigureWidget(" in bundle["text/plain"]
    html = p.static().data
    assert "<svg" in html and "step 0 / 1" in html
    with pytest.raises(ValueError):
        panel()


def test_grid_shortens_long_labels_but_hover_keeps_them():
    grid = BlockGrid(2, cell_px=40)
    grid.update([BlockCell(0, ("req-alpha", "req-beta"), 2)])
    top, bottom = grid.cell_text(grid.cells[0])
    assert bottom.endswith("…") and len(bottom) <= 6
    assert "req-alpha+req-beta" in grid.fig.data[0].hovertext[0]


def test_grid_resize_keeps_the_widget():
    grid = BlockGrid(4, columns=4)
    fig = grid.fig
    grid.update([BlockCell(1, "A", 1)])
    grid.resize(10, columns=5)
    assert grid.fig is fig and len(fig.data[0].x) == 10 and len(fig.data[0].marker.color) == 10
    assert grid.rows == 2 and len(grid.cells) == 10 and all(c.state == "free" for c in grid.cells)
    assert fig.layout.height == 2 * grid.cell_px + 76
    grid.update([BlockCell(9, "B", 1)])
    assert grid.changed == {9}
    with pytest.raises(ValueError):
        grid.resize(0)
    assert grid.num_blocks == 10


# ---------------------------------------------------------------------------------------------- BlockTableView
from minienv.viz import BlockTableView  # noqa: E402


def test_block_tables_update_in_place_and_highlight_new_blocks():
    grid = BlockGrid(8)
    view = BlockTableView(block_size=4, num_blocks=8, colors_from=grid)
    widget = view.widget
    view.update({"A": [0, 1], "B": [3]}, tokens={"A": 5, "B": 2}, refcounts={0: 1, 1: 1, 3: 1})
    cells = view.cells()
    assert [(c["req"], c["col"], c["block"]) for c in cells] == [("A", 0, 0), ("A", 1, 1), ("B", 0, 3)]
    assert (cells[0]["top"], cells[0]["bottom"]) == ("p0 ·rc1", "4/4")
    assert (cells[1]["top"], cells[1]["bottom"]) == ("p1 ·rc1", "1/4")
    assert cells[0]["color"] == grid.owner_color("A")
    v1 = widget.value
    assert "p0 ·rc1" in v1 and ">A<" in v1 and ">B<" in v1 and "logical block 1 → physical block 1" in v1
    # A grows within its last block: only that cell changes; then crosses a boundary: a new cell
    assert view.update({"A": [0, 1], "B": [3]}, tokens={"A": 6, "B": 2}, refcounts={0: 1, 1: 1, 3: 1}) == {("A", 1)}
    changed = view.update({"A": [0, 1, 2], "B": [3]}, tokens={"A": 9, "B": 2}, refcounts={0: 1, 1: 1, 2: 1, 3: 1})
    assert changed == {("A", 1), ("A", 2)}  # block 1 became full, block 2 is new
    assert view.widget is widget and widget.value != v1 and widget.value == view.to_svg()
    assert [c["changed"] for c in view.cells()] == [False, True, True, False]
    assert widget.value.count(f'stroke="{S.CHANGED}" stroke-width="3.5"') == 2
    # a shared block is drawn in the shared colour with its refcount
    view.update({"A": [0, 1, 2], "C": [0]}, refcounts={0: 2, 1: 1, 2: 1})
    assert view.cells()[0]["color"] == S.SHARED and view.cells()[3]["top"] == "p0 ·rc2"
    svg = view.static().data
    assert "p0 ·rc2" in svg and ">C<" in svg and "[2]" in svg
    assert "FigureWidget" not in repr(view) and view._repr_mimebundle_()["text/plain"] == repr(view)


@pytest.mark.parametrize(
    "tables, kw, match",
    [
        ({"A": [0, 0]}, {}, "twice"),
        ({"A": [9]}, {}, "unknown block id 9"),
        ({"A": [-1]}, {}, "integers >= 0"),
        ({"A": [0]}, {"refcounts": {0: -1}}, "negative refcount"),
        ({"A": [0]}, {"tokens": {"A": 5}}, "room for 4"),
        ({"A": [0]}, {"tokens": {"B": 1}}, "has no table"),
        ([0, 1], {}, "mapping"),
        ({"A": "01"}, {}, "sequence"),
    ],
)
def test_block_tables_bad_input_leaves_view_unchanged(tables, kw, match):
    view = BlockTableView(block_size=4, num_blocks=8)
    view.update({"A": [1]}, tokens={"A": 3}, caption="ok")
    state = (view.tables, view.changed, view.caption, view.updates, view.widget.value)
    with pytest.raises(ValueError, match=match):
        view.update(tables, **kw)
    assert (view.tables, view.changed, view.caption, view.updates, view.widget.value) == state


def test_block_tables_empty_and_reset():
    view = BlockTableView()
    assert "(no requests)" in view.widget.value and view.cells() == []
    view.update({"A": [2]})
    view.reset()
    assert view.tables == {} and view.cells() == [] and "(no requests)" in view.widget.value
    with pytest.raises(ValueError, match="block_size"):
        view.update({"A": [2]}, tokens={"A": 1})


def test_missing_widget_stack_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install -e \.\[lab\]"):
        S.require("minienv_no_such_module_for_this_test")


# ---------------------------------------------------------------------------------------------- StatsView
from minienv.viz import StatsView  # noqa: E402


def test_stats_view_marks_changes_in_place():
    st = StatsView(title="engine")
    widget = st.widget
    assert st.update({"blocks in use": 3, "hit rate": 0.5}, bars={"blocks in use": (3, 8)}) == {"blocks in use",
                                                                                                   "hit rate"}
    assert st.update({"blocks in use": 4, "hit rate": 0.5}, bars={"blocks in use": (4, 8)}) == {"blocks in use"}
    assert st.widget is widget and "width:50.0%" in widget.value and "0.5" in widget.value
    assert "blocks in use" in st.static().data
    st.reset()
    assert st.values == {} and "(nothing yet)" in st.widget.value


@pytest.mark.parametrize(
    "values, bars, match",
    [
        ([1, 2], None, "mapping"),
        ({"a": 1}, {"b": (1, 2)}, "not among the values"),
        ({"a": 1}, {"a": (3, 2)}, "used <= total"),
        ({"a": 1}, {"a": 5}, r"\(used, total\)"),
    ],
)
def test_stats_view_bad_input_leaves_view_unchanged(values, bars, match):
    st = StatsView()
    st.update({"a": 0}, caption="ok")
    state = (st.values, st.changed, st.updates, st.widget.value)
    with pytest.raises(ValueError, match=match):
        st.update(values, bars=bars)
    assert (st.values, st.changed, st.updates, st.widget.value) == state
