"""Turning logits into the next token: greedy, temperature, top-k, top-p — seeded per request.

``SamplingParams`` is shaped like vLLM's (``temperature=0`` means greedy; ``top_k`` 0 or -1 means off) and checks
its values when it is built, so a bad value fails at the call site rather than as a NaN several steps later.
Each request gets its own :class:`Sampler` holding its own ``np.random.Generator``: a sampled run with a seed is
reproducible however many other requests are batched beside it (vLLM does the same with per-request generators).

A speculating engine draws differently (:meth:`Sampler.coupled_sample`): the token at position ``i`` is the
Gumbel-max sample ``argmax(p / E)`` with exponential noise ``E`` that is a function of (seed, ``i``) only. The draft
model samples its proposal for ``i`` with the *same* noise, so verification keeps a draft exactly when it equals
the target's own sample: the text is the same whatever was proposed, preempted or retried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class SamplingTypeError(TypeError, ValueError):
    """A sampling parameter of the wrong type. Both a TypeError and a ValueError, so ``except ValueError`` around
    user input catches every bad sampling value."""


def _as_float(name: str, value: object) -> float:
    """``value`` as a float for range checks; an int too large for a float counts as infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise SamplingTypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    max_tokens: most tokens to generate (>= 1).
    temperature: 0 = greedy (argmax); otherwise logits are divided by it before the softmax. As it tends to 0 the
        distribution tends to the argmax (uniform over exact ties), and a tiny positive temperature gives exactly
        that limit: see :func:`scale_logits`.
    top_k: keep only the k most likely tokens (0 or -1 = off).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = off).
    seed: seeds this request's random generator; None draws fresh entropy.
    stop: a string or list of strings; generation stops once the output text contains one.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)):
            raise SamplingTypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        temperature = _as_float("temperature", self.temperature)
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise SamplingTypeError(f"top_k must be an int (0 or -1 = off), got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive int, got {self.top_k}")
        top_p = _as_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise SamplingTypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise SamplingTypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise SamplingTypeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = stops

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Set every logit outside the k largest (per row) to -inf. Ties at the boundary are kept."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[..., -k, None]
    return np.where(logits < kth, -np.inf, logits)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest prefix of tokens, most likely first, whose probability mass reaches ``p``; -inf the rest.

    The most likely token is always kept. Vectorized: one sort, one cumulative sum, one scatter.
    """
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1, kind="stable")
    sorted_logits = np.take_along_axis(logits, order, axis=-1)
    probs = softmax(sorted_logits)
    # a token is dropped if the mass *before* it already reaches p
    mass_before = np.cumsum(probs, axis=-1) - probs
    drop_sorted = mass_before >= p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, logits)


def scale_logits(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``(logits - max) / temperature`` in float64: after a softmax, the same distribution as ``logits / temperature``.

    Subtracting the row maximum *before* dividing keeps every entry <= 0 with the maxima exactly 0, so dividing by
    a tiny temperature sends the other entries to -inf (probability 0) instead of sending the maxima to +inf
    (``inf - inf`` = NaN in the softmax). Any positive temperature therefore gives a valid distribution, and as
    ``temperature -> 0+`` it is the limit: all mass on the argmax, split evenly among exact ties.
    """
    x = np.asarray(logits, dtype=np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # -large / tiny -> -inf is the intended result
        return z / temperature


def check_logits(logits: np.ndarray) -> None:
    """Every row needs a finite maximum: a NaN, a +inf or an all -inf row has no distribution to sample from."""
    top = np.max(logits, axis=-1)
    if not np.isfinite(top).all():
        raise ValueError(
            "logits contain NaN or +inf, or a row that is all -inf; there is no distribution to sample from"
        )


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class Sampler:
    """Picks tokens for one request; owns that request's random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._rng: np.random.Generator | None = None
        self._entropy: int | None = params.seed  # the key of the coupled draws (fresh entropy when unseeded)

    @property
    def rng(self) -> np.random.Generator:
        """The request's generator, made on first use: a greedy request never draws, and seeding one from the OS
        (``seed=None``) costs more than a decode step's bookkeeping. A seed gives the same stream either way."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.params.seed)
        return self._rng

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the sampler draws from, after temperature, top-k and top-p (float64)."""
        p = self.params
        x = np.asarray(logits, dtype=np.float64)
        check_logits(x)
        if p.greedy:
            out = np.zeros_like(x)
            np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
            return out
        x = apply_top_k(scale_logits(x, p.temperature), p.top_k)
        x = apply_top_p(x, p.top_p)
        return softmax(x)

    def sample(self, logits: np.ndarray) -> int | np.ndarray:
        """Next token for logits ``[vocab]`` (-> int) or ``[B, vocab]`` (-> ``[B]`` ints, same params)."""
        x = np.asarray(logits)
        if self.params.greedy:
            check_logits(x)
            out = np.argmax(x, axis=-1)
        else:
            probs = self.probs(x)
            # inverse-CDF sampling: one uniform per row, vectorized over the batch
            u = self.rng.random(probs.shape[:-1] + (1,))
            cdf = np.cumsum(probs, axis=-1)
            out = np.minimum((cdf < u * cdf[..., -1:]).sum(axis=-1), probs.shape[-1] - 1)
        return int(out) if np.ndim(out) == 0 else out


    def noise(self, position: int, size: int) -> np.ndarray:
        """Exponential noise ``E`` for the token at ``position``: a function of (seed, position) only — never of how
        many draws came before, so a preempted, re-proposed or retried step draws the same."""
        if self._entropy is None:
            self._entropy = int(np.random.SeedSequence().entropy)  # once: an unseeded request is still consistent
        return np.random.default_rng([self._entropy, int(position)]).standard_exponential(size)

    def coupled_sample(self, probs: np.ndarray, position: int) -> int:
        """The Gumbel-max sample ``argmax(probs / E)`` (exactly distributed as ``probs``) with :meth:`noise`'s ``E``
        for ``position``: two models that sample one position with this share its noise (Daliri, Musco & Suresh,
        "Coupling without Communication and Drafter-Invariant Speculative Decoding", 2024)."""
        return int(np.argmax(probs / self.noise(position, probs.shape[-1])))


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit (the token greedy decoding picks)."""
    return int(np.argmax(logits))
