"""The benchmark harness (``benchmarks/_common.py``) and every benchmark script, run small.

Timings are never asserted (they depend on the machine); what is checked is what a reader of a benchmark relies on:
the interleaved schedule covers every variant every round, in every position and after every other variant;
``settle`` collects what a run left and ``race`` settles before every side; min and median are what they say;
and every script runs with ``--quick``, pins BLAS threads, and ends with exactly one parseable JSON line that
carries the machine's settings.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402

SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


# ------------------------------------------------------------------------------------------------ the harness
@pytest.mark.parametrize("n", [2, 3, 4, 5, 15])
def test_williams_rows_balance_positions_and_predecessors(n):
    rows = _common.williams_rows(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    for r in rows:
        assert sorted(r) == list(range(n))  # every variant exactly once per round
    positions = collections.Counter((x, i) for r in rows for i, x in enumerate(r))
    assert len(positions) == n * n and len(set(positions.values())) == 1  # every variant in every position, evenly
    pairs = collections.Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
    # every variant right after every other one, equally often: no variant inherits one neighbour's state
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


def test_schedule_is_a_seeded_balanced_design_that_runs_every_variant_once_per_round():
    names = ["a", "b", "c", "d"]
    rounds = _common.schedule(names, 8, seed=3)
    assert len(rounds) == 8
    for r in rounds:
        assert sorted(r) == names  # every variant exactly once per round
    for cycle in (rounds[:4], rounds[4:]):  # a cycle of n rounds (n even): balanced on its own
        assert all(len({r[i] for r in cycle}) == 4 for i in range(4))  # each variant in each position once
        follows = {(a, b) for r in cycle for a, b in zip(r, r[1:])}
        assert len(follows) == 12  # each ordered pair adjacent once: no fixed predecessor, unlike a rotation
    assert _common.schedule(names, 8, seed=3) == rounds  # seeded: reproducible
    assert any(_common.schedule(names, 1, seed=s)[0] != rounds[0] for s in range(10))  # the seed matters
    assert rounds[:4] != rounds[4:]  # a new deal of the names each cycle


def test_settle_frees_what_only_the_cycle_collector_can_and_race_settles_before_every_side(monkeypatch):
    freed = []

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle, as a discarded engine leaves behind
    weakref.finalize(a, freed.append, "a")
    gc_was_enabled = gc.isenabled()
    gc.disable()  # only settle() may collect it here
    try:
        del a, b
        assert freed == []
        _common.settle()
        assert freed == ["a"]
    finally:
        if gc_was_enabled:
            gc.enable()

    log: list[str] = []
    monkeypatch.setattr(_common, "settle", lambda: log.append("settle"))
    times, outs = _common.race({"x": lambda: (log.append("x") or 1.0, "X"), "y": lambda: (log.append("y") or 2.0, "Y")},
                               rounds=3, seed=0)
    assert log[0::2] == ["settle"] * 6 and sorted(log[1::2]) == ["x"] * 3 + ["y"] * 3  # settled before every side
    assert times == {"x": [1.0] * 3, "y": [2.0] * 3} and outs == {"x": "X", "y": "Y"}


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


def _needs(script: str):
    """The marks of a script that needs more than a plain machine: bench_real_model needs the downloaded model and
    transformers (its baseline)."""
    return [pytest.mark.realmodel, pytest.mark.reference] if script == "bench_real_model.py" else []


@pytest.mark.parametrize("script", [pytest.param(s, marks=_needs(s)) for s in SCRIPTS])
def test_benchmark_runs_quick_and_ends_with_one_json_line(script, tmp_path):
    if script == "bench_real_model.py":
        from minienv.model.hub import cached_path

        if cached_path("smollm2-135m-instruct", verify=False) is None:
            pytest.skip("realmodel tier: smollm2-135m-instruct is not in the model cache (python -m minienv download "
                        "smollm2-135m-instruct; CI does)")
        pytest.importorskip("torch", reason="reference tier: bench_real_model races transformers (torch)")
        pytest.importorskip("transformers", reason="reference tier: bench_real_model races transformers")
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


def test_checkouts_can_put_this_block_walk_into_the_base_engine(tmp_path):
    """``bench_checkouts.py --kernel-on-base`` runs the base's engine with this tree's block walk as its attention
    (what the kernel alone buys the base). Against this very tree as its base, the side's greedy tokens must equal
    every other side's (the script stops otherwise), and it is reported by name."""
    pytest.importorskip("numba", reason="the block walk is the lab extra's numba kernel")
    proc = subprocess.run([sys.executable, str(BENCH / "bench_checkouts.py"), "--quick", "--kernel-on-base"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["identical_tokens"] is True
    assert set(result["sides"]) == {"base", "base + this walk", "this (numpy)", "this (numba)"}


def test_block_manager_baseline_hashes_like_nano_vllm_or_says_why_not(tmp_path):
    """nano-vllm hashes blocks with xxhash; without it the benchmark stops and names the package (a sha256 stand-in
    is slower, a weaker baseline) unless the stand-in is asked for by name — and then it says so."""
    blocker = tmp_path / "no_xxhash"
    blocker.mkdir()
    (blocker / "xxhash.py").write_text("raise ImportError('xxhash is blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(REPO)]))
    script = [sys.executable, str(BENCH / "bench_block_manager.py"), "--quick"]
    proc = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "xxhash" in proc.stderr and "--nano-hash sha256" in proc.stderr
    assert not any(ln.lstrip().startswith("{") for ln in proc.stdout.splitlines())  # no figures from a weak baseline
    proc = subprocess.run(script + ["--nano-hash", "sha256"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sha256 truncated to 64 bits" in proc.stdout
    assert json.loads(proc.stdout.splitlines()[-1])["nano_hash"] == "sha256-64"
    proc = subprocess.run(script, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["nano_hash"] == "xxh64"


def test_the_transformers_baseline_is_the_fastest_configuration_by_median(capsys):
    """``_hf.strongest`` keeps the variant with the lowest median (not the lowest minimum: one lucky run must not
    pick the baseline), prints every variant, and refuses variants that generate different tokens."""
    import _hf

    series = {"a": [5.0, 1.0, 5.0], "b": [2.0, 2.0, 2.0], "c": [3.0, 3.0, 3.0]}
    def timed(name):
        runs = iter(series[name])
        return lambda: (next(runs), [[1, 2, 3]])
    best, summary = _hf.strongest({n: timed(n) for n in series}, rounds=3, seed=0)
    assert best == "b" and summary["chosen"] == "b"  # a has the lowest minimum, b the lowest median
    assert summary["seconds"]["a"] == {"min": 1.0, "median": 5.0}
    printed = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in printed if ln.strip() and ln.split()[0] in series] == ["a", "b", "c"]
    assert [ln.split()[0] for ln in printed if "<- the baseline" in ln] == ["b"]  # the choice is marked, once
    with pytest.raises(RuntimeError, match="disagree"):
        _hf.strongest({"x": lambda: (1.0, [[1]]), "y": lambda: (1.0, [[2]])}, rounds=3, seed=0)


@pytest.mark.reference
def test_every_transformers_configuration_generates_the_same_tokens():
    """The four configurations the benchmarks race (sdpa / eager attention, dynamic / static cache) are the same
    model: on the bundled checkpoint, a padded batch, each generates the same greedy tokens, exactly n of them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import _hf

    x = torch.tensor([[0, 0, 5, 17, 901], [3, 44, 1200, 7, 7]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    variants = _hf.generate_variants(REPO / "assets" / "target", x, mask, 6, threads=1)
    assert set(variants) == {f"{a}+{c}" for a, c in _hf.CONFIGS}
    outs = {name: run()[1] for name, run in variants.items()}
    first = outs["sdpa+dynamic"]
    assert len(first) == 2 and all(len(row) == 6 for row in first)
    assert all(out == first for out in outs.values())
