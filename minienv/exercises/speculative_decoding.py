"""Notebook 12's exercises: the acceptance step of speculative sampling, and n-gram prompt lookup.

Each check tries hand-made cases, one rule at a time, in an order where a wrong answer fails first on the rule it
breaks; the student's function is told which rule a case tests (``attempt.rule``), so an exception from their code
is reported as "✗ <that rule>" with their error.
"""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.lab.speculation import chi_square_check
from minienv.spec_decode.ngram import NgramProposer
from minienv.spec_decode.rejection import VerifyResult

SHAPE = "return the kept drafts (a prefix of the drafts) followed by exactly one token of the target's"
STOP = "on the first rejection draw one token and stop: every token before the last is a kept draft, in order"
NEVER = "keep a draft with probability min(1, p/q): p = 0 means never"
ALWAYS = "keep a draft with probability min(1, p/q): p >= q means always (p = q included)"
HALF = "keep a draft with probability min(1, p/q): p/q = 0.5 means half the time"
RESIDUAL = "on rejection draw from normalise(max(p - q, 0)), not from p"
PROPORTION = "on rejection draw from the residual in proportion to max(p - q, 0), not its largest entry"
BONUS = "when every draft is kept, draw the bonus from p at position k + 1"
NO_DRAFTS = "with no drafts (k = 0) return one token drawn from p at position 1"
SEEDED = "draw only from the rng you are given: the same seed gives the same tokens"
EXACT = "the output must be distributed exactly as the target's samples"


def _tokens(out, drafts: list[int], vocab: int, rule: str = SHAPE) -> list[int]:
    """The student's answer as ints, after the shape rules every answer must keep. A token outside the vocabulary
    was drawn from something that is not a distribution: it breaks the rule of the draw that made it. ``rule`` (the
    case's) is broken by an empty answer when there were no drafts."""
    try:
        out = [int(t) for t in out]
    except (TypeError, ValueError):
        fail(SHAPE, f"drafts {drafts}: you returned {out!r}, not a list of token ids")
    require(1 <= len(out) <= len(drafts) + 1, SHAPE if drafts else rule, f"drafts {drafts}, you returned {out}")
    if not all(0 <= t < vocab for t in out):  # only a draw makes a token: the bonus's, or the fix-up token's
        # (in the p >= q case the residual is all zeros: rejecting there, not the draw, is the mistake)
        drawn = (NO_DRAFTS if not drafts else BONUS if out[:-1] == list(drafts) else
                 ALWAYS if rule == ALWAYS else RESIDUAL)
        fail(drawn, f"drafts {drafts}, vocabulary of {vocab} (ids 0 … {vocab - 1}): you returned {out}")
    require(out[:-1] == list(drafts[:len(out) - 1]), STOP, f"drafts {drafts}, you returned {out}")
    return out


def _as_verifier(attempt):
    """The student's ``accept_step(drafts, target_probs, draft_probs, rng)`` as a verifier for the chi-square
    check, after checking the shape of what it returns on every call."""
    def verifier(drafts, target_probs, draft_probs, rng, greedy):
        out = _tokens(attempt(list(drafts), target_probs, draft_probs, rng), list(drafts), target_probs.shape[1])
        return VerifyResult(out, len(drafts), len(out) - 1)
    return verifier


def _case(drafts, p, q):
    p = np.array(p, dtype=float)
    return list(drafts), p, np.array(q, dtype=float).reshape(len(drafts), p.shape[1])


def _runs(attempt, rule, case, trials, seed):
    """``trials`` answers of the student's function on one case, each checked for shape; ``rule`` names what the
    case tests (an exception from the student's code is reported as breaking it)."""
    attempt.rule = rule
    drafts, p, q = case
    rng = np.random.default_rng(seed)
    return [_tokens(attempt(list(drafts), p.copy(), q.copy(), rng), drafts, p.shape[1], rule) for _ in range(trials)]


