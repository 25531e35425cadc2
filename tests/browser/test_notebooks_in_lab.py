"""Every notebook, run in a real JupyterLab in headless Chromium: no error output, every widget output a rendered
live view, every plotly figure a rendered `.js-plotly-plot`, no JS console error. Screenshots (one per notebook)
land in tests/browser/screenshots/ (git-ignored) -- look at them.

    .venv/bin/python -m pytest tests/browser -m browser -v            # the tier
    MINIENV_BROWSER_NOTEBOOKS_DIR=/tmp/nbs .venv/bin/python -m pytest tests/browser -m browser   # other notebooks
    .venv/bin/python tools/lab_check.py [notebooks...]                 # the same check without pytest
"""

from __future__ import annotations

import sys

import pytest
from browser_support import (RESULTS, SCREENSHOTS, SELFTEST, SELFTEST_CONTROLS, SELFTEST_DIR, SELFTEST_EXPECT,
                             lab_check, notebooks_dir, started)

pytestmark = pytest.mark.browser

NOTEBOOKS = sorted(notebooks_dir().glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS or [None], ids=[nb.stem for nb in NOTEBOOKS] or ["no-notebooks"])
def test_notebook_renders_in_jupyterlab(lab, notebook, record_property):
    if notebook is None:
        pytest.skip(f"no *.ipynb in {notebooks_dir()}")
    server, browser = started(lab)
    expected = lab_check.expected_from_ipynb(notebook)
    res = lab_check.check_notebook(browser, server, notebook.name, expected,
                                   screenshot=SCREENSHOTS / f"{notebook.stem}.png")
    RESULTS.append(res)
    record_property("seconds", round(res.seconds, 1))
    print(res.summary())
    assert res.ok, res.summary()
    # A notebook that displays widgets / figures must show at least as many (the checks above count them).
    assert res.counts["widget_views"] >= expected.widget_views
    assert res.counts["plotly_plots"] >= expected.plotly_figures


# ----------------------------------------------------------------------------------------- the checker itself
def test_checker_sees_live_views_and_catches_every_kind_of_failure(lab):
    """A slider and a FigureWidget count as rendered live views; a cell that raises, the cell after it never
    running, a widget that cannot render, a widget output without a model, a figure that is not a plot, and a
    console error are each reported."""
    server, browser = started(lab)
    res = lab_check.check_notebook(browser, server, f"{SELFTEST_DIR}/{SELFTEST}",
                                   lab_check.Expected(**SELFTEST_EXPECT),
                                   screenshot=SCREENSHOTS / "_selftest.png")
    RESULTS.append(res)
    print(res.summary())
    p = {k: "\n".join(v) for k, v in res.problems.items()}
    assert res.counts["widget_views"] == 2 and res.counts["plotly_plots"] == 1, res.summary()  # slider, FigureWidget
    assert "ValueError: deliberate failure from the self-test" in p["errors"], res.summary()
    assert "never runs" in p["unrun"], res.summary()
    assert "cell 4 (class Broken" in p["widgets"] and "not a live view" in p["widgets"], res.summary()
    assert "cell 5 (display(" in p["widgets"] and "Error displaying widget" in p["widgets"], res.summary()
    assert "2 rendered widget views, the committed notebook has 4" in p["widgets"], res.summary()
    assert "1 rendered .js-plotly-plot, the committed notebook has 2" in p["plotly"], res.summary()
    assert "deliberate console error from the self-test" in p["console"], res.summary()
    assert "no-such-widget-module" in p["console"], res.summary()
    assert not res.ok


def test_checker_drives_every_control_and_reports_dead_ones(lab, monkeypatch):
    """Step / Reset, a slider and a text box that answer pass; a Step that changes only its counter, a Reset that
    restores nothing, a slider nothing follows, and a view named in the repr but not drawn are each reported.
    (A dead control is waited for until the checker's timeout: 6 s here, not the 20 s notebooks get.)"""
    monkeypatch.setattr(sys.modules["lab_controls"], "CHANGE_TIMEOUT", 6.0)
    server, browser = started(lab)
    res = lab_check.check_notebook(browser, server, f"{SELFTEST_DIR}/{SELFTEST_CONTROLS}",
                                   lab_check.Expected(widget_views=7), screenshot=SCREENSHOTS / "_selftest_controls.png")
    RESULTS.append(res)
    print(res.summary())
    ctl = res.problems["controls"]
    assert res.counts["controls"] == {"stepper": 3, "slider": 2, "text": 1}, res.summary()
    assert any(p.startswith("cell 3 (") and "Step did not change the live view" in p for p in ctl), res.summary()
    assert any(p.startswith("cell 4 (") and "Reset did not restore the first picture" in p for p in ctl), res.summary()
    assert any(p.startswith("cell 6 (") and "slider to either end did not change" in p for p in ctl), res.summary()
    assert len(ctl) == 3, res.summary()  # the good stepper (cell 2), slider (cell 5) and text box (cell 7) pass
    widgets = "\n".join(res.problems["widgets"])
    assert "cell 8 (" in widgets and "draws 0 QueueView, its repr names 1" in widgets, res.summary()
    assert "draws 0 BlockGrid, its repr names 1" in widgets, res.summary()
