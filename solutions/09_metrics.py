"""Solutions to notebook 09_metrics's exercises (kept out of the notebook; tests/unit/test_metrics_exercise.py runs
the notebook's check on them)."""

from __future__ import annotations

import math


def quantile_from_buckets(q, buckets):
    """PromQL's ``histogram_quantile(q, ...)`` on cumulative buckets ``[(le, count), ...]``, ``+Inf`` last."""
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == math.inf:
                return lower  # off the scale: the largest finite bound is all the buckets can say
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    raise ValueError("the last bucket must be +Inf and hold every observation")


def increase(samples):
    """PromQL's ``increase`` over ``[(t, value), ...]`` without extrapolation: counter resets handled."""
    if len(samples) < 2:
        return None
    total = 0.0
    for (_, before), (_, after) in zip(samples, samples[1:]):
        total += after - before if after >= before else after  # a drop: restarted from 0
    return total