@exercise("write accept_step(drafts, target_probs, draft_probs, rng) -> the tokens to append")
def check_accept_step(fn) -> str:
    """The residual's support first, then deterministic cases (rule 2's edges, rule 4, the seed rule), then the
    statistical ones (2's middle, 3's proportions), then the chi-square test on the enumerable bigram world."""
    # rule 3 first: this case passes whatever a draft's keep probability (it tests only the fix-up token), so a
    # broken residual draw — or an exception inside one — is named here, not under rule 2
    outs = _runs(fn, RESIDUAL, _case([0], [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [[1.0, 0.0, 0.0]]), 200, 6)
    with_bonus = any(len(out) == 2 for out in outs)  # [0] alone is then a fix-up token 0, not a missing bonus
    for out in outs:
        require(len(out) == 2 or out == [1] or (out == [0] and not with_bonus), RESIDUAL,
                f"p = [0.5, 0.5, 0], q = [1, 0, 0]: the residual is all on token 1; you drew {out}")
    for out in _runs(fn, NEVER, _case([0], [[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], [[0.9, 0.05, 0.05]]), 50, 0):
        require(len(out) == 1, NEVER, f"draft 0 has p = 0, q = 0.9, and you kept it: {out}")
    p = [[0.1, 0.8, 0.1], [0.2, 0.3, 0.5], [0.4, 0.3, 0.3], [1.0, 0.0, 0.0]]
    q = [[0.3, 0.4, 0.3], [0.2, 0.3, 0.5], [0.4, 0.3, 0.3]]  # p/q = 2 for draft 1; p = q for drafts 2 and 0
    for out in _runs(fn, ALWAYS, _case([1, 2, 0], p, q), 50, 1):
        require(out != [1, 2, 0], SHAPE,
                f"drafts [1, 2, 0] are all kept (p >= q), and you returned only {out}: the bonus is missing")
        require(len(out) == 4, ALWAYS, f"drafts [1, 2, 0] have p/q = 2, 1 and 1, and you kept {len(out) - 1}")
        require(out[-1] == 0, BONUS, f"p at position 4 puts all its mass on token 0; your bonus was {out[-1]}")
    for out in _runs(fn, NO_DRAFTS, _case([], [[0.0, 0.0, 1.0]], []), 20, 2):
        require(out == [2], NO_DRAFTS, f"no drafts, p at position 1 is all on token 2: you returned {out}")
    half = _case([0], [[0.25, 0.75, 0.0], [0.2, 0.3, 0.5]], [[0.5, 0.25, 0.25]])
    fn.rule = SEEDED
    for seed in range(3, 13):
        answers = []
        for _ in range(2):
            rng = np.random.default_rng(seed)
            before = rng.bit_generator.state
            answers.append(_tokens(fn([0], half[1].copy(), half[2].copy(), rng), [0], 3, SEEDED))
            require(rng.bit_generator.state != before, SEEDED, "your function never drew from the rng it was given")
        require(answers[0] == answers[1], SEEDED, f"two calls with default_rng({seed}) gave {answers[0]} and "
                                                  f"{answers[1]}")
    kept = sum(len(out) == 2 for out in _runs(fn, HALF, half, 400, 5)) / 400
    require(0.4 <= kept <= 0.6, HALF, f"draft 0 has p = 0.25, q = 0.5: you kept it {kept:.0%} of 400 times")
    fixes = [out[0] for out in _runs(fn, PROPORTION, _case([0], [[0.2, 0.6, 0.2], [0.2, 0.3, 0.5]],
                                                           [[1.0, 0.0, 0.0]]), 400, 7) if len(out) == 1]
    share = fixes.count(1) / max(len(fixes), 1)
    require(len(fixes) > 200 and 0.65 <= share <= 0.85, PROPORTION,
            f"p = [0.2, 0.6, 0.2], q = [1, 0, 0]: the residual is [0, 0.6, 0.2], so token 1 should be 3 of 4 "
            f"fix-up tokens; it was {share:.0%} of your {len(fixes)}")
    fn.rule = EXACT
    result = chi_square_check(_as_verifier(fn), k=2, seed=1)
    require(result.passed, EXACT, str(result))
    return f"your acceptance step keeps the target's distribution ({result})"


NGRAM_CASES = [  # (tokens, k, min_n, max_n, rule the case tests), in the order a wrong answer meets its rule first
    ([1, 2, 3, 4, 1, 2, 3], 4, 1, 3, "match the suffix and propose the tokens that followed it"),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, "propose at most k tokens"),
    ([], 2, 1, 3, "no match: propose nothing ([]) — an empty sequence included"),
    ([3], 2, 1, 3, "no match: propose nothing ([]) — one token has nothing before it"),
    ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 3, 1, 3, "try the longest n first, from max_n (included) down to min_n"),
    ([8, 9, 5, 6, 9, 7, 8, 9], 3, 1, 3, "try the longest n first, from max_n (included) down to min_n"),
    ([5, 6, 5], 2, 1, 2, "try every n from max_n down to min_n, min_n included"),
    ([4, 1, 4, 2, 4], 2, 1, 3, "among matches of the same length, the most recent wins"),
    ([5, 6, 7], 2, 1, 3, "no match: propose nothing ([])"),
    ([1, 5, 6, 1], 2, 2, 3, "never use an n below min_n"),
    ([7, 7], 3, 1, 3, "a match may overlap the suffix, but must end before the last token"),
    ([1, 1, 2, 1, 1, 1], 2, 1, 2, "a match may overlap the suffix, but must end before the last token"),
]


def _proposal(got):
    """A student's proposal as a list of ints (``None`` and anything that is not a sequence as they are)."""
    try:
        return None if got is None else [int(t) for t in got]
    except (TypeError, ValueError):
        return got


@exercise("write propose(token_ids, k, min_n, max_n) -> the tokens that followed the latest longest match")
def check_ngram(fn) -> str:
    for tokens, k, lo, hi, rule in NGRAM_CASES:
        fn.rule = rule
        want = NgramProposer(k, lo, hi).propose(tokens)
        got = _proposal(fn(list(tokens), k, lo, hi))
        require(got == want, rule, f"tokens {tokens}, k={k}, n in [{lo}, {hi}]: expected {want}, got {got}")
    rng = np.random.default_rng(5)
    fn.rule = ("the latest occurrence of the longest suffix n-gram (n from max_n down to min_n), then up to k tokens "
               "after it")
    for _ in range(300):  # random sequences over a small vocabulary: many repeats
        tokens = [int(t) for t in rng.integers(0, 4, int(rng.integers(0, 14)))]
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        want = NgramProposer(k, lo, hi).propose(tokens)
        got = _proposal(fn(list(tokens), k, lo, hi))
        if (got or []) != want:
            fail(fn.rule, f"tokens {tokens}, k={k}, n in [{lo}, {hi}]: expected {want}, got {got}")
    return f"your n-gram lookup proposes what minienv's NgramProposer does on {len(NGRAM_CASES) + 300} sequences"
