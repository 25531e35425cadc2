"""Notebook 09's exercise: a quantile from histogram buckets, as PromQL's ``histogram_quantile`` computes it.

The check knows only expected numbers for fixed bucket lists (worked out by hand in the notebook) and, on a live
histogram, the exact quantile of the raw values: it never contains an implementation a student could copy. Each
rule it states has its own case, so a wrong answer is told which rule it broke.

Buckets are what Prometheus stores: ``[(le, cumulative_count), ...]`` sorted by ``le``, ``+Inf`` last.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

INF = float("inf")
Buckets = Sequence[tuple[float, float]]

#: (rule, q, buckets, expected)
CASES: tuple[tuple[str, float, list[tuple[float, float]], float], ...] = (
    # (order matters: each classic slip breaks its own rule first, so the message names the right one)
    ("the counts are cumulative: a bucket holds count(le) - count(previous le), not count(le)",
     0.9, [(0.01, 5), (0.02, 9), (0.04, 10), (INF, 10)], 0.02),
    ("interpolate linearly inside the bucket that holds rank q * total (between its lower and upper bound)",
     0.5, [(0.1, 2), (0.5, 10), (1.0, 10), (INF, 10)], 0.25),
    ("the first bucket's lower bound is 0",
     0.25, [(0.004, 8), (0.008, 8), (INF, 8)], 0.001),
    ("a rank that lands in the +Inf bucket gives the largest finite bound (the quantile is off the scale)",
     0.95, [(1.0, 3), (2.5, 9), (INF, 20)], 2.5),
    ("no observations: the quantile is NaN",
     0.9, [(0.1, 0), (INF, 0)], math.nan),
)


def _same(a: float, b: float) -> bool:
    if math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    return isinstance(a, (int, float)) and not math.isnan(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def check_quantile_from_buckets(fn: Callable[[float, Buckets], float], live_buckets: Buckets | None = None,
                                live_values: Sequence[float] | None = None, q: float = 0.9) -> str:
    """Run ``fn(q, buckets)`` on every rule's case (and on a live histogram if given); return a verdict.

    Raises AssertionError naming the rule a wrong answer broke. A stub that raises NotImplementedError gets
    "not implemented yet" back instead of an error, so the notebook still runs from top to bottom.
    """
    try:
        fn(0.5, [(1.0, 1), (INF, 1)])
    except NotImplementedError:
        return ("not implemented yet: write quantile_from_buckets(q, buckets) in the cell above, then run this "
                "cell again")
    for rule, qq, buckets, expected in CASES:
        try:
            got = fn(qq, list(buckets))
        except Exception as exc:  # noqa: BLE001 - a student's code: report which rule's case it failed on
            raise AssertionError(f"rule broken: {rule}. For q={qq} and buckets {buckets} your function raised "
                                 f"{type(exc).__name__}: {exc}") from exc
        assert _same(got, expected), (f"rule broken: {rule}. For q={qq} and buckets {buckets} the answer is "
                                      f"{expected}, got {got!r}")
    verdict = f"correct on all {len(CASES)} rules"
    if live_buckets is not None and live_values is not None:
        values = sorted(live_values)
        exact = values[max(0, math.ceil(q * len(values)) - 1)]
        est = fn(q, list(live_buckets))
        bounds = [0.0] + [le for le, _ in live_buckets]
        i = next(k for k in range(1, len(bounds)) if exact <= bounds[k])
        lo, hi = bounds[i - 1], bounds[i]
        if hi == INF:
            lo = hi = bounds[i - 1]
        assert lo - 1e-12 <= est <= hi + 1e-12, (
            f"on the live histogram: the exact p{q * 100:g} is {exact:.4g} s, in bucket ({lo:g}, {hi:g}], but your "
            f"estimate is {est!r}: an estimate from buckets must land in the bucket that holds the true value")
        verdict += (f"; live p{q * 100:g}: {est * 1e3:.2f} ms from the buckets vs {exact * 1e3:.2f} ms exact "
                    f"(bucket {lo * 1e3:g}–{hi * 1e3:g} ms)")
    return verdict


# ------------------------------------------------------------------------------------------------ exercise 2
#: (rule, samples, expected increase) — samples are (seconds, counter value), oldest first
INCREASE_CASES: tuple[tuple[str, list[tuple[float, float]], float | None], ...] = (
    ("without a reset, the increase is the last value minus the first",
     [(0.0, 10.0), (15.0, 14.0), (30.0, 21.0)], 11.0),
    ("a value lower than the one before is a reset: the counter restarted from 0, so the new value is all increase",
     [(0.0, 10.0), (15.0, 15.0), (30.0, 4.0), (45.0, 7.0)], 12.0),
    ("every reset in the window counts, not only the first",
     [(0.0, 5.0), (1.0, 8.0), (2.0, 2.0), (3.0, 6.0), (4.0, 1.0), (5.0, 4.0)], 13.0),
    ("fewer than two samples: no increase can be told (None)",
     [(0.0, 42.0)], None),
)


def check_increase(fn: Callable[[Sequence[tuple[float, float]]], float | None],
                   live_samples: Sequence[tuple[float, float]] | None = None,
                   live_expected: float | None = None) -> str:
    """Run ``fn(samples)`` (PromQL's ``increase`` without its extrapolation) on every rule's case, then on live
    samples of ``vllm:generation_tokens_total`` across an engine restart if given. Same contract as
    :func:`check_quantile_from_buckets`: "not implemented yet" for a stub, AssertionError naming a broken rule."""
    try:
        fn([(0.0, 1.0), (1.0, 2.0)])
    except NotImplementedError:
        return "not implemented yet: write increase(samples) in the cell above, then run this cell again"
    for rule, samples, expected in INCREASE_CASES:
        try:
            got = fn(list(samples))
        except Exception as exc:  # noqa: BLE001 - a student's code
            raise AssertionError(f"rule broken: {rule}. For samples {samples} your function raised "
                                 f"{type(exc).__name__}: {exc}") from exc
        ok = got is None if expected is None else (got is not None and _same(float(got), expected))
        assert ok, f"rule broken: {rule}. For samples {samples} the answer is {expected}, got {got!r}"
    verdict = f"correct on all {len(INCREASE_CASES)} rules"
    if live_samples is not None and live_expected is not None:
        got = fn(list(live_samples))
        assert got is not None and _same(float(got), live_expected), (
            f"on the live counter across an engine restart: {live_expected:g} tokens were generated in the window, "
            f"your increase says {got!r}")
        seconds = live_samples[-1][0] - live_samples[0][0]
        verdict += (f"; live: {got:g} tokens across the restart, rate = {got / seconds:.0f} tokens/s "
                    f"over {seconds:.2f} s")
    return verdict
