"""Speculative decoding's verification rule and n-gram proposer, checked against exact distributions."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.lab.speculation import BigramWorld, chi_square_check, chi_square_critical
from minienv.spec_decode.ngram import NgramProposer
from minienv.spec_decode.rejection import VerifyResult, _draw, verify


# ---------------------------------------------------------------- planted bugs (each a classic mistake)
def always_accept(drafts, target, draft_probs, rng, greedy):
    """Keeps every draft: the output follows the draft model, not the target."""
    return VerifyResult(list(drafts) + [_draw(target[len(drafts)], rng)], len(drafts), len(drafts))


def forget_residual(drafts, target, draft_probs, rng, greedy):
    """On rejection, resamples from p instead of normalise(max(p - q, 0)): over-weights tokens q likes."""
    out = []
    for i, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else draft_probs[i, d]
        if rng.random() * q_d < target[i, d]:
            out.append(d)
            continue
        return VerifyResult(out + [_draw(target[i], rng)], len(drafts), i)
    return VerifyResult(out + [_draw(target[-1], rng)], len(drafts), len(drafts))


def bonus_from_last_draft_position(drafts, target, draft_probs, rng, greedy):
    """Draws the bonus token from p_k (the last draft's position) instead of p_{k+1}: an off-by-one."""
    r = verify(drafts, target, draft_probs, rng, greedy)
    if r.num_accepted == len(drafts) and drafts:
        return VerifyResult(r.token_ids[:-1] + [_draw(target[len(drafts) - 1], rng)], len(drafts), len(drafts))
    return r


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_samples_follow_the_target_distribution(proposer, k):
    result = chi_square_check(verify, k=k, proposer=proposer, seed=k)
    assert result.passed, str(result)


@pytest.mark.parametrize("bug", [always_accept, forget_residual, bonus_from_last_draft_position])
def test_chi_square_catches_planted_bugs(bug):
    result = chi_square_check(bug, k=2, proposer="draft", seed=0)
    assert not result.passed, f"{bug.__name__} should be caught: {result}"


def test_chi_square_catches_forgotten_residual_with_ngram_drafts():
    # with a one-hot q the residual is p without the draft: resampling from p can re-emit the rejected draft
    assert not chi_square_check(forget_residual, k=2, proposer="ngram", seed=0).passed


def test_critical_value_matches_tables():
    # chi-square upper 0.1 % points from standard tables
    for dof, table in [(10, 29.588), (36, 67.985), (63, 103.442)]:
        assert chi_square_critical(dof, 0.001) == pytest.approx(table, rel=0.01)


def test_every_verification_emits_accepted_plus_one():
    world = BigramWorld.make(vocab_size=5, seed=3)
    rng = np.random.default_rng(0)
    for _ in range(500):
        k = int(rng.integers(0, 5))
        drafts = [int(x) for x in rng.integers(0, 5, k)]
        target = world.P[rng.integers(0, 5, k + 1)]
        q = world.Q[rng.integers(0, 5, k)] if rng.random() < 0.5 else None
        r = verify(drafts, target, q, rng, greedy=False)
        assert len(r.token_ids) == r.num_accepted + 1
        assert r.token_ids[:r.num_accepted] == drafts[:r.num_accepted]
        assert 0 <= r.num_accepted <= k


def test_greedy_accepts_while_draft_equals_argmax_then_emits_the_argmax():
    target = np.array([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]])
    assert verify([1, 0, 2], target, None, None, True).token_ids == [1, 0, 2, 1]  # all kept + bonus
    r = verify([1, 2, 2], target, None, None, True)
    assert (r.token_ids, r.num_accepted) == ([1, 0], 1)  # second draft wrong: the target's argmax instead
    r = verify([0, 0, 2], target, None, None, True)
    assert (r.token_ids, r.num_accepted) == ([1], 0)


def test_a_draft_the_target_rules_out_is_never_kept():
    target = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    rng = np.random.default_rng(0)
    for _ in range(200):
        r = verify([0], target, np.array([[1.0, 0.0, 0.0]]), rng, greedy=False)
        assert r.token_ids[0] == 1 and r.num_accepted == 0


def test_verify_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"target_probs must be \[k \+ 1, V\]"):
        verify([1, 2], np.ones((2, 4)) / 4, None, np.random.default_rng(0), False)
    with pytest.raises(ValueError, match=r"draft_probs must be \[k, V\]"):
        verify([1], np.ones((2, 4)) / 4, np.ones((2, 4)) / 4, np.random.default_rng(0), False)


# ---------------------------------------------------------------- n-gram prompt lookup
def test_ngram_proposes_what_followed_the_longest_recent_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    # the longest n wins over a more recent shorter match: [8, 9] matched at 0, [9] alone more recently at 4
    assert p.propose([8, 9, 5, 6, 9, 7, 8, 9]) == [5, 6, 9]
    # among matches of one length, the most recent
    assert p.propose([4, 1, 4, 2, 4]) == [2, 4]
    assert p.propose([5, 6, 7]) == []
    assert p.propose([]) == [] and p.propose([3]) == []
    assert p.propose([1, 2, 3, 4, 1, 2, 3], k=1) == [4]


def test_ngram_respects_min_n():
    assert NgramProposer(k=2, min_n=2, max_n=3).propose([1, 5, 6, 1]) == []  # only a 1-gram matches
    assert NgramProposer(k=2, min_n=1, max_n=3).propose([1, 5, 6, 1]) == [5, 6]


@pytest.mark.parametrize("kwargs, message", [
    ({"k": 0}, "k must be an int >= 1"),
    ({"k": 2, "min_n": 0}, "min_n must be an int >= 1"),
    ({"k": 2, "min_n": 3, "max_n": 2}, r"min_n \(3\) must be <= max_n \(2\)"),
    ({"k": True}, "k must be an int >= 1"),
])
def test_ngram_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)
