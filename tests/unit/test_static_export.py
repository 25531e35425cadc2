"""Static images never cost a student the figure: with no browser, a browser that never answers, or one that dies
at start, ``show`` returns at once (or within its bounds) with the live figure, one note per kernel, no traceback,
and no browser process left behind.

Each case runs in a fresh Python process (the exporter is one per kernel, as in a notebook), with the browser
chosen through ``BROWSER_PATH`` — the variable kaleido's own lookup honours first. Before this module's fix, the
first case hung forever: kaleido's export thread died with ``ChromeNotFoundError`` and ``calc_fig_sync`` waited on
its queue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("plotly")
pytest.importorskip("kaleido")

REPO = Path(__file__).resolve().parents[2]

SHOW_TWICE = textwrap.dedent("""
    import json, sys, time
    import IPython.display
    import plotly.graph_objects as go
    from minienv.viz import static
    static.START_TIMEOUT = float(sys.argv[1])
    shown = []
    IPython.display.display = lambda obj, raw=False: shown.append(sorted(obj))
    t0 = time.perf_counter()
    static.show(go.Figure(go.Bar(x=[1, 2], y=[3, 4])))
    static.show(go.Figure(go.Bar(x=[1, 2], y=[4, 3])))
    import threading
    threads = sorted(t.name for t in threading.enumerate() if t.name == "minienv-png-export")
    print(json.dumps({"shown": shown, "seconds": time.perf_counter() - t0, "export_threads": threads}))
""")


def _show_twice(browser: str, start_timeout: float = 30.0, budget: float = 60.0):
    env = dict(os.environ, BROWSER_PATH=browser, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", SHOW_TWICE, str(start_timeout)], env=env, capture_output=True,
                              text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"show() did not return within {budget:.0f} s with BROWSER_PATH={browser!r}: it hangs")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1], proc.stderr, time.perf_counter() - t0


def _executable(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _assert_live_only_with_one_note(result, printed, stderr, reason: str):
    assert result["shown"] == [["application/vnd.plotly.v1+json"]] * 2  # both figures, live, no image
    notes = [line for line in printed if "static images are off" in line]
    assert len(notes) == 1, printed  # one note per kernel, not one per figure
    assert reason in notes[0] and "Chromium" in notes[0], notes[0]  # why, and how to get images
    assert "Traceback" not in stderr and "exception was never retrieved" not in stderr, stderr


def test_no_browser_means_the_live_figure_at_once_and_one_note(tmp_path):
    result, printed, stderr, _ = _show_twice(str(tmp_path / "no-such-browser"))
    _assert_live_only_with_one_note(result, printed, stderr, "no browser at BROWSER_PATH")
    assert result["export_threads"] == []  # decided up front: no exporter was ever started


def test_a_browser_that_never_answers_is_bounded_and_killed(tmp_path):
    marker = tmp_path / "browser-alive"
    hung = _executable(tmp_path, "hung-browser", f"touch {marker}; exec sleep 300")
    result, printed, stderr, _ = _show_twice(str(hung), start_timeout=3.0)
    _assert_live_only_with_one_note(result, printed, stderr, "no answer from the exporter within 3 s")
    # the 3 s start timeout, a kill, and never a second try (generous: a loaded CI machine imports slowly; the
    # unbounded exporter never returned at all)
    assert result["seconds"] < 30.0
    assert marker.exists()  # it was started ...
    alive = subprocess.run(["pgrep", "-f", str(hung)], capture_output=True, text=True).stdout.split()
    assert alive == [], f"browser processes left running: {alive}"  # ... and is gone


def test_a_browser_that_dies_at_start(tmp_path):
    dead = _executable(tmp_path, "dead-browser", "exit 1")
    result, printed, stderr, _ = _show_twice(str(dead))
    # the reason is the browser library's own words (which vary with how the browser dies): any one line will do
    _assert_live_only_with_one_note(result, printed, stderr, "static images are off in this kernel — ")
    assert result["seconds"] < 30.0


def test_exporter_problem_names_the_missing_part(monkeypatch, tmp_path):
    from minienv.viz import static

    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "nothing"))
    assert static.find_browser() is None
    assert "BROWSER_PATH" in static.exporter_problem()
    real = _executable(tmp_path, "a-browser", "exit 0")
    monkeypatch.setenv("BROWSER_PATH", str(real))
    assert static.find_browser() == str(real) and static.exporter_problem() is None
    not_executable = tmp_path / "not-executable"
    not_executable.write_text("")
    monkeypatch.setenv("BROWSER_PATH", str(not_executable))
    assert static.find_browser() is None  # a file kaleido could not start is no browser


def test_building_a_notebook_without_an_exporter_is_refused_up_front(tmp_path):
    """tools/nb.py build would write a notebook the gate rejects (figures without PNGs): it stops before executing
    anything, says why, and writes nothing."""
    before = {p: p.read_bytes() for p in (REPO / "notebooks").glob("00_tour.*")}
    env = dict(os.environ, BROWSER_PATH=str(tmp_path / "none"))
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "nb.py"), "build", str(REPO / "notebooks" / "00_tour.py")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "none can be made here" in proc.stderr and "chromium" in proc.stderr
    assert {p: p.read_bytes() for p in before} == before


def test_the_stop_button_during_an_export_stops_it_and_leaves_images_on(monkeypatch, tmp_path):
    """Ctrl-C / JupyterLab's stop while the exporter starts: the interrupt reaches the reader, what was started is
    stopped, and static images are not switched off for the rest of the kernel (the next figure tries again)."""
    import plotly.graph_objects as go

    from minienv.viz import static

    monkeypatch.setenv("BROWSER_PATH", str(_executable(tmp_path, "a-browser", "exec sleep 30")))
    exporter = static._Exporter()
    monkeypatch.setattr(static, "_exporter", exporter)

    def interrupted(coro, timeout):
        coro.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        static.png_bytes(go.Figure())
    assert exporter.problem is None and not exporter._started  # not disabled: the next figure starts afresh
    assert exporter._loop is None and exporter._kaleido is None  # nothing of the interrupted start is kept
