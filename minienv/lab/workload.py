"""Seeded synthetic request-length workloads (ShareGPT-like and Alpaca-like).

An inference engine's memory behaviour depends on *how long* requests are, not on what they say. This module
draws request lengths from documented long-tailed distributions, so notebooks and benchmarks can serve a
realistic mix of short and very long requests without shipping a dataset.

The distribution
----------------
Prompt and output lengths are drawn independently from **log-normal** distributions. A log-normal with
parameters ``(mu, sigma)`` has mean ``exp(mu + sigma**2 / 2)``, so for a target mean ``m`` and a chosen shape
``sigma`` we use ``mu = ln(m) - sigma**2 / 2``. Samples are rounded to integers and clipped:

* ``prompt_len`` to ``[1, max_len - 1]``;
* ``output_len`` to ``[1, max_len - prompt_len]`` so that ``prompt_len + output_len <= max_len``
  (the model's maximum sequence length; 2048 for OPT-13B in the vLLM paper).

Clipping removes a little of the upper tail, so sample means end slightly below the targets; the notebook
prints the means actually drawn.

The means come from the vLLM paper (Kwon et al., SOSP 2023, Fig. 11): ShareGPT has mean input 161.31 and mean
output 337.99 tokens; Alpaca 19.31 and 58.45. The paper publishes histograms, not fitted shapes, so the
``sigma`` values below are our choice (a long right tail, most requests well below the mean + a few near the
2048 limit), not fitted to the real traces.

Arrivals
--------
``rate=None`` puts every request at time 0 (an offline batch). A float ``rate`` (requests per second) draws
Poisson arrivals: exponential inter-arrival gaps with mean ``1 / rate``, as vLLM's benchmarks do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "RequestSpec",
    "LengthDistribution",
    "WorkloadConfig",
    "SHAREGPT",
    "ALPACA",
    "generate_workload",
    "sharegpt_like",
    "workload_stats",
]


@dataclass(frozen=True)
class RequestSpec:
    """One synthetic request: how many prompt tokens it brings, how many it will generate, when it arrives."""

    request_id: int
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0

    @property
    def total_len(self) -> int:
        """Tokens the request holds in the KV cache when it finishes (prompt + output)."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class LengthDistribution:
    """A log-normal length distribution given by its (pre-clipping) mean and its log-space std ``sigma``."""

    mean: float
    sigma: float

    def __post_init__(self) -> None:
        if not (isinstance(self.mean, (int, float)) and math.isfinite(self.mean) and self.mean >= 1):
            raise ValueError(f"mean length must be a finite number >= 1, got {self.mean!r}")
        if not (isinstance(self.sigma, (int, float)) and math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0, got {self.sigma!r}")

    @property
    def mu(self) -> float:
        """The log-space mean: ``ln(mean) - sigma**2 / 2`` so that the log-normal's mean is ``mean``."""
        return math.log(self.mean) - self.sigma**2 / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` raw (unclipped) integer lengths, each at least 1."""
        return np.maximum(1, np.rint(rng.lognormal(self.mu, self.sigma, size=n))).astype(np.int64)


@dataclass(frozen=True)
class WorkloadConfig:
    """A named pair of prompt/output length distributions."""

    name: str
    prompt: LengthDistribution
    output: LengthDistribution


#: ShareGPT-like: the paper's means (161.31 in / 337.99 out); sigmas are our choice (long tails).
SHAREGPT = WorkloadConfig("ShareGPT-like", LengthDistribution(161.31, 1.0), LengthDistribution(337.99, 0.9))
#: Alpaca-like: the paper's means (19.31 in / 58.45 out), shorter and less variable.
ALPACA = WorkloadConfig("Alpaca-like", LengthDistribution(19.31, 0.6), LengthDistribution(58.45, 0.7))


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def generate_workload(
    num_requests: int,
    config: WorkloadConfig = SHAREGPT,
    *,
    max_len: int = 2048,
    rate: float | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """Draw ``num_requests`` requests from ``config``; same arguments → same list.

    Args:
        num_requests: how many requests (>= 1).
        config: the length distributions (``SHAREGPT`` or ``ALPACA`` or your own).
        max_len: the model's maximum sequence length; every request has ``prompt_len + output_len <= max_len``.
        rate: ``None`` → every request arrives at time 0; a positive float → Poisson arrivals at that many
            requests per second (the first request arrives after one exponential gap, like a real trace).
        seed: seed of the ``numpy.random.Generator`` that draws everything.

    Raises:
        ValueError: on a non-positive count, a ``max_len`` below 2, a non-positive or non-finite rate.
    """
    n = _check_int("num_requests", num_requests, 1)
    max_len = _check_int("max_len", max_len, 2)
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"rate must be None (all at t=0) or a finite number > 0 requests/s, got {rate!r}")
    if not isinstance(config, WorkloadConfig):
        raise ValueError(f"config must be a WorkloadConfig, got {type(config).__name__}")
    rng = np.random.default_rng(seed)
    prompts = np.minimum(config.prompt.sample(rng, n), max_len - 1)
    outputs = np.minimum(config.output.sample(rng, n), max_len - prompts)
    if rate is None:
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    return [
        RequestSpec(request_id=i, prompt_len=int(p), output_len=int(o), arrival_time=float(t))
        for i, (p, o, t) in enumerate(zip(prompts, outputs, arrivals))
    ]


def sharegpt_like(num_requests: int, *, max_len: int = 2048, rate: float | None = None, seed: int = 0):
    """Shorthand for ``generate_workload(num_requests, SHAREGPT, ...)``."""
    return generate_workload(num_requests, SHAREGPT, max_len=max_len, rate=rate, seed=seed)


def workload_stats(requests: list[RequestSpec]) -> dict[str, float]:
    """Mean / median / p99 / max of prompt and output lengths, for printing next to the paper's means."""
    if not requests:
        raise ValueError("workload_stats needs at least one request")
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    stats: dict[str, float] = {"num_requests": float(len(requests))}
    for name, a in (("prompt", p), ("output", o)):
        stats[f"{name}_mean"] = float(a.mean())
        stats[f"{name}_median"] = float(np.median(a))
        stats[f"{name}_p99"] = float(np.percentile(a, 99))
        stats[f"{name}_max"] = float(a.max())
    return stats
