"""Notebook 12's exercise checks: the solutions pass, each wrong answer fails with the rule it breaks, the stubs
say "not implemented yet"."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from minienv.exercises import NOT_IMPLEMENTED, PASSED, ExerciseFailed
from minienv.exercises.speculative_decoding import check_accept_step, check_ngram

REPO = Path(__file__).resolve().parents[2]


def _solutions():
    spec = importlib.util.spec_from_file_location("sol12", REPO / "solutions" / "12_speculative_decoding.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SOL = _solutions()


def _draw(w, rng):
    cdf = np.cumsum(w)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def no_bonus(drafts, p, q, rng):
    out = SOL.accept_step(drafts, p, q, rng)
    return out[:-1] if len(out) == len(drafts) + 1 else out


def always_keep(drafts, p, q, rng):
    return list(drafts) + [_draw(p[len(drafts)], rng)]


def keep_if_p_at_least_q(drafts, p, q, rng):  # deterministic: the "larger probability wins" misreading
    out = []
    for i, d in enumerate(drafts):
        if p[i, d] >= q[i, d]:
            out.append(d)
            continue
        return out + [_draw(np.maximum(p[i] - q[i], 0), rng)]
    return out + [_draw(p[len(drafts)], rng)]


def residual_forgotten(drafts, p, q, rng):
    out = []
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] < p[i, d]:
            out.append(d)
            continue
        return out + [_draw(p[i], rng)]
    return out + [_draw(p[len(drafts)], rng)]


def bonus_from_position_k(drafts, p, q, rng):
    out = SOL.accept_step(drafts, p, q, rng)
    if len(out) == len(drafts) + 1 and drafts:
        out[-1] = _draw(p[len(drafts) - 1], rng)
    return out


def accept_by_ratio_without_min(drafts, p, q, rng):  # p/q > 1 counted as... a coin at q/p: wrong for p > q
    out = []
    for i, d in enumerate(drafts):
        ratio = p[i, d] / q[i, d]
        if rng.random() < (ratio if ratio <= 1 else 1 / ratio):
            out.append(d)
            continue
        return out + [_draw(np.maximum(p[i] - q[i], 0), rng)]
    return out + [_draw(p[len(drafts)], rng)]


@pytest.mark.parametrize("wrong, rule", [
    (no_bonus, "followed by exactly one token"),
    (always_keep, "p = 0 means never"),
    (keep_if_p_at_least_q, "distributed exactly as the target's"),
    (residual_forgotten, "not from p"),
    (bonus_from_position_k, "bonus from p at position k + 1"),
    (accept_by_ratio_without_min, "p >= q means always"),
])
def test_accept_step_wrong_answers_fail_with_their_rule(wrong, rule):
    with pytest.raises(ExerciseFailed, match=re.escape(rule)):
        check_accept_step(wrong)


def test_accept_step_solution_and_stub():
    assert check_accept_step(SOL.accept_step) == PASSED

    def stub(drafts, target_probs, draft_probs, rng):
        raise NotImplementedError

    assert check_accept_step(stub) == NOT_IMPLEMENTED


def ngram_shortest_first(tokens, k, lo, hi):
    t = len(tokens)
    for n in range(lo, min(hi, t - 1) + 1):
        for s in range(t - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[t - n:]:
                return tokens[s + n:s + n + k]
    return []


def ngram_earliest(tokens, k, lo, hi):
    t = len(tokens)
    for n in range(min(hi, t - 1), lo - 1, -1):
        for s in range(0, t - n):
            if tokens[s:s + n] == tokens[t - n:]:
                return tokens[s + n:s + n + k]
    return []


def ngram_ignores_min_n(tokens, k, lo, hi):
    return SOL.propose(tokens, k, 1, hi)


def ngram_no_k_limit(tokens, k, lo, hi):
    return SOL.propose(tokens, 100, lo, hi)


def ngram_none_when_missing(tokens, k, lo, hi):
    return SOL.propose(tokens, k, lo, hi) or None


def ngram_no_overlap(tokens, k, lo, hi):  # requires the match to end before the suffix starts
    t = len(tokens)
    for n in range(min(hi, t - 1), lo - 1, -1):
        for s in range(t - 2 * n, -1, -1):
            if tokens[s:s + n] == tokens[t - n:]:
                return tokens[s + n:s + n + k]
    return []


@pytest.mark.parametrize("wrong, rule", [
    (ngram_shortest_first, "longest n first"),
    (ngram_earliest, "most recent wins"),
    (ngram_ignores_min_n, "below min_n"),
    (ngram_no_k_limit, "at most k"),
    (ngram_none_when_missing, r"no match: propose nothing"),
    (ngram_no_overlap, "may overlap the suffix"),
])
def test_ngram_wrong_answers_fail_with_their_rule(wrong, rule):
    with pytest.raises(ExerciseFailed, match=re.escape(rule)):
        check_ngram(wrong)


def test_ngram_solution_and_stub():
    assert check_ngram(SOL.propose) == PASSED

    def stub(token_ids, k, min_n, max_n):
        raise NotImplementedError

    assert check_ngram(stub) == NOT_IMPLEMENTED
