"""Live views for the notebooks: the block grid, the queue view and the stepper that drives them.

    from minienv.viz import BlockCell, BlockGrid, QueueView, Stepper, panel

- ``BlockGrid(num_blocks)``: one cell per physical block, coloured by owner, labelled "id ·rcN", the cells that
  changed in the last update outlined. ``grid.update(cells)`` takes plain ``BlockCell`` records.
- ``BlockTableView(block_size=...)``: every request's block table, logical → physical, refcounts and fill.
- ``QueueView()``: an ordered queue (free queue in LRU order, waiting queue), head marked, joins / leaves /
  evictions highlighted. ``queue.update(items, evicted=...)``.
- ``StatsView()``: named numbers (KV usage, hit rate, evictions), changed values marked, optional fill bars.
- ``Stepper(on_step, on_reset, n_steps=...)``: step / play / reset controls; ``stepper.step()`` from code.
- ``panel(stepper, grid, queue)``: one live widget stacking them.
- ``flow_diagram([Stage(...), ...])``: a static box-and-arrow picture (the engine map).

Every view updates in place (one widget for its lifetime) and has ``static()``: the same picture as SVG/HTML, for
readers without a kernel (GitHub and nbviewer drop widget state). The views take plain data, never an engine
class, so every layer of minienv can feed them.

This package (and only this package) needs the ``lab`` extra: ipywidgets, plotly and anywidget.
"""

from __future__ import annotations

from . import _style

# Fail at import, with the fix, rather than deep inside a constructor.
_style.require("ipywidgets")
_style.require("anywidget")
_style.require("plotly.graph_objects")

from ._view import SvgView, View  # noqa: E402
from .block_grid import BlockCell, BlockGrid, block_cells  # noqa: E402
from .block_table import BlockTableView  # noqa: E402
from .diagram import Stage, flow_diagram, flow_svg  # noqa: E402
from .queue_view import QueueChange, QueueView  # noqa: E402
from .stats_view import StatsView  # noqa: E402
from .stepper import Stepper  # noqa: E402

__all__ = [
    "BlockCell",
    "BlockGrid",
    "BlockTableView",
    "Panel",
    "QueueChange",
    "QueueView",
    "Stage",
    "StatsView",
    "Stepper",
    "block_cells",
    "flow_diagram",
    "flow_svg",
    "panel",
]


class Panel(View):
    """Several views stacked in one live widget (a ``VBox``), e.g. ``panel(stepper, grid, queue)``.

    ``static()`` renders every view's static picture one under the other (HTML).
    """

    def __init__(self, *views, horizontal: bool = False) -> None:
        import ipywidgets as w

        if not views:
            raise ValueError("panel() needs at least one view")
        for v in views:
            if not hasattr(v, "widget"):
                raise ValueError(f"not a minienv.viz view (no .widget): {v!r}")
        self.views = views
        box = w.HBox if horizontal else w.VBox
        self.widget = box([v.widget for v in views])

    def to_html(self) -> str:
        parts = [v.to_html() if hasattr(v, "to_html") else v.static().data for v in self.views]
        return "<div>" + "".join(f"<div>{p}</div>" for p in parts) + "</div>"

    def parts(self) -> list[View]:
        return [self] + [p for v in self.views for p in v.parts()]

    def __repr__(self) -> str:
        return "Panel(" + ", ".join(repr(v) for v in self.views) + ")"


def panel(*views, horizontal: bool = False) -> Panel:
    """Stack views (a ``Stepper``, ``BlockGrid``s, ``QueueView``s) into one live widget."""
    return Panel(*views, horizontal=horizontal)
