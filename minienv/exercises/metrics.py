"""Notebook 09's exercises: a quantile from histogram buckets (PromQL's ``histogram_quantile``) and a counter's
increase across restarts (PromQL's ``increase`` without its extrapolation).

The checks know only expected numbers for fixed cases (worked out by hand; one case per rule, ordered so that each
classic slip breaks its own rule first) and, on live data from the notebook's engines, the exact answer from the
raw values: they contain no implementation a student could copy.

Buckets are what Prometheus stores: ``[(le, cumulative_count), ...]`` sorted by ``le``, ``+Inf`` last.
"""

from __future__ import annotations

import math
from typing import Sequence

from minienv.exercises._check import exercise, require

INF = float("inf")

_INTERPOLATE = ("interpolate linearly inside the bucket that holds rank q * total, from its lower bound (the "
                "previous bucket's le, even when that bucket is empty) to its own le, at (rank - count below) / "
                "(its own observations)")
_FIRST_REACHING = ("a rank exactly equal to a bucket's cumulative count lies in that bucket (the first whose count "
                   ">= rank), even when empty buckets follow it")
_OFF_SCALE = ("a rank that lands in the +Inf bucket gives the largest finite bound (the quantile is off the scale), "
              "even when that bucket is empty")

#: (rule, q, buckets, expected) — one case per rule and one per edge of a rule, ordered so that each classic slip
#: breaks its own rule first
QUANTILE_CASES: tuple[tuple[str, float, list[tuple[float, float]], float], ...] = (
    ("the counts are cumulative: a bucket holds count(le) - count(previous le), not count(le)",
     0.9, [(0.01, 5), (0.02, 9), (0.04, 10), (INF, 10)], 0.02),
    (_INTERPOLATE, 0.5, [(0.1, 2), (0.5, 10), (1.0, 10), (INF, 10)], 0.25),
    # the edge: the bucket below the one that holds the rank is empty — its le is still the lower bound
    (_INTERPOLATE, 0.75, [(1.0, 4), (2.0, 4), (4.0, 8), (INF, 8)], 3.0),
    ("the first bucket's lower bound is 0",
     0.25, [(0.004, 8), (0.008, 8), (INF, 8)], 0.001),
    (_FIRST_REACHING, 0.5, [(1.0, 5), (2.0, 5), (3.0, 10), (INF, 10)], 1.0),
    (_FIRST_REACHING, 1.0, [(1.0, 3), (2.0, 10), (4.0, 10), (INF, 10)], 2.0),  # the edge: q = 1, rank = total
    (_OFF_SCALE, 0.95, [(1.0, 3), (2.5, 9), (INF, 20)], 2.5),
    (_OFF_SCALE, 0.9, [(1.0, 2), (2.0, 2), (INF, 10)], 2.0),  # the edge: the largest finite bucket is empty
    ("no observations: the quantile is NaN",
     0.9, [(0.1, 0), (INF, 0)], math.nan),
)

_RESET = "a value lower than the one before is a reset: the counter restarted from 0, so the new value is all increase"
_EVERY_RESET = ("every reset in the window counts, not only the first — each drop compared with the sample just "
                "before it")

#: (rule, samples, expected increase) — samples are (seconds, counter value), oldest first
INCREASE_CASES: tuple[tuple[str, list[tuple[float, float]], float | None], ...] = (
    ("without a reset, the increase is the last value minus the first",
     [(0.0, 10.0), (15.0, 14.0), (30.0, 21.0)], 11.0),
    ("two samples are enough: their difference",
     [(0.0, 3.0), (1.0, 7.0)], 4.0),
    ("an equal value is not a reset: a flat stretch adds nothing",
     [(0.0, 5.0), (1.0, 5.0), (2.0, 5.0), (3.0, 6.0)], 1.0),
    (_RESET, [(0.0, 10.0), (15.0, 15.0), (30.0, 4.0), (45.0, 7.0)], 12.0),
    (_RESET, [(0.0, 9.0), (1.0, 2.0), (2.0, 5.0)], 5.0),  # the edge: a reset between the first two samples
    (_RESET, [(0.0, 6.0), (1.0, 0.0), (2.0, 3.0)], 3.0),  # the edge: restarted and read before its first count
    (_EVERY_RESET, [(0.0, 5.0), (1.0, 8.0), (2.0, 2.0), (3.0, 6.0), (4.0, 1.0), (5.0, 4.0)], 13.0),
    (_EVERY_RESET, [(0.0, 9.0), (1.0, 5.0), (2.0, 2.0), (3.0, 4.0)], 9.0),  # the edge: two resets in a row
    ("fewer than two samples: no increase can be told (None)",
     [(0.0, 42.0)], None),
)


