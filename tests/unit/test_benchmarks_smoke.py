"""The benchmark harness (``benchmarks/_common.py``) and every benchmark script, run small.

Timings are never asserted (they depend on the machine); what is checked is what a reader of a benchmark relies on:
the interleaved schedule really rotates and covers every variant every round, min and median are what they say,
and every script runs with ``--quick``, pins BLAS threads, and ends with exactly one parseable JSON line that
carries the machine's settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402

SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


# ------------------------------------------------------------------------------------------------ the harness
def test_schedule_rotates_a_seeded_order_and_runs_every_variant_once_per_round():
    names = ["a", "b", "c", "d"]
    rounds = _common.schedule(names, 6, seed=3)
    assert len(rounds) == 6
    for r in rounds:
        assert sorted(r) == names  # every variant exactly once per round
    for prev, cur in zip(rounds, rounds[1:]):
        assert cur == prev[1:] + prev[:1]  # rotated by one place
    assert len({r[0] for r in rounds[:4]}) == 4  # each variant goes first once in len(names) rounds
    assert _common.schedule(names, 6, seed=3) == rounds  # seeded: reproducible
    assert any(_common.schedule(names, 1, seed=s)[0] != rounds[0] for s in range(10))  # the seed matters


def test_interleaved_runs_in_the_schedules_order_and_reports_min_and_median():
    calls: list[str] = []
    ticks = iter(range(10_000))
    durations = {"x": [5, 1, 3], "y": [2, 2, 8]}
    clock_now = [0.0]

    def make(name):
        def run():
            calls.append(name)
            clock_now[0] += durations[name][(len([c for c in calls if c == name]) - 1) % 3]
            return name.upper()
        return run

    def clock():
        next(ticks)
        return clock_now[0]

    t = _common.interleaved({"x": make("x"), "y": make("y")}, rounds=3, seed=1, clock=clock, warmup=False)
    assert calls == [n for r in _common.schedule(["x", "y"], 3, seed=1) for n in r]
    assert t["x"].samples == [5, 1, 3] and t["y"].samples == [2, 2, 8]
    assert (t["x"].min, t["x"].median) == (1, 3)
    assert (t["y"].min, t["y"].median) == (2, 2)
    assert t["x"].result == "X" and len(t["x"].wall) == 3
    assert t["y"].as_dict() == {"min": 2, "median": 2}


def test_interleaved_warms_up_once_and_keeps_going_until_min_seconds():
    n = {"a": 0}

    def a():
        n["a"] += 1

    t = _common.interleaved({"a": a}, rounds=3, warmup=True)
    assert n["a"] == 4 and len(t["a"].samples) == 3
    t = _common.interleaved({"a": a}, rounds=3, min_seconds=0.02)
    assert len(t["a"].samples) >= 3


def test_before_each_runs_untimed_before_every_timed_call():
    log: list[str] = []
    t = _common.interleaved({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, rounds=3,
                            before_each=lambda: log.append("flush"), warmup=True)
    assert log[:2] in (["a", "b"], ["b", "a"])  # warm-up: no flush
    timed = log[2:]
    assert timed[0::2] == ["flush"] * 6 and sorted(timed[1::2]) == ["a"] * 3 + ["b"] * 3
    assert len(t["a"].samples) == len(t["b"].samples) == 3


def test_interleaved_rejects_fewer_than_three_rounds_and_no_variants():
    with pytest.raises(ValueError, match=">= 3 rounds"):
        _common.interleaved({"a": lambda: None}, rounds=2)
    with pytest.raises(ValueError, match="at least one variant"):
        _common.interleaved({}, rounds=3)


def test_emit_json_prints_one_line_with_settings_and_no_nan(capsys):
    import numpy as np

    _common.emit_json({"ratio": np.float32(1.5), "bad": float("nan"), "rows": (1, 2)}, settings={"s": 1})
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out) == {"ratio": 1.5, "bad": None, "rows": [1, 2], "settings": {"s": 1}}
    with pytest.raises(TypeError, match="dict"):
        _common.emit_json([1, 2])


def test_settings_name_numpy_blas_and_thread_variables():
    s = _common.blas_settings()
    assert s["numpy"] and s["cpu_count"] >= 1
    assert set(s["threads_env"]) == set(_common.THREAD_VARS)
    assert s["blas"], "the BLAS numpy uses should be identified"
    assert "OPENBLAS_NUM_THREADS" in _common.format_settings(s)


# ------------------------------------------------------------------------------------------------ every script
def test_every_benchmark_is_listed_here():
    """A new benchmark must run in the smoke test: the list is the directory, so this guards the glob itself."""
    assert len(SCRIPTS) >= 11 and "bench_paged.py" in SCRIPTS and "bench_engine.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quick_and_ends_with_one_json_line(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="7")  # the script must pin it to 1 itself
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"{script} printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    json_lines = [ln for ln in lines if ln.lstrip().startswith("{")]
    assert json_lines == [lines[-1]], f"{script}: exactly one JSON line, and it is the last"
    s = result["settings"]
    assert s["threads_env"]["OPENBLAS_NUM_THREADS"] == "1", f"{script} did not pin BLAS threads"
    assert s["numpy"] and s["cpu_count"] >= 1
    assert lines[0].startswith("settings:") or any(ln.startswith("settings:") for ln in lines[:5]), \
        f"{script} should print its settings first"
