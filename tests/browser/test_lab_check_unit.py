"""The browser checker's pure parts (no browser, no server; milliseconds): what a committed notebook says must
render, the console allow-list, and the skip-or-fail gate for missing dependencies."""

from __future__ import annotations

import json

import pytest
from browser_support import lab_check, require_browser_tier

WIDGET = lab_check.WIDGET_MIME
PLOTLY = lab_check.PLOTLY_MIME


def _out(data: dict, kind: str = "display_data") -> dict:
    return {"output_type": kind, "data": data, "metadata": {}}


def _write(tmp_path, cells) -> object:
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_expected_counts_widgets_static_figures_and_nested_figure_widgets(tmp_path):
    code = lambda *outs: {"cell_type": "code", "source": "", "metadata": {}, "outputs": list(outs),  # noqa: E731
                          "execution_count": 1}
    path = _write(tmp_path, [
        {"cell_type": "markdown", "source": "# hi", "metadata": {}},
        code(_out({WIDGET: {"model_id": "a", "version_major": 2, "version_minor": 0},
                   "text/plain": "IntSlider(value=3)"}, "execute_result")),
        # a viz panel holding two FigureWidgets; text/plain stored as a list of lines, as nbformat does
        code(_out({WIDGET: {"model_id": "b"}, "text/plain": ["Panel(Stepper(), BlockGrid(fig=FigureWidget(...)),\n",
                                                                 " QueueView(fig=FigureWidget(...)))"]})),
        code(_out({PLOTLY: {"data": [], "layout": {}}, "text/html": "<div></div>"}),
             _out({PLOTLY: {"data": [], "layout": {}}})),
        code(_out({WIDGET: {"model_id": ""}, "text/plain": "FigureWidget()"})),  # closed widget: renders nothing
        code({"output_type": "stream", "name": "stdout", "text": "FigureWidget( in a print is not a figure"}),
    ])
    exp = lab_check.expected_from_ipynb(path)
    assert (exp.widget_views, exp.plotly_figures, exp.code_cells) == (2, 4, 5)


def test_console_allow_list_is_narrow():
    cdn = "Failed to load resource: net::ERR_NAME_NOT_RESOLVED @ https://cdn.plot.ly/plotly-4.1.1.min"
    assert lab_check._console_allowed("run", cdn)
    assert not lab_check._console_allowed("run", cdn.replace("cdn.plot.ly", "example.com"))
    assert not lab_check._console_allowed("run", "Failed to load resource: the server responded with a status of "
                                                 "404 (Not Found) @ http://127.0.0.1:8888/files/x.png")
    assert not lab_check._console_allowed("run", "Error: No version of module no-such-widget-module is registered")
    assert lab_check._console_allowed("load", "Error: widget model not found")
    assert not lab_check._console_allowed("run", "Error: widget model not found")


def test_missing_dependency_skips_or_fails_under_require_tiers(monkeypatch, tmp_path):
    monkeypatch.setattr(lab_check, "CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.delenv("MINIENV_REQUIRE_TIERS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        require_browser_tier()
    monkeypatch.setenv("MINIENV_REQUIRE_TIERS", "1")
    with pytest.raises(pytest.fail.Exception, match="MINIENV_REQUIRE_TIERS=1 .*apt-get install -y chromium"):
        require_browser_tier()
