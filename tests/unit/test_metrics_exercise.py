"""Notebook 09's exercises (minienv/exercises/metrics.py): the checks pass the solutions, say "not implemented yet"
to the stub, and reject a wrong answer for every rule they state, naming that rule."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from minienv.exercises import NOT_IMPLEMENTED, PASSED, ExerciseFailed
from minienv.exercises.metrics import INCREASE_CASES, QUANTILE_CASES, check_quantile_from_buckets, check_increase

REPO = Path(__file__).resolve().parents[2]


def _solution():
    spec = importlib.util.spec_from_file_location("solutions_09_metrics", REPO / "solutions" / "09_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quantile_from_buckets


def _wrong(*, cumulative=True, interpolate=True, first_lower_zero=True, inf_ok=True, empty_nan=True,
           strictly_above=False):
    def fn(q, buckets):
        counts = [c for _, c in buckets]
        if not cumulative:  # treats each count as the bucket's own
            counts = [sum(counts[: i + 1]) for i in range(len(counts))]
        total = counts[-1]
        if total == 0 and empty_nan:
            return math.nan
        rank = q * total
        lower, below = (0.0 if first_lower_zero else buckets[0][0]), 0.0
        for (le, _), count in zip(buckets, counts, strict=True):
            if (count > rank if strictly_above else count >= rank):
                if le == math.inf:
                    return lower if inf_ok else math.inf
                if not interpolate:
                    return le
                return lower + (le - lower) * (rank - below) / (count - below)
            lower, below = le, count
        return math.nan
    return fn


def test_the_solution_passes_including_a_live_histogram(capsys):
    values = [0.0012, 0.003, 0.004, 0.0045, 0.006, 0.009, 0.011, 0.015, 0.03, 0.07]
    bounds = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, math.inf]
    buckets = [(le, sum(v <= le for v in values)) for le in bounds]
    assert check_quantile_from_buckets(_solution(), buckets, values) == PASSED
    out = capsys.readouterr().out
    rules = len({case[0] for case in QUANTILE_CASES})
    assert out.startswith(f"✓ quantile_from_buckets is histogram_quantile on all {rules} rules "
                          f"({len(QUANTILE_CASES)} cases, edges included)")
    assert "live p90" in out


def test_the_stub_is_not_implemented_yet_and_does_not_raise():
    def stub(q, buckets):
        raise NotImplementedError
    assert check_quantile_from_buckets(stub) == NOT_IMPLEMENTED


@pytest.mark.parametrize("wrong, rule", [
    (_wrong(cumulative=False), "cumulative"),
    (_wrong(interpolate=False), "interpolate linearly"),
    (_wrong(first_lower_zero=False), "first bucket's lower bound is 0"),
    (_wrong(inf_ok=False), "+Inf bucket"),
    (_wrong(empty_nan=False), "no observations"),
    (_wrong(strictly_above=True), "a rank exactly equal to a bucket's cumulative count"),
    (lambda q, b: b[-1][0], "cumulative"),  # always the last bound
    (lambda q, b: b[0][0] / b[0][1], "cumulative"),  # crashes with ZeroDivisionError on the empty histogram
])
def test_each_rule_rejects_its_wrong_answer_by_name(wrong, rule):
    with pytest.raises(ExerciseFailed) as info:
        check_quantile_from_buckets(wrong)
    first = str(info.value).splitlines()[0]
    assert first.startswith("✗ ") and rule in first, str(info.value)


def test_a_live_estimate_outside_the_true_bucket_is_rejected():
    values = [0.002] * 9 + [0.03]
    bounds = [0.001, 0.005, 0.01, 0.02, 0.04, math.inf]
    buckets = [(le, sum(v <= le for v in values)) for le in bounds]
    sol = _solution()

    def off_by_a_bucket(q, b):
        return sol(q, b) if len(b) <= 5 else 0.03  # right on the fixed cases, wrong bucket on the live one

    with pytest.raises(ExerciseFailed, match="lands in the bucket that holds the true value"):
        check_quantile_from_buckets(off_by_a_bucket, buckets, values)


# ------------------------------------------------------------------------------------------------ exercise 2


def _solution_increase():
    spec = importlib.util.spec_from_file_location("solutions_09_metrics", REPO / "solutions" / "09_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.increase


def test_increase_solution_passes_including_live_samples_across_a_restart(capsys):
    live = [(0.0, 100.0), (0.5, 140.0), (1.0, 180.0), (1.5, 12.0), (2.0, 50.0)]  # restart between 1.0 and 1.5
    assert check_increase(_solution_increase(), live, 80.0 + 12.0 + 38.0) == PASSED
    out = capsys.readouterr().out
    rules = len({case[0] for case in INCREASE_CASES})
    assert out.startswith(f"✓ increase handles all {rules} rules ({len(INCREASE_CASES)} cases, edges included)")
    assert "across the restart" in out


def test_increase_stub_is_not_implemented_yet():
    def stub(samples):
        raise NotImplementedError
    assert check_increase(stub) == NOT_IMPLEMENTED


def _single_reset(samples):
    if len(samples) < 2:
        return None
    values = [v for _, v in samples]
    drop = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    return values[-1] - values[0] + (values[drop - 1] if drop else 0)


@pytest.mark.parametrize("wrong, rule", [
    (lambda s: s[-1][1] - s[0][1] if len(s) > 1 else None, "is a reset"),  # ignores resets
    (lambda s: sum(max(0.0, b[1] - a[1]) for a, b in zip(s, s[1:])) if len(s) > 1 else None, "is a reset"),
    (lambda s: max(v for _, v in s) - min(v for _, v in s) if len(s) > 1 else None, "is a reset"),  # spread
    (_single_reset, "every reset"),
    (lambda s: _solution_increase()(s) if len(s) > 1 else 0.0, "fewer than two samples"),
    (lambda s: (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]), "last value minus the first"),  # a rate, not increase
    (lambda s: _solution_increase()(s) if len(s) > 2 else None, "two samples are enough"),
    (lambda s: sum(b[1] - a[1] if b[1] > a[1] else b[1] for a, b in zip(s, s[1:])) if len(s) > 1 else None,
     "an equal value is not a reset"),
    (lambda s: s[1][1] - s[0][1] + _solution_increase()(s[1:]) if len(s) > 2 else 1 / 0, "two samples are enough"),
])
def test_increase_rejects_each_wrong_answer_by_rule(wrong, rule):
    with pytest.raises(ExerciseFailed) as info:
        check_increase(wrong)
    assert rule in str(info.value).splitlines()[0], str(info.value)


def test_increase_live_mismatch_is_rejected():
    sol = _solution_increase()
    with pytest.raises(ExerciseFailed, match="across an engine restart"):
        check_increase(lambda s: sol(s) if len(s) != 5 else 0.0, [(0, 1), (1, 2), (2, 0), (3, 1), (4, 5)], 6.0)
