"""Helpers of the browser tier: where things are, the dependency gate, and two generated notebooks that prove the
checker works (one must pass; one must fail in every way the checker looks for -- written without outputs, the
tests state what each must show)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
SELFTEST_DIR = "_lab_check_selftest"  # inside the served (temporary) root

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


GOOD = "good_widgets.ipynb"
BAD = "bad_everything.ipynb"

GOOD_CELLS = [
    ("markdown", "A FigureWidget, a slider, a box holding a FigureWidget, and two static plotly figures."),
    ("code", "import ipywidgets as w\nimport plotly.graph_objects as go\nfrom IPython.display import display"),
    ("code", "fw = go.FigureWidget(go.Bar(y=[1, 3, 2]))\nfw"),
    ("code", "s = w.IntSlider(value=3, max=10, description='n')\ns"),
    ("code", "box = w.VBox([w.HTML('<b>hello</b>'), go.FigureWidget(go.Scatter(y=[3, 1, 2]))])\nbox"),
    ("code", "go.Figure(go.Scatter(y=[1, 2, 3])).show()"),
    ("code", "display(go.Figure(go.Bar(y=[2, 2, 1])))"),
    ("code", "fw.data[0].y = [3, 2, 1]  # a live update, in place\nassert s.value == 3"),
]
GOOD_EXPECT = {"widget_views": 3, "plotly_figures": 4}

BAD_CELLS = [
    ("code", "import ipywidgets as w\nimport plotly.graph_objects as go\nimport traitlets\n"
             "from IPython.display import Javascript, display"),
    # A widget whose frontend module does not exist: ipywidgets shows its error view + logs a console error.
    ("code", "class Broken(w.DOMWidget):\n"
             "    _model_module = traitlets.Unicode('no-such-widget-module').tag(sync=True)\n"
             "    _model_module_version = traitlets.Unicode('9.9.9').tag(sync=True)\n"
             "    _model_name = traitlets.Unicode('NoSuchModel').tag(sync=True)\n"
             "    _view_module = traitlets.Unicode('no-such-widget-module').tag(sync=True)\n"
             "    _view_module_version = traitlets.Unicode('9.9.9').tag(sync=True)\n"
             "    _view_name = traitlets.Unicode('NoSuchView').tag(sync=True)\n"
             "Broken()"),
    # A figure that does not render as a plot (JSON tree instead), while one plotly figure is expected.
    ("code", "go.Figure(go.Bar(y=[1, 2])).show(renderer='json')"),
    ("code", "display(Javascript(\"console.error('deliberate console error from the self-test')\"))"),
    ("code", "raise ValueError('deliberate failure from the self-test')"),
    ("code", "print('never runs: Run All stops at the error above')"),
]
BAD_EXPECT = {"widget_views": 1, "plotly_figures": 1}


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
    for name, cells in [(GOOD, GOOD_CELLS), (BAD, BAD_CELLS)]:
        nb = _notebook(cells)
        for i, cell in enumerate(nb["cells"]):
            cell["id"] = f"cell-{i}"
        (Path(folder) / name).write_text(json.dumps(nb, indent=1), encoding="utf-8")
