"""Verifying a speculated run of tokens so the output is distributed *exactly* as the target model's.

A proposer guesses ``k`` tokens ``d_1 … d_k`` after a request's last token; the target model then scores all
``k + 1`` positions in one call, giving ``p_1 … p_{k+1}`` (``p_i`` is the target's distribution for the token in
position ``i``, conditioned on the drafts before it). :func:`verify` walks the drafts left to right:

* **greedy** (temperature 0): accept ``d_i`` while it equals ``argmax p_i``; at the first mismatch emit
  ``argmax p_i`` instead and stop. The output is token for token what plain greedy decoding gives.
* **sampling** (Leviathan et al. 2023, Chen et al. 2023): accept ``d_i`` with probability
  ``min(1, p_i(d_i) / q_i(d_i))``, where ``q_i`` is the distribution the proposer drew ``d_i`` from. On the first
  rejection emit a token drawn from the *residual* ``normalise(max(p_i - q_i, 0))`` and stop. If all ``k`` are
  accepted, emit a *bonus* token drawn from ``p_{k+1}``.

Why it is exact: the probability of emitting ``x`` at position ``i`` is ``q(x)·min(1, p(x)/q(x))`` (drafted and
kept) plus ``P(reject)·residual(x)`` (resampled). The first term is ``min(q(x), p(x))``; the rejection
probability is ``Σ_y max(q(y) - p(y), 0) = Σ_y max(p(y) - q(y), 0)``, which is exactly the residual's normaliser,
so the second term is ``max(p(x) - q(x), 0)``. Together: ``min(p, q) + max(p - q, 0) = p(x)``.

A deterministic proposer (n-gram lookup) has ``q = one-hot(d_i)``: the draft is kept with probability ``p_i(d_i)``
and the residual is ``p_i`` with ``d_i`` removed.

Invariant: every call emits between 1 and ``k + 1`` tokens, the accepted drafts first; it draws only from the
request's own generator, so a seeded request is reproducible whatever it is batched with.

**What the engine runs for sampling: the drafter-invariant rule** (:func:`verify_coupled`). Rejection sampling's
output depends on *what was proposed*: a request that was preempted (no drafts in its resume step), or whose drafts
did not fit the step, would emit other tokens than the same request alone. The engine therefore fixes each
position's randomness first — exponential noise that is a function of (seed, position),
:meth:`minienv.sampling.Sampler.noise` — and lets the target's token be the Gumbel-max sample ``argmax(p / E)``; the
draft proposes ``argmax(q / E)`` with the same noise. Verification is then the greedy rule against the target's
sample, and the emitted text is the plain (k = 0) text whatever the drafts were. The price: a draft is kept with
probability ``P(argmax(p/E) = argmax(q/E))``, a little below rejection sampling's ``1 - TV(p, q)`` (measured on the
bundled models at temperature 0.8: 0.60 vs 0.65; Daliri, Musco & Suresh 2024 bound it below by
``(1 - TV) / (1 + TV)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VerifyResult:
    """What verification decided for one request in one step."""

    token_ids: list[int]  # the tokens to append: accepted drafts, then one resampled or bonus token
    num_draft_tokens: int  # k proposed
    num_accepted: int  # how many drafts were kept (0 … k)

    @property
    def accepted_per_position(self) -> list[bool]:
        return [i < self.num_accepted for i in range(self.num_draft_tokens)]


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from ``probs`` (float64, sums to > 0) by inverse CDF, as :class:`minienv.sampling.Sampler` does."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(probs) - 1))


def verify_coupled(draft_token_ids: list[int], target_probs: np.ndarray, noise: np.ndarray) -> VerifyResult:
    """The drafter-invariant rule (module docstring): ``noise`` is ``[k + 1, V]`` exponential noise of the ``k + 1``
    positions; the target's token at row ``i`` is ``argmax(target_probs[i] / noise[i])``, and a draft is kept while it
    equals that token. Returns what :func:`verify` returns."""
    k = len(draft_token_ids)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1 or noise.shape != target_probs.shape:
        raise ValueError(f"target_probs and noise must be [k + 1, V] = [{k + 1}, V], got {target_probs.shape} "
                         f"and {noise.shape}")
    best = np.argmax(target_probs / noise, axis=-1).tolist()
    for i, d in enumerate(draft_token_ids):
        if d != best[i]:
            return VerifyResult(best[:i + 1], k, i)
    return VerifyResult(list(draft_token_ids) + [best[k]], k, k)


def verify(draft_token_ids: list[int], target_probs: np.ndarray, draft_probs: np.ndarray | None,
           rng: np.random.Generator | None, greedy: bool) -> VerifyResult:
    """Accept a prefix of the drafts and emit the tokens a request appends this step.

    Args:
        draft_token_ids: the ``k`` proposed tokens (``k`` may be 0: then this is one plain decode step).
        target_probs: ``[k + 1, V]`` the target's distributions at the k + 1 positions, after the request's
            temperature / top-k / top-p (for greedy, any scores whose argmax is the target's choice).
        draft_probs: ``[k, V]`` the distributions the drafts were drawn from (same processing), or ``None`` for a
            deterministic proposer (one-hot ``q``).
        rng: the request's generator (unused when greedy).
        greedy: temperature 0.

    Returns:
        A :class:`VerifyResult`; ``token_ids`` has ``num_accepted + 1`` tokens.
    """
    k = len(draft_token_ids)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, V] = [{k + 1}, V], got shape {target_probs.shape}")
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {target_probs.shape[1]}], got {draft_probs.shape}")
    out: list[int] = []
    if greedy:
        best = np.argmax(target_probs, axis=-1).tolist()
        for i, d in enumerate(draft_token_ids):
            if d != best[i]:
                return VerifyResult(out + [best[i]], k, i)
            out.append(d)
        return VerifyResult(out + [best[k]], k, k)
    assert rng is not None, "sampling verification needs the request's generator"
    for i, d in enumerate(draft_token_ids):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        # accept with probability min(1, p/q); u < p/q  <=>  u·q < p (no division by a zero q)
        if rng.random() * q_d < p[d]:
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0; fall back to p
            residual = p
        return VerifyResult(out + [_draw(residual, rng)], k, i)
    return VerifyResult(out + [_draw(target_probs[k], rng)], k, k)
