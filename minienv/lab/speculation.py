"""A world small enough to enumerate, for checking that speculative sampling keeps the target's distribution.

The target and the draft are bigram "models" over a vocabulary of ``V`` tokens: ``P[a]`` (target) and ``Q[a]``
(draft) are the next-token distributions after token ``a``. The exact joint distribution of the first ``L``
generated tokens is a product of table entries, so ``V ** L`` outcomes can be listed with their probabilities.
:func:`chi_square_check` draws many speculative samples with a given verification function and compares their
histogram with that exact joint: Pearson's chi-square against the critical value at significance ``alpha``
(Wilson–Hilferty's approximation of the chi-square quantile). A correct verifier passes with probability
``1 - alpha``; the test seeds the draws, so the verdict is the same on every run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from minienv.spec_decode.rejection import VerifyResult, verify

Verifier = Callable[..., VerifyResult]  # same signature as minienv.spec_decode.rejection.verify

#: standard normal quantiles for the significance levels the checks use
_Z = {0.01: 2.326347874, 0.001: 3.090232306, 1e-4: 3.719016485}


@dataclass(frozen=True)
class BigramWorld:
    P: np.ndarray  # [V, V] target: P[a, b] = p(next = b | last = a)
    Q: np.ndarray  # [V, V] draft

    @classmethod
    def make(cls, vocab_size: int = 4, seed: int = 0, concentration: float = 1.0) -> "BigramWorld":
        rng = np.random.default_rng(seed)
        P = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
        Q = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
        return cls(P, Q)

    @property
    def vocab_size(self) -> int:
        return self.P.shape[0]

    def exact_joint(self, length: int, start: int = 0) -> dict[tuple[int, ...], float]:
        """Probability of every sequence of ``length`` tokens after ``start`` under the target."""
        out = {}
        for seq in itertools.product(range(self.vocab_size), repeat=length):
            prob, last = 1.0, start
            for t in seq:
                prob, last = prob * self.P[last, t], t
            out[seq] = prob
        return out


def speculative_sequence(world: BigramWorld, verifier: Verifier, k: int, length: int, rng: np.random.Generator,
                         proposer: str = "draft", start: int = 0) -> tuple[tuple[int, ...], int]:
    """Generate ``length`` tokens by propose-then-verify steps; returns (tokens, number of target calls).

    ``proposer="draft"`` samples drafts from ``Q``; ``"ngram"`` proposes deterministically (``(last + 1) % V``,
    a one-hot ``q``), as prompt lookup does.
    """
    V = world.vocab_size
    seq: list[int] = []
    calls = 0
    while len(seq) < length:
        last = seq[-1] if seq else start
        drafts: list[int] = []
        qs = []
        for _ in range(k):
            if proposer == "draft":
                q = world.Q[last]
                d = int(rng.choice(V, p=q))
                qs.append(q)
            else:
                d = (last + 1) % V
            drafts.append(d)
            last = d
        context = [seq[-1] if seq else start] + drafts
        target = np.stack([world.P[c] for c in context])  # p at positions 1 … k+1
        result = verifier(drafts, target, np.stack(qs) if proposer == "draft" else None, rng, False)
        calls += 1
        seq.extend(result.token_ids)
    return tuple(seq[:length]), calls


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    dof: int
    critical: float
    alpha: float
    num_samples: int
    target_calls_per_token: float
    #: how often each token came out first, over the samples (``first_token[t]`` for token ``t``): set beside the
    #: target's ``P[start]`` it shows *which* tokens a wrong verifier over- or under-produces
    first_token: tuple[float, ...] = ()

    @property
    def passed(self) -> bool:
        return self.statistic <= self.critical

    def __str__(self) -> str:
        verdict = "consistent with" if self.passed else "NOT consistent with"
        return (f"chi-square {self.statistic:.1f} vs critical {self.critical:.1f} (dof {self.dof}, alpha "
                f"{self.alpha:g}, {self.num_samples} samples): {verdict} the target's distribution")


def chi_square_critical(dof: int, alpha: float) -> float:
    """Upper ``alpha`` quantile of chi-square(dof), Wilson–Hilferty (within ~1 % for dof >= 10)."""
    z = _Z[alpha]
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def pearson_statistic(counts: dict, probs: dict, num_samples: int) -> tuple[float, int]:
    """Pearson's chi-square of observed ``counts`` against exact ``probs`` (same keys); returns (statistic, dof).

    Cells expected to hold fewer than 5 samples are pooled into one, as the test's chi-square approximation needs.
    """
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, prob in probs.items():
        exp = prob * num_samples
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + exp
        else:
            stat += (counts.get(key, 0) - exp) ** 2 / exp
            cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


def chi_square_check(verifier: Verifier = verify, *, world: BigramWorld | None = None, k: int = 2,
                     length: int = 3, num_samples: int = 20_000, seed: int = 0, proposer: str = "draft",
                     alpha: float = 0.001) -> ChiSquareResult:
    """Sample ``num_samples`` sequences speculatively and test them against the exact target joint."""
    world = world or BigramWorld.make()
    rng = np.random.default_rng(seed)
    joint = world.exact_joint(length)
    counts = dict.fromkeys(joint, 0)
    calls = 0
    for _ in range(num_samples):
        seq, c = speculative_sequence(world, verifier, k, length, rng, proposer)
        counts[seq] += 1
        calls += c
    stat, dof = pearson_statistic(counts, joint, num_samples)
    first = [0] * world.vocab_size
    for seq, n in counts.items():
        first[seq[0]] += n
    return ChiSquareResult(stat, dof, chi_square_critical(dof, alpha), alpha, num_samples,
                           calls / (num_samples * length), tuple(n / num_samples for n in first))


def residual_forgotten(drafts: list[int], target_probs: np.ndarray, draft_probs: np.ndarray,
                       rng: np.random.Generator, greedy: bool = False) -> VerifyResult:
    """Broken on purpose, the classic bug notebook 12 shows by its output: on rejection it draws the fix-up token
    from ``p`` instead of the residual ``normalise(max(p - q, 0))``. A token the draft proposes is then emitted both
    as a kept draft and again from ``p``, so tokens with ``q > p`` come out too often."""
    for i, d in enumerate(drafts):
        if rng.random() * draft_probs[i, d] < target_probs[i, d]:
            continue
        return VerifyResult(list(drafts[:i]) + [_sample(target_probs[i], rng)], len(drafts), i)
    return VerifyResult(list(drafts) + [_sample(target_probs[-1], rng)], len(drafts), len(drafts))


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))
