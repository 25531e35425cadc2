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


# ---------------------------------------------------------------- the draft model's own paged KV
@pytest.fixture(scope="module")
def draft_model():
    from minienv.model.llama import load_model
    from minienv.paths import assets_dir

    return load_model(assets_dir() / "draft")


def _plain_greedy(model, ids, n):
    from minienv.generate import generate_ids
    from minienv.sampling import SamplingParams

    return list(generate_ids(model, list(ids), SamplingParams(temperature=0, max_tokens=n), eos_token_id=None))


def test_draft_proposals_equal_plain_greedy_decoding_across_rollbacks(draft_model):
    from minienv.sampling import Sampler, SamplingParams
    from minienv.spec_decode.draft import DraftInput, DraftProposer

    rng = np.random.default_rng(0)
    V = draft_model.config.vocab_size
    proposer = DraftProposer(draft_model, kv_budget_tokens=256, block_size=4, num_sampled_ids=V)
    seqs = {str(i): [int(t) for t in rng.integers(0, V, int(rng.integers(1, 12)))] for i in range(3)}
    samplers = {rid: Sampler(SamplingParams(temperature=0, max_tokens=64)) for rid in seqs}
    for _ in range(6):  # propose, "verify" (keep a random prefix + one other token), propose again
        k = int(rng.integers(1, 6))
        out = proposer.propose([DraftInput(rid, ids, k, samplers[rid]) for rid, ids in seqs.items()])
        for rid, ids in seqs.items():
            assert out[rid].token_ids == _plain_greedy(draft_model, ids, k), rid
            kept = int(rng.integers(0, k + 1))
            seqs[rid] = ids + out[rid].token_ids[:kept] + [int(rng.integers(0, V))]
        proposer.kv.check_invariants()
    for rid in seqs:
        proposer.free(rid)
    assert proposer.kv.stats().num_in_use == 0


def test_draft_without_room_proposes_nothing_and_holds_nothing(draft_model):
    from minienv.sampling import Sampler, SamplingParams
    from minienv.spec_decode.draft import DraftInput, DraftProposer

    greedy = Sampler(SamplingParams(temperature=0))
    proposer = DraftProposer(draft_model, kv_budget_tokens=8, block_size=4, num_sampled_ids=2048)
    out = proposer.propose([DraftInput("long", list(range(20)), 3, greedy)])
    assert out == {} and not proposer.kv.has_request("long")
    # 6 real tokens fill 2 blocks with 2 slots to spare: d1 and d2 are fed, d3 is proposed, feeding it would need
    # a third block, so the run stops at 3 of the 4 asked for
    out = proposer.propose([DraftInput("mid", list(range(6)), 4, greedy)])
    assert out["mid"].token_ids == _plain_greedy(draft_model, list(range(6)), 3)
    proposer.kv.check_invariants()


def test_the_labs_forgotten_residual_shows_in_the_first_tokens_frequencies():
    """Notebook 12 shows the classic bug by its output, not its code: lab's ``residual_forgotten`` fails the test,
    and ``first_token`` (the first generated token's frequencies) follows p for ``verify`` and not for the bug."""
    from minienv.lab.speculation import residual_forgotten

    world = BigramWorld.make()
    good, bad = chi_square_check(verify, k=2, seed=0), chi_square_check(residual_forgotten, k=2, seed=0)
    assert good.passed and not bad.passed
    assert sum(good.first_token) == pytest.approx(1) and sum(bad.first_token) == pytest.approx(1)
    assert max(abs(good.first_token[t] - world.P[0, t]) for t in range(world.vocab_size)) < 0.01
    # the bug's first token: min(p, q) + P(reject) * p, in place of p
    overlap = np.minimum(world.P[0], world.Q[0])
    predicted = overlap + (1 - overlap.sum()) * world.P[0]
    assert max(abs(bad.first_token[t] - predicted[t]) for t in range(world.vocab_size)) < 0.02