def _same(a: object, b: float) -> bool:
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        return False
    if math.isnan(b):
        return math.isnan(a)
    return not math.isnan(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@exercise("write quantile_from_buckets(q, buckets): PromQL's histogram_quantile on cumulative buckets")
def check_quantile_from_buckets(fn, live_buckets: Sequence[tuple[float, float]] | None = None,
                                live_values: Sequence[float] | None = None, q: float = 0.9) -> str:
    """``fn(q, buckets)`` on one case per rule, then (if given) on a live histogram, whose estimate must land in
    the bucket that holds the exact quantile of the raw values."""
    for rule, qq, buckets, expected in QUANTILE_CASES:
        fn.rule = rule
        got = fn(qq, list(buckets))
        require(_same(got, expected), rule, f"q={qq}, buckets {buckets}: the answer is {expected}, got {got!r}")
    rules = len({case[0] for case in QUANTILE_CASES})
    verdict = (f"quantile_from_buckets is histogram_quantile on all {rules} rules "
               f"({len(QUANTILE_CASES)} cases, edges included)")
    if live_buckets is not None and live_values is not None:
        rule = "an estimate from buckets lands in the bucket that holds the true value"
        fn.rule = rule
        values = sorted(live_values)
        exact = values[max(0, math.ceil(q * len(values)) - 1)]
        est = fn(q, list(live_buckets))
        bounds = [0.0] + [le for le, _ in live_buckets]
        i = next(k for k in range(1, len(bounds)) if exact <= bounds[k])
        lo, hi = bounds[i - 1], bounds[i]
        if hi == INF:
            lo = hi = bounds[i - 1]
        require(isinstance(est, (int, float)) and lo - 1e-12 <= est <= hi + 1e-12, rule,
                f"on the live histogram the exact p{q * 100:g} is {exact:.4g} s, in bucket ({lo:g}, {hi:g}], "
                f"your estimate is {est!r}")
        verdict += (f"; live p{q * 100:g}: {est * 1e3:.2f} ms from the buckets vs {exact * 1e3:.2f} ms exact "
                    f"(bucket {lo * 1e3:g}–{hi * 1e3:g} ms)")
    return verdict


@exercise("write increase(samples): how much a counter grew over [(seconds, value), ...], resets included",
          none_ok=True)
def check_increase(fn, live_samples: Sequence[tuple[float, float]] | None = None,
                   live_expected: float | None = None) -> str:
    """``fn(samples)`` on one case per rule, then (if given) live samples of ``vllm:generation_tokens_total``
    across an engine restart."""
    for rule, samples, expected in INCREASE_CASES:
        fn.rule = rule
        got = fn(list(samples))
        ok = got is None if expected is None else (got is not None and _same(got, expected))
        require(ok, rule, f"samples {samples}: the answer is {expected}, got {got!r}")
    rules = len({case[0] for case in INCREASE_CASES})
    verdict = f"increase handles all {rules} rules ({len(INCREASE_CASES)} cases, edges included)"
    if live_samples is not None and live_expected is not None:
        rule = "on a live counter across an engine restart, the increase is every token generated in the window"
        fn.rule = rule
        got = fn(list(live_samples))
        require(got is not None and _same(got, live_expected), rule,
                f"{live_expected:g} tokens were generated in the window, your increase says {got!r}")
        seconds = live_samples[-1][0] - live_samples[0][0]
        verdict += (f"; live: {got:g} tokens across the restart, rate = {got / seconds:.0f} tokens/s "
                    f"over {seconds:.2f} s")
    return verdict
