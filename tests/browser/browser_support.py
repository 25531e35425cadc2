"""Helpers of the browser tier: where things are, the dependency gate, and a generated notebook that proves the
checker works: its live views must count as rendered, and each of its deliberate failures must be reported.
(It is written without outputs; SELFTEST_EXPECT states what a committed copy would have shown.)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
SELFTEST_DIR = "_lab_check_selftest"  # inside the served (temporary) root
RESULTS: list = []  # lab_check.Result of every notebook checked in this session (timings in the summary)

sys.path.insert(0, str(REPO / "tools"))
import lab_check  # noqa: E402


def notebooks_dir() -> Path:
    """notebooks/, or MINIENV_BROWSER_NOTEBOOKS_DIR to check another folder (e.g. scratch notebooks)."""
    return Path(os.environ.get("MINIENV_BROWSER_NOTEBOOKS_DIR") or REPO / "notebooks").resolve()


def require_browser_tier() -> None:
    """Skip when playwright or chromium is missing -- or fail, saying what to install, if MINIENV_REQUIRE_TIERS=1."""
    missing = lab_check.missing_dependencies()
    if not missing:
        return
    msg = "browser tier needs " + "; and ".join(missing)
    if os.environ.get("MINIENV_REQUIRE_TIERS") == "1":
        pytest.fail(f"MINIENV_REQUIRE_TIERS=1 but the {msg}", pytrace=False)
    pytest.skip(msg)


class MissingDependency(str):
    """What the `lab` fixture yields when MINIENV_REQUIRE_TIERS=1 and a dependency is missing."""


def started(lab):
    """(server, browser) from the `lab` fixture, or fail the calling test saying what to install."""
    if isinstance(lab, MissingDependency):
        pytest.fail(str(lab), pytrace=False)
    return lab


SELFTEST = "selftest.ipynb"

# Live views that must count as rendered, then every kind of failure the checker must report.
SELFTEST_CELLS = [
    ("markdown", "Self-test of tools/lab_check.py: two live views, then one failure of each kind."),
    ("code", "import ipywidgets as w\nimport plotly.graph_objects as go\nimport traitlets\n"
             "from IPython.display import Javascript, display"),
    # good: an ipywidget, and a FigureWidget updated in place after display
    ("code", "s = w.IntSlider(value=3, max=10, description='n')\ns"),
    ("code", "fw = go.FigureWidget(go.Bar(y=[1, 3, 2]))\ndisplay(fw)\nfw.data[0].y = [3, 2, 1]"),
    # bad: a widget whose frontend module does not exist -> ipywidgets' error view + a console error
    ("code", "class Broken(w.DOMWidget):\n"
             "    _model_module = traitlets.Unicode('no-such-widget-module').tag(sync=True)\n"
             "    _model_module_version = traitlets.Unicode('9.9.9').tag(sync=True)\n"
             "    _model_name = traitlets.Unicode('NoSuchModel').tag(sync=True)\n"
             "    _view_module = traitlets.Unicode('no-such-widget-module').tag(sync=True)\n"
             "    _view_module_version = traitlets.Unicode('9.9.9').tag(sync=True)\n"
             "    _view_name = traitlets.Unicode('NoSuchView').tag(sync=True)\n"
             "Broken()"),
    # bad: a widget output whose model the frontend never gets -> "Error displaying widget: model not found"
    ("code", "display({'application/vnd.jupyter.widget-view+json': "
             "{'model_id': 'no-such-model', 'version_major': 2, 'version_minor': 0}}, raw=True)"),
    # bad: a figure that does not render as a plot (a JSON tree instead) where a plotly figure is expected
    ("code", "go.Figure(go.Bar(y=[1, 2])).show(renderer='json')"),
    # bad: a JS console error
    ("code", "display(Javascript(\"console.error('deliberate console error from the self-test')\"))"),
    # bad: a cell that raises, and so a cell that never runs
    ("code", "raise ValueError('deliberate failure from the self-test')"),
    ("code", "print('never runs: Run All stops at the error above')"),
]
# What "the committed notebook" would show: 4 widget outputs (slider, FigureWidget, Broken, the orphan view);
# 2 plotly figures (the FigureWidget, and the figure that the json renderer turns into a tree).
SELFTEST_EXPECT = {"widget_views": 4, "plotly_figures": 2}


SELFTEST_CONTROLS = "controls.ipynb"

# Controls the checker must drive: a good stepper, slider and text box (no problem), and dead ones it must report,
# plus a view its repr names that the live widget does not draw. The steppers are built like minienv's Stepper
# (a box of [Step, Reset, counter] and a caption, above the views), from plain ipywidgets.
CONTROLS_CELLS = [
    ("markdown", "Self-test of tools/lab_controls.py: good controls, then dead ones."),
    ("code", "import ipywidgets as w\n"
             "def stepper(view, on_step, on_reset):\n"
             "    counter, status, n = w.Label('step 0'), w.HTML(''), [0]\n"
             "    step, reset = w.Button(description='Step'), w.Button(description='Reset')\n"
             "    def do_step(_):\n"
             "        n[0] += 1; counter.value = f'step {n[0]}'; status.value = f'did step {n[0]}'; on_step(n[0])\n"
             "    def do_reset(_):\n"
             "        n[0] = 0; counter.value = 'step 0'; status.value = ''; on_reset()\n"
             "    step.on_click(do_step); reset.on_click(do_reset)\n"
             "    return w.VBox([w.VBox([w.HBox([step, reset, counter]), status]), view])"),
    ("code", "good = w.HTML('count 0')\n"
             "stepper(good, lambda n: setattr(good, 'value', f'count {n}'), lambda: setattr(good, 'value', 'count 0'))"),
    ("code", "stepper(w.HTML('never changes'), lambda n: None, lambda: None)  # dead Step: only its counter moves"),
    ("code", "sticky = w.HTML('v 0')\n"
             "stepper(sticky, lambda n: setattr(sticky, 'value', f'v {n}'), lambda: None)  # Reset restores nothing"),
    ("code", "import plotly.graph_objects as go  # a slider driving a FigureWidget (whose mode bar has buttons)\n"
             "s, fig = w.IntSlider(value=0, max=10), go.FigureWidget(go.Bar(y=[0, 1]))\n"
             "s.observe(lambda c: setattr(fig.data[0], 'y', [c['new'], 1]), 'value')\nw.VBox([s, fig])"),
    ("code", "w.VBox([w.IntSlider(value=3, max=10), w.HTML('nothing follows the slider')])  # dead slider"),
    ("code", "t, o = w.Text(value='abc'), w.HTML('ABC')\n"
             "t.observe(lambda c: setattr(o, 'value', c['new'].upper()), 'value')\nw.VBox([t, o])"),
    ("code", "class Named:  # its repr names a grid and a queue; the live widget draws neither\n"
             "    def _repr_mimebundle_(self, **kw):\n"
             "        b = w.VBox([w.HTML('no views here')])._repr_mimebundle_(**kw)\n"
             "        b['text/plain'] = 'ManagerView(grid=BlockGrid(...), queue=QueueView(...))'\n"
             "        return b\nNamed()"),
]


def _notebook(cells) -> dict:
    out = []
    for kind, src in cells:
        cell = {"cell_type": kind, "metadata": {}, "source": src}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        out.append(cell)
    return {
        "cells": out,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
                     "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def write_selftest_notebooks(folder: Path) -> None:
    for name, cells in [(SELFTEST, SELFTEST_CELLS), (SELFTEST_CONTROLS, CONTROLS_CELLS)]:
        nb = _notebook(cells)
        for i, cell in enumerate(nb["cells"]):
            cell["id"] = f"cell-{i}"
        (Path(folder) / name).write_text(json.dumps(nb, indent=1), encoding="utf-8")
